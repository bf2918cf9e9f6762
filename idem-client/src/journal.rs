//! Keys that survive a process restart.
//!
//! A client that crashes between sending a request and reading the answer must retry
//! with the same key after it restarts, or the retry is a new operation (a phantom
//! worker). The journal maps a caller-chosen operation name (a job id, "create worker
//! for ticket 42") to its key in an append-only file: one line per event,
//! `put <operation> <key>` or `done <operation>`, each written and fsynced before the
//! first attempt is sent. Operation names are visible ASCII without spaces.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
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
    /// [`JournalError::Io`] when the file cannot be read or created. Lines that do not
    /// parse (a torn last write) are ignored.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, JournalError> {
        let path = path.as_ref().to_path_buf();
        let io = |source| JournalError::Io { path: path.clone(), source };
        let file = OpenOptions::new().create(true).read(true).append(true).open(&path).map_err(io)?;
        let mut keys = HashMap::new();
        for line in BufReader::new(&file).lines() {
            let line = line.map_err(io)?;
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

fn check_name(op: &str) -> Result<(), JournalError> {
    if op.is_empty() || op.len() > 255 || !op.bytes().all(|b| (0x21..=0x7e).contains(&b)) {
        return Err(JournalError::BadOperation(op.to_string()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
