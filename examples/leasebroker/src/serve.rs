//! `leasebroker serve`: its flags, logs and run loop, shared with the test rig's `serve`
//! (`harness/`), which adds fault flags, crash points and a firmware route.

use std::path::PathBuf;
use std::time::Duration;

use crate::app::{Config, Faults};
use crate::server::{Server, ServerError, StoreSpec};

/// Where to listen, which store, the infra state file, the record rules.
#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// Listen address.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub addr: String,
    /// Record store: `redb:PATH`, `sqlite:PATH`, `redis://HOST:PORT`,
    /// `redis-cluster://HOST:PORT[,HOST:PORT...][?wait=N]`, `postgres://USER@HOST/DB`,
    /// `mysql://USER@HOST/DB` (or `mariadb://`), `dynamodb://TABLE[?endpoint=URL&region=R]` (credentials and, without `region`, the
    /// region from the AWS environment) or `memory`.
    #[arg(long, default_value = "redb:leasebroker.redb")]
    pub store: StoreSpec,
    /// Infra state file (a redb file of its own, whatever the store).
    #[arg(long, default_value = "leasebroker-state.redb")]
    pub state: PathBuf,
    /// In-flight lease, ms (at least 100). A retry takes over a claim once its lease has
    /// passed. A running handler's lease is renewed (every lease / 3), so it only has to
    /// outlast a stall of this process (seconds), not the handler: a lease of 2 s covers a
    /// 20 s handler, and a killed server's claims free up 2 s later.
    #[arg(long, default_value_t = 5_000, value_parser = clap::value_parser!(u64).range(100..))]
    pub lease_ms: u64,
    /// Retention window, ms.
    #[arg(long, default_value_t = 86_400_000)]
    pub retention_ms: u64,
    /// Upper bound of a random delay inside the create handler, ms (keep below the lease):
    /// a retry that arrives meanwhile gets 409 + `Retry-After`.
    #[arg(long, default_value_t = 0)]
    pub work_ms: u64,
}

impl ServeArgs {
    /// The server's settings: the flags' lease, retention and handler delay, no other fault.
    #[must_use]
    pub fn config(&self) -> Config {
        let mut config = Config { faults: Faults { work_ms: self.work_ms, ..Faults::default() }, ..Config::default() };
        config.policy.lease_ttl = Duration::from_millis(self.lease_ms);
        config.policy.retention = Duration::from_millis(self.retention_ms);
        config
    }
}

/// `--log-format`: log lines as text or as JSON objects (with the current span's fields).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line (tracing-subscriber's JSON format).
    Json,
}

impl LogFormat {
    /// Installs the log subscriber, on stderr, at `RUST_LOG`'s level (default `warn`).
    /// Closed spans are logged too: at `RUST_LOG=idem_http=info` every keyed request gives
    /// one line with its `idempotency` span's decision, outcome and renewals.
    pub fn init(self) {
        let logs = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
            .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
            .with_writer(std::io::stderr);
        match self {
            LogFormat::Text => logs.init(),
            LogFormat::Json => logs.json().with_current_span(true).with_span_list(false).init(),
        }
    }
}

/// Prints `LISTENING <url>` on stdout (a supervisor, such as the rig's crash test, reads
/// it to know the server is up) and serves until Ctrl-C.
///
/// # Errors
/// When serving failed.
pub async fn until_ctrl_c(server: Server) -> Result<(), ServerError> {
    println!("LISTENING {}", server.url());
    tokio::select! {
        r = server.wait() => r,
        _ = tokio::signal::ctrl_c() => Ok(()),
    }
}
