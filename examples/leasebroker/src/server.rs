//! Opening a store from a `--store` spec and running the server.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use idem_core::{MemoryStore, Store};
use idem_redb::RedbStore;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use redb::Database;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::app::{Config, router};
use crate::state::Infra;

/// Where records go: `redb:PATH` (or a bare path ending in `.redb`), `sqlite:PATH`,
/// `redis://…`, `postgres://…`, `mysql://…`, `dynamodb://TABLE…` or `memory`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreSpec {
    /// Records in a redb file; infra state in the `--state` redb file. The infra keeps its
    /// own file so that it never holds the records' database: after a commit on a full
    /// disk the store closes and reopens its file, which waits until no one else holds it.
    Redb(PathBuf),
    /// Records in a SQLite file; infra state in the `--state` redb file.
    Sqlite(PathBuf),
    /// Records in Redis at this URL (key prefix `idem:`, or `?prefix=P`); infra state in the
    /// `--state` redb file.
    Redis(String),
    /// Records in a Redis Cluster reached through any of `nodes` (`redis://HOST:PORT`
    /// URLs), `WAIT wait` replicas (1 s timeout) after each claim and complete when set,
    /// a shard with fewer replicas refused (`Shortfall::Strict`) or, with `degrade`, written
    /// with the replicas it has; infra state in the `--state` redb file. Spelled
    /// `redis-cluster://HOST:PORT[,HOST:PORT...][?wait=N[&shortfall=degrade]]`.
    RedisCluster {
        /// Seed nodes.
        nodes: Vec<String>,
        /// Replicas to wait for.
        wait: Option<u32>,
        /// `Shortfall::Degrade` instead of the default `Strict`.
        degrade: bool,
    },
    /// Records in PostgreSQL at this URL (schema `idem`, or `?schema=S`, migrated on start); infra state
    /// in the `--state` redb file.
    Postgres(String),
    /// Records in MySQL or MariaDB at this URL (tables `idem_*`, or `?prefix=P`, migrated
    /// on start); infra state in the `--state` redb file.
    MySql(String),
    /// Records in the DynamoDB table `table` (created when missing), credentials from the
    /// AWS environment; `endpoint` (an emulator) and `region` override the environment's.
    /// Infra state in the `--state` redb file. Spelled `dynamodb://TABLE[?endpoint=URL&region=R]`,
    /// as the `idem` CLI takes it.
    Dynamo {
        /// The table.
        table: String,
        /// The endpoint URL instead of the region's.
        endpoint: Option<String>,
        /// The region instead of the environment's.
        region: Option<String>,
    },
    /// Records in memory (lost on restart); infra state in the `--state` redb file.
    Memory,
}

impl std::str::FromStr for StoreSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "memory" {
            Ok(StoreSpec::Memory)
        } else if let Some(p) = s.strip_prefix("sqlite:") {
            Ok(StoreSpec::Sqlite(PathBuf::from(p)))
        } else if let Some(rest) = s.strip_prefix("redis-cluster://") {
            parse_cluster(rest)
        } else if s.starts_with("redis://") || s.starts_with("rediss://") {
            Ok(StoreSpec::Redis(s.to_string()))
        } else if s.starts_with("postgres://") || s.starts_with("postgresql://") {
            Ok(StoreSpec::Postgres(s.to_string()))
        } else if s.starts_with("mysql://") || s.starts_with("mariadb://") {
            Ok(StoreSpec::MySql(s.to_string()))
        } else if let Some(rest) = s.strip_prefix("dynamodb://") {
            parse_dynamo(rest)
        } else if let Some(p) = s.strip_prefix("redb:") {
            Ok(StoreSpec::Redb(PathBuf::from(p)))
        } else if s.ends_with(".redb") {
            Ok(StoreSpec::Redb(PathBuf::from(s)))
        } else {
            Err(format!(
                "unknown store {s:?}: use redb:PATH, sqlite:PATH, redis://HOST:PORT, \
                 redis-cluster://HOST:PORT[,HOST:PORT...][?wait=N[&shortfall=degrade]], postgres://USER@HOST/DB, \
                 mysql://USER@HOST/DB, dynamodb://TABLE[?endpoint=URL&region=R] or memory"
            ))
        }
    }
}

/// `HOST:PORT[,HOST:PORT...][?wait=N]`, after `redis-cluster://`.
fn parse_cluster(rest: &str) -> Result<StoreSpec, String> {
    let (hosts, query) = rest.split_once('?').unwrap_or((rest, ""));
    let nodes: Vec<String> = hosts
        .split(',')
        .map(str::trim)
        .filter(|h| !h.is_empty())
        .map(|h| {
            let port = h.rsplit_once(':').map(|(_, p)| p).unwrap_or("");
            match port.parse::<u16>() {
                Ok(_) => Ok(format!("redis://{h}")),
                Err(_) => Err(format!("cluster node {h:?} is not HOST:PORT")),
            }
        })
        .collect::<Result<_, _>>()?;
    if nodes.is_empty() {
        return Err("redis-cluster:// needs at least one HOST:PORT".into());
    }
    let (mut wait, mut degrade) = (None, false);
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("wait", n)) => wait = Some(n.parse::<u32>().map_err(|_| format!("wait={n:?} is not a count"))?),
            Some(("shortfall", "degrade")) => degrade = true,
            Some(("shortfall", "strict")) => degrade = false,
            _ => return Err(format!("unknown cluster option {pair:?} (known: wait=N, shortfall=strict|degrade)")),
        }
    }
    Ok(StoreSpec::RedisCluster { nodes, wait, degrade })
}

/// `TABLE[?endpoint=URL&region=R]`, after `dynamodb://`.
fn parse_dynamo(rest: &str) -> Result<StoreSpec, String> {
    let (table, query) = rest.split_once('?').unwrap_or((rest, ""));
    if table.is_empty() {
        return Err("dynamodb:// needs a table name: dynamodb://TABLE".into());
    }
    let (mut endpoint, mut region) = (None, None);
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("endpoint", v)) if !v.is_empty() => endpoint = Some(v.to_owned()),
            Some(("region", v)) if !v.is_empty() => region = Some(v.to_owned()),
            _ => return Err(format!("unknown dynamodb option {pair:?} (known: endpoint=URL, region=R)")),
        }
    }
    Ok(StoreSpec::Dynamo { table: table.to_owned(), endpoint, region })
}

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The store or state file could not be opened.
    #[error("opening {what}: {message}")]
    Open {
        /// What was being opened.
        what: String,
        /// The reason.
        message: String,
    },
    /// Binding or serving failed.
    #[error("serving: {0}")]
    Io(#[from] std::io::Error),
}

fn open_err(what: impl Into<String>, e: impl std::fmt::Display) -> ServerError {
    ServerError::Open { what: what.into(), message: e.to_string() }
}

/// Opens the store and the infra state.
///
/// # Errors
/// [`ServerError::Open`] when a file cannot be opened.
pub async fn open(spec: &StoreSpec, state_path: &Path) -> Result<(Arc<dyn Store>, Infra), ServerError> {
    let infra_file = || -> Result<Infra, ServerError> {
        let db = Database::create(state_path).map_err(|e| open_err(state_path.display().to_string(), e))?;
        Infra::new(Arc::new(db)).map_err(|e| open_err("infra tables", e))
    };
    match spec {
        StoreSpec::Redb(path) => {
            let store = RedbStore::open(path, idem_redb::Config::default())
                .map_err(|e| open_err(path.display().to_string(), e))?;
            Ok((Arc::new(store), infra_file()?))
        }
        StoreSpec::Sqlite(path) => {
            let store = idem_sqlite::SqliteStore::open(path, idem_sqlite::Config::default())
                .map_err(|e| open_err(path.display().to_string(), e))?;
            Ok((Arc::new(store), infra_file()?))
        }
        StoreSpec::Redis(url) => {
            let (driver_url, prefix) = take_option(url, "prefix");
            let mut config = idem_redis::Config::default();
            if let Some(prefix) = prefix {
                config = config.with_prefix(prefix);
            }
            let store =
                idem_redis::RedisStore::connect(&driver_url, config).await.map_err(|e| open_err(url.clone(), e))?;
            Ok((Arc::new(store), infra_file()?))
        }
        StoreSpec::RedisCluster { nodes, wait, degrade } => {
            let shortfall = if *degrade { idem_redis::Shortfall::Degrade } else { idem_redis::Shortfall::Strict };
            let ack = wait
                .map(|n| idem_redis::ReplicaAck::new(n, std::time::Duration::from_secs(1)).with_shortfall(shortfall));
            let config = idem_redis::Config::default().with_replica_ack(ack);
            let store = idem_redis::RedisStore::connect_cluster(nodes, config)
                .await
                .map_err(|e| open_err(nodes.join(","), e))?;
            Ok((Arc::new(store), infra_file()?))
        }
        StoreSpec::Postgres(url) => {
            // Applies the missing migrations before it returns.
            let (driver_url, schema) = take_option(url, "schema");
            let mut config = idem_postgres::Config::default();
            if let Some(schema) = schema {
                config = config.with_schema(schema);
            }
            let store = idem_postgres::PostgresStore::connect(&driver_url, config)
                .await
                .map_err(|e| open_err(url.clone(), e))?;
            Ok((Arc::new(store), infra_file()?))
        }
        StoreSpec::MySql(url) => {
            // Applies the missing migrations before it returns.
            let (driver_url, prefix) = take_option(url, "prefix");
            let mut config = idem_mysql::Config::default();
            if let Some(prefix) = prefix {
                config = config.with_table_prefix(prefix);
            }
            let store =
                idem_mysql::MySqlStore::connect(&driver_url, config).await.map_err(|e| open_err(url.clone(), e))?;
            Ok((Arc::new(store), infra_file()?))
        }
        StoreSpec::Dynamo { table, endpoint, region } => {
            let mut config = idem_dynamodb::Config::default().with_table(table);
            if let Some(url) = endpoint {
                config = config.with_endpoint_url(url);
            }
            if let Some(region) = region {
                config = config.with_region(region);
            }
            let store = idem_dynamodb::DynamoStore::connect(config).await.map_err(|e| open_err(table.clone(), e))?;
            Ok((Arc::new(store), infra_file()?))
        }
        StoreSpec::Memory => Ok((Arc::new(MemoryStore::new()), infra_file()?)),
    }
}

/// Splits the option `name` (`?prefix=P`, `?schema=S`) off a store URL, the same spelling
/// as the `idem` CLI's store URLs (docs/operations.md): the rest of the URL, with its other
/// query parameters, goes to the driver. Two demos (or a demo and tests) on one shared
/// Redis or PostgreSQL then keep their records apart.
fn take_option(url: &str, name: &str) -> (String, Option<String>) {
    let Some((base, query)) = url.split_once('?') else {
        return (url.to_owned(), None);
    };
    let mut value = None;
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some((k, v)) if k == name && !v.is_empty() => value = Some(v.to_owned()),
            _ => kept.push(pair),
        }
    }
    let rest = if kept.is_empty() { base.to_owned() } else { format!("{base}?{}", kept.join("&")) };
    (rest, value)
}

/// How often the server sweeps expired records (stores without native expiry).
pub const SWEEP_PERIOD: std::time::Duration = std::time::Duration::from_secs(60);
/// Records deleted per sweep call; a sweep repeats while the store says there are more.
pub const SWEEP_BATCH: usize = 1_000;

/// The process's Prometheus recorder for the idem metrics (docs/observability.md):
/// installed as the global `metrics` recorder on the first call, the same handle on every
/// later one. `None` when another recorder was installed first (the application chose its
/// own exporter); `/metrics` then answers 404.
#[must_use]
pub fn prometheus() -> Option<PrometheusHandle> {
    static HANDLE: Mutex<Option<Result<PrometheusHandle, String>>> = Mutex::new(None);
    let mut handle = HANDLE.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let installed = handle.get_or_insert_with(|| {
        prometheus_builder().install_recorder().map_err(|e| {
            tracing::warn!(error = %e, "leasebroker: no Prometheus recorder (another metrics recorder is installed)");
            e.to_string()
        })
    });
    installed.as_ref().ok().cloned()
}

/// Bucket bounds of `idem_store_call_seconds` (seconds: 100 µs to 10 s).
pub const LATENCY_BUCKETS: [f64; 12] =
    [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 1.0, 10.0];
/// Bucket bounds of `idem_group_commit_batch_size` (operations per batch).
pub const BATCH_BUCKETS: [f64; 9] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];

/// The exporter with buckets for idem's histograms: without them
/// `metrics-exporter-prometheus` renders every histogram as a summary (quantiles per
/// process), which Prometheus cannot aggregate across servers.
fn prometheus_builder() -> PrometheusBuilder {
    use metrics_exporter_prometheus::Matcher;
    let builder = PrometheusBuilder::new();
    let with_latency =
        builder.set_buckets_for_metric(Matcher::Full("idem_store_call_seconds".into()), &LATENCY_BUCKETS);
    let with_batch = with_latency
        .and_then(|b| b.set_buckets_for_metric(Matcher::Full("idem_group_commit_batch_size".into()), &BATCH_BUCKETS));
    // Only an empty bucket list is refused; these are constants, never empty.
    with_batch.unwrap_or_else(|_| PrometheusBuilder::new())
}

/// `GET /metrics`: every metric in the Prometheus text format (version 0.0.4).
fn metrics_route(handle: Option<PrometheusHandle>) -> axum::Router {
    use axum::http::{StatusCode, header};
    use axum::response::IntoResponse;
    axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let handle = handle.clone();
            async move {
                let Some(handle) = handle else {
                    return (StatusCode::NOT_FOUND, "no Prometheus recorder in this process\n").into_response();
                };
                // Histograms are kept in buckets that upkeep rolls over; run it per scrape.
                handle.run_upkeep();
                ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], handle.render()).into_response()
            }
        }),
    )
}

/// A running server.
#[derive(Debug)]
pub struct Server {
    /// Where it listens.
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<std::io::Result<()>>,
}

impl Server {
    /// Serves `router(infra, store, config)` on `listener` until [`Server::stop`], plus
    /// `GET /metrics` (see [`prometheus`]).
    ///
    /// # Errors
    /// When the listener has no local address.
    pub fn start(
        listener: TcpListener,
        store: Arc<dyn Store>,
        infra: Infra,
        config: &Config,
    ) -> Result<Self, ServerError> {
        let addr = listener.local_addr()?;
        let sweep = idem_kit::SweepConfig::default().with_period(SWEEP_PERIOD).with_batch(SWEEP_BATCH);
        let sweeper = idem_kit::Sweeper::start(Arc::clone(&store), sweep);
        let app = router(infra, store, config).merge(metrics_route(prometheus()));
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let serve = axum::serve(listener, app).with_graceful_shutdown(async move {
                let _ = rx.await;
            });
            let served = serve.await;
            // The sweeper lives exactly as long as the server, so stopping the server
            // releases the store (a redb file can then be reopened).
            sweeper.stop().await;
            served
        });
        Ok(Self { addr, stop: Some(tx), task })
    }

    /// The base URL, `http://127.0.0.1:PORT`.
    #[must_use]
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops accepting, finishes the requests in flight, and releases the store.
    ///
    /// # Errors
    /// When serving failed.
    pub async fn stop(mut self) -> Result<(), ServerError> {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        match self.task.await {
            Ok(r) => Ok(r?),
            Err(e) => Err(ServerError::Io(std::io::Error::other(e))),
        }
    }

    /// Waits until the server ends (Ctrl-C handling is the caller's).
    ///
    /// # Errors
    /// When serving failed.
    pub async fn wait(self) -> Result<(), ServerError> {
        match self.task.await {
            Ok(r) => Ok(r?),
            Err(e) => Err(ServerError::Io(std::io::Error::other(e))),
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn prefix_and_schema_options_are_taken_off_the_driver_url() {
        // Regression: `?prefix=` / `?schema=` went to the driver unchanged, so the demo on a
        // shared Redis or PostgreSQL always wrote under `idem:` / schema `idem`.
        assert_eq!(
            super::take_option("redis://127.0.0.1:6379/0?prefix=r2demo:", "prefix"),
            ("redis://127.0.0.1:6379/0".to_owned(), Some("r2demo:".to_owned()))
        );
        assert_eq!(
            super::take_option("postgres://u@h/db?sslmode=disable&schema=r2&connect_timeout=5", "schema"),
            ("postgres://u@h/db?sslmode=disable&connect_timeout=5".to_owned(), Some("r2".to_owned()))
        );
        assert_eq!(super::take_option("redis://h:1", "prefix"), ("redis://h:1".to_owned(), None));
    }

    #[test]
    fn a_dynamodb_spec_names_its_table_endpoint_and_region() {
        use super::StoreSpec;
        let spec: StoreSpec = "dynamodb://idem?endpoint=http://127.0.0.1:5005&region=eu-west-1".parse().unwrap();
        let endpoint = Some("http://127.0.0.1:5005".to_owned());
        assert_eq!(spec, StoreSpec::Dynamo { table: "idem".into(), endpoint, region: Some("eu-west-1".into()) });
        let bare: StoreSpec = "dynamodb://t".parse().unwrap();
        assert_eq!(bare, StoreSpec::Dynamo { table: "t".into(), endpoint: None, region: None });
        assert!("dynamodb://".parse::<StoreSpec>().is_err());
        assert!("dynamodb://t?prefix=x".parse::<StoreSpec>().is_err());
    }
}
