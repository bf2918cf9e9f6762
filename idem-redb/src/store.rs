//! [`RedbStore`]: the [`Store`] on one redb file, and its claim path.

use std::fmt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idem_core::engine::{self, Write};
use idem_core::group_commit::{BatchStats, GroupCommit};
use idem_core::store::JournalWrite;
use idem_core::{
    Capabilities, ClaimOutcome, ClaimRequest, FencingToken, ListFilter, Listing, ReclaimOutcome, ReclaimRequest,
    Record, RecordId, Store, StoreError, StoredResponse, SweepOutcome, UnixMillis,
};
use redb::Database;

use crate::config::Config;
use crate::error::{BACKEND, Error};
use crate::table::{self, RedbEngine, RedbView};

/// The [`Store`] on one redb file, with group commit.
///
/// Every operation that may write (`claim` of a key without a live record, `reclaim`,
/// `complete`, `fail`, `sweep`, `journal_put`) goes to one writer thread, which applies
/// the waiting operations in one write transaction and commits once: see
/// [`idem_core::group_commit`] for what a batch holds and how it fails. A `claim` that
/// finds a live record is answered from a read transaction ([`Config::with_claim_reads`]);
/// `get` and `journal_get` read on Tokio's blocking pool.
///
/// Clones share the file and the writer; dropping the last one answers what is queued,
/// makes pending commits durable, stops the writer and releases the file.
#[derive(Clone)]
pub struct RedbStore {
    db: Arc<Database>,
    config: Config,
    writer: GroupCommit,
}

impl fmt::Debug for RedbStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedbStore")
            .field("config", &self.config)
            .field("stats", &self.batch_stats())
            .finish_non_exhaustive()
    }
}

impl RedbStore {
    /// Opens (or creates) the redb file at `path` and starts the writer.
    ///
    /// Blocks (file I/O, a repair after a crash, one commit): call it at start-up, or from
    /// `tokio::task::spawn_blocking`.
    ///
    /// # Errors
    /// [`Error::Open`] when redb cannot open the file (for example it is already open, in
    /// this process or another); otherwise as [`RedbStore::from_database`].
    pub fn open(path: impl AsRef<Path>, config: Config) -> Result<Self, Error> {
        let db = Database::create(path)?;
        Self::from_database(Arc::new(db), config)
    }

    /// Runs the store on a database the application already opened, so the application
    /// can keep its own tables in the same file. The store only touches [`table::RECORDS`],
    /// [`table::EXPIRY`] and [`table::JOURNAL`], and creates them here. The application's
    /// own write transactions take turns with the writer's batches (redb allows one write
    /// transaction at a time); keep them short.
    ///
    /// # Errors
    /// [`Error::Transaction`], [`Error::Table`] or [`Error::Commit`] from creating the
    /// tables; [`Error::Spawn`] when the writer thread cannot start.
    pub fn from_database(db: Arc<Database>, config: Config) -> Result<Self, Error> {
        table::create_tables(&db)?;
        let engine = RedbEngine { db: Arc::clone(&db) };
        let writer = GroupCommit::start(engine, Arc::clone(config.clock()), config.batch()).map_err(Error::Spawn)?;
        // The settings this store runs on (docs/observability.md).
        tracing::info!(
            backend = "redb",
            durability = ?config.durability(),
            max_batch = config.batch().max_batch(),
            linger = ?config.batch().linger(),
            flush_interval_ms = config.batch().flush_interval().map(|d| d.as_millis() as u64),
            "idem-redb: store settings"
        );
        Ok(Self { db, config, writer })
    }

    /// The underlying database, for the application's own tables.
    #[must_use]
    pub fn database(&self) -> Arc<Database> {
        Arc::clone(&self.db)
    }

    /// The configuration the store runs with.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// What the writer has done so far.
    #[must_use]
    pub fn batch_stats(&self) -> BatchStats {
        self.writer.stats()
    }

    /// The claim's outcome when a read transaction finds a live record; `None` sends the
    /// claim to the writer. Runs on the caller's thread before the first `.await`: a redb
    /// read transaction never waits for the writer, and a claim that goes on to the writer
    /// is queued in the order its future was first polled.
    fn claim_from_view(&self, req: &ClaimRequest) -> Option<ClaimOutcome> {
        let view = RedbView::begin(&self.db).ok()?;
        self.writer.claim_from_view(&view, req)
    }

    /// Runs `read` on a read transaction on the blocking pool, with `now` read after the
    /// transaction began (a record live now was live at its snapshot).
    async fn read<T: Send + 'static>(
        &self,
        read: impl FnOnce(&RedbView, UnixMillis) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let db = Arc::clone(&self.db);
        let clock = Arc::clone(self.config.clock());
        tokio::task::spawn_blocking(move || read(&RedbView::begin(&db)?, clock.now())).await.map_err(Error::Join)?
    }
}

#[async_trait]
impl Store for RedbStore {
    fn capabilities(&self) -> Capabilities {
        Capabilities::new().with_backend("redb").with_journal(true).with_list(true)
    }

    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        if self.config.claim_reads()
            && let Some(outcome) = self.claim_from_view(&req)
        {
            return Ok(outcome);
        }
        self.writer.submit(Write::Claim(req)).await?.into_claim(BACKEND)
    }

    async fn reclaim(&self, req: ReclaimRequest) -> Result<ReclaimOutcome, StoreError> {
        self.writer.submit(Write::Reclaim(req)).await?.into_reclaim(BACKEND)
    }

    async fn complete(
        &self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Record, StoreError> {
        self.writer.submit(Write::Complete { id, token, response }).await?.into_record(BACKEND)
    }

    async fn fail(&self, id: RecordId, token: FencingToken) -> Result<Record, StoreError> {
        self.writer.submit(Write::Fail { id, token }).await?.into_record(BACKEND)
    }

    async fn extend(&self, id: RecordId, token: FencingToken, lease_ttl: Duration) -> Result<Record, StoreError> {
        self.writer.submit(Write::Extend { id, token, lease_ttl }).await?.into_record(BACKEND)
    }

    async fn get(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        self.read(move |view, now| engine::get(view, id, now)).await
    }

    async fn sweep(&self, limit: usize) -> Result<SweepOutcome, StoreError> {
        self.writer.submit(Write::Sweep { limit }).await?.into_sweep(BACKEND)
    }

    async fn journal_put(
        &self,
        id: RecordId,
        token: FencingToken,
        name: &str,
        value: Vec<u8>,
        overwrite: bool,
    ) -> Result<JournalWrite, StoreError> {
        let write = Write::JournalPut { id, token, name: name.to_owned(), value, overwrite };
        self.writer.submit(write).await?.into_journal(BACKEND)
    }

    async fn journal_get(&self, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let name = name.to_owned();
        self.read(move |view, now| engine::journal_get(view, id, &name, now)).await
    }

    /// One read transaction on the blocking pool: a range scan of the records table.
    async fn list(&self, filter: ListFilter) -> Result<Listing, StoreError> {
        self.read(move |view, now| view.list(&filter, now)).await
    }
}
