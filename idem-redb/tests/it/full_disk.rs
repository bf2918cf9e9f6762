//! A redb store on a full disk (a small private tmpfs, so the real `ENOSPC` path runs):
//! redb latches the failed commit (`PreviousIo`) and refuses every later transaction until
//! the file is opened again. A store opened from a path reopens it by itself once space is
//! back; with reopening turned off it never recovers.
//!
//! Needs root (`mount -t tmpfs`); each test mounts its own tmpfs and unmounts it on drop.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use idem_core::{
    ClaimOutcome, ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, ManualClock, Receipt, ReclaimOutcome,
    ReclaimRequest, Record, RecordId, RecordState, Scope, Store, StoreError, StoredResponse, UnixMillis,
};
use idem_redb::{Config, RedbStore};
use redb::Database;

const LEASE: Duration = Duration::from_secs(5);
const RETENTION: Duration = Duration::from_secs(3600);
/// Hang guard for the recovery: far above the reopen's largest backoff (1 s).
const RECOVERY_GUARD: Duration = Duration::from_secs(30);
/// Each completion stores this much, so the file outgrows the disk in a few operations.
const BODY: usize = 256 * 1024;

/// A tmpfs of a few MiB, unmounted on drop.
struct SmallDisk {
    dir: tempfile::TempDir,
}

impl SmallDisk {
    fn mount(mib: u32) -> Self {
        let dir = tempfile::Builder::new().prefix("idem-redb-full-disk").tempdir().expect("temp dir");
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs"])
            .arg(dir.path())
            .output()
            .expect("run mount");
        assert!(
            out.status.success(),
            "mounting a tmpfs failed (the full-disk tests need root): {}",
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

fn req(key: &str) -> ClaimRequest {
    let scope = Scope::new("tenant-full-disk", Endpoint::new("POST", "/v1/workers")).expect("scope");
    let key = IdempotencyKey::parse(key.as_bytes()).expect("key");
    ClaimRequest::new(scope, key, Fingerprint::of_bytes(b"{}"), LEASE, RETENTION)
}

fn body(n: usize) -> StoredResponse {
    #[allow(clippy::cast_possible_truncation)]
    StoredResponse::new(201, vec![], vec![(n % 251) as u8; BODY])
}

fn is_unavailable(e: &StoreError) -> bool {
    matches!(e, StoreError::Unavailable { .. })
}

/// The error's whole source chain, to see which redb error is behind it.
fn chain(e: &StoreError) -> String {
    let mut out = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

/// The record a fenced write just wrote, read back; its receipt must report it.
async fn written(store: &RedbStore, id: RecordId, receipt: Receipt) -> Record {
    let record = store.get(id).await.expect("get after a write").expect("the record just written is live");
    assert_eq!(Receipt::of(&record), receipt, "the receipt reports the record as written");
    record
}

/// Claims and completes fresh keys with large responses until a write fails; returns the
/// records whose completion was acknowledged. The failing one is the commit on the full
/// disk.
async fn write_until_full(store: &RedbStore, prefix: &str) -> (Vec<Record>, StoreError) {
    let mut acknowledged = Vec::new();
    for n in 0..1000 {
        let record = match store.claim(req(&format!("{prefix}-{n}"))).await {
            Ok(ClaimOutcome::Claimed(r)) => r,
            Ok(other) => panic!("a fresh key is claimed, got {other:?}"),
            Err(e) => return (acknowledged, e),
        };
        match store.complete(record.id, record.token, body(n)).await {
            Ok(receipt) => acknowledged.push(written(store, record.id, receipt).await),
            Err(e) => return (acknowledged, e),
        }
    }
    panic!("1000 completions of {BODY} bytes fit on a disk of a few MiB");
}

struct Faulted {
    disk: SmallDisk,
    clock: ManualClock,
    store: RedbStore,
    /// Completed before the disk filled up.
    done: Record,
    /// Claimed (in flight) before the disk filled up.
    running: Record,
    /// Completions acknowledged while the disk was filling.
    acknowledged: Vec<Record>,
    /// The database the store opened first (not held: a reopen waits for every handle).
    first_db: Weak<Database>,
}

/// A store on a tmpfs, one completed and one running record, then a full disk and writes
/// until a commit fails.
async fn faulted(reopen: bool) -> Faulted {
    let disk = SmallDisk::mount(8);
    let clock = ManualClock::new(UnixMillis(1_800_000_000_000));
    let config = Config::default().with_clock(Arc::new(clock.clone())).with_reopen(reopen);
    let store = RedbStore::open(disk.path().join("idem.redb"), config).expect("open on the tmpfs");
    let first_db = Arc::downgrade(&store.database().expect("the database is open"));

    let ClaimOutcome::Claimed(first) = store.claim(req("done")).await.expect("claim") else { panic!("fresh key") };
    let receipt = store.complete(first.id, first.token, body(7)).await.expect("complete");
    let done = written(&store, first.id, receipt).await;
    let ClaimOutcome::Claimed(running) = store.claim(req("running")).await.expect("claim") else { panic!("fresh key") };

    disk.fill();
    let (acknowledged, error) = write_until_full(&store, "filling").await;
    assert!(is_unavailable(&error), "a commit on a full disk is Unavailable (503), got {error:?}");
    Faulted { disk, clock, store, done, running, acknowledged, first_db }
}

/// Whether a claim and a completion of a fresh key both go through now.
async fn writes_work(store: &RedbStore, key: &str) -> Result<Record, StoreError> {
    let record = match store.claim(req(key)).await? {
        ClaimOutcome::Claimed(r) => r,
        other => panic!("a fresh key is claimed, got {other:?}"),
    };
    let receipt = store.complete(record.id, record.token, body(1)).await?;
    Ok(written(store, record.id, receipt).await)
}

// Pins: after a commit failed on a full disk, redb refused every later transaction
// (`PreviousIo`) until the process restarted; the store must reopen its file by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_opened_from_a_path_recovers_from_a_full_disk_by_itself() {
    let Faulted { disk, clock, store, done, running, acknowledged, first_db } = faulted(true).await;

    // While the disk stays full, every write keeps failing closed.
    for n in 0..5 {
        let e = writes_work(&store, &format!("during-{n}")).await.expect_err("the disk is still full");
        assert!(is_unavailable(&e), "{e:?}");
    }

    disk.free();
    let freed = Instant::now();
    let mut attempts = 0u32;
    let recovered = loop {
        attempts += 1;
        match writes_work(&store, &format!("after-{attempts}")).await {
            Ok(record) => break record,
            Err(e) => {
                assert!(is_unavailable(&e), "{e:?}");
                assert!(
                    freed.elapsed() < RECOVERY_GUARD,
                    "not recovered {RECOVERY_GUARD:?} after the disk was freed: {}",
                    chain(&e)
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    assert!(first_db.upgrade().is_none(), "the store reopened its file: the first database is gone");
    assert_eq!(recovered.state, RecordState::Completed);

    // Nothing acknowledged before or during the fault was lost, and reads see it through
    // the reopened database.
    let got = store.get(done.id).await.expect("get").expect("the completed record is still there");
    assert_eq!(got.state, RecordState::Completed);
    assert_eq!(got.response, done.response);
    for record in &acknowledged {
        let got = store.get(record.id).await.expect("get").expect("an acknowledged completion is still there");
        assert_eq!(got.response, record.response);
    }
    let got = store.get(running.id).await.expect("get").expect("the running claim is still there");
    assert_eq!((got.state, got.token), (RecordState::InFlight, running.token));
    // A replay is answered from a read transaction on the reopened database.
    match store.claim(req("done")).await.expect("replay") {
        ClaimOutcome::Existing { record, .. } => assert_eq!(record.response, done.response),
        other => panic!("the completed key replays, got {other:?}"),
    }
    store.database().expect("the application gets the reopened database");

    // Fencing tokens never repeat: a reclaim of the running record after its lease moves
    // its token on, and a fresh claim's token is above every earlier one.
    let before = acknowledged.iter().chain([&done, &running]).map(|r| r.token).max().expect("tokens");
    clock.advance(LEASE + Duration::from_secs(1));
    let reclaim = ReclaimRequest {
        id: running.id,
        expected: running.token,
        fingerprint: running.fingerprint,
        lease_ttl: LEASE,
        retention: RETENTION,
    };
    let ReclaimOutcome::Reclaimed(reclaimed) = store.reclaim(reclaim).await.expect("reclaim") else {
        panic!("an expired lease is reclaimable")
    };
    assert!(reclaimed.token > running.token, "{:?} after {:?}", reclaimed.token, running.token);
    let fresh = writes_work(&store, "fresh-after-recovery").await.expect("write after recovery");
    assert!(fresh.token > before, "{:?} after {before:?}", fresh.token);
    drop(store);
}

// Control: without the reopen, redb's latch never clears, so the recovery above is the
// store's doing and not the disk's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_reopen_off_the_store_stays_unavailable_after_the_disk_is_freed() {
    let Faulted { disk, store, done, first_db, .. } = faulted(false).await;
    disk.free();
    // Several tries over more than the reopen's largest backoff (1 s): each one refused by
    // redb's latch, not by the disk.
    for n in 0..15 {
        let e = writes_work(&store, &format!("after-{n}")).await.expect_err("redb's latch never clears");
        assert!(is_unavailable(&e), "{e:?}");
        assert!(chain(&e).contains("Previous I/O error"), "refused by the latch: {}", chain(&e));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let first = first_db.upgrade().expect("the store never closed its first database");
    assert!(Arc::ptr_eq(&first, &store.database().expect("the latched database")), "the store reopened its file");
    drop(first);
    // Reads of what was committed before the fault still work on the latched database.
    let got = store.get(done.id).await.expect("get").expect("the completed record");
    assert_eq!(got.response, done.response);
    drop(store);
    // The caller's way out: a new store on the file.
    let store = RedbStore::open(disk.path().join("idem.redb"), Config::default()).expect("reopen by hand");
    writes_work(&store, "after-reopen-by-hand").await.expect("a new store writes");
}
