//! The leasebroker command line: `demo`, `serve`, `storm`, `chaos`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use idem_core::Policy;
use idem_http::LeaseRenewal;
use leasebroker::app::{Bmc, Config, DEFAULT_FLASH_MS, Faults};
use leasebroker::chaos;
use leasebroker::crash::CrashPlan;
use leasebroker::server::{Server, StoreSpec, open};
use leasebroker::storm::{self, StormConfig, StormMode};
use tokio::net::TcpListener;

#[derive(Parser, Debug)]
#[command(name = "leasebroker", about = "A provisioning API protected by idem, and a retry storm to prove it")]
struct Cli {
    /// Log lines as text or as JSON objects (one per line, with the current span's
    /// fields, e.g. the `idempotency` span's `decision`, and one line per closed span); the
    /// level comes from `RUST_LOG` (default `warn`; `idem_http=info` logs every keyed
    /// request).
    #[arg(long, value_enum, default_value = "text", global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

/// `--log-format`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line (tracing-subscriber's JSON format).
    Json,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Start a server on a temporary redb file with faults on, storm it, print the table.
    /// With `--mode firmware` the server's lease is 2 s and every flash takes `--flash-ms`.
    Demo {
        #[command(flatten)]
        storm: StormArgs,
        /// How long a firmware flash takes, ms (`--mode firmware`).
        #[arg(long, default_value_t = DEFAULT_FLASH_MS)]
        flash_ms: u64,
        /// Lease renewal while a handler runs: `on` (every lease / 3) or `off` (to see the
        /// double flashes renewal prevents; with `--bmc blind`).
        #[arg(long, value_enum, default_value = "on")]
        lease_renewal: RenewalSwitch,
        /// The simulated BMC: `tasks` (flashes can be looked up, so a retry adopts a running
        /// flash) or `blind` (no lookup: only renewal keeps a second flash away).
        #[arg(long, value_enum, default_value = "tasks")]
        bmc: BmcSwitch,
    },
    /// Run the server.
    Serve(ServeArgs),
    /// The chaos run: the retry storm against `serve` on real stores (a private
    /// redis-server, a private PostgreSQL cluster, SQLite and redb files on a small tmpfs)
    /// while faults hit them; prints one table per backend and exits non-zero on any
    /// phantom worker, extra VM, double flash or lost stored response of a durable
    /// configuration. Uses
    /// loopback ports BASE_PORT to BASE_PORT+3 and temp dirs only; needs redis-server,
    /// PostgreSQL's initdb, and root for the tmpfs.
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
    /// First private loopback port (the run uses it to +3).
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
struct ServeArgs {
    /// Listen address.
    #[arg(long, default_value = "127.0.0.1:8080")]
    addr: String,
    /// Record store: `redb:PATH`, `sqlite:PATH`, `redis://HOST:PORT`,
    /// `redis-cluster://HOST:PORT[,HOST:PORT...][?wait=N]`, `postgres://USER@HOST/DB` or `memory`.
    #[arg(long, default_value = "redb:leasebroker.redb")]
    store: StoreSpec,
    /// Infra state file (a redb file of its own, whatever the store).
    #[arg(long, default_value = "leasebroker-state.redb")]
    state: PathBuf,
    /// In-flight lease, ms (at least 100). A retry takes over a claim once its lease has
    /// passed. With lease renewal on, a running handler keeps extending its lease, so the
    /// lease only has to outlast a stall of this process (seconds), not the handler: a
    /// lease of 2 s covers a 20 s flash, and a killed server's claims free up 2 s later.
    /// With renewal off, the lease must exceed every handler's worst-case run time: a
    /// lease shorter than a hypervisor boot lets a retry reconcile before the first boot is
    /// visible and boot a second VM, and one shorter than a flash bricks the node.
    #[arg(long, default_value_t = 5_000, value_parser = clap::value_parser!(u64).range(100..))]
    lease_ms: u64,
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
    /// Retention window, ms.
    #[arg(long, default_value_t = 86_400_000)]
    retention_ms: u64,
    #[command(flatten)]
    faults: FaultArgs,
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

impl ServeArgs {
    fn crash_plan(&self) -> Result<CrashPlan, String> {
        let points = self.crash_at.clone().or_else(|| std::env::var("LEASEBROKER_CRASH_AT").ok()).unwrap_or_default();
        let rate = match self.crash_rate {
            Some(r) => r,
            None => match std::env::var("LEASEBROKER_CRASH_RATE") {
                Ok(v) => v.parse().map_err(|e| format!("LEASEBROKER_CRASH_RATE={v:?}: {e}"))?,
                Err(_) => 1.0,
            },
        };
        CrashPlan::parse(&points, rate, self.crash_abort)
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

#[derive(Args, Debug, Clone, Copy)]
struct FaultArgs {
    /// Share of responses held back after the work is done (0.0-1.0).
    #[arg(long, default_value_t = 0.0)]
    drop_rate: f64,
    /// How long a held-back response is held, ms.
    #[arg(long, default_value_t = 2_000)]
    hold_ms: u64,
    /// Upper bound of a random delay inside the create handler, ms (keep below the lease).
    #[arg(long, default_value_t = 0)]
    work_ms: u64,
    /// Share of hypervisor boots that fail (answered 503).
    #[arg(long, default_value_t = 0.0)]
    hypervisor_fail_rate: f64,
}

impl From<FaultArgs> for Faults {
    fn from(f: FaultArgs) -> Self {
        Faults {
            drop_rate: f.drop_rate,
            hold_ms: f.hold_ms,
            work_ms: f.work_ms,
            hypervisor_fail_rate: f.hypervisor_fail_rate,
            crash: CrashPlan::default(),
        }
    }
}

#[derive(Args, Debug, Clone)]
struct StormArgs {
    /// What each operation does: `create` a worker, or create one and flash its
    /// `firmware` (`demo` uses a 2 s lease itself; for `storm`, start the server with
    /// `serve --lease-ms 2000`).
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
    fn mode(&self) -> StormMode {
        match self.mode {
            ModeArg::Create => StormMode::Create,
            ModeArg::Firmware => StormMode::Firmware,
        }
    }

    fn config(&self, target: String) -> StormConfig {
        StormConfig {
            target,
            mode: self.mode(),
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
    // A closed span is logged too: at `RUST_LOG=idem_http=info` every keyed request gives
    // one line with its `idempotency` span's decision, outcome and renewals.
    let logs = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
        .with_writer(std::io::stderr);
    match cli.log_format {
        LogFormat::Text => logs.init(),
        LogFormat::Json => logs.json().with_current_span(true).with_span_list(false).init(),
    }
    match run(cli).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("leasebroker: {e}");
            ExitCode::from(2)
        }
    }
}

async fn run(cli: Cli) -> Result<ExitCode, Box<dyn std::error::Error>> {
    match cli.command {
        Command::Serve(args) => {
            let crash = args.crash_plan()?;
            let (store, infra) = open(&args.store, &args.state).await?;
            let policy = Policy::default()
                .with_lease_ttl(Duration::from_millis(args.lease_ms))
                .with_retention(Duration::from_millis(args.retention_ms));
            let listener = TcpListener::bind(&args.addr).await?;
            let config = Config {
                policy,
                lease_renewal: args.lease_renewal.into(),
                faults: Faults { crash, ..args.faults.into() },
                flash_ms: args.flash_ms,
                bmc: args.bmc.into(),
            };
            let server = Server::start(listener, store, infra, &config)?;
            eprintln!("leasebroker: listening on {} (store {:?})", server.url(), args.store);
            if crash.is_armed() {
                eprintln!("leasebroker: crash points armed: {crash:?}");
            }
            // A supervisor (the crash test) reads this line to know the server is up.
            println!("LISTENING {}", server.url());
            tokio::select! {
                r = server.wait() => r?,
                _ = tokio::signal::ctrl_c() => {}
            }
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
                return Err("--base-port must keep clear of the shared Redis (6379) and Postgres (5432)".into());
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
        Command::Storm { target, storm } => report(storm::run(storm.config(target)).await?),
        Command::Demo { storm, flash_ms, lease_renewal, bmc } => {
            let dir = tempfile::tempdir()?;
            let path = dir.path().join("leasebroker.redb");
            let (store, infra) = open(&StoreSpec::Redb(path.clone()), &dir.path().join("state.redb")).await?;
            // Faults: a quarter of responses are lost after the work is done, handlers take
            // up to 300 ms (so retries meet in-flight claims), 5% of boots fail.
            let faults = Faults {
                drop_rate: 0.25,
                hold_ms: 1_000,
                work_ms: 300,
                hypervisor_fail_rate: 0.05,
                crash: CrashPlan::default(),
            };
            // A flash outlives a 2 s lease ten times over: only renewal keeps its claim.
            let lease = match storm.mode {
                ModeArg::Create => Duration::from_secs(3),
                ModeArg::Firmware => Duration::from_secs(2),
            };
            let config = Config {
                policy: Policy::default().with_lease_ttl(lease),
                lease_renewal: lease_renewal.into(),
                faults,
                flash_ms,
                bmc: bmc.into(),
            };
            let server = Server::start(TcpListener::bind("127.0.0.1:0").await?, store, infra, &config)?;
            println!(
                "leasebroker demo: server on {} with store {}, {} {:?} operations from {} principals, {} at a time",
                server.url(),
                path.display(),
                storm.operations,
                storm.mode,
                storm.principals,
                storm.concurrency
            );
            println!("faults: 25% of responses lost after the work, handlers up to 300 ms, 5% of boots fail");
            if storm.mode == ModeArg::Firmware {
                println!(
                    "firmware: every flash takes {flash_ms} ms under a lease of {} ms, lease renewal {lease_renewal:?}, \
                     {bmc:?} BMC",
                    lease.as_millis()
                );
            }
            let result = storm::run(storm.config(server.url())).await;
            server.stop().await?;
            report(result?)
        }
    }
}

fn report(r: storm::StormReport) -> Result<ExitCode, Box<dyn std::error::Error>> {
    print!("{}", r.table());
    if r.phantoms() > 0 {
        println!("FAIL: {} phantom workers", r.phantoms());
        return Ok(ExitCode::FAILURE);
    }
    if r.extra_vms() > 0 {
        println!("FAIL: {} VMs booted beyond one per operation", r.extra_vms());
        return Ok(ExitCode::FAILURE);
    }
    if r.double_flashes() > 0 || r.server.bricked > 0 {
        println!("FAIL: {} double flashes, {} bricked nodes", r.double_flashes(), r.server.bricked);
        return Ok(ExitCode::FAILURE);
    }
    if r.failed > 0 {
        println!("FAIL: {} operations did not complete within their budget", r.failed);
        return Ok(ExitCode::FAILURE);
    }
    match r.mode {
        StormMode::Create => println!("OK: every operation created exactly one worker; phantom workers 0, extra VMs 0"),
        StormMode::Firmware => println!("OK: every operation flashed its node exactly once; bricked nodes 0"),
    }
    Ok(ExitCode::SUCCESS)
}
