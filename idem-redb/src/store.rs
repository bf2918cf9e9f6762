//! [`RedbStore`]: the [`Store`] on one redb file, and its claim path.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idem_core::engine::{self, Write};
use idem_core::group_commit::{BatchStats, GroupCommit};
use idem_core::store::JournalWrite;
use idem_core::{
    Capabilities, ClaimOutcome, ClaimRequest, FencingToken, ListFilter, Listing, Receipt, ReclaimOutcome,
    ReclaimRequest, Record, RecordId, Store, StoreError, StoredResponse, SweepOutcome, UnixMillis,
};
use redb::Database;

use crate::config::Config;
use crate::error::{BACKEND, Error};
use crate::handle::Handle;
use crate::table::{self, RedbEngine, RedbView};

/// The [`Store`] on one redb file, with group commit.
///
/// Every operation that may write goes to one writer thread, which applies the waiting
/// operations in one write transaction and commits once ([`idem_core::group_commit`]). A
/// `claim` that finds a live record is answered from a read transaction; `get`,
/// `journal_get` and `list` read on Tokio's blocking pool.
///
/// Clones share the file and the writer; dropping the last one answers what is queued,
/// makes pending commits durable, stops the writer and releases the file.
#[derive(Clone)]
pub struct RedbStore {
    handle: Arc<Handle>,
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
    /// Opens (or creates) the redb file at `path` and starts the writer. After redb latched
    /// an I/O failure (a full disk) the store opens the file again by itself, answering
    /// [`StoreError::Unavailable`] until it can (`docs/contract.md#redb`).
    ///
    /// Blocks (file I/O, a repair after a crash, one commit): call it at start-up, or from
    /// `tokio::task::spawn_blocking`.
    ///
    /// # Errors
    /// [`Error::Open`] when redb cannot open the file (for example it is already open, in
    /// this process or another); otherwise as [`RedbStore::from_database`].
    pub fn open(path: impl AsRef<Path>, config: Config) -> Result<Self, Error> {
        let db = Arc::new(Database::create(path.as_ref())?);
        let reopen_from = config.reopen.then(|| path.as_ref().to_path_buf());
        Self::start(db, reopen_from, config)
    }

    /// Runs the store on a database the application already opened, so the application
    /// can keep its own tables in the same file. The store only touches [`table::RECORDS`],
    /// [`table::EXPIRY`] and [`table::JOURNAL`], and creates them here. The application's
    /// own write transactions take turns with the writer's batches (redb allows one write
    /// transaction at a time); keep them short.
    ///
    /// Unlike [`RedbStore::open`], it never reopens the database after redb latched an I/O
    /// failure: every write then answers [`StoreError::Unavailable`] until the application
    /// drops this store and every handle, and builds a new one (`docs/contract.md#redb`).
    ///
    /// # Errors
    /// [`Error::Transaction`], [`Error::Table`] or [`Error::Commit`] from creating the
    /// tables; [`Error::Spawn`] when the writer thread cannot start.
    pub fn from_database(db: Arc<Database>, config: Config) -> Result<Self, Error> {
        Self::start(db, None, config)
    }

    fn start(db: Arc<Database>, reopen_from: Option<PathBuf>, config: Config) -> Result<Self, Error> {
        table::create_tables(&db)?;
        let handle = Arc::new(Handle::new(db, reopen_from));
        let engine = RedbEngine { handle: Arc::clone(&handle) };
        let batch = config.batch();
        let writer = GroupCommit::start(engine, Arc::clone(&config.clock), batch.clone()).map_err(Error::Spawn)?;
        // The settings this store runs on (docs/observability.md).
        tracing::info!(
            backend = "redb",
            batch = ?batch,
            reopen = config.reopen,
            "idem-redb: store settings"
        );
        Ok(Self { handle, config, writer })
    }

    /// The current database, for the application's own tables; blocks while the file is
    /// opened again after an I/O failure. Hold it only as long as a transaction: the reopen
    /// waits until every handle on the old database is dropped.
    ///
    /// # Errors
    /// [`Error::Reopening`] or [`Error::Reopen`] while the file is closed after an I/O
    /// failure and could not be opened again yet (both retryable).
    pub fn database(&self) -> Result<Arc<Database>, Error> {
        self.handle.get()
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
        let db = self.handle.current()?;
        let view = RedbView::begin(&db).ok()?;
        self.writer.claim_from_view(&view, req)
    }

    /// Runs `read` on a read transaction on the blocking pool, with `now` read after the
    /// transaction began (a record live now was live at its snapshot).
    async fn read<T: Send + 'static>(
        &self,
        read: impl FnOnce(&RedbView, UnixMillis) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let handle = Arc::clone(&self.handle);
        let clock = Arc::clone(&self.config.clock);
        tokio::task::spawn_blocking(move || {
            // The view (a read transaction) is dropped before `db`, and both before the
            // task ends: a reopen waits only for reads in progress.
            let db = handle.get()?;
            let view = RedbView::begin(&db)?;
            read(&view, clock.now())
        })
        .await
        .map_err(Error::Join)?
    }
}

#[async_trait]
impl Store for RedbStore {
    fn capabilities(&self) -> Capabilities {
        Capabilities { backend: "redb", journal: true, list: true, ..Capabilities::NONE }
    }

    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        if self.config.claim_reads
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
    ) -> Result<Receipt, StoreError> {
        self.writer.submit(Write::Complete { id, token, response }).await?.into_receipt(BACKEND)
    }

    async fn fail(&self, id: RecordId, token: FencingToken) -> Result<Receipt, StoreError> {
        self.writer.submit(Write::Fail { id, token }).await?.into_receipt(BACKEND)
    }

    async fn extend(&self, id: RecordId, token: FencingToken, lease_ttl: Duration) -> Result<Receipt, StoreError> {
        self.writer.submit(Write::Extend { id, token, lease_ttl }).await?.into_receipt(BACKEND)
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
