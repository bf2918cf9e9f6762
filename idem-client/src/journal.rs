//! Keys that survive a process restart.
//!
//! A client that crashes between sending a request and reading the answer must retry
//! with the same key after it restarts, or the retry is a new operation (a phantom
//! worker). The journal maps a caller-chosen operation name (a job id, "create worker
//! for ticket 42") to its key in an append-only file: one line per event,
//! `put <operation> <key>` or `done <operation>`, each written and fsynced before the
//! first attempt is sent. Operation names are visible ASCII without spaces.
//!
//! # Crash safety
//! - A line counts only once its `\n` is on disk: a crash half-way through an append
//!   leaves a last line without one, which is ignored when the journal is opened (its
//!   `key_for` never returned, so no request carried that key). Opening the journal cuts
//!   the torn tail off, so it cannot glue itself to the next
//!   entry and turn a valid line into garbage (which would give that operation a new key
//!   after the next restart, and run it twice).
//! - A journal file created by [`KeyJournal::open`] has its directory fsynced before
//!   `open` returns: without that, a power loss can lose the new file's directory entry,
//!   and with it every key written to the file since.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::retry::OperationKey;

/// Why the journal failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum JournalError {
    /// Reading or writing the file failed.
    #[error("key journal {path}: {source}")]
    Io {
        /// The journal file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// An operation name that the line format cannot hold.
    #[error("operation name {0:?} must be 1-255 bytes of visible ASCII")]
    BadOperation(String),
}

/// An append-only, fsynced map from operation name to idempotency key.
#[derive(Debug)]
pub struct KeyJournal {
    path: PathBuf,
    state: Mutex<(File, HashMap<String, String>)>,
}

impl KeyJournal {
    /// Opens (or creates) the journal at `path` and replays it.
    ///
    /// # Errors
    /// [`JournalError::Io`] when the file cannot be read or created, or its directory
    /// cannot be fsynced after creating it. Lines that do not parse, and a last line
    /// without its `\n` (a torn write), are ignored.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, JournalError> {
        let path = path.as_ref().to_path_buf();
        let io = |source| JournalError::Io { path: path.clone(), source };
        let created = match OpenOptions::new().write(true).create_new(true).open(&path) {
            Ok(_) => true,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => false,
            Err(e) => return Err(io(e)),
        };
        let mut file = OpenOptions::new().read(true).append(true).open(&path).map_err(io)?;
        if created {
            sync_dir(&path).map_err(io)?;
        }
        let mut text = Vec::new();
        file.read_to_end(&mut text).map_err(io)?;
        // Only lines ended by `\n` were written whole; a tail without one is torn.
        let whole = text.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
        if whole < text.len() {
            // Cut the torn tail off now, so the next entry starts on a line of its own
            // (closing it with a `\n` instead would make a torn `put` look whole).
            file.set_len(whole as u64).map_err(io)?;
            file.sync_data().map_err(io)?;
        }
        let mut keys = HashMap::new();
        for line in text[..whole].split(|&b| b == b'\n') {
            let Ok(line) = std::str::from_utf8(line) else { continue };
            let mut parts = line.split(' ');
            match (parts.next(), parts.next(), parts.next(), parts.next()) {
                (Some("put"), Some(op), Some(key), None) => {
                    keys.insert(op.to_string(), key.to_string());
                }
                (Some("done"), Some(op), None, None) => {
                    keys.remove(op);
                }
                _ => {}
            }
        }
        Ok(Self { path, state: Mutex::new((file, keys)) })
    }

    /// The key of `operation`: the recorded one if the operation was started before (in
    /// this process or an earlier one), else a new key, recorded durably before return.
    ///
    /// # Errors
    /// [`JournalError`] for a bad name or a failed write.
    pub fn key_for(&self, operation: &str) -> Result<OperationKey, JournalError> {
        check_name(operation)?;
        let mut guard = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(k) = guard.1.get(operation) {
            return Ok(OperationKey::from_string(k.clone()));
        }
        let key = OperationKey::generate();
        self.append(&mut guard.0, &format!("put {operation} {}\n", key.as_str()))?;
        guard.1.insert(operation.to_string(), key.as_str().to_string());
        Ok(key)
    }

    /// Marks `operation` finished: a later `key_for` with the same name starts a new
    /// operation with a new key.
    ///
    /// # Errors
    /// [`JournalError`] for a bad name or a failed write.
    pub fn done(&self, operation: &str) -> Result<(), JournalError> {
        check_name(operation)?;
        let mut guard = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        self.append(&mut guard.0, &format!("done {operation}\n"))?;
        guard.1.remove(operation);
        Ok(())
    }

    fn append(&self, file: &mut File, line: &str) -> Result<(), JournalError> {
        let io = |source| JournalError::Io { path: self.path.clone(), source };
        file.write_all(line.as_bytes()).map_err(io)?;
        file.sync_data().map_err(io)
    }
}

/// Fsyncs the directory holding `path`, making a new file's directory entry durable.
fn sync_dir(path: &Path) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    #[cfg(test)]
    tests::DIR_SYNCS.with(|n| n.set(n.get() + 1));
    File::open(dir)?.sync_all()
}

fn check_name(op: &str) -> Result<(), JournalError> {
    if op.is_empty() || op.len() > 255 || !op.bytes().all(|b| (0x21..=0x7e).contains(&b)) {
        return Err(JournalError::BadOperation(op.to_string()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    thread_local! {
        /// Directory fsyncs made by this test thread.
        pub(super) static DIR_SYNCS: Cell<usize> = const { Cell::new(0) };
    }

    #[test]
    fn key_survives_reopen_until_done() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.journal");
        let k1 = KeyJournal::open(&path).unwrap().key_for("create-worker-42").unwrap();
        // A restarted process gets the same key back.
        let j = KeyJournal::open(&path).unwrap();
        assert_eq!(j.key_for("create-worker-42").unwrap(), k1);
        j.done("create-worker-42").unwrap();
        let j = KeyJournal::open(&path).unwrap();
        assert_ne!(j.key_for("create-worker-42").unwrap(), k1);
    }

    #[test]
    fn bad_names_and_torn_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.journal");
        std::fs::write(&path, "put a k1\nput b\ngarbage line here\n").unwrap();
        let j = KeyJournal::open(&path).unwrap();
        assert_eq!(j.key_for("a").unwrap().as_str(), "k1");
        assert!(matches!(j.key_for("has space"), Err(JournalError::BadOperation(_))));
        assert!(matches!(j.key_for(""), Err(JournalError::BadOperation(_))));
    }

    /// A torn last line (a crash mid-append) swallowed the next entry appended after the
    /// restart: "put a k" + "put b K2\n" made one garbage line, so after the next restart
    /// operation b got a new key and ran twice.
    #[test]
    fn a_torn_last_line_cannot_swallow_the_next_entry() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.journal");
        std::fs::write(&path, "put a k1\nput torn 7c3f").unwrap();
        let j = KeyJournal::open(&path).unwrap();
        assert_eq!(j.key_for("a").unwrap().as_str(), "k1");
        let b = j.key_for("b").unwrap();
        drop(j);
        // The restart after that: b keeps its key, and the torn entry never counted.
        let j = KeyJournal::open(&path).unwrap();
        assert_eq!(j.key_for("b").unwrap(), b, "b's entry was swallowed by the torn line");
        assert_ne!(j.key_for("torn").unwrap().as_str(), "7c3f");
        assert_eq!(j.key_for("a").unwrap().as_str(), "k1");
    }

    /// A new journal file's directory entry was never fsynced, so a power loss could drop
    /// the file and every key in it.
    #[test]
    fn creating_the_journal_fsyncs_its_directory_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.journal");
        let before = DIR_SYNCS.with(Cell::get);
        KeyJournal::open(&path).unwrap().key_for("a").unwrap();
        assert_eq!(DIR_SYNCS.with(Cell::get), before + 1, "the new file's directory was not fsynced");
        // Reopening an existing journal creates no directory entry: nothing to sync.
        KeyJournal::open(&path).unwrap();
        assert_eq!(DIR_SYNCS.with(Cell::get), before + 1);
    }
}
