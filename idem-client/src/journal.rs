//! [`KeyJournal`]: keys that survive a process restart. Its crash-safety rules (torn
//! lines, the cut-back after a failed append, the directory fsync, one opener) are in
//! `docs/contract.md#the-client`; the comments below say where each is kept.

use std::collections::HashMap;
use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::retry::OperationKey;

/// Tries of the file lock, 5 ms apart, before a journal reports [`JournalError::InUse`].
const LOCK_TRIES: u32 = 20;

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
    /// An earlier append failed part-way and its partial line could not be cut off the
    /// file, then or now. Nothing was written: appending would glue the entry onto the
    /// partial line. Reopening the journal cuts it off.
    #[error(
        "key journal {path}: a failed append left a partial line that cannot be cut off ({source}); reopen the journal"
    )]
    TornTail {
        /// The journal file.
        path: PathBuf,
        /// Why cutting the partial line off failed.
        #[source]
        source: std::io::Error,
    },
    /// Another [`KeyJournal`] has the file open, in this process or another. A journal has
    /// one opener: two would cut each other's acknowledged lines off the file. Share the
    /// open journal, or give the other user a file of its own.
    #[error(
        "key journal {path}: another KeyJournal in this or another process has the file open; a journal has one opener"
    )]
    InUse {
        /// The journal file.
        path: PathBuf,
    },
    /// An operation name that the line format cannot hold.
    #[error("operation name {0:?} must be 1-255 bytes of visible ASCII")]
    BadOperation(String),
}

/// An append-only, fsynced map from operation name (a job id, "create worker for ticket
/// 42") to idempotency key, so that a client that crashes between sending a request and
/// reading the answer retries with the same key after it restarts.
///
/// One line per event, `put <operation> <key>` or `done <operation>`, written and fsynced
/// before the call returns. It holds an exclusive (advisory) lock on its file until it
/// is dropped: one journal per file.
#[derive(Debug)]
pub struct KeyJournal {
    path: PathBuf,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// Opened for appending: every write lands at the end of the file. Its lock on the file
    /// keeps every other opener out, and goes when it is closed.
    file: File,
    keys: HashMap<String, String>,
    /// The file's length at the end of its last whole line: every acknowledged entry lies
    /// before it, and a failed append is cut back to it.
    whole_len: u64,
    /// A failed append's bytes may still follow `whole_len` (cutting them off failed).
    torn: bool,
}

impl KeyJournal {
    /// Opens (or creates) the journal at `path` and replays it.
    ///
    /// # Errors
    /// [`JournalError::InUse`] when another `KeyJournal`, in this process or another, has
    /// the file open: a journal has one opener, and the file is left as it is.
    /// [`JournalError::Io`] when the file cannot be read, created or locked, or its
    /// directory cannot be fsynced after creating it. Lines that do not parse, and a last
    /// line without its `\n` (a torn write), are ignored.
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
            // Before the lock: a creator that loses the lock to another opener must still
            // make the new file's directory entry durable, as that opener did not create it.
            sync_dir(&path).map_err(io)?;
        }
        // Before reading: what another opener has half-written must not be cut off as torn,
        // nor its appends cut back later by this journal.
        // A few short tries before `InUse`: a thread of this process that forks while an
        // earlier opener's file is open gives the child that descriptor, and with it the
        // lock, until the child execs (close-on-exec), so a lock released by a `drop` can
        // still read as held for a moment after it.
        let mut tries = 0;
        loop {
            match file.try_lock() {
                Ok(()) => break,
                Err(TryLockError::WouldBlock) if tries < LOCK_TRIES => {
                    tries += 1;
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
                Err(TryLockError::WouldBlock) => return Err(JournalError::InUse { path }),
                Err(TryLockError::Error(e)) => return Err(io(e)),
            }
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
        let state = State { file, keys, whole_len: whole as u64, torn: false };
        Ok(Self { path, state: Mutex::new(state) })
    }

    /// The key of `operation`: the recorded one if the operation was started before (in
    /// this process or an earlier one), else a new key, recorded durably before return.
    ///
    /// # Errors
    /// [`JournalError::BadOperation`] for a bad name; [`JournalError::Io`] when writing or
    /// fsyncing the entry fails (what was written of it is cut off the file again);
    /// [`JournalError::TornTail`] while an earlier failed entry cannot be cut off.
    pub fn key_for(&self, operation: &str) -> Result<OperationKey, JournalError> {
        check_name(operation)?;
        let mut guard = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(k) = guard.keys.get(operation) {
            return Ok(OperationKey::from_string(k.clone()));
        }
        let key = OperationKey::generate();
        self.append(&mut guard, &format!("put {operation} {}\n", key.as_str()))?;
        guard.keys.insert(operation.to_string(), key.as_str().to_string());
        Ok(key)
    }

    /// Marks `operation` finished: a later `key_for` with the same name starts a new
    /// operation with a new key.
    ///
    /// # Errors
    /// As [`KeyJournal::key_for`]; after an error the operation keeps its key.
    pub fn done(&self, operation: &str) -> Result<(), JournalError> {
        check_name(operation)?;
        let mut guard = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        self.append(&mut guard, &format!("done {operation}\n"))?;
        guard.keys.remove(operation);
        Ok(())
    }

    /// Writes and fsyncs `line`, or leaves the file ending at its last whole line.
    fn append(&self, state: &mut State, line: &str) -> Result<(), JournalError> {
        if state.torn {
            cut(&state.file, state.whole_len)
                .map_err(|source| JournalError::TornTail { path: self.path.clone(), source })?;
            state.torn = false;
        }
        let written = write_line(&mut state.file, line.as_bytes()).and_then(|()| state.file.sync_data());
        if let Err(source) = written {
            // Part of the line may be on the file: cut it off, or the next entry would
            // join it. The write's error is the one the caller needs; a failed cut is
            // remembered and tried again before the next write. The cut needs no fsync of
            // its own: the next append's fsync makes it durable along with that entry.
            state.torn = cut(&state.file, state.whole_len).is_err();
            return Err(JournalError::Io { path: self.path.clone(), source });
        }
        state.whole_len += line.len() as u64;
        Ok(())
    }
}

/// Appends `line` to the file. Tests can make it stop part-way, as a full disk does.
fn write_line(file: &mut File, line: &[u8]) -> std::io::Result<()> {
    #[cfg(test)]
    if let Some(n) = tests::SHORT_WRITE.with(std::cell::Cell::take) {
        file.write_all(&line[..n])?;
        return Err(std::io::Error::new(std::io::ErrorKind::StorageFull, "test: the disk filled part-way"));
    }
    file.write_all(line)
}

/// Cuts the file back to `len` bytes. Tests can make it fail.
fn cut(file: &File, len: u64) -> std::io::Result<()> {
    #[cfg(test)]
    if tests::FAILING_CUTS.with(|n| n.replace(n.get().saturating_sub(1))) > 0 {
        return Err(std::io::Error::other("test: the cut failed"));
    }
    file.set_len(len)
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
        /// The next line written by this test thread stops after this many bytes and fails.
        pub(super) static SHORT_WRITE: Cell<Option<usize>> = const { Cell::new(None) };
        /// This many of this test thread's next cuts fail.
        pub(super) static FAILING_CUTS: Cell<usize> = const { Cell::new(0) };
    }

    #[test]
    fn an_append_that_fails_part_way_cannot_swallow_the_next_entry() {
        // Pins: an append that failed part-way left its partial line on the file and the next
        // entry joined it ("put b 7c3f" + "put c K3\n", one garbage line), so after a restart
        // c got a new key and ran twice. `tests/journal_full_disk.rs` fails it on a real full
        // disk; this one runs without root.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.journal");
        let j = KeyJournal::open(&path).unwrap();
        let a = j.key_for("a").unwrap();
        let before = std::fs::read_to_string(&path).unwrap();
        SHORT_WRITE.with(|n| n.set(Some(10)));
        assert!(matches!(j.key_for("b"), Err(JournalError::Io { .. })));
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            before,
            "the failed entry's partial line stayed on the file"
        );
        let c = j.key_for("c").unwrap();
        // The failed key never reached the caller: asking again makes a new, durable one.
        let b = j.key_for("b").unwrap();
        drop(j);
        let j = KeyJournal::open(&path).unwrap();
        assert_eq!(j.key_for("c").unwrap(), c, "c's entry was glued onto b's partial line");
        assert_eq!(j.key_for("b").unwrap(), b);
        assert_eq!(j.key_for("a").unwrap(), a);
    }

    #[test]
    fn a_partial_line_that_cannot_be_cut_off_blocks_appends_until_it_is() {
        // Pins: when a failed append's partial line could not be cut off, the next entry was
        // written after it and joined it; it must try the cut again and refuse with
        // `TornTail` while the cut keeps failing.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.journal");
        let j = KeyJournal::open(&path).unwrap();
        let a = j.key_for("a").unwrap();
        let before = std::fs::read_to_string(&path).unwrap();
        SHORT_WRITE.with(|n| n.set(Some(10)));
        FAILING_CUTS.with(|n| n.set(3));
        assert!(matches!(j.key_for("b"), Err(JournalError::Io { .. })));
        let torn = std::fs::read_to_string(&path).unwrap();
        assert_eq!(torn.len(), before.len() + 10, "the test's failed cut left no partial line");
        // The next two cuts fail too: c and a's `done` are refused, nothing joins the partial
        // line, and a keeps its key.
        assert!(matches!(j.key_for("c"), Err(JournalError::TornTail { .. })));
        assert!(matches!(j.done("a"), Err(JournalError::TornTail { .. })));
        assert_eq!(std::fs::read_to_string(&path).unwrap(), torn);
        // The cut works again: the partial line goes, then c's entry is written whole.
        let c = j.key_for("c").unwrap();
        drop(j);
        let j = KeyJournal::open(&path).unwrap();
        assert_eq!(j.key_for("c").unwrap(), c, "c's entry was glued onto b's partial line");
        assert_eq!(j.key_for("a").unwrap(), a);
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
