//! The rig's command line: `serve`, `storm`, `chaos`.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use idem_harness::firmware::{self, Bmc, DEFAULT_FLASH_MS};
use idem_harness::storm::{self, StormConfig, StormMode};
use idem_harness::{chaos, crash};
use idem_http::LeaseRenewal;
use leasebroker::app::Faults;
use leasebroker::crash::CrashPlan;
use leasebroker::serve::{self, LogFormat, ServeArgs};
use tokio::net::TcpListener;

#[derive(Parser, Debug)]
#[command(name = "idem-harness", about = "Retry storms, chaos and crash runs against the leasebroker demo")]
struct Cli {
    /// Log lines as text or as JSON objects; the level comes from `RUST_LOG` (default
    /// `warn`; `idem_http=info` logs every keyed request).
    #[arg(long, value_enum, default_value = "text", global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the demo's server (`leasebroker serve`'s flags) with the firmware route
    /// (`POST /v1/workers/{id}/firmware`, `GET /admin/bmc`), faults and crash points.
    Serve(RigServeArgs),
    /// The chaos run: the retry storm against `serve` on real stores (a private
    /// redis-server, a private PostgreSQL cluster, a private MariaDB server, a private
    /// moto_server, SQLite and redb files on a small tmpfs)
    /// while faults hit them; prints one table per backend and exits non-zero on any
    /// phantom worker, extra VM, double flash or lost stored response of a durable
    /// configuration. Uses
    /// loopback ports BASE_PORT to BASE_PORT+3 and temp dirs only; needs redis-server,
    /// PostgreSQL's initdb, MariaDB's mariadbd and mariadb-install-db, and root for the
    /// tmpfs.
    Chaos(ChaosArgs),
    /// Storm a running server.
    Storm {
        /// Base URL of the server.
        #[arg(long, default_value = "http://127.0.0.1:8080")]
        target: String,
        #[command(flatten)]
        storm: StormArgs,
    },
}

#[derive(Args, Debug)]
struct ChaosArgs {
    /// Logical operations per fault.
    #[arg(long, default_value_t = 2_000)]
    operations: u32,
    /// Operations in flight at once.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// How long a stall or a full disk lasts, ms.
    #[arg(long, default_value_t = 10_000)]
    fault_ms: u64,
    /// When the fault hits after the storm started, ms.
    #[arg(long, default_value_t = 3_000)]
    fault_after_ms: u64,
    /// The server's lease TTL, ms.
    #[arg(long, default_value_t = 3_000)]
    lease_ms: u64,
    /// First private loopback port (the run uses it to +3; the Redis Cluster rows to +9).
    #[arg(long, default_value_t = 7100)]
    base_port: u16,
    /// One fault of each kind instead of every fault.
    #[arg(long)]
    short: bool,
    /// Only the faults whose `backend / fault` title contains this text (e.g. `redis`,
    /// `stall`).
    #[arg(long)]
    only: Option<String>,
    /// Every this many operations one also flashes firmware (0: none).
    #[arg(long, default_value_t = 10)]
    firmware_every: u32,
    /// How long a firmware flash takes, ms (longer than the lease, so it needs renewal).
    #[arg(long, default_value_t = 4_000)]
    flash_ms: u64,
    /// The server's lease renewal: `off` only to see the double flashes it prevents (with
    /// `--bmc blind`; the run then fails).
    #[arg(long, value_enum, default_value = "on")]
    lease_renewal: RenewalSwitch,
    /// The server's simulated BMC: `tasks` (default) or `blind` (the app-kill rows then
    /// double-flash: nothing can be reconciled).
    #[arg(long, value_enum, default_value = "tasks")]
    bmc: BmcSwitch,
}

#[derive(Args, Debug)]
struct RigServeArgs {
    #[command(flatten)]
    serve: ServeArgs,
    /// Lease renewal while a handler runs: `on` (every lease / 3) or `off`.
    #[arg(long, value_enum, default_value = "on")]
    lease_renewal: RenewalSwitch,
    /// How long the simulated BMC takes to flash firmware, ms.
    #[arg(long, default_value_t = DEFAULT_FLASH_MS)]
    flash_ms: u64,
    /// The simulated BMC: `tasks` (a flash is a task the server can look up by its
    /// idempotency sub-key, so a retry after a crash adopts it) or `blind` (an older BMC
    /// with no lookup: a flash whose server dies mid-flash is flashed again by the retry).
    #[arg(long, value_enum, default_value = "tasks")]
    bmc: BmcSwitch,
    /// Share of responses held back after the work is done (0.0-1.0).
    #[arg(long, default_value_t = 0.0)]
    drop_rate: f64,
    /// How long a held-back response is held, ms.
    #[arg(long, default_value_t = 2_000)]
    hold_ms: u64,
    /// Share of hypervisor boots that fail (answered 503).
    #[arg(long, default_value_t = 0.0)]
    hypervisor_fail_rate: f64,
    /// Crash points to arm inside the create handler, comma-separated, or `any`:
    /// before_allocate, after_allocate, after_lease, before_boot, after_boot,
    /// after_boot_recorded, after_worker, after_completion. At a point that fires the server
    /// prints `CRASHPOINT <name>` on stdout and blocks for an outside SIGKILL (or aborts,
    /// with --crash-abort). Default: the LEASEBROKER_CRASH_AT environment variable, else none.
    #[arg(long)]
    crash_at: Option<String>,
    /// Probability that an armed point fires when a request passes it (0.0-1.0).
    /// Default: LEASEBROKER_CRASH_RATE, else 1.0.
    #[arg(long)]
    crash_rate: Option<f64>,
    /// Abort the process at a crash point instead of waiting for SIGKILL.
    #[arg(long)]
    crash_abort: bool,
}

impl RigServeArgs {
    fn crash_plan(&self) -> Result<CrashPlan, String> {
        let points = self.crash_at.clone().or_else(|| std::env::var("LEASEBROKER_CRASH_AT").ok()).unwrap_or_default();
        let rate = match self.crash_rate {
            Some(r) => r,
            None => match std::env::var("LEASEBROKER_CRASH_RATE") {
                Ok(v) => v.parse().map_err(|e| format!("LEASEBROKER_CRASH_RATE={v:?}: {e}"))?,
                Err(_) => 1.0,
            },
        };
        CrashPlan::parse_in(&crash::POINTS, &points, rate, self.crash_abort)
    }
}

/// `--lease-renewal`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum RenewalSwitch {
    /// The layer's default: renew every lease / 3 while the handler runs.
    On,
    /// Never renew.
    Off,
}

impl From<RenewalSwitch> for LeaseRenewal {
    fn from(s: RenewalSwitch) -> Self {
        match s {
            RenewalSwitch::On => LeaseRenewal::default(),
            RenewalSwitch::Off => LeaseRenewal::Off,
        }
    }
}

/// `--bmc`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum BmcSwitch {
    /// A BMC with a task monitor: flashes can be looked up by the caller's id.
    Tasks,
    /// A BMC that takes no caller id and cannot be asked what it flashes.
    Blind,
}

impl From<BmcSwitch> for Bmc {
    fn from(s: BmcSwitch) -> Self {
        match s {
            BmcSwitch::Tasks => Bmc::Tasks,
            BmcSwitch::Blind => Bmc::Blind,
        }
    }
}

#[derive(Args, Debug, Clone)]
struct StormArgs {
    /// What each operation does: `create` a worker, or create one and flash its
    /// `firmware` (start the server with `serve --lease-ms 2000`).
    #[arg(long, value_enum, default_value = "create")]
    mode: ModeArg,
    /// Logical operations.
    #[arg(long, default_value_t = 200)]
    operations: u32,
    /// Principals (bearer tokens).
    #[arg(long, default_value_t = 4)]
    principals: u32,
    /// Operations in flight at once.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Timeout of one attempt, ms.
    #[arg(long, default_value_t = 400)]
    attempt_timeout_ms: u64,
    /// Budget per operation, ms.
    #[arg(long, default_value_t = 30_000)]
    budget_ms: u64,
}

/// `--mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum ModeArg {
    /// `POST /v1/workers`.
    Create,
    /// `POST /v1/workers/{id}/firmware`.
    Firmware,
}

impl StormArgs {
    fn config(&self, target: String) -> StormConfig {
        StormConfig {
            target,
            mode: match self.mode {
                ModeArg::Create => StormMode::Create,
                ModeArg::Firmware => StormMode::Firmware,
            },
            operations: self.operations,
            principals: self.principals,
            concurrency: self.concurrency,
            attempt_timeout_ms: self.attempt_timeout_ms,
            budget_ms: self.budget_ms,
            token_prefix: format!("storm-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]),
        }
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    cli.log_format.init();
    match run(cli).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("idem-harness: {e}");
            ExitCode::from(2)
        }
    }
}

async fn run(cli: Cli) -> Result<ExitCode, Box<dyn std::error::Error + Send + Sync>> {
    match cli.command {
        Command::Serve(args) => {
            let crash = args.crash_plan()?;
            let mut config = args.serve.config();
            config.lease_renewal = args.lease_renewal.into();
            config.faults = Faults {
                drop_rate: args.drop_rate,
                hold_ms: args.hold_ms,
                hypervisor_fail_rate: args.hypervisor_fail_rate,
                crash,
                ..config.faults
            };
            let listener = TcpListener::bind(&args.serve.addr).await?;
            let (spec, state) = (&args.serve.store, &args.serve.state);
            let server = firmware::start(listener, spec, state, config, args.flash_ms, args.bmc.into()).await?;
            eprintln!("idem-harness: listening on {} (store {spec:?})", server.url());
            if crash.is_armed() {
                eprintln!("idem-harness: crash points armed: {crash:?}");
            }
            serve::until_ctrl_c(server).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Chaos(args) => {
            let mut cfg = chaos::ChaosConfig::full(chaos::current_exe()?);
            cfg.operations = args.operations;
            cfg.concurrency = args.concurrency;
            cfg.fault_for = Duration::from_millis(args.fault_ms);
            cfg.fault_after = Duration::from_millis(args.fault_after_ms);
            cfg.lease = Duration::from_millis(args.lease_ms);
            cfg.base_port = args.base_port;
            cfg.firmware_every = args.firmware_every;
            cfg.flash = Duration::from_millis(args.flash_ms);
            cfg.lease_renewal = matches!(args.lease_renewal, RenewalSwitch::On);
            cfg.bmc = args.bmc.into();
            if args.short {
                cfg.faults = chaos::Fault::one_of_each_kind();
            }
            if let Some(only) = &args.only {
                cfg.faults.retain(|f| format!("{} / {}", f.backend().name(), f.label()).contains(only.as_str()));
            }
            if !chaos::uses_private_ports(&cfg) {
                return Err(
                    "--base-port must keep clear of the shared Redis (6379), Postgres (5432) and MariaDB (3306)".into(),
                );
            }
            let rows = chaos::run(&cfg).await?;
            print!("{}", chaos::report(&rows, &cfg));
            let failed: Vec<_> = rows.iter().filter(|r| r.failed()).collect();
            if failed.is_empty() {
                println!(
                    "OK: no phantom worker, extra VM, double flash or lost stored response on any durable configuration"
                );
                Ok(ExitCode::SUCCESS)
            } else {
                for r in failed {
                    println!("FAIL: {} / {}", r.backend, r.fault);
                }
                Ok(ExitCode::FAILURE)
            }
        }
        Command::Storm { target, storm } => Ok(report(&storm::run(storm.config(target)).await?)),
    }
}

fn report(r: &storm::StormReport) -> ExitCode {
    print!("{}", r.table());
    if r.phantoms() > 0 {
        println!("FAIL: {} phantom workers", r.phantoms());
        return ExitCode::FAILURE;
    }
    if r.extra_vms() > 0 {
        println!("FAIL: {} VMs booted beyond one per operation", r.extra_vms());
        return ExitCode::FAILURE;
    }
    if r.double_flashes() > 0 || r.server.bmc.bricked > 0 {
        println!("FAIL: {} double flashes, {} bricked nodes", r.double_flashes(), r.server.bmc.bricked);
        return ExitCode::FAILURE;
    }
    if r.failed > 0 {
        println!("FAIL: {} operations did not complete within their budget", r.failed);
        return ExitCode::FAILURE;
    }
    match r.mode {
        StormMode::Create => println!("OK: every operation created exactly one worker; phantom workers 0, extra VMs 0"),
        StormMode::Firmware => println!("OK: every operation flashed its node exactly once; bricked nodes 0"),
    }
    ExitCode::SUCCESS
}
