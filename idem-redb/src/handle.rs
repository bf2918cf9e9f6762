//! The store's handle on its [`Database`], and the reopen after redb latched an I/O
//! failure (`docs/contract.md#redb`): the writer that meets the failure takes the database
//! out of the handle, and the next caller that needs it opens the file again, backing off
//! so that a disk that stays full costs one open attempt per second, not one per request.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use redb::Database;

use crate::error::Error;

const FIRST_BACKOFF: Duration = Duration::from_millis(10);
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// The current database, or the way to open it again.
pub(crate) struct Handle {
    /// Where to reopen from; `None` for a database the caller owns.
    path: Option<PathBuf>,
    slot: Mutex<Slot>,
}

struct Slot {
    db: Option<Arc<Database>>,
    /// No open is attempted before this instant.
    next_attempt: Instant,
    backoff: Duration,
    reopens: u64,
}

/// Whether a redb storage error is the latched failure that only a reopen clears.
pub(crate) fn needs_reopen(e: &redb::StorageError) -> bool {
    // `Io` is the failure itself (redb latches it as it reports it); `PreviousIo` is every
    // later transaction refused because of it.
    matches!(e, redb::StorageError::PreviousIo | redb::StorageError::Io(_))
}

impl Handle {
    pub(crate) fn new(db: Arc<Database>, path: Option<PathBuf>) -> Self {
        let slot = Slot { db: Some(db), next_attempt: Instant::now(), backoff: FIRST_BACKOFF, reopens: 0 };
        Self { path, slot: Mutex::new(slot) }
    }

    fn lock(&self) -> MutexGuard<'_, Slot> {
        // The slot is consistent after every statement; a panic elsewhere cannot break it.
        self.slot.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The open database, without trying to reopen (for a claim's first look, which must
    /// not block on file I/O).
    pub(crate) fn current(&self) -> Option<Arc<Database>> {
        self.lock().db.clone()
    }

    /// The open database, reopening the file first when a latched I/O failure closed it
    /// and the backoff allows. Blocks on file I/O: call it from the writer thread or the
    /// blocking pool.
    pub(crate) fn get(&self) -> Result<Arc<Database>, Error> {
        let mut slot = self.lock();
        if let Some(db) = &slot.db {
            return Ok(Arc::clone(db));
        }
        let Some(path) = &self.path else {
            // Unreachable: a handle without a path is never closed. Answer unavailable anyway.
            return Err(Error::Reopen(redb::DatabaseError::Storage(redb::StorageError::DatabaseClosed)));
        };
        let now = Instant::now();
        if now < slot.next_attempt {
            return Err(Error::Reopening);
        }
        // Fails with `DatabaseAlreadyOpen` while a reader or the application still holds
        // the old database, and with an I/O error while the disk is still full (the open
        // repairs the file and commits).
        match Database::create(path) {
            Ok(db) => {
                let db = Arc::new(db);
                slot.db = Some(Arc::clone(&db));
                slot.backoff = FIRST_BACKOFF;
                slot.reopens += 1;
                tracing::info!(backend = crate::error::BACKEND, reopens = slot.reopens, "redb database reopened");
                Ok(db)
            }
            Err(e) => {
                slot.next_attempt = now + slot.backoff;
                slot.backoff = (slot.backoff * 2).min(MAX_BACKOFF);
                Err(Error::Reopen(e))
            }
        }
    }

    /// `db` met a latched I/O failure: close it (when this store may reopen the file), so
    /// the next [`Handle::get`] opens the file again. Returns whether it was closed.
    pub(crate) fn close_failed(&self, db: &Arc<Database>) -> bool {
        if self.path.is_none() {
            return false;
        }
        let mut slot = self.lock();
        if slot.db.as_ref().is_some_and(|current| Arc::ptr_eq(current, db)) {
            slot.db = None;
            slot.next_attempt = Instant::now();
            slot.backoff = FIRST_BACKOFF;
            tracing::warn!(backend = crate::error::BACKEND, "redb latched an I/O failure; reopening the file");
        }
        true
    }
}
