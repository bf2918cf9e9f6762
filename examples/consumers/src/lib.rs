//! Provisioning jobs from a broker: each message asks for one worker, and the "cloud" that
//! creates workers (a PostgreSQL table standing in for a provider's API) does not
//! deduplicate: every create call makes a new row, as a real `RunInstances` without a
//! client token makes a new machine. `nats-worker` and `amqp-worker` consume jobs through
//! `idem-consumer`; with `--no-idem` they run the same handler bare, to show what
//! redeliveries and re-published jobs do without it.

use std::sync::Arc;
use std::time::Duration;

use idem_consumer::{Config, Consumer};
use idem_core::{Reconciled, Resumable, StepError, Store};
use rand::Rng as _;
use sqlx::PgPool;

/// What every worker binary takes.
#[derive(Debug, Clone, clap::Args)]
pub struct Common {
    /// PostgreSQL for the idem records and the cloud's workers table.
    #[arg(long, env = "IDEM_POSTGRES_URL", default_value = "postgres://postgres@127.0.0.1:5432/test")]
    pub postgres: String,
    /// The principal jobs are scoped to (the tenant that publishes them).
    #[arg(long, default_value = "tenant-a")]
    pub principal: String,
    /// The idem lease, in milliseconds: how soon a job held by a dead consumer is taken over.
    #[arg(long, default_value_t = 30_000)]
    pub lease_ms: u64,
    /// Up to this many milliseconds of random work before and after the create call.
    #[arg(long, default_value_t = 0)]
    pub hold_ms: u64,
    /// Messages handled at once.
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    /// Run the handler without idem (no claim, ack after the create call).
    #[arg(long)]
    pub no_idem: bool,
}

impl Common {
    /// The cloud and the engine every worker binary builds: idem records in PostgreSQL
    /// under the `--lease-ms` lease.
    ///
    /// # Errors
    /// The database's or the store's.
    pub async fn connect(&self) -> Result<(Cloud, Consumer), Box<dyn std::error::Error>> {
        let cloud = Cloud::connect(&self.postgres).await?;
        let config = Config::default().with_lease_ttl(Duration::from_millis(self.lease_ms));
        Ok((cloud, Consumer::new(store(&self.postgres).await?, config)))
    }
}

/// The cloud: a table of workers, each tagged with the job that asked for it and the tag
/// its create call carried.
#[derive(Clone, Debug)]
pub struct Cloud {
    pool: PgPool,
}

impl Cloud {
    /// Connects and creates the table if it is missing.
    ///
    /// # Errors
    /// The database's.
    pub async fn connect(url: &str) -> Result<Self, sqlx::Error> {
        let pool = sqlx::postgres::PgPoolOptions::new().max_connections(8).connect(url).await?;
        // Several workers start at once: one creates the table, the others wait on the lock.
        let mut tx = pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock(7368121)").execute(&mut *tx).await?;
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS example_cloud_workers (
                id bigserial PRIMARY KEY, job text NOT NULL, tag text, created_at timestamptz DEFAULT now())",
        )
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(Self { pool })
    }

    /// Creates a worker for `job`, tagged `tag`: never deduplicated.
    ///
    /// # Errors
    /// The database's.
    pub async fn create(&self, job: &str, tag: Option<&str>) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar("INSERT INTO example_cloud_workers (job, tag) VALUES ($1, $2) RETURNING id")
            .bind(job)
            .bind(tag)
            .fetch_one(&self.pool)
            .await
    }

    /// The worker a create call tagged `tag` made, if any.
    ///
    /// # Errors
    /// The database's.
    pub async fn find(&self, tag: &str) -> Result<Option<i64>, sqlx::Error> {
        sqlx::query_scalar("SELECT min(id) FROM example_cloud_workers WHERE tag = $1")
            .bind(tag)
            .fetch_one(&self.pool)
            .await
    }

    /// `(job, workers)` for every job whose name starts with `prefix`.
    ///
    /// # Errors
    /// The database's.
    pub async fn workers_per_job(&self, prefix: &str) -> Result<Vec<(String, i64)>, sqlx::Error> {
        sqlx::query_as(
            "SELECT job, count(*) FROM example_cloud_workers WHERE job LIKE $1 || '%' GROUP BY job ORDER BY job",
        )
        .bind(prefix)
        .fetch_all(&self.pool)
        .await
    }
}

/// The idem store: PostgreSQL, its tables created on first use.
///
/// # Errors
/// The store's.
pub async fn store(url: &str) -> Result<Arc<dyn Store>, idem_postgres::Error> {
    let config = idem_postgres::Config::default().with_auto_migrate(true).with_max_connections(8);
    Ok(Arc::new(idem_postgres::PostgresStore::connect(url, config).await?))
}

/// The job a message carries: `{"job": "<name>", ...}`.
///
/// # Errors
/// A payload that is not such an object.
pub fn job_of(payload: &[u8]) -> Result<String, String> {
    let v: serde_json::Value = serde_json::from_slice(payload).map_err(|e| format!("bad payload: {e}"))?;
    v.get("job").and_then(|j| j.as_str()).map(str::to_owned).ok_or_else(|| "payload has no \"job\"".to_owned())
}

async fn hold(max_ms: u64) {
    if max_ms > 0 {
        let ms = rand::rng().random_range(0..=max_ms);
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
}

/// The job under idem: the create call is an intent tagged with its sub-key, so a delivery
/// that takes over after a consumer died looks the worker up by its tag before creating one.
///
/// # Errors
/// The cloud's or the journal's, as text.
pub async fn provision(journal: Resumable, cloud: &Cloud, payload: &[u8], hold_ms: u64) -> Result<(), String> {
    let job = job_of(payload)?;
    hold(hold_ms).await;
    journal
        .intent(
            "create-worker",
            |tag| async move { cloud.create(&job, Some(&tag.to_string())).await.map(|id| id.to_string()) },
            |tag| async move {
                Ok(match cloud.find(&tag.to_string()).await? {
                    Some(id) => Reconciled::Found(id.to_string()),
                    None => Reconciled::NotFound,
                })
            },
        )
        .await
        .map_err(|e: StepError<sqlx::Error>| e.to_string())?;
    hold(hold_ms).await;
    Ok(())
}

/// The same job without idem: create, then return (the caller acks).
///
/// # Errors
/// The cloud's, as text.
pub async fn provision_bare(cloud: &Cloud, payload: &[u8], hold_ms: u64) -> Result<(), String> {
    let job = job_of(payload)?;
    hold(hold_ms).await;
    cloud.create(&job, None).await.map_err(|e| e.to_string())?;
    hold(hold_ms).await;
    Ok(())
}

/// Logs to stderr, filtered by `RUST_LOG` (default `warn`).
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into());
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}
