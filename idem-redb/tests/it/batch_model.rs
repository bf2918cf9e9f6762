//! Group commit against the specification model: random operations sent as full batches (each
//! batch one write transaction), with the clock moved between batches. Every outcome, in
//! arrival order, and the final state must equal the [`Spec`] applying the same
//! operations one by one: a batch behaves exactly like its operations run in sequence.
//! Also: arbitrary bytes stored as a record never make any operation panic.

use std::sync::Arc;
use std::time::Duration;

use idem_conformance::{Oracle, Spec};
use idem_core::Clock;
use idem_core::store::JournalWrite;
use idem_core::{
    ClaimOutcome, ClaimRequest, Endpoint, FencingToken, Fingerprint, IdempotencyKey, ManualClock, ReclaimRequest,
    Record, RecordId, Scope, Store, StoredResponse, UnixMillis,
};
use idem_redb::{BatchConfig, Config, RedbStore};
use proptest::prelude::*;

/// Operations per batch; the store closes a batch only when it is full.
const BATCH: usize = 6;
const KEYS: usize = 3;
const NAMES: [&str; 2] = ["step:a", "step:b"];
const LEASE: Duration = Duration::from_secs(5);
const RETENTION: Duration = Duration::from_secs(60);

/// An operation. As generated, a token is `1..4` relative to the key's token when the
/// operation's turn comes (1 the one before, stale; 2 the current one; 3 the next one);
/// [`resolve`] makes it absolute before the operation is sent.
#[derive(Clone, Debug)]
enum Op {
    Claim { key: usize, body: u8 },
    Reclaim { key: usize, expected: u64, body: u8 },
    Complete { key: usize, token: u64 },
    Fail { key: usize, token: u64 },
    Extend { key: usize, token: u64 },
    Sweep { limit: usize },
    JournalPut { key: usize, token: u64, name: usize, overwrite: bool },
}

/// `op` with its relative token made absolute against `model` at `now`: the key's live
/// token, or with none the token a claim would take now (a new generation's first).
fn resolve(model: &Spec, op: &Op, now: UnixMillis) -> Op {
    let abs = |key: usize, t: u64| {
        let base = model.get(id(key), now).map_or(FencingToken::first_at(now), |r| r.token);
        (base.0 + t).saturating_sub(2)
    };
    match *op {
        Op::Reclaim { key, expected, body } => Op::Reclaim { key, expected: abs(key, expected), body },
        Op::Complete { key, token } => Op::Complete { key, token: abs(key, token) },
        Op::Fail { key, token } => Op::Fail { key, token: abs(key, token) },
        Op::Extend { key, token } => Op::Extend { key, token: abs(key, token) },
        Op::JournalPut { key, token, name, overwrite } => {
            Op::JournalPut { key, token: abs(key, token), name, overwrite }
        }
        ref other => other.clone(),
    }
}

#[derive(Clone, Debug)]
enum Step {
    /// Move the clock by this many ms.
    Advance(i64),
    /// Send these operations at once, in this order.
    Batch(Vec<Op>),
}

fn op() -> impl Strategy<Value = Op> {
    let key = 0..KEYS;
    let token = 1..4u64;
    prop_oneof![
        3 => (key.clone(), 0..2u8).prop_map(|(key, body)| Op::Claim { key, body }),
        2 => (key.clone(), token.clone(), 0..2u8).prop_map(|(key, expected, body)| Op::Reclaim { key, expected, body }),
        2 => (key.clone(), token.clone()).prop_map(|(key, token)| Op::Complete { key, token }),
        2 => (key.clone(), token.clone()).prop_map(|(key, token)| Op::Fail { key, token }),
        1 => (key.clone(), token.clone()).prop_map(|(key, token)| Op::Extend { key, token }),
        // Partial sweeps too: the store and the model both remove the oldest expiry first
        // (ties by record id), through the same engine.
        1 => (0..=KEYS).prop_map(|limit| Op::Sweep { limit }),
        2 => (key, token, 0..NAMES.len(), any::<bool>())
            .prop_map(|(key, token, name, overwrite)| Op::JournalPut { key, token, name, overwrite }),
    ]
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        1 => prop::sample::select(vec![1, 4_999, 5_000, 30_000, 60_000]).prop_map(Step::Advance),
        3 => prop::collection::vec(op(), BATCH).prop_map(Step::Batch),
    ]
}

fn scope() -> Scope {
    Scope::new("batch-model", Endpoint::new("POST", "/m")).expect("scope")
}

fn key(k: usize) -> IdempotencyKey {
    IdempotencyKey::parse(format!("k{k}").as_bytes()).expect("key")
}

fn id(k: usize) -> RecordId {
    scope().record_id(&key(k))
}

fn claim_req(k: usize, body: u8) -> ClaimRequest {
    ClaimRequest::new(scope(), key(k), Fingerprint::of_bytes(&[body]), LEASE, RETENTION)
}

fn reclaim_req(k: usize, expected: u64, body: u8) -> ReclaimRequest {
    ReclaimRequest {
        id: id(k),
        expected: FencingToken(expected),
        fingerprint: Fingerprint::of_bytes(&[body]),
        lease_ttl: LEASE,
        retention: RETENTION,
    }
}

fn response(token: u64) -> StoredResponse {
    StoredResponse::new(200, vec![("x-token".into(), token.to_string().into_bytes())], vec![1, 2, 3])
}

/// What the model says, in the same shape as the store's answers.
fn model_apply(model: &mut Spec, op: &Op, now: UnixMillis) -> String {
    match op {
        Op::Claim { key, body } => format!("{:?}", Ok::<_, ()>(model.claim(&claim_req(*key, *body), now))),
        Op::Reclaim { key, expected, body } => {
            format!("{:?}", Ok::<_, ()>(model.reclaim(&reclaim_req(*key, *expected, *body), now)))
        }
        Op::Complete { key, token } => {
            format!("{:?}", model.complete(id(*key), FencingToken(*token), response(*token), now))
        }
        Op::Fail { key, token } => format!("{:?}", model.fail(id(*key), FencingToken(*token), now)),
        Op::Extend { key, token } => format!("{:?}", model.extend(id(*key), FencingToken(*token), RETENTION * 2, now)),
        Op::Sweep { limit } => format!("{:?}", Ok::<_, ()>(model.sweep(*limit, now))),
        Op::JournalPut { key, token, name, overwrite } => format!(
            "{:?}",
            model.journal_put(id(*key), FencingToken(*token), NAMES[*name], vec![*token as u8], *overwrite, now)
        ),
    }
}

async fn store_apply(store: &RedbStore, op: Op) -> String {
    fn show<T: std::fmt::Debug>(r: Result<T, idem_core::StoreError>) -> String {
        match r {
            Ok(v) => format!("{:?}", Ok::<_, ()>(v)),
            Err(e) => format!("{:?}", Err::<(), _>(e)),
        }
    }
    match op {
        Op::Claim { key, body } => show(store.claim(claim_req(key, body)).await),
        Op::Reclaim { key, expected, body } => show(store.reclaim(reclaim_req(key, expected, body)).await),
        Op::Complete { key, token } => show(store.complete(id(key), FencingToken(token), response(token)).await),
        Op::Fail { key, token } => show(store.fail(id(key), FencingToken(token)).await),
        Op::Extend { key, token } => show(store.extend(id(key), FencingToken(token), RETENTION * 2).await),
        Op::Sweep { limit } => show(store.sweep(limit).await),
        Op::JournalPut { key, token, name, overwrite } => show::<JournalWrite>(
            store.journal_put(id(key), FencingToken(token), NAMES[name], vec![token as u8], overwrite).await,
        ),
    }
}

async fn check(steps: Vec<Step>) -> Result<(), TestCaseError> {
    let clock = ManualClock::new(UnixMillis(1_800_000_000_000));
    let file = tempfile::tempfile().expect("temporary file");
    let db = redb::Database::builder()
        .create_with_backend(redb::backends::FileBackend::new(file).expect("backend"))
        .expect("database");
    let config = Config::default()
        .with_clock(Arc::new(clock.clone()))
        .with_batch(BatchConfig::default().with_max_batch(BATCH).with_full_batches(Duration::from_secs(60)))
        // Every claim goes through the writer, so each batch is exactly the operations
        // listed, in order (a claim answered from a read would not join the batch).
        .with_claim_reads(false);
    let store = RedbStore::from_database(Arc::new(db), config).expect("store");
    let mut model = Spec::new();
    let mut batches = 0;
    for step in steps {
        match step {
            Step::Advance(ms) => clock.advance_ms(ms),
            Step::Batch(ops) => {
                batches += 1;
                let now = clock.now();
                let mut sent = Vec::with_capacity(ops.len());
                let mut expected = Vec::with_capacity(ops.len());
                for op in &ops {
                    let op = resolve(&model, op, now);
                    expected.push(model_apply(&mut model, &op, now));
                    sent.push(op);
                }
                // join_all polls the futures in order, so the operations reach the writer in
                // this order and fill exactly one batch.
                let got = futures::future::join_all(sent.into_iter().map(|op| store_apply(&store, op))).await;
                for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
                    prop_assert_eq!(g, e, "operation {} ({:?}) of batch {}", i, ops[i], batches);
                }
            }
        }
    }
    prop_assert_eq!(store.batch_stats().batches, batches, "every batch was one write transaction");
    let now = clock.now();
    for k in 0..KEYS {
        prop_assert_eq!(store.get(id(k)).await.expect("get"), model.get(id(k), now));
        for name in NAMES {
            prop_assert_eq!(
                store.journal_get(id(k), name).await.expect("journal_get"),
                model.journal_get(id(k), name, now)
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn batches_behave_like_their_operations_in_sequence(steps in prop::collection::vec(step(), 1..8)) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        runtime.block_on(check(steps))?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// Arbitrary bytes stored as a record (a damaged file, a foreign writer) never make the
    /// store panic: every operation on that record answers, with `Corrupt` or (if the bytes
    /// happen to decode) a normal outcome, and the writer keeps serving other records.
    #[test]
    fn arbitrary_stored_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..96), versioned in any::<bool>()) {
        let mut value = bytes;
        if versioned {
            value.insert(0, idem_core::codec::FORMAT_VERSION);
        }
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        runtime.block_on(async {
            let clock = ManualClock::new(UnixMillis(1_800_000_000_000));
            let file = tempfile::tempfile().expect("temporary file");
            let db = redb::Database::builder()
                .create_with_backend(redb::backends::FileBackend::new(file).expect("backend"))
                .expect("database");
            let store = RedbStore::from_database(Arc::new(db), Config::default().with_clock(Arc::new(clock))).expect("store");
            {
                let db = store.database().expect("the database is open");
                let txn = db.begin_write().expect("write");
                txn.open_table(idem_redb::table::RECORDS).expect("records").insert(id(0).as_bytes(), value.as_slice()).expect("insert");
                txn.commit().expect("commit");
            }
            let ok_or_corrupt = |r: Result<String, idem_core::StoreError>| match r {
                Ok(_) | Err(idem_core::StoreError::Corrupt { .. } | idem_core::StoreError::LeaseLost { .. }) => Ok(()),
                Err(e) => Err(TestCaseError::fail(format!("{e:?}"))),
            };
            ok_or_corrupt(store.get(id(0)).await.map(|r| format!("{r:?}")))?;
            ok_or_corrupt(store.claim(claim_req(0, 0)).await.map(|r| format!("{r:?}")))?;
            ok_or_corrupt(store.reclaim(reclaim_req(0, 1, 0)).await.map(|r| format!("{r:?}")))?;
            ok_or_corrupt(store.complete(id(0), FencingToken(1), response(1)).await.map(|r| format!("{r:?}")))?;
            ok_or_corrupt(store.fail(id(0), FencingToken(1)).await.map(|r| format!("{r:?}")))?;
            ok_or_corrupt(store.journal_get(id(0), NAMES[0]).await.map(|r| format!("{r:?}")))?;
            prop_assert!(matches!(store.claim(claim_req(1, 0)).await, Ok(idem_core::ClaimOutcome::Claimed(_))));
            Ok(())
        })?;
    }
}

/// The winner of claims of one key sent together, after checking that exactly one of them
/// got `Claimed` and every other saw the winner's record as it was written.
fn one_winner(outcomes: Vec<Result<ClaimOutcome, idem_core::StoreError>>) -> Record {
    let mut winners = Vec::new();
    let mut seen = Vec::new();
    for outcome in outcomes {
        match outcome.expect("claim") {
            ClaimOutcome::Claimed(r) => winners.push(r),
            ClaimOutcome::Existing { record, .. } => seen.push(record),
        }
    }
    assert_eq!(winners.len(), 1, "exactly one claim wins: {winners:?}");
    let winner = winners.remove(0);
    assert!(seen.iter().all(|r| *r == winner), "the others see the winner's record untouched: {seen:?}");
    winner
}

/// The expiry index entries of record `k`.
fn index_entries(store: &RedbStore, k: usize) -> Vec<i64> {
    use redb::{ReadableDatabase, ReadableTable};
    let db = store.database().expect("the database is open");
    let txn = db.begin_read().expect("read");
    let expiry = txn.open_table(idem_redb::table::EXPIRY).expect("expiry");
    let entries = expiry.iter().expect("iter").map(|e| e.expect("entry").0.value());
    entries.filter(|(_, of)| of == id(k).as_bytes()).map(|(at, _)| at).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_of_one_key_in_one_batch_have_one_winner_first_and_over_an_expired_record() {
    //! A claim is decided by an insert that hands back what it displaced (no read before
    //! it): of eight claims of one key in one batch, each with its own body, exactly one
    //! wins, the displaced winner goes back untouched with one index entry (also for a
    //! claim that meets it later), and a claim over an expired record takes the next
    //! generation's token and an empty journal.
    const N: usize = 8;
    let clock = ManualClock::new(UnixMillis(1_800_000_000_000));
    let file = tempfile::tempfile().expect("temporary file");
    let db = redb::Database::builder()
        .create_with_backend(redb::backends::FileBackend::new(file).expect("backend"))
        .expect("database");
    // Claim reads on (the default): every claim looks in a read transaction first, finds
    // nothing live, and goes to the writer, which takes all eight in one batch.
    let batch = BatchConfig::default().with_max_batch(N).with_full_batches(Duration::from_millis(200));
    let config = Config::default().with_clock(Arc::new(clock.clone())).with_batch(batch);
    let db = Arc::new(db);
    let store = RedbStore::from_database(Arc::clone(&db), config).expect("store");
    let race = || futures::future::join_all((0..N).map(|body| store.claim(claim_req(0, body as u8))));

    let first = one_winner(race().await);
    assert_eq!(store.get(id(0)).await.expect("get"), Some(first.clone()));
    assert_eq!(index_entries(&store, 0), [first.expires_at.0]);
    // A later claim that meets the live record in the writer (a store without claim reads),
    // in a batch that commits, leaves it and its one index entry as they were.
    clock.advance_ms(1);
    let writer_only = Config::default()
        .with_clock(Arc::new(clock.clone()))
        .with_claim_reads(false)
        .with_batch(BatchConfig::default().with_max_batch(2).with_full_batches(Duration::from_millis(200)));
    let other = RedbStore::from_database(db, writer_only).expect("second store");
    let (lost, won) = futures::join!(other.claim(claim_req(0, 0)), other.claim(claim_req(1, 0)));
    assert!(matches!(lost.expect("claim"), ClaimOutcome::Existing { record, .. } if record == first));
    assert!(matches!(won.expect("claim"), ClaimOutcome::Claimed(_)), "the batch wrote, so it committed");
    assert_eq!(index_entries(&store, 0), [first.expires_at.0], "no entry for the claim that lost");
    store.journal_put(id(0), first.token, NAMES[0], b"old".to_vec(), false).await.expect("journal put");

    clock.advance_ms(RETENTION.as_millis() as i64 - 1);
    let second = one_winner(race().await);
    assert_eq!(second.token, FencingToken::first_at(clock.now()).max(first.token.next()));
    assert_eq!(store.get(id(0)).await.expect("get"), Some(second.clone()));
    assert_eq!(index_entries(&store, 0), [second.expires_at.0], "the expired record's entry moved");
    assert_eq!(store.journal_get(id(0), NAMES[0]).await.expect("journal_get"), None, "a new generation's journal");
    let stats = store.batch_stats();
    assert_eq!((stats.batches, stats.claims_read), (3, 0), "{stats:?}");
}
