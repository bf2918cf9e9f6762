//! redb-specific behaviour beyond the conformance suite: persistence across reopen, the
//! expiry index, bounded sweeps and the sweeper, group commit (abandoned claims, panics),
//! corrupt values, commit failures and shutdown.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::FutureExt;

use idem_core::codec::{self, CodecError};
use idem_core::store::JournalWrite;
use idem_core::sweeper::{SweepConfig, Sweeper};
use idem_core::{
    ClaimOutcome, ClaimRequest, Endpoint, FencingToken, Fingerprint, IdempotencyKey, ManualClock, Receipt,
    ReclaimOutcome, ReclaimRequest, Record, RecordId, RecordState, Scope, Store, StoreError, StoredResponse,
    UnixMillis,
};
use idem_redb::table::{EXPIRY, JOURNAL, RECORDS};
use idem_redb::{BatchConfig, Config, RedbStore};
use redb::{ReadableDatabase, ReadableTable};

const LEASE: Duration = Duration::from_secs(5);
const RETENTION: Duration = Duration::from_secs(60);
/// Long enough that a batch under test only closes because it is full.
/// Batches of exactly `n` operations: the writer waits up to 30 s for each to fill.
fn full_batches(n: usize) -> BatchConfig {
    BatchConfig::default().with_max_batch(n).with_full_batches(Duration::from_secs(30))
}

fn clock() -> ManualClock {
    ManualClock::new(UnixMillis(1_800_000_000_000))
}

fn req(key: &str, body: &[u8], retention: Duration) -> ClaimRequest {
    let scope = Scope::new("tenant-a", Endpoint::new("POST", "/v1/workers")).expect("scope");
    let key = IdempotencyKey::parse(key.as_bytes()).expect("key");
    ClaimRequest::new(scope, key, Fingerprint::of_bytes(body), LEASE, retention)
}

fn config(clock: &ManualClock) -> Config {
    Config::default().with_clock(Arc::new(clock.clone()))
}

fn temp_store(config: Config) -> RedbStore {
    let file = tempfile::tempfile().expect("temporary file");
    let backend = redb::backends::FileBackend::new(file).expect("file backend");
    let db = redb::Database::builder().create_with_backend(backend).expect("database");
    RedbStore::from_database(Arc::new(db), config).expect("store")
}

fn response(body: &[u8]) -> StoredResponse {
    StoredResponse::new(201, vec![("location".into(), b"/v1/workers/w-1".to_vec())], body.to_vec())
}

async fn must_claim(store: &RedbStore, r: ClaimRequest) -> Record {
    match store.claim(r).await.expect("claim") {
        ClaimOutcome::Claimed(r) => r,
        other => panic!("expected Claimed, got {other:?}"),
    }
}

/// The record a fenced write just wrote, read back; its receipt must report it.
async fn written(store: &RedbStore, id: RecordId, receipt: Receipt) -> Record {
    let record = store.get(id).await.expect("get after a write").expect("the record just written is live");
    assert_eq!(Receipt::of(&record), receipt, "the receipt reports the record as written");
    record
}

/// (`expires_at` ms, record id) pairs.
type ExpirySet = BTreeSet<(i64, [u8; 32])>;

/// Every record's (expires_at, id) and every index entry, read in one read transaction.
fn records_and_index(store: &RedbStore) -> (ExpirySet, ExpirySet) {
    let db = store.database().expect("the database is open");
    let txn = db.begin_read().expect("read txn");
    let records = txn.open_table(RECORDS).expect("records");
    let expiry = txn.open_table(EXPIRY).expect("expiry");
    let from_records = records
        .iter()
        .expect("iter")
        .map(|e| {
            let (k, v) = e.expect("entry");
            let r = codec::decode(v.value()).expect("decodes");
            assert_eq!(r.id.as_bytes(), k.value(), "a record is stored under its own id");
            (r.expires_at.0, *r.id.as_bytes())
        })
        .collect();
    let index = expiry.iter().expect("iter").map(|e| e.expect("entry").0.value()).collect();
    (from_records, index)
}

/// Record ids that own at least one journal entry.
fn journal_owners(store: &RedbStore) -> BTreeSet<[u8; 32]> {
    let db = store.database().expect("the database is open");
    let txn = db.begin_read().expect("read txn");
    let journal = txn.open_table(JOURNAL).expect("journal");
    journal.iter().expect("iter").map(|e| *e.expect("entry").0.value().0).collect()
}

fn assert_index_consistent(store: &RedbStore) -> usize {
    let (records, index) = records_and_index(store);
    assert_eq!(records, index, "the expiry index holds exactly one entry per record, at its expires_at");
    let ids: BTreeSet<[u8; 32]> = records.iter().map(|(_, id)| *id).collect();
    assert!(journal_owners(store).is_subset(&ids), "no journal entry outlives its record");
    records.len()
}

// ---------------------------------------------------------------------------------------
// Persistence
// ---------------------------------------------------------------------------------------

/// A completed record replays after the file is closed and reopened, and an in-flight claim
/// is still in flight with the same fencing token (its owner can still complete it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_survive_close_and_reopen() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("idem.redb");
    let clock = clock();

    let store = RedbStore::open(&path, config(&clock)).expect("open");
    let done = must_claim(&store, req("done", b"{}", RETENTION)).await;
    store.complete(done.id, done.token, response(b"{\"id\":\"w-1\"}")).await.expect("complete");
    let running = must_claim(&store, req("running", b"{}", RETENTION)).await;
    drop(store);

    clock.advance(Duration::from_secs(1));
    let store = RedbStore::open(&path, config(&clock)).expect("reopen");
    let got = store.get(done.id).await.expect("get").expect("completed record present");
    assert_eq!(got.state, RecordState::Completed);
    assert_eq!(got.response, Some(response(b"{\"id\":\"w-1\"}")));
    match store.claim(req("done", b"{}", RETENTION)).await.expect("claim") {
        ClaimOutcome::Existing { record, .. } => assert_eq!(record, got),
        other => panic!("a retry after reopen must find the completed record, got {other:?}"),
    }
    match store.claim(req("running", b"{}", RETENTION)).await.expect("claim") {
        ClaimOutcome::Existing { record, .. } => {
            assert_eq!(record.state, RecordState::InFlight);
            assert_eq!(record.token, running.token);
            assert_eq!(record, running);
        }
        other => panic!("the in-flight claim must survive reopen, got {other:?}"),
    }
    let receipt = store.complete(running.id, running.token, response(b"late")).await.expect("owner completes");
    let completed = written(&store, running.id, receipt).await;
    assert_eq!(completed.state, RecordState::Completed);
    assert_index_consistent(&store);
}

// ---------------------------------------------------------------------------------------
// Expiry index and sweep
// ---------------------------------------------------------------------------------------

/// Sweep removes only records past `expires_at`, at most `limit` per call, reports `more`
/// while expired records remain, and leaves the expiry index consistent after each call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweep_removes_only_expired_records_in_bounded_batches() {
    let clock = clock();
    let store = temp_store(config(&clock));
    let mut short = Vec::new();
    for i in 0..10 {
        let r = must_claim(&store, req(&format!("short-{i}"), b"{}", RETENTION)).await;
        if i % 2 == 0 {
            store.complete(r.id, r.token, response(b"{}")).await.expect("complete");
        }
        short.push(r);
    }
    let mut long = Vec::new();
    for i in 0..5 {
        long.push(must_claim(&store, req(&format!("long-{i}"), b"{}", RETENTION * 2)).await);
    }
    assert_eq!(assert_index_consistent(&store), 15);

    // One millisecond before expiry nothing goes.
    clock.advance(RETENTION - Duration::from_millis(1));
    let out = store.sweep(100).await.expect("sweep");
    assert_eq!((out.removed, out.more), (0, false));

    clock.advance(Duration::from_millis(1));
    // Expired but not yet swept: already absent to readers.
    assert_eq!(store.get(short[0].id).await.expect("get"), None);
    let mut removed = Vec::new();
    loop {
        let out = store.sweep(3).await.expect("sweep");
        assert!(out.removed <= 3, "a sweep never exceeds its limit");
        assert_index_consistent(&store);
        removed.push((out.removed, out.more));
        if !out.more {
            break;
        }
    }
    assert_eq!(removed, vec![(3, true), (3, true), (3, true), (1, false)]);
    assert_eq!(assert_index_consistent(&store), 5);
    for r in &long {
        assert_eq!(store.get(r.id).await.expect("get").map(|g| g.id), Some(r.id), "live records stay");
    }
    assert_eq!(store.sweep(3).await.expect("sweep").removed, 0);
}

/// A reclaim that extends `expires_at` moves the record's expiry index entry, so the sweep
/// neither deletes the reclaimed record at its old expiry nor leaves a stale entry behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reclaim_moves_the_expiry_index_entry() {
    let clock = clock();
    let store = temp_store(config(&clock));
    let t0 = clock.now_ms();
    let first = must_claim(&store, req("k", b"{}", RETENTION)).await;
    store.fail(first.id, first.token).await.expect("fail");
    clock.advance(Duration::from_secs(30));
    let reclaim = ReclaimRequest {
        id: first.id,
        expected: first.token,
        fingerprint: first.fingerprint,
        lease_ttl: LEASE,
        retention: RETENTION,
    };
    let ReclaimOutcome::Reclaimed(second) = store.reclaim(reclaim).await.expect("reclaim") else {
        panic!("a failed record is reclaimable")
    };
    assert_eq!(second.expires_at.0, t0 + 90_000);
    let (_, index) = records_and_index(&store);
    assert_eq!(
        index,
        BTreeSet::from([(t0 + 90_000, *first.id.as_bytes())]),
        "the old entry is gone, the new one is there"
    );

    clock.set(UnixMillis(t0 + 60_000));
    assert_eq!(store.sweep(10).await.expect("sweep").removed, 0, "the old expiry no longer applies");
    assert!(store.get(first.id).await.expect("get").is_some());
    clock.set(UnixMillis(t0 + 90_000));
    assert_eq!(store.sweep(10).await.expect("sweep").removed, 1);
    assert_eq!(assert_index_consistent(&store), 0);
}

/// A claim that replaces an expired, unswept record moves the index entry to the new
/// record's expiry and starts a new generation (a token from the clock, above the old one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_over_expired_record_moves_the_index_entry() {
    let clock = clock();
    let store = temp_store(config(&clock));
    let old = must_claim(&store, req("k", b"{}", RETENTION)).await;
    clock.advance(RETENTION);
    let new = must_claim(&store, req("k", b"{}", RETENTION)).await;
    assert_eq!(new.token, FencingToken::first_at(UnixMillis(clock.now_ms())));
    assert!(new.token > old.token);
    let (_, index) = records_and_index(&store);
    assert_eq!(index, BTreeSet::from([(new.expires_at.0, *old.id.as_bytes())]));
    assert_eq!(store.sweep(10).await.expect("sweep").removed, 0, "the new claim is live");
}

// ---------------------------------------------------------------------------------------
// Journal
// ---------------------------------------------------------------------------------------

/// Journal entries are fenced on the current claim, first write wins unless overwriting,
/// survive a reclaim and a reopen, and leave with their record (sweep, or a claim that
/// replaces the expired record).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn journal_lives_and_dies_with_its_record() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("idem.redb");
    let clock = clock();
    let store = RedbStore::open(&path, config(&clock)).expect("open");
    let first = must_claim(&store, req("k", b"{}", RETENTION)).await;
    let id = first.id;
    let put = |token, value: &[u8], overwrite| store.journal_put(id, token, "step:charge", value.to_vec(), overwrite);
    assert_eq!(put(first.token, b"ch_1", false).await.expect("put"), JournalWrite::Written);
    assert_eq!(put(first.token, b"ch_2", false).await.expect("put"), JournalWrite::Exists(b"ch_1".to_vec()));
    assert_eq!(put(first.token, b"ch_3", true).await.expect("put"), JournalWrite::Written);
    assert!(put(FencingToken(9), b"x", true).await.expect_err("stale token").is_lease_lost());

    // A reclaim (after a failure) keeps the journal; the old token is fenced out.
    store.fail(id, first.token).await.expect("fail");
    let reclaim = ReclaimRequest {
        id,
        expected: first.token,
        fingerprint: first.fingerprint,
        lease_ttl: LEASE,
        retention: RETENTION,
    };
    let ReclaimOutcome::Reclaimed(second) = store.reclaim(reclaim).await.expect("reclaim") else {
        panic!("reclaimable")
    };
    assert!(put(first.token, b"late", true).await.expect_err("old owner").is_lease_lost());
    assert_eq!(store.journal_get(id, "step:charge").await.expect("get"), Some(b"ch_3".to_vec()));
    drop(store);

    let store = RedbStore::open(&path, config(&clock)).expect("reopen");
    assert_eq!(store.journal_get(id, "step:charge").await.expect("get"), Some(b"ch_3".to_vec()));
    assert_eq!(store.journal_get(id, "step:other").await.expect("get"), None);

    // Expired: gone for readers at once; a new claim starts with an empty journal.
    clock.set(second.expires_at);
    assert_eq!(store.journal_get(id, "step:charge").await.expect("get"), None);
    let third = must_claim(&store, req("k", b"{}", RETENTION)).await;
    assert_eq!(store.journal_get(id, "step:charge").await.expect("get"), None);
    store.journal_put(id, third.token, "step:charge", b"ch_9".to_vec(), false).await.expect("put");
    assert_index_consistent(&store);

    // The sweep removes the record and its entries together.
    clock.set(third.expires_at);
    assert_eq!(store.sweep(10).await.expect("sweep").removed, 1);
    assert!(journal_owners(&store).is_empty());
    assert_eq!(assert_index_consistent(&store), 0);
}

// ---------------------------------------------------------------------------------------
// Group commit
// ---------------------------------------------------------------------------------------

/// 64 concurrent claims (16 keys, 4 callers each) applied in a single write transaction:
/// exactly one winner per key, and the losers see the winner's record.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_batch_of_concurrent_claims_has_one_winner_per_key() {
    let clock = clock();
    let store = Arc::new(temp_store(config(&clock).with_batch(full_batches(64))));
    let barrier = Arc::new(tokio::sync::Barrier::new(64));
    let mut tasks = Vec::new();
    for i in 0..64 {
        let store = Arc::clone(&store);
        let barrier = Arc::clone(&barrier);
        tasks.push(tokio::spawn(async move {
            let r = req(&format!("key-{}", i % 16), format!("caller {i}").as_bytes(), RETENTION);
            barrier.wait().await;
            (r.id(), store.claim(r).await.expect("claim"))
        }));
    }
    let mut winners = std::collections::BTreeMap::<RecordId, Record>::new();
    let mut losers = Vec::new();
    for t in tasks {
        match t.await.expect("task") {
            (id, ClaimOutcome::Claimed(r)) => assert!(winners.insert(id, r).is_none(), "two winners for one key"),
            (id, ClaimOutcome::Existing { record, .. }) => losers.push((id, record)),
        }
    }
    assert_eq!(winners.len(), 16);
    assert_eq!(losers.len(), 48);
    for (id, seen) in losers {
        assert_eq!(Some(&seen), winners.get(&id), "a loser sees the winner's record");
    }
    let stats = store.batch_stats();
    assert_eq!((stats.batches, stats.operations), (1, 64), "all claims shared one write transaction");
    assert_eq!(assert_index_consistent(&store), 16);
}

/// Within one batch, later operations see earlier ones: two claims of one id, sent in
/// order, give `Claimed` then `Existing`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn later_operations_in_a_batch_see_earlier_ones() {
    let clock = clock();
    let store = temp_store(config(&clock).with_batch(full_batches(2)));
    // join! polls the first future first, so its operation reaches the writer first.
    let (a, b) = tokio::join!(store.claim(req("k", b"a", RETENTION)), store.claim(req("k", b"b", RETENTION)));
    let ClaimOutcome::Claimed(won) = a.expect("first") else { panic!("the first claim in the batch wins") };
    match b.expect("second") {
        ClaimOutcome::Existing { record, .. } => assert_eq!(record, won),
        other => panic!("the second claim must see the first, got {other:?}"),
    }
    assert_eq!(store.batch_stats().batches, 1);
}

/// The adaptive linger never makes a lone caller wait: with a 30 s maximum, sequential
/// operations still return at once (the previous batch held one operation).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adaptive_linger_does_not_delay_a_lone_caller() {
    let clock = clock();
    let store = temp_store(config(&clock).with_batch(BatchConfig::default().with_linger(Duration::from_secs(30))));
    let lone = async {
        for i in 0..5 {
            let r = must_claim(&store, req(&format!("k{i}"), b"{}", RETENTION)).await;
            store.complete(r.id, r.token, response(b"{}")).await.expect("complete");
        }
    };
    tokio::time::timeout(Duration::from_secs(20), lone).await.expect("no operation waited for the linger");
    assert_eq!(store.batch_stats().batches, 10);
}

/// Many concurrent callers with default settings: exactly one winner per key, and every
/// outcome is durable and readable once returned.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_claims_of_distinct_and_shared_keys() {
    let clock = clock();
    let store = Arc::new(temp_store(config(&clock)));
    let mut tasks = Vec::new();
    for i in 0..200 {
        let store = Arc::clone(&store);
        tasks.push(tokio::spawn(async move {
            // 100 keys of their own, plus 100 callers racing for 4 shared keys.
            let key = if i % 2 == 0 { format!("own-{i}") } else { format!("shared-{}", i % 4) };
            let r = req(&key, b"{}", RETENTION);
            (r.id(), store.claim(r).await.expect("claim"))
        }));
    }
    let mut winners = BTreeSet::new();
    for t in tasks {
        let (id, outcome) = t.await.expect("task");
        if let ClaimOutcome::Claimed(_) = outcome {
            assert!(winners.insert(id), "two winners for one key");
        }
        assert!(store.get(id).await.expect("get").is_some(), "an answered claim is committed");
    }
    assert_eq!(winners.len(), 102);
    assert_eq!(assert_index_consistent(&store), 102);
}

// ---------------------------------------------------------------------------------------
// Corrupt values
// ---------------------------------------------------------------------------------------

fn write_raw(store: &RedbStore, id: RecordId, value: &[u8]) {
    let db = store.database().expect("the database is open");
    let txn = db.begin_write().expect("write txn");
    {
        let mut t = txn.open_table(RECORDS).expect("records");
        t.insert(id.as_bytes(), value).expect("insert");
    }
    txn.commit().expect("commit");
}

/// A stored value that does not decode is `StoreError::Corrupt` for every operation on that
/// record (never a panic), and does not disturb other operations in the same batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_value_is_a_typed_error() {
    let clock = clock();
    let store = temp_store(config(&clock).with_batch(full_batches(2)));
    let bad = req("bad", b"{}", RETENTION);
    let id = bad.id();
    for (value, expect) in [
        (&b""[..], "empty"),
        (&[0x7f, 1, 2, 3][..], "version"),
        (&[codec::FORMAT_VERSION, 0xff, 0xff, 0xff][..], "malformed"),
    ] {
        write_raw(&store, id, value);
        match store.get(id).await {
            Err(StoreError::Corrupt { id: Some(got), source }) => {
                assert_eq!(got, id);
                let ok = match expect {
                    "empty" => matches!(source, CodecError::Empty),
                    "version" => matches!(source, CodecError::UnknownVersion(0x7f)),
                    _ => matches!(source, CodecError::Malformed(_) | CodecError::Trailing(_)),
                };
                assert!(ok, "{expect}: got {source:?}");
            }
            other => panic!("get of a corrupt value: {other:?}"),
        }
        // The corrupt claim and a healthy claim share one batch.
        let (c, ok) =
            tokio::join!(store.claim(bad.clone()), store.claim(req(&format!("good-{expect}"), b"{}", RETENTION)));
        assert!(matches!(c, Err(StoreError::Corrupt { id: Some(got), .. }) if got == id), "claim: {c:?}");
        assert!(matches!(ok, Ok(ClaimOutcome::Claimed(_))), "the other claim in the batch: {ok:?}");
        let reclaim = ReclaimRequest {
            id,
            expected: FencingToken::FIRST,
            fingerprint: bad.fingerprint(),
            lease_ttl: LEASE,
            retention: RETENTION,
        };
        // Pairs, so that every batch fills and none waits for the linger.
        let (r, c) = tokio::join!(store.reclaim(reclaim), store.complete(id, FencingToken::FIRST, response(b"")));
        assert!(matches!(r, Err(StoreError::Corrupt { .. })), "reclaim: {r:?}");
        assert!(matches!(c, Err(StoreError::Corrupt { .. })), "complete: {c:?}");
        let (f, ok) = tokio::join!(
            store.fail(id, FencingToken::FIRST),
            store.claim(req(&format!("other-{expect}"), b"{}", RETENTION))
        );
        assert!(matches!(f, Err(StoreError::Corrupt { .. })), "fail: {f:?}");
        assert!(matches!(ok, Ok(ClaimOutcome::Claimed(_))), "the other claim in the batch: {ok:?}");
        assert!(!store.get(id).await.unwrap_err().is_retryable(), "corruption does not heal on retry");
    }
}

// ---------------------------------------------------------------------------------------
// Commit failure
// ---------------------------------------------------------------------------------------

/// An in-memory backend whose writes and syncs fail while `broken` is set, and whose
/// sync waits while `held` is set, after saying it got there (`holding`): that holds the
/// writer between applying a batch and its commit.
#[derive(Debug, Default)]
struct Flaky {
    inner: Arc<redb::backends::InMemoryBackend>,
    broken: Arc<AtomicBool>,
    held: Arc<AtomicBool>,
    holding: Arc<AtomicBool>,
}

impl Flaky {
    fn check(&self) -> std::io::Result<()> {
        if self.broken.load(Ordering::SeqCst) { Err(std::io::Error::other("injected disk failure")) } else { Ok(()) }
    }
}

impl redb::StorageBackend for Flaky {
    fn len(&self) -> std::io::Result<u64> {
        self.inner.len()
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        self.inner.read(offset, out)
    }
    fn set_len(&self, len: u64) -> std::io::Result<()> {
        self.check()?;
        self.inner.set_len(len)
    }
    fn sync_data(&self) -> std::io::Result<()> {
        if self.held.load(Ordering::SeqCst) {
            self.holding.store(true, Ordering::SeqCst);
            while self.held.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        self.check()?;
        self.inner.sync_data()
    }
    fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.check()?;
        self.inner.write(offset, data)
    }
}

/// A store on `memory` (kept across reopens) whose disk fails while `broken` is set.
fn on_flaky(memory: &Arc<redb::backends::InMemoryBackend>, broken: &Arc<AtomicBool>, config: Config) -> RedbStore {
    let backend = Flaky { inner: Arc::clone(memory), broken: Arc::clone(broken), ..Flaky::default() };
    let db = redb::Database::builder().create_with_backend(backend).expect("database");
    RedbStore::from_database(Arc::new(db), config).expect("store")
}

/// Claims keys `{prefix}{0..n}` from `n` concurrent tasks; outcomes in key order.
async fn claim_all(store: &Arc<RedbStore>, prefix: &str, n: usize) -> Vec<Result<ClaimOutcome, StoreError>> {
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let store = Arc::clone(store);
            let r = req(&format!("{prefix}{i}"), b"{}", RETENTION);
            tokio::spawn(async move { store.claim(r).await })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.expect("task"));
    }
    out
}

/// When a batch's commit fails, every caller in the batch gets the error (none is told its
/// claim succeeded) and none of the batch's writes reach the file.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failed_commit_fails_every_caller_and_applies_nothing() {
    let clock = clock();
    let memory = Arc::new(redb::backends::InMemoryBackend::new());
    let broken = Arc::new(AtomicBool::new(false));
    let open = || on_flaky(&memory, &broken, config(&clock).with_batch(full_batches(8)));
    let store = Arc::new(open());
    let before: Vec<Record> = claim_all(&store, "before", 8)
        .await
        .into_iter()
        .map(|o| match o {
            Ok(ClaimOutcome::Claimed(r)) => r,
            other => panic!("healthy batch: {other:?}"),
        })
        .collect();
    let batches_before = store.batch_stats().batches;

    broken.store(true, Ordering::SeqCst);
    let mut ids = Vec::new();
    for (i, outcome) in claim_all(&store, "k", 8).await.into_iter().enumerate() {
        match outcome {
            Err(e @ StoreError::Unavailable { .. }) => {
                assert!(!e.is_lease_lost());
            }
            other => panic!("caller {i} of a failed batch must get the error, got {other:?}"),
        }
        ids.push(req(&format!("k{i}"), b"{}", RETENTION).id());
    }
    let stats = store.batch_stats();
    assert_eq!(stats.batches - batches_before, 1);
    assert_eq!(stats.failed_batches, 1);

    // redb latches an I/O failure: later writes fail, not retryable, until the file is
    // opened again (the crate docs say so). Reads keep working.
    broken.store(false, Ordering::SeqCst);
    for outcome in claim_all(&store, "after", 8).await {
        match outcome {
            Err(e @ StoreError::Unavailable { .. }) => assert!(!e.is_retryable(), "{e:?}"),
            other => panic!("a write after a latched I/O failure: {other:?}"),
        }
    }
    assert!(store.get(before[0].id).await.expect("reads still work").is_some());

    // Reopen the same bytes with a healthy disk: the batch is not there, the earlier
    // commit is.
    drop(store);
    let store = open();
    for id in ids {
        assert_eq!(store.get(id).await.expect("get"), None, "nothing of the failed batch was applied");
    }
    for r in before {
        assert_eq!(store.get(r.id).await.expect("get"), Some(r), "earlier commits are intact");
    }
    assert_index_consistent(&store);
}

/// A clock that panics while `armed` is set: a stand-in for a bug inside a batch.
#[derive(Debug)]
struct PanickingClock {
    inner: ManualClock,
    armed: Arc<AtomicBool>,
}

impl idem_core::Clock for PanickingClock {
    fn now(&self) -> UnixMillis {
        assert!(!self.armed.load(Ordering::SeqCst), "injected panic inside the writer");
        self.inner.now()
    }
}

/// A panic while the writer applies a batch fails that batch's callers with an error
/// (never a hang), applies nothing of it, and leaves the writer serving later batches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_inside_a_batch_fails_only_that_batch() {
    let armed = Arc::new(AtomicBool::new(false));
    let clock = PanickingClock { inner: clock(), armed: Arc::clone(&armed) };
    let store = temp_store(Config::default().with_clock(Arc::new(clock)));
    armed.store(true, Ordering::SeqCst);
    let r = req("k", b"{}", RETENTION);
    match tokio::time::timeout(Duration::from_secs(20), store.claim(r.clone())).await.expect("no hang") {
        Err(e @ StoreError::Unavailable { .. }) => assert!(!e.is_lease_lost()),
        other => panic!("the caller of a panicked batch gets an error, got {other:?}"),
    }
    armed.store(false, Ordering::SeqCst);
    assert_eq!(store.get(r.id()).await.expect("get"), None, "nothing of the panicked batch was applied");
    must_claim(&store, r).await;
    assert_eq!(store.batch_stats().failed_batches, 1);
}

/// A clock that panics on the `fuse`-th read after the fuse is set (0: never), so that a
/// batch breaks after earlier operations of it have written inside its transaction.
#[derive(Debug)]
struct FusedClock {
    inner: ManualClock,
    fuse: Arc<AtomicU64>,
}

impl idem_core::Clock for FusedClock {
    fn now(&self) -> UnixMillis {
        let before = self.fuse.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).unwrap_or(0);
        assert_ne!(before, 1, "injected panic inside the writer");
        self.inner.now()
    }
}

/// A panic part-way through a batch, after earlier operations of it wrote inside its
/// transaction: every caller of the batch gets an error, nothing of the batch is in the
/// file (checked again after reopening it), and the next operation is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_after_writes_in_a_batch_leaves_nothing_of_it_on_disk() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("idem.redb");
    let manual = clock();
    let fuse = Arc::new(AtomicU64::new(0));
    let clock = FusedClock { inner: manual.clone(), fuse: Arc::clone(&fuse) };
    let fused = Config::default().with_clock(Arc::new(clock)).with_batch(full_batches(4));
    let store = RedbStore::open(&path, fused).expect("open");
    let reqs: Vec<ClaimRequest> = (0..4).map(|i| req(&format!("k{i}"), b"{}", RETENTION)).collect();

    // The writer reads the clock once per operation: the fourth claim of the batch panics
    // after the first three wrote their records.
    fuse.store(4, Ordering::SeqCst);
    let claims = futures::future::join_all(reqs.iter().cloned().map(|r| store.claim(r)));
    let outcomes = tokio::time::timeout(Duration::from_secs(20), claims).await.expect("no caller hangs");
    for (i, outcome) in outcomes.into_iter().enumerate() {
        match outcome {
            Err(e @ StoreError::Unavailable { .. }) => assert!(!e.is_lease_lost()),
            other => panic!("caller {i} of the panicked batch must get an error, got {other:?}"),
        }
    }
    assert_eq!(fuse.load(Ordering::SeqCst), 0, "the panic fired inside the batch");
    for r in &reqs {
        assert_eq!(store.get(r.id()).await.expect("get"), None, "nothing of the panicked batch is visible");
    }

    // The writer goes on: the next batch (four other keys, so that it fills) is applied.
    let after: Vec<ClaimRequest> = (0..4).map(|i| req(&format!("after-{i}"), b"{}", RETENTION)).collect();
    for outcome in futures::future::join_all(after.iter().cloned().map(|r| store.claim(r))).await {
        assert!(matches!(outcome, Ok(ClaimOutcome::Claimed(_))), "the next batch is served: {outcome:?}");
    }
    // Read after the next batch: the writer counts a panicked batch once it has unwound,
    // which may be just after its callers saw their errors.
    let stats = store.batch_stats();
    assert_eq!((stats.batches, stats.failed_batches), (2, 1));
    drop(store);

    let store = RedbStore::open(&path, config(&manual)).expect("reopen");
    for r in &reqs {
        assert_eq!(store.get(r.id()).await.expect("get"), None, "nothing of the panicked batch is in the file");
    }
    for r in &after {
        assert!(store.get(r.id()).await.expect("get").is_some(), "the next batch is in the file");
    }
    assert_eq!(assert_index_consistent(&store), 4);
}

/// A claim whose caller stopped waiting before its batch ran is not applied: nobody would
/// run the handler, and the claim would only lock the key for a lease. The next claim of
/// the key wins it with the first fencing token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_abandoned_before_its_batch_runs_is_not_applied() {
    let clock = clock();
    // Two operations per batch and a long linger: the batch runs once both are queued.
    let store = temp_store(config(&clock).with_batch(full_batches(2)));
    let abandoned = req("abandoned", b"{}", RETENTION);
    // One poll hands the claim to the writer; dropping the future is the caller going away.
    assert!(store.claim(abandoned.clone()).now_or_never().is_none(), "the claim waits for its batch");
    let other = must_claim(&store, req("other", b"{}", RETENTION)).await;
    let stats = store.batch_stats();
    assert_eq!((stats.batches, stats.operations, stats.abandoned_claims), (1, 2, 1));
    assert_eq!(store.get(abandoned.id()).await.expect("get"), None, "the abandoned claim was not applied");
    assert_eq!(store.get(other.id).await.expect("get"), Some(other), "the rest of its batch was");
    // A full batch again, so that it does not wait for the linger.
    let (again, _) = tokio::join!(must_claim(&store, abandoned), must_claim(&store, req("third", b"{}", RETENTION)));
    assert_eq!(
        again.token,
        FencingToken::first_at(UnixMillis(clock.now_ms())),
        "the key is free: the next claim wins it"
    );
}

/// The generic sweeper, started by one call, removes records past their retention from
/// the file, with their journal entries, and leaves live records alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweeper_removes_expired_records_from_the_file() {
    let clock = clock();
    let store = Arc::new(temp_store(config(&clock)));
    // Three records per sweep call, so a round needs several calls.
    let sweep = SweepConfig::default().with_period(Duration::from_millis(10)).with_batch(3);
    let _sweeper = Sweeper::start(Arc::clone(&store), sweep);
    let mut short = Vec::new();
    for i in 0..10 {
        short.push(must_claim(&store, req(&format!("short-{i}"), b"{}", RETENTION)).await);
    }
    store.journal_put(short[0].id, short[0].token, "step:a", b"x".to_vec(), false).await.expect("journal put");
    let long = must_claim(&store, req("long", b"{}", RETENTION * 2)).await;
    assert_eq!(assert_index_consistent(&store), 11, "nothing is swept before its retention ends");

    clock.advance(RETENTION);
    let deadline = Instant::now() + Duration::from_secs(20);
    while assert_index_consistent(&store) > 1 {
        assert!(Instant::now() < deadline, "the sweeper left expired records in the file for 20 s");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (records, _) = records_and_index(&store);
    assert_eq!(records, BTreeSet::from([(long.expires_at.0, *long.id.as_bytes())]), "the live record stays");
    assert!(journal_owners(&store).is_empty(), "journal entries leave with their record");
}

/// The application's own tables live in the same file: its write transactions take turns
/// with the writer's batches, and both survive a reopen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn application_tables_share_the_file() {
    const WORKERS: redb::TableDefinition<'static, u64, &'static str> = redb::TableDefinition::new("app_workers");
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("idem.redb");
    let clock = clock();
    let db = Arc::new(redb::Database::create(&path).expect("database"));
    let store = RedbStore::from_database(Arc::clone(&db), config(&clock)).expect("store");
    let app = tokio::task::spawn_blocking(move || {
        for i in 0..50u64 {
            let txn = db.begin_write().expect("app write");
            txn.open_table(WORKERS).expect("app table").insert(i, "w").expect("insert");
            txn.commit().expect("app commit");
        }
    });
    let mut claimed = Vec::new();
    for i in 0..50 {
        claimed.push(must_claim(&store, req(&format!("k{i}"), b"{}", RETENTION)).await);
    }
    app.await.expect("app task");
    drop(store);

    let store = RedbStore::open(&path, config(&clock)).expect("reopen");
    for r in &claimed {
        assert!(store.get(r.id).await.expect("get").is_some());
    }
    let db = store.database().expect("the database is open");
    let txn = db.begin_read().expect("read");
    assert_eq!(redb::ReadableTableMetadata::len(&txn.open_table(WORKERS).expect("app table")).expect("len"), 50);
}

/// A second opener of a file that is in use gets a typed, non-retryable error that keeps
/// redb's error as its source.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_opener_gets_a_typed_error() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("idem.redb");
    let clock = clock();
    let _first = RedbStore::open(&path, config(&clock)).expect("open");
    let err = RedbStore::open(&path, config(&clock)).expect_err("the file is in use");
    assert!(matches!(err, idem_redb::Error::Open(redb::DatabaseError::DatabaseAlreadyOpen)), "{err:?}");
    assert!(!err.is_retryable());
    match StoreError::from(err) {
        StoreError::Unavailable { backend, retryable, source, .. } => {
            assert_eq!((backend, retryable), ("redb", false));
            assert!(source.downcast_ref::<idem_redb::Error>().is_some(), "the redb error is the source");
        }
        other => panic!("{other:?}"),
    }
}

// ---------------------------------------------------------------------------------------
// Shutdown
// ---------------------------------------------------------------------------------------

/// Dropping the last handle stops the writer thread without hanging and releases the file,
/// so it can be opened again at once; dropping a clone does not stop the writer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_store_stops_the_writer_cleanly() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("idem.redb");
    let clock = clock();
    let store = RedbStore::open(&path, config(&clock)).expect("open");
    let clone = store.clone();
    must_claim(&store, req("a", b"{}", RETENTION)).await;
    drop(clone);
    must_claim(&store, req("b", b"{}", RETENTION)).await;

    let dropped = tokio::task::spawn_blocking(move || drop(store));
    tokio::time::timeout(Duration::from_secs(30), dropped)
        .await
        .expect("dropping the store must not hang")
        .expect("drop task");
    let store = RedbStore::open(&path, config(&clock)).expect("the file is free again after drop");
    assert!(store.get(req("b", b"{}", RETENTION).id()).await.expect("get").is_some());
}

/// A replay must not cost a commit: a claim that finds a live record is answered from a
/// read transaction (no batch), and a claim of an expired record still goes through the
/// writer and replaces it with the next fencing token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_of_live_records_are_answered_without_the_writer() {
    let clock = clock();
    let store = temp_store(config(&clock));
    let r = must_claim(&store, req("k", b"{}", RETENTION)).await;
    let receipt = store.complete(r.id, r.token, response(b"{}")).await.expect("complete");
    let done = written(&store, r.id, receipt).await;
    let before = store.batch_stats();
    for _ in 0..3 {
        match store.claim(req("k", b"{}", RETENTION)).await.expect("replay") {
            ClaimOutcome::Existing { record, .. } => assert_eq!(record, done),
            other => panic!("expected Existing, got {other:?}"),
        }
    }
    let after = store.batch_stats();
    assert_eq!(after.batches, before.batches, "no replay entered the writer");
    assert_eq!(after.claims_read - before.claims_read, 3);

    clock.advance_ms(RETENTION.as_millis() as i64);
    let again = must_claim(&store, req("k", b"{}", RETENTION)).await;
    assert_eq!(
        again.token,
        FencingToken::first_at(UnixMillis(clock.now_ms())),
        "an expired record is replaced (a new generation) through the writer"
    );
    assert_eq!(store.batch_stats().batches, after.batches + 1);
}

/// A batch that writes nothing is not committed: with claim reads off, batches of claims
/// of one live record are counted as read-only and their callers still get `Existing`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_that_write_nothing_are_not_committed() {
    let clock = clock();
    let store = temp_store(config(&clock).with_claim_reads(false).with_batch(BatchConfig::default().with_max_batch(1)));
    let r = must_claim(&store, req("k", b"{}", RETENTION)).await;
    store.complete(r.id, r.token, response(b"{}")).await.expect("complete");
    let before = store.batch_stats();
    let outcomes = futures::future::join_all((0..4).map(|_| store.claim(req("k", b"{}", RETENTION)))).await;
    for o in outcomes {
        assert!(matches!(o.expect("claim"), ClaimOutcome::Existing { .. }));
    }
    let after = store.batch_stats();
    assert_eq!((after.batches - before.batches, after.read_only_batches - before.read_only_batches), (4, 4));
    // A batch that writes is still committed (and counted as such).
    let w = must_claim(&store, req("k2", b"{}", RETENTION)).await;
    assert_eq!(store.get(w.id).await.expect("get"), Some(w));
    let last = store.batch_stats();
    assert_eq!((last.batches, last.read_only_batches), (after.batches + 1, after.read_only_batches));
}

/// Two stores on one `Database` (one per router or service in a process) each claim keys
/// `k{0..n}` at once; returns how many `Claimed` each key got across both.
async fn race_two_stores(a: &Arc<RedbStore>, b: &Arc<RedbStore>, n: usize) -> Vec<usize> {
    let (left, right) = tokio::join!(claim_all(a, "k", n), claim_all(b, "k", n));
    left.into_iter()
        .zip(right)
        .map(|(l, r)| {
            [l, r].into_iter().filter(|o| matches!(o.as_ref().expect("claim"), ClaimOutcome::Claimed(_))).count()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_stores_on_one_database_claim_each_key_once() {
    //! Two `RedbStore::from_database` handles on one `Database` both answered `Claimed` for one key (each decided claims in its own memory), and the second claim's write left the expiry index pointing at the first claim's time, so a sweep deleted a live claim.
    let clock = clock();
    let file = tempfile::tempfile().expect("temporary file");
    let backend = redb::backends::FileBackend::new(file).expect("file backend");
    let db = Arc::new(redb::Database::builder().create_with_backend(backend).expect("database"));
    let a = Arc::new(RedbStore::from_database(Arc::clone(&db), config(&clock)).expect("first store"));
    let b = Arc::new(RedbStore::from_database(db, config(&clock)).expect("second store"));
    let wins = race_two_stores(&a, &b, 64).await;
    for (i, w) in wins.iter().enumerate() {
        assert_eq!(*w, 1, "k{i} was claimed {w} times by two stores on one database");
    }
    assert_eq!(assert_index_consistent(&a), 64, "one expiry index entry per record, at its own time");
    // A sweep once the leases (not the retention) have passed removes nothing live.
    clock.advance(LEASE + Duration::from_secs(1));
    assert_eq!(b.sweep(1000).await.expect("sweep").removed, 0);
    assert_eq!(assert_index_consistent(&b), 64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_racing_an_uncommitted_reclaim_does_not_claim() {
    //! A claim decided against the last commit took a key whose expired record the writer had already reclaimed in its open transaction: both callers owned the record and ran the handler.
    let clock = clock();
    let backend = Flaky::default();
    let (closed, entered) = (Arc::clone(&backend.held), Arc::clone(&backend.holding));
    let db = redb::Database::builder().create_with_backend(backend).expect("database");
    let store = Arc::new(RedbStore::from_database(Arc::new(db), config(&clock)).expect("store"));
    // A retention just past the lease: the reclaim is applied while the record is live,
    // and by the time the claim arrives the last commit shows it past its retention.
    let retention = LEASE + Duration::from_secs(5);
    let r = req("k", b"{}", retention);
    let first = must_claim(&store, r.clone()).await;
    clock.advance(LEASE + Duration::from_secs(1));

    // The reclaim is applied, and its commit waits in the disk's sync.
    closed.store(true, Ordering::SeqCst);
    let reclaim = {
        let store = Arc::clone(&store);
        let req = ReclaimRequest {
            id: first.id,
            expected: first.token,
            fingerprint: first.fingerprint,
            lease_ttl: LEASE,
            retention,
        };
        tokio::spawn(async move { store.reclaim(req).await })
    };
    while !entered.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    clock.advance(Duration::from_secs(5));
    // The last commit shows a record past its retention (absent); the claim must not
    // decide from it.
    let claim = {
        let store = Arc::clone(&store);
        tokio::spawn(async move { store.claim(r).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    closed.store(false, Ordering::SeqCst);
    let reclaimed = match reclaim.await.expect("task").expect("reclaim") {
        ReclaimOutcome::Reclaimed(rec) => rec,
        other => panic!("the reclaim lost: {other:?}"),
    };
    match claim.await.expect("task").expect("claim") {
        ClaimOutcome::Existing { record, .. } => assert_eq!(record.token, reclaimed.token),
        other => panic!("a claim beside an uncommitted reclaim must see it, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_store_that_cannot_commit_acknowledges_no_claim() {
    //! While nothing could be committed (redb's latched I/O failure), claims were still acknowledged from memory and their handlers ran; and a claim whose write then failed was dropped while its handler ran, so a retry with another body claimed the key again.
    let clock = clock();
    let memory = Arc::new(redb::backends::InMemoryBackend::new());
    let broken = Arc::new(AtomicBool::new(false));
    let open = || on_flaky(&memory, &broken, config(&clock));
    let store = Arc::new(open());
    must_claim(&store, req("before", b"{}", RETENTION)).await;
    broken.store(true, Ordering::SeqCst);
    let first = store.claim(req("k", b"{}", RETENTION)).await;
    assert!(matches!(first, Err(StoreError::Unavailable { .. })), "a claim on a failing disk: {first:?}");
    broken.store(false, Ordering::SeqCst);
    // The failure is latched: every later claim fails too, and none is acknowledged.
    for (i, outcome) in claim_all(&store, "latched", 64).await.into_iter().enumerate() {
        assert!(matches!(outcome, Err(StoreError::Unavailable { .. })), "latched{i}: {outcome:?}");
    }
    // After a reopen, the key was never claimed: a retry (even with another body) is the
    // first claim, not a second owner of a running handler.
    drop(store);
    let store = open();
    assert_eq!(store.get(req("k", b"{}", RETENTION).id()).await.expect("get"), None);
    must_claim(&store, req("k", b"another body", RETENTION)).await;
}
