//! `leasebroker-pg`: serves the create variant whose worker row lives in PostgreSQL
//! (`POST /v1/pg/workers`, see `leasebroker::pgworkers`), for the demo and the crash test
//! `tests/pg_crash.rs`.
//!
//! ```text
//! leasebroker-pg --postgres postgres://postgres@127.0.0.1:5432/test --completion transactional
//! curl -X POST -H 'Authorization: Bearer t' -H 'Idempotency-Key: op-1' http://127.0.0.1:8081/v1/pg/workers
//! ```

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use idem_core::Policy;
use idem_postgres::sqlx::postgres::PgPoolOptions;
use leasebroker::crash::CrashPlan;
use leasebroker::pgworkers::{Completion, PgWorkers};
use tokio::net::TcpListener;

/// Serves `POST /v1/pg/workers`: a worker row in PostgreSQL per operation.
#[derive(Parser, Debug)]
struct Args {
    /// Listen address.
    #[arg(long, default_value = "127.0.0.1:8081")]
    addr: String,
    /// The database holding the records and the worker rows.
    #[arg(long, default_value = "postgres://postgres@127.0.0.1:5432/test")]
    postgres: String,
    /// Schema of the records and the `pg_workers` table.
    #[arg(long, default_value = "leasebroker_pg")]
    schema: String,
    /// How the worker row and the record's completion commit.
    #[arg(long, value_enum, default_value = "transactional")]
    completion: Completion,
    /// In-flight lease, ms.
    #[arg(long, default_value_t = 5_000)]
    lease_ms: u64,
    /// Crash points to arm, comma-separated: pg_after_insert, pg_before_commit,
    /// pg_after_commit, pg_after_response. At a point that fires the server prints
    /// `CRASHPOINT <name>` and blocks for an outside SIGKILL.
    #[arg(long, default_value = "")]
    crash_at: String,
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt().with_writer(std::io::stderr).with_env_filter("warn").init();
    match run(Args::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("leasebroker-pg: {e}");
            ExitCode::from(2)
        }
    }
}

async fn run(args: Args) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let crash = CrashPlan::parse(&args.crash_at, 1.0, false)?;
    let pool = PgPoolOptions::new().max_connections(8).connect(&args.postgres).await?;
    let app = PgWorkers::open(pool, &args.schema, args.completion, crash).await?;
    let mut policy = Policy::default();
    policy.lease_ttl = Duration::from_millis(args.lease_ms);
    let listener = TcpListener::bind(&args.addr).await?;
    let addr = listener.local_addr()?;
    eprintln!("leasebroker-pg: listening on http://{addr} ({:?} completion)", args.completion);
    // A supervisor (the crash test) reads this line to know the server is up.
    println!("LISTENING http://{addr}");
    axum::serve(listener, app.router(policy)).await?;
    Ok(())
}
