//! The key journal across restarts: a key comes back until `done`, a torn line never
//! swallows the next entry, a second opener is refused. And on a full disk (a small private
//! tmpfs, so a real append stops part-way and then fails with `ENOSPC`): the failed entry's
//! bytes are cut off, and the entries after it keep their keys across a restart.
//!
//! The full-disk test needs root (`mount -t tmpfs`); it mounts its own tmpfs and unmounts
//! it on drop.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use idem_client::{JournalError, KeyJournal};

/// Free bytes left in the journal's last page when the disk fills: fewer than a `put` line
/// needs, so that line's write fills them and then finds no page for the rest.
const ROOM: u64 = 10;

/// A tmpfs of a few MiB, unmounted on drop.
struct SmallDisk {
    dir: tempfile::TempDir,
}

impl SmallDisk {
    fn mount(mib: u32) -> Self {
        let dir = tempfile::Builder::new().prefix("idem-client-full-disk").tempdir().expect("temp dir");
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs"])
            .arg(dir.path())
            .output()
            .expect("run mount");
        assert!(
            out.status.success(),
            "mounting a tmpfs failed (the full-disk test needs root): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Self { dir }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn filler(&self) -> PathBuf {
        self.dir.path().join("filler")
    }

    /// Writes a filler file until the disk refuses even one more byte.
    fn fill(&self) {
        let mut f = std::fs::File::create(self.filler()).expect("filler");
        let chunk = vec![0u8; 64 * 1024];
        let mut size = chunk.len();
        while size > 0 {
            while f.write_all(&chunk[..size]).is_ok() {}
            size /= 2;
        }
    }

    fn free(&self) {
        std::fs::remove_file(self.filler()).expect("remove the filler");
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(self.dir.path()).status();
    }
}

/// tmpfs hands out space a page at a time.
fn page_size() -> u64 {
    Command::new("getconf")
        .arg("PAGESIZE")
        .output()
        .ok()
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(4096)
}

fn file_len(path: &Path) -> u64 {
    std::fs::metadata(path).expect("journal metadata").len()
}

/// Appends `done` lines (valid entries for operations that never started) until the
/// journal ends `ROOM` bytes short of a page boundary.
fn pad_to_page_end(journal: &KeyJournal, path: &Path, page: u64) {
    // A `done` line is "done " + a name of 1 to 255 bytes + "\n": 7 to 261 bytes.
    let mut missing = (2 * page - ROOM - file_len(path) % page) % page;
    if missing < 7 {
        missing += page;
    }
    while missing > 0 {
        let line = match missing {
            0..=261 => missing,
            // Leave at least one whole line's worth for the last `done`.
            262..=267 => missing - 7,
            _ => 261,
        };
        journal.done(&"p".repeat(usize::try_from(line - 6).expect("small"))).expect("padding entry");
        missing -= line;
    }
    assert_eq!(file_len(path) % page, page - ROOM, "padding missed the page end");
}

#[test]
fn an_append_that_fails_half_way_on_a_full_disk_cannot_swallow_the_next_entry() {
    // Pins: an append that failed half-way (disk full) left its partial line on the file and
    // the next entry was glued onto it, so after a restart that operation got a new key and ran twice.
    let disk = SmallDisk::mount(1);
    let page = page_size();
    let path = disk.path().join("keys.journal");
    let journal = KeyJournal::open(&path).expect("open on the tmpfs");
    let a = journal.key_for("a").expect("a's entry");
    pad_to_page_end(&journal, &path, page);

    // A probe file ending the same way shows what the full disk does to a write: it fills the
    // last page's free bytes and stops there (the journal's `write_all` then sees ENOSPC).
    let probe_path = disk.path().join("probe");
    std::fs::write(&probe_path, vec![b'x'; usize::try_from(page - ROOM).expect("small")]).expect("probe");
    let mut probe = std::fs::OpenOptions::new().append(true).open(&probe_path).expect("open the probe");
    disk.fill();
    let wrote = probe.write(&[b'x'; 43]).expect("the probe's last page still has room");
    assert_eq!(u64::try_from(wrote).expect("small"), ROOM, "the full disk did not stop the write part-way");

    let before = std::fs::read(&path).expect("read the journal");
    let err = journal.key_for("b").expect_err("b's entry cannot fit on the full disk");
    assert!(
        matches!(&err, JournalError::Io { source, .. } if source.kind() == std::io::ErrorKind::StorageFull),
        "expected ENOSPC, got {err}"
    );

    disk.free();
    let c = journal.key_for("c").expect("c's entry once there is space again");
    // b's failed key never reached the caller, so the map must not hand it out: asking again
    // writes a new entry.
    let len = file_len(&path);
    let b = journal.key_for("b").expect("b's entry, retried");
    assert!(file_len(&path) > len, "the retried b reused the key whose entry failed");
    drop(journal);

    // The restart: every key handed out comes back.
    let journal = KeyJournal::open(&path).expect("reopen");
    assert_eq!(journal.key_for("c").expect("c"), c, "c's entry was glued onto b's torn line");
    assert_eq!(journal.key_for("b").expect("b"), b, "the retried b lost its key");
    assert_eq!(journal.key_for("a").expect("a"), a);
    let text = String::from_utf8(std::fs::read(&path).expect("read the journal")).expect("journal is ASCII");
    assert!(text.starts_with(std::str::from_utf8(&before).expect("ASCII")));
    let puts: Vec<&str> = text.lines().filter(|l| l.contains("put")).collect();
    let want = [format!("put a {}", a.as_str()), format!("put c {}", c.as_str()), format!("put b {}", b.as_str())];
    assert_eq!(puts, want, "the journal holds a line that is not a whole entry");
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
    // Shadowing would keep it open, and the file takes one opener at a time.
    drop(j);
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

#[test]
fn a_second_opener_of_the_file_is_refused_until_the_first_is_dropped() {
    // Pins: two openers of one journal file each remembered their own end of the last
    // whole line, so one's failed append cut off a line the other had fsynced and handed
    // out (after a restart that operation got a new key and ran twice), and an open cut
    // off the other opener's line half-way through its write as a torn tail. Two opens
    // in one process must conflict too: the lock belongs to the open file, not the process.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("keys.journal");
    let first = KeyJournal::open(&path).unwrap();
    let a = first.key_for("a").unwrap();
    // The first opener's next line, caught half-way through its write.
    std::fs::OpenOptions::new().append(true).open(&path).unwrap().write_all(b"put b 7c3f").unwrap();
    let mid_write = std::fs::read_to_string(&path).unwrap();

    let err = KeyJournal::open(&path).expect_err("a second opener was let in while the first is open");
    assert!(matches!(&err, JournalError::InUse { path: p } if *p == path), "expected InUse, got {err}");
    assert!(err.to_string().contains("one opener"), "{err}");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), mid_write, "the refused opener changed the file");

    drop(first);
    // The lock went with the first journal; this open is a restart after a crash
    // mid-write, and cuts the torn line off.
    let j = KeyJournal::open(&path).unwrap();
    assert_eq!(j.key_for("a").unwrap(), a);
    assert_ne!(j.key_for("b").unwrap().as_str(), "7c3f");
}
