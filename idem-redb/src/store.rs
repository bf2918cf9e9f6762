//! [`RedbStore`]: the store on one redb file, an [`Embedded`] store of `idem-core`.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use idem_core::group_commit::{BatchStats, Embedded, GroupCommit};
use idem_core::{Capabilities, RecordRead, StoreError};
use redb::Database;

use crate::config::Config;
use crate::error::Error;
use crate::handle::Handle;
use crate::table::{self, RedbEngine, RedbView};

/// The [`Store`](idem_core::Store) on one redb file, with group commit: an [`Embedded`]
/// store, whose `Store` methods `idem-core` writes once for every embedded engine.
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
}

impl Embedded for RedbStore {
    const CAPABILITIES: Capabilities =
        Capabilities { backend: "redb", journal: true, list: true, ..Capabilities::NONE };

    fn writer(&self) -> &GroupCommit {
        &self.writer
    }

    /// A read transaction on the database as it is: never a reopen (file I/O), and a redb
    /// read transaction does not wait for the writer.
    fn try_view<T>(&self, read: impl FnOnce(&dyn RecordRead) -> T) -> Option<T> {
        if !self.config.claim_reads {
            return None;
        }
        let db = self.handle.current()?;
        let view = RedbView::begin(&db).ok()?;
        Some(read(&view))
    }

    /// One read transaction, on the database opened again first if a latched I/O failure
    /// closed it.
    fn view<T>(&self, read: impl FnOnce(&dyn RecordRead) -> Result<T, StoreError>) -> Result<T, StoreError> {
        // The view is dropped before `db`: a reopen waits only for reads in progress.
        let db = self.handle.get()?;
        let view = RedbView::begin(&db)?;
        read(&view)
    }
}
