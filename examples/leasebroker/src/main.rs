//! The leasebroker command line: `demo` and `serve` (the rig that faults it is `harness/`).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};
use idem_client::{AttemptStats, ClientError, IdempotentClient, OperationKey, RetryPolicy};
use leasebroker::app::{Config, Faults};
use leasebroker::serve::{self, LogFormat, ServeArgs};
use leasebroker::server::{Server, StoreSpec, open};
use leasebroker::state::Stats;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

#[derive(Parser, Debug)]
#[command(name = "leasebroker", about = "A provisioning API protected by idem, and a retry storm to prove it")]
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
    /// Start a server on a temporary redb file with faults on, send it 200 creates from
    /// retrying clients, 32 at a time, print the counts and fail on any phantom worker.
    Demo,
    /// Run the server.
    Serve(ServeArgs),
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    cli.log_format.init();
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
            let (store, infra) = open(&args.store, &args.state).await?;
            let server = Server::start(TcpListener::bind(&args.addr).await?, store, infra, &args.config())?;
            eprintln!("leasebroker: listening on {} (store {:?})", server.url(), args.store);
            serve::until_ctrl_c(server).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Demo => demo(200, 32).await,
    }
}

/// `demo`: the server on a temporary redb file with faults on, `operations` creates from
/// retrying clients, then the server's own counts: one worker and one VM per operation.
async fn demo(operations: u32, concurrency: usize) -> Result<ExitCode, Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("leasebroker.redb");
    let (store, infra) = open(&StoreSpec::Redb(path.clone()), &dir.path().join("state.redb")).await?;
    // Faults: a quarter of responses are lost after the work is done, handlers take up to
    // 300 ms (so retries meet in-flight claims), 5% of boots fail.
    let faults =
        Faults { drop_rate: 0.25, hold_ms: 1_000, work_ms: 300, hypervisor_fail_rate: 0.05, ..Faults::default() };
    let mut config = Config { faults, ..Config::default() };
    config.policy.lease_ttl = Duration::from_secs(3);
    let server = Server::start(TcpListener::bind("127.0.0.1:0").await?, store, infra, &config)?;
    let url = server.url();
    println!("leasebroker demo: server on {url} with store {}", path.display());
    println!("faults: 25% of responses lost after the work, handlers up to 300 ms, 5% of boots fail");
    let (created, replays, attempts, lost) = creates(&url, operations, concurrency).await;
    let counts: Stats = reqwest::get(format!("{url}/admin/stats")).await?.json().await?;
    server.stop().await?;
    let n = u64::from(operations);
    let (phantoms, extra_vms) = (counts.workers.saturating_sub(n), counts.boots.saturating_sub(n));
    println!(
        "clients: {operations} creates from 4 principals, {concurrency} at a time: {created} answered 201 ({replays} \
         replayed) after {attempts} attempts, {lost} of them lost to timeouts"
    );
    let ok = phantoms == 0 && extra_vms == 0 && created == n;
    println!(
        "{}: {} workers and {} VMs booted for {n} operations; phantom workers {phantoms}, extra VMs {extra_vms}",
        if ok { "OK" } else { "FAIL" },
        counts.workers,
        counts.boots
    );
    Ok(if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// `operations` creates from four principals, `concurrency` at a time. Each operation has
/// one idempotency key, made before its first attempt and sent on every retry: an attempt
/// times out after 400 ms, so a response the server holds back is lost and the create is
/// sent again, and the layer replays the stored 201 instead of creating a second worker.
/// Returns the 201s, the replays among them, the attempts, and the attempts lost.
async fn creates(target: &str, operations: u32, concurrency: usize) -> (u64, u64, u64, u64) {
    let policy = RetryPolicy::default().with_attempt_timeout(Duration::from_millis(400));
    let client = Arc::new(IdempotentClient::new(reqwest::Client::new(), policy));
    let gate = Arc::new(Semaphore::new(concurrency.max(1)));
    let mut tasks = Vec::new();
    for op in 0..operations {
        let (client, gate, url) = (Arc::clone(&client), Arc::clone(&gate), format!("{target}/v1/workers"));
        tasks.push(tokio::spawn(async move {
            let _permit = gate.acquire_owned().await;
            let key = OperationKey::generate();
            let body = format!(r#"{{"image":"worker-base:2025.11","cpu":16,"memory_gb":64,"labels":{{"op":"{op}"}}}}"#);
            let bearer = format!("Bearer demo-{}", op % 4);
            client
                .request(reqwest::Method::POST, url, &key)
                .header("authorization", &bearer)
                .json_body(body)
                .send()
                .await
        }));
    }
    let (mut created, mut replays, mut attempts, mut lost) = (0, 0, 0, 0);
    for task in tasks {
        let stats = match task.await {
            Ok(Ok(reply)) => {
                created += u64::from(reply.status == 201);
                replays += u64::from(reply.replayed);
                reply.stats
            }
            Ok(Err(ClientError::GaveUp { stats, .. })) => stats,
            Ok(Err(_)) | Err(_) => AttemptStats::default(),
        };
        attempts += u64::from(stats.attempts);
        lost += u64::from(stats.transport_errors);
    }
    (created, replays, attempts, lost)
}
