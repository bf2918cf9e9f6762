//! `leasebroker-sql`: serves the create variant whose worker row lives in PostgreSQL or
//! MySQL/MariaDB (`POST /v1/sql/workers`, see `leasebroker::sqlworkers`), for the demo and
//! the crash test `tests/it/tx_crash.rs`.
//!
//! ```text
//! leasebroker-sql --database postgres://postgres@127.0.0.1:5432/test --completion transactional
//! leasebroker-sql --database mysql://root@127.0.0.1:3306/test --completion transactional
//! curl -X POST -H 'Authorization: Bearer t' -H 'Idempotency-Key: op-1' http://127.0.0.1:8081/v1/sql/workers
//! ```

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use idem_core::Policy;
use leasebroker::crash::CrashPlan;
use leasebroker::sqlworkers::{Completion, SqlWorkers};
use tokio::net::TcpListener;

/// Serves `POST /v1/sql/workers`: a worker row in the database per operation.
#[derive(Parser, Debug)]
struct Args {
    /// Listen address.
    #[arg(long, default_value = "127.0.0.1:8081")]
    addr: String,
    /// The database holding the records and the worker rows: `postgres://…`, or
    /// `mysql://…`/`mariadb://…`.
    #[arg(long, default_value = "postgres://postgres@127.0.0.1:5432/test")]
    database: String,
    /// Where the records and the worker table live: the Postgres schema (table
    /// `sql_workers` in it), or the MySQL table prefix (tables `<prefix>_records`,
    /// `<prefix>_workers`).
    #[arg(long, default_value = "leasebroker_sql")]
    namespace: String,
    /// How the worker row and the record's completion commit.
    #[arg(long, value_enum, default_value = "transactional")]
    completion: Completion,
    /// In-flight lease, ms.
    #[arg(long, default_value_t = 5_000)]
    lease_ms: u64,
    /// Crash points to arm, comma-separated: tx_after_insert, tx_before_commit,
    /// tx_after_commit, tx_after_response. At a point that fires the server prints
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
            eprintln!("leasebroker-sql: {e}");
            ExitCode::from(2)
        }
    }
}

async fn run(args: Args) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let crash = CrashPlan::parse(&args.crash_at, 1.0, false)?;
    let app = SqlWorkers::open(&args.database, &args.namespace, args.completion, crash).await?;
    let mut policy = Policy::default();
    policy.lease_ttl = Duration::from_millis(args.lease_ms);
    let listener = TcpListener::bind(&args.addr).await?;
    let addr = listener.local_addr()?;
    eprintln!("leasebroker-sql: listening on http://{addr} ({:?} completion)", args.completion);
    // A supervisor (the crash test) reads this line to know the server is up.
    println!("LISTENING http://{addr}");
    axum::serve(listener, app.router(policy)).await?;
    Ok(())
}
