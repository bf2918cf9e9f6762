//! # A custom backend in one file: the file-per-record store
//!
//! The smallest [`Store`] that passes the idem conformance suite, written the way a user
//! would write one for their own engine. Each record is one file named by its record id
//! in hex (`<dir>/<64 hex chars>`), holding [`idem_core::codec`] bytes. One process-wide
//! mutex makes every operation atomic: read the file, apply the pure transition from
//! [`idem_core::transition`], write a temporary file and rename it over the old one, so a
//! crash never leaves a half-written record.
//!
//! It is deliberately simple, not a production store: one process only (the mutex is not
//! a file lock), blocking file I/O on the caller's thread, a sweep that lists the whole
//! directory, no fsync. Its `tests/conformance.rs` is the point:
//!
//! ```ignore
//! idem_conformance::store_tests!(TempFileStores);
//! ```
//!
//! # Layout
//! - [`FileStore`]: the store.

use std::fs;
use std::io::{self, ErrorKind};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use async_trait::async_trait;
use idem_core::codec;
use idem_core::transition::{self, ClaimOutcome, ClaimRequest, ReclaimOutcome, ReclaimRequest};
use idem_core::{Capabilities, Clock, FencingToken, Record, RecordId, Store, StoreError, StoredResponse, SweepOutcome};

/// Serialises every operation of every [`FileStore`] in this process: the whole
/// read-transition-write of one operation happens under it, which is what makes claim an
/// insert-if-absent and complete a compare-and-set.
static LOCK: Mutex<()> = Mutex::new(());

const BACKEND: &str = "file";

/// A [`Store`] keeping one file per record under a directory. Clones are independent
/// handles on the same directory.
#[derive(Clone, Debug)]
pub struct FileStore {
    dir: PathBuf,
    clock: Arc<dyn Clock>,
    /// Keeps a temporary directory alive as long as any handle uses it.
    _temp: Option<Arc<tempfile::TempDir>>,
}

impl FileStore {
    /// Opens (creating if needed) a store in `dir`, timed by `clock`.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] when the directory cannot be created.
    pub fn open(dir: impl Into<PathBuf>, clock: Arc<dyn Clock>) -> Result<Self, StoreError> {
        let dir = dir.into();
        fs::create_dir_all(&dir).map_err(|e| io_error("creating the store directory", e))?;
        Ok(Self { dir, clock, _temp: None })
    }

    /// A store in a fresh temporary directory, removed when the last handle drops (tests).
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] when no temporary directory can be made.
    pub fn temporary(clock: Arc<dyn Clock>) -> Result<Self, StoreError> {
        let temp = tempfile::tempdir().map_err(|e| io_error("creating a temporary directory", e))?;
        Ok(Self { dir: temp.path().to_owned(), clock, _temp: Some(Arc::new(temp)) })
    }

    /// The directory holding the record files.
    #[must_use]
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, id: RecordId) -> PathBuf {
        self.dir.join(id.to_hex())
    }

    fn read(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        match fs::read(self.path(id)) {
            Ok(bytes) => codec::decode(&bytes).map(Some).map_err(|source| StoreError::Corrupt { id: Some(id), source }),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_error("reading a record", e)),
        }
    }

    /// Writes a temporary file, then renames it over the record: readers see the old
    /// bytes or the new ones, never half of them.
    fn write(&self, record: &Record) -> Result<(), StoreError> {
        let path = self.path(record.id);
        let tmp = path.with_extension("tmp");
        fs::write(&tmp, codec::encode(record)).map_err(|e| io_error("writing a record", e))?;
        fs::rename(&tmp, &path).map_err(|e| io_error("renaming a record into place", e))
    }

    fn remove(&self, id: RecordId) -> Result<(), StoreError> {
        match fs::remove_file(self.path(id)) {
            Err(e) if e.kind() != ErrorKind::NotFound => Err(io_error("removing a record", e)),
            _ => Ok(()),
        }
    }
}

fn lock() -> MutexGuard<'static, ()> {
    // The guarded data is `()`: a panic under the lock cannot leave it inconsistent, and a
    // record file is replaced by rename, so it is whole either way.
    LOCK.lock().unwrap_or_else(PoisonError::into_inner)
}

fn io_error(what: &str, e: io::Error) -> StoreError {
    let retryable = matches!(e.kind(), ErrorKind::Interrupted | ErrorKind::WouldBlock | ErrorKind::TimedOut);
    StoreError::unavailable(BACKEND, what, retryable, e)
}

#[async_trait]
impl Store for FileStore {
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let _guard = lock();
        let now = self.clock.now();
        let current = self.read(req.id)?;
        let (write, outcome) = transition::claim(current.as_ref(), &req, now);
        if let Some(r) = write {
            self.write(&r)?;
        }
        Ok(outcome)
    }

    async fn reclaim(&self, req: ReclaimRequest) -> Result<ReclaimOutcome, StoreError> {
        let _guard = lock();
        let now = self.clock.now();
        let current = self.read(req.id)?;
        let (write, outcome) = transition::reclaim(current.as_ref(), &req, now);
        if let Some(r) = write {
            self.write(&r)?;
        }
        Ok(outcome)
    }

    async fn complete(
        &self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Record, StoreError> {
        let _guard = lock();
        let now = self.clock.now();
        let current = self.read(id)?;
        let next = transition::complete(current.as_ref(), id, token, response, now)
            .map_err(|lost| StoreError::lease_lost(id, lost))?;
        self.write(&next)?;
        Ok(next)
    }

    async fn fail(&self, id: RecordId, token: FencingToken) -> Result<Record, StoreError> {
        let _guard = lock();
        let now = self.clock.now();
        let current = self.read(id)?;
        let next =
            transition::fail(current.as_ref(), id, token, now).map_err(|lost| StoreError::lease_lost(id, lost))?;
        self.write(&next)?;
        Ok(next)
    }

    async fn get(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        let _guard = lock();
        let now = self.clock.now();
        Ok(self.read(id)?.filter(|r| !r.is_expired(now)))
    }

    async fn sweep(&self, limit: usize) -> Result<SweepOutcome, StoreError> {
        let _guard = lock();
        let now = self.clock.now();
        let entries = fs::read_dir(&self.dir).map_err(|e| io_error("listing records", e))?;
        let mut removed = 0u64;
        for entry in entries {
            let entry = entry.map_err(|e| io_error("listing records", e))?;
            // Leftover temporary files and foreign files are not records.
            let Some(id) = entry.file_name().to_str().and_then(RecordId::from_hex) else { continue };
            let Some(record) = self.read(id)? else { continue };
            if !record.is_expired(now) {
                continue;
            }
            if removed == limit as u64 {
                // One more expired record than the batch may take: tell the caller.
                return Ok(SweepOutcome { removed, more: true });
            }
            self.remove(id)?;
            removed += 1;
        }
        Ok(SweepOutcome { removed, more: false })
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::new()
    }
}
