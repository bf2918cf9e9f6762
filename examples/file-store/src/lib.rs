//! # A custom backend in one file: the file-per-record store
//!
//! The smallest [`Store`] that passes the idem conformance suite, written the way a user
//! would write one for their own engine. Each record is one file named by its record id
//! in hex (`<dir>/<64 hex chars>`), holding [`idem_core::codec`] bytes. One process-wide
//! mutex makes every operation atomic: read the file, apply the pure transition from
//! [`idem_core::transition`], write a temporary file and rename it over the old one, so a
//! crash never leaves a half-written record.
//!
//! The journal of resumable handlers ([`Store::journal_put`]) lives next to the record in
//! `<dir>/<hex>.journal`: every entry of the record in one file (`u32` little-endian name
//! length, name bytes, `u32` value length, value bytes, repeated), replaced by rename like
//! the record. A claim that replaces an expired record and a sweep that removes one delete
//! the journal file first, then write or remove the record: a crash in between leaves an
//! expired record without entries, never a new claim with the old attempt's entries.
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

use std::collections::BTreeMap;
use std::fs;
use std::io::{self, ErrorKind};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use async_trait::async_trait;
use idem_core::codec::{self, CodecError};
use idem_core::transition::{self, ClaimOutcome, ClaimRequest, ReclaimOutcome, ReclaimRequest};
use idem_core::{
    Capabilities, Clock, FencingToken, JournalWrite, Record, RecordId, Store, StoreError, StoredResponse, SweepOutcome,
};

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
        // The journal goes first: a crash between the two leaves an expired record
        // without entries, which reads the same as the removed record.
        self.remove_journal(id)?;
        match fs::remove_file(self.path(id)) {
            Err(e) if e.kind() != ErrorKind::NotFound => Err(io_error("removing a record", e)),
            _ => Ok(()),
        }
    }

    fn journal_path(&self, id: RecordId) -> PathBuf {
        self.dir.join(format!("{}.journal", id.to_hex()))
    }

    fn read_journal(&self, id: RecordId) -> Result<Journal, StoreError> {
        match fs::read(self.journal_path(id)) {
            Ok(bytes) => decode_journal(&bytes).map_err(|source| StoreError::Corrupt { id: Some(id), source }),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(Journal::new()),
            Err(e) => Err(io_error("reading a journal", e)),
        }
    }

    fn write_journal(&self, id: RecordId, journal: &Journal) -> Result<(), StoreError> {
        let path = self.journal_path(id);
        let tmp = path.with_extension("journal-tmp");
        fs::write(&tmp, encode_journal(journal)).map_err(|e| io_error("writing a journal", e))?;
        fs::rename(&tmp, &path).map_err(|e| io_error("renaming a journal into place", e))
    }

    fn remove_journal(&self, id: RecordId) -> Result<(), StoreError> {
        match fs::remove_file(self.journal_path(id)) {
            Err(e) if e.kind() != ErrorKind::NotFound => Err(io_error("removing a journal", e)),
            _ => Ok(()),
        }
    }
}

/// One record's journal: entry name bytes to value bytes.
type Journal = BTreeMap<Vec<u8>, Vec<u8>>;

fn encode_journal(journal: &Journal) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, value) in journal {
        for part in [name, value] {
            // Names are at most 255 bytes; a value over 4 GiB cannot be a step's result
            // held in memory by this example, so the length always fits.
            out.extend_from_slice(&u32::try_from(part.len()).unwrap_or(u32::MAX).to_le_bytes());
            out.extend_from_slice(part);
        }
    }
    out
}

fn decode_journal(mut bytes: &[u8]) -> Result<Journal, CodecError> {
    fn take<'a>(bytes: &mut &'a [u8]) -> Result<&'a [u8], CodecError> {
        let truncated = CodecError::Trailing(bytes.len());
        let (len, rest) = bytes.split_first_chunk::<4>().ok_or(truncated)?;
        let len = u32::from_le_bytes(*len) as usize;
        if rest.len() < len {
            return Err(CodecError::Trailing(bytes.len()));
        }
        let (part, rest) = rest.split_at(len);
        *bytes = rest;
        Ok(part)
    }
    let mut journal = Journal::new();
    while !bytes.is_empty() {
        let name = take(&mut bytes)?.to_vec();
        let value = take(&mut bytes)?.to_vec();
        journal.insert(name, value);
    }
    Ok(journal)
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
            // A claim that replaces an expired record starts with an empty journal; the
            // old entries go before the new record exists.
            self.remove_journal(r.id)?;
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
            // Journals, leftover temporary files and foreign files are not records.
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
        Capabilities::new().with_journal(true)
    }

    async fn journal_put(
        &self,
        id: RecordId,
        token: FencingToken,
        name: &str,
        value: Vec<u8>,
        overwrite: bool,
    ) -> Result<JournalWrite, StoreError> {
        let _guard = lock();
        let now = self.clock.now();
        let current = self.read(id)?;
        transition::check_journal_owner(current.as_ref(), id, token, now)
            .map_err(|lost| StoreError::lease_lost(id, lost))?;
        let mut journal = self.read_journal(id)?;
        if !overwrite && let Some(stored) = journal.get(name.as_bytes()) {
            return Ok(JournalWrite::Exists(stored.clone()));
        }
        journal.insert(name.as_bytes().to_vec(), value);
        self.write_journal(id, &journal)?;
        Ok(JournalWrite::Written)
    }

    async fn journal_get(&self, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let _guard = lock();
        let now = self.clock.now();
        if self.read(id)?.filter(|r| !r.is_expired(now)).is_none() {
            return Ok(None);
        }
        Ok(self.read_journal(id)?.remove(name.as_bytes()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn journal_files_round_trip_and_truncation_is_corrupt() {
        let mut j = Journal::new();
        j.insert(b"s:a".to_vec(), vec![]);
        j.insert("é".repeat(127).into_bytes(), vec![0, 255, 7]);
        let bytes = encode_journal(&j);
        assert_eq!(decode_journal(&bytes).unwrap(), j);
        assert_eq!(decode_journal(&[]).unwrap(), Journal::new());
        // The first entry ("s:a", empty) ends at byte 11: a cut there is a whole, shorter journal.
        for cut in (1..bytes.len()).filter(|&c| c != 11) {
            assert!(decode_journal(&bytes[..cut]).is_err(), "a journal cut at {cut} bytes is corrupt");
        }
        assert_eq!(decode_journal(&bytes[..11]).unwrap().len(), 1);
    }
}
