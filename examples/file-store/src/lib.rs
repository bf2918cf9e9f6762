//! # A custom backend in one file: the file-per-record store
//!
//! The smallest [`Store`](idem_core::Store) that passes the idem conformance suite, written the way a user
//! would write one for their own engine: a [`RecordTable`] over a directory, and every
//! operation handed to the shared engine by idem-core's [`TableStore`], so no rule of
//! the state machine, and no `Store` method, is restated here.
//!
//! Each record is one file named by its record id in hex (`<dir>/<64 hex chars>`),
//! holding [`idem_core::codec`] bytes; each journal entry is one file in
//! `<dir>/<hex>.journal/`, named by the BLAKE3 hash of the entry name (names are any
//! bytes, up to 255 of them, so they cannot be file names themselves). Files are replaced
//! by writing a temporary file and renaming it, so a crash never leaves half a record.
//! The store's mutex is the "transaction": every operation runs whole under it.
//!
//! It is deliberately simple, not a production store: one handle per directory (the mutex
//! is not a file lock), blocking file I/O on the caller's thread, a sweep that lists the whole
//! directory (its expiry "index"), no fsync. Its `tests/conformance.rs` is the point:
//!
//! ```ignore
//! idem_conformance::store_tests!(TempFileStores);
//! ```
//!
//! # Layout
//! - [`FileStore`], [`open`], [`temporary`]: the store.
//! - [`Files`]: its record table.

use std::fs;
use std::io::{self, ErrorKind};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use idem_core::{Clock, Expired, Record, RecordId, RecordRead, RecordTable, StoreError, TableStore, UnixMillis, codec};

/// The file store: the directory as a [`RecordTable`], run under one mutex by idem-core's
/// [`TableStore`] (the mutex is the transaction). Clones share the lock: open one store
/// per directory per process and clone it.
pub type FileStore = TableStore<Files>;

/// Opens (creating if needed) a store in `dir`, timed by `clock`.
///
/// # Errors
/// [`StoreError::Unavailable`] when the directory cannot be created.
pub fn open(dir: impl Into<PathBuf>, clock: Arc<dyn Clock>) -> Result<FileStore, StoreError> {
    let dir = dir.into();
    fs::create_dir_all(&dir).map_err(io_error)?;
    Ok(TableStore::from_table(Files { dir, _temp: None }, clock))
}

/// A store in a fresh temporary directory, removed with the last handle (tests).
///
/// # Errors
/// [`StoreError::Unavailable`] when no temporary directory can be made.
pub fn temporary(clock: Arc<dyn Clock>) -> Result<FileStore, StoreError> {
    let temp = tempfile::tempdir().map_err(io_error)?;
    Ok(TableStore::from_table(Files { dir: temp.path().to_owned(), _temp: Some(temp) }, clock))
}

/// The record table: one directory.
#[derive(Debug)]
pub struct Files {
    dir: PathBuf,
    /// Keeps a temporary directory alive as long as the store.
    _temp: Option<tempfile::TempDir>,
}

impl Files {
    fn record(&self, id: RecordId) -> PathBuf {
        self.dir.join(id.to_hex())
    }

    fn journal(&self, id: RecordId) -> PathBuf {
        self.dir.join(format!("{}.journal", id.to_hex()))
    }
}

fn io_error(e: io::Error) -> StoreError {
    let retryable = matches!(e.kind(), ErrorKind::Interrupted | ErrorKind::WouldBlock | ErrorKind::TimedOut);
    StoreError::unavailable("file", "file system", retryable, e)
}

/// A missing file reads as `None`; removing one is done.
fn absent_ok<T>(result: io::Result<T>) -> Result<Option<T>, StoreError> {
    match result {
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
        other => other.map(Some).map_err(io_error),
    }
}

fn replace(path: &Path, bytes: &[u8]) -> Result<(), StoreError> {
    let tmp = path.with_extension("tmp");
    fs::write(&tmp, bytes).and_then(|()| fs::rename(&tmp, path)).map_err(io_error)
}

impl RecordRead for Files {
    fn read(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        let bytes = absent_ok(fs::read(self.record(id)))?;
        bytes.map(|b| codec::decode(&b).map_err(|source| StoreError::Corrupt { id: Some(id), source })).transpose()
    }

    fn journal_read(&self, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        absent_ok(fs::read(self.journal(id).join(blake3::hash(name.as_bytes()).to_hex().as_str())))
    }
}

impl RecordTable for Files {
    fn write(&mut self, _old: Option<&Record>, new: &Record) -> Result<(), StoreError> {
        replace(&self.record(new.id), &codec::encode(new))
    }

    fn expired(&mut self, now: UnixMillis, limit: usize) -> Result<Vec<Expired>, StoreError> {
        let mut expired = Vec::new();
        for entry in fs::read_dir(&self.dir).map_err(io_error)? {
            // Journals, temporary files and foreign files are not records.
            let Some(id) = entry.map_err(io_error)?.file_name().to_str().and_then(RecordId::from_hex) else { continue };
            let Some(record) = self.read(id)? else { continue };
            if record.is_expired(now) {
                expired.push(Expired { expires_at: record.expires_at, id });
            }
        }
        expired.sort_unstable();
        expired.truncate(limit);
        Ok(expired)
    }

    fn remove(&mut self, expired: Expired) -> Result<(), StoreError> {
        absent_ok(fs::remove_file(self.record(expired.id))).map(drop)
    }

    fn journal_write(&mut self, id: RecordId, name: &str, value: &[u8]) -> Result<(), StoreError> {
        fs::create_dir_all(self.journal(id)).map_err(io_error)?;
        replace(&self.journal(id).join(blake3::hash(name.as_bytes()).to_hex().as_str()), value)
    }

    fn journal_clear(&mut self, id: RecordId) -> Result<(), StoreError> {
        absent_ok(fs::remove_dir_all(self.journal(id))).map(drop)
    }
}
