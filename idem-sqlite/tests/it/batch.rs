//! Batch-level behaviour through the real store: operations pushed together share one
//! transaction because the writer lingers until the batch is full.

use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use idem_core::group_commit::BatchConfig;
use idem_core::{
    ClaimOutcome, ClaimRequest, Endpoint, FencingToken, Fingerprint, IdempotencyKey, ManualClock, Record, RecordState,
    Scope, Store, StoreError, StoredResponse, UnixMillis,
};
use idem_sqlite::{Config, SqliteStore};
use rusqlite::Connection;

struct Fixture {
    store: SqliteStore,
    _dir: tempfile::TempDir,
}

impl Fixture {
    /// Runs `sql` on the file through a second connection (triggers that fail the
    /// writer's statements or its commit).
    fn plant(&self, sql: &str) {
        Connection::open(self.store.path()).and_then(|c| c.execute_batch(sql)).expect("plant SQL");
    }

    async fn stored(&self, key: &str) -> Option<Record> {
        self.store.get(req(key).id()).await.expect("get")
    }
}

/// A store whose batches close only once `batch` operations are queued (or after 5 s).
fn fixture(batch: usize, adjust: impl FnOnce(Config) -> Config) -> Fixture {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = Config::default()
        .with_clock(Arc::new(ManualClock::new(UnixMillis(1_000_000))))
        .with_batch(BatchConfig::default().with_max_batch(batch).with_full_batches(Duration::from_secs(5)));
    let store = SqliteStore::open(dir.path().join("batch.sqlite3"), adjust(config)).expect("open");
    Fixture { store, _dir: dir }
}

fn req(key: &str) -> ClaimRequest {
    let scope = Scope::new("p", Endpoint::new("POST", "/e")).expect("scope");
    let key = IdempotencyKey::parse(key.as_bytes()).expect("key");
    ClaimRequest::new(scope, key, Fingerprint::of_bytes(b"b"), Duration::from_secs(5), Duration::from_secs(60))
}

fn claimed(outcome: &Result<ClaimOutcome, StoreError>) -> bool {
    matches!(outcome, Ok(ClaimOutcome::Claimed(_)))
}

#[tokio::test]
async fn operations_later_in_a_batch_see_earlier_ones() {
    let f = fixture(4, |c| c);
    let response = StoredResponse::new(201, vec![], b"{}".to_vec());
    let id = req("k").id();
    // The fixture's clock stands still: the claim takes the first token of its time.
    let token = FencingToken::first_at(UnixMillis(1_000_000));
    // `join!` polls in order, so the operations are queued in this order.
    let (first, second, complete, fail) = futures::join!(
        f.store.claim(req("k")),
        f.store.claim(req("k")),
        f.store.complete(id, token, response.clone()),
        // The completion above already ended the claim: a late fail is fenced.
        f.store.fail(id, token),
    );
    assert!(matches!(first, Ok(ClaimOutcome::Claimed(r)) if r.token == token));
    assert!(matches!(second, Ok(ClaimOutcome::Existing { record, .. }) if record.state == RecordState::InFlight));
    assert_eq!(complete.expect("complete").token, token);
    assert!(fail.expect_err("fenced").is_lease_lost());
    let stored = f.stored("k").await.expect("stored");
    assert_eq!((stored.state, stored.response), (RecordState::Completed, Some(response)));
    let stats = f.store.batch_stats();
    assert_eq!((stats.batches, stats.operations), (1, 4), "one batch: {stats:?}");
}

#[tokio::test]
async fn a_claim_whose_caller_gave_up_is_not_written() {
    //! A claim nobody waits for anymore must not block the client's retry for a lease.
    let f = fixture(2, |c| c);
    // Polled once (queued; the writer waits for a second operation), then dropped.
    assert!(f.store.claim(req("gone")).now_or_never().is_none());
    let kept = f.store.claim(req("kept")).await;
    assert!(f.stored("gone").await.is_none());
    assert!(claimed(&kept));
    assert_eq!(f.store.batch_stats().abandoned_claims, 1);
}

/// Claims `a`, `poison` and `b` in one batch, with a trigger that makes SQLite answer
/// the insert of `poison` with `RAISE(action)`.
async fn claims_around_a_poisoned_insert(action: &str) -> (Fixture, [Result<ClaimOutcome, StoreError>; 3]) {
    let f = fixture(3, |c| c);
    f.plant(&format!(
        "CREATE TRIGGER poison BEFORE INSERT ON idem_records WHEN NEW.key = 'poison' \
         BEGIN SELECT RAISE({action}, 'poisoned'); END;"
    ));
    let (a, p, b) = futures::join!(f.store.claim(req("a")), f.store.claim(req("poison")), f.store.claim(req("b")));
    assert_eq!(f.store.batch_stats().batches, 1, "the three claims shared one batch");
    (f, [a, p, b])
}

#[tokio::test]
async fn a_failed_statement_fails_only_its_caller() {
    //! A statement error SQLite undoes by itself (constraint, RAISE(ABORT)) must not
    //! take the other callers of the batch down with it.
    let (f, [a, p, b]) = claims_around_a_poisoned_insert("ABORT").await;
    assert!(claimed(&a));
    assert!(!p.expect_err("poisoned").is_retryable());
    assert!(claimed(&b));
    assert!(f.stored("a").await.is_some() && f.stored("b").await.is_some());
    assert!(f.stored("poison").await.is_none());
}

#[tokio::test]
async fn a_rolled_back_transaction_fails_every_caller_and_writes_nothing() {
    //! When SQLite rolls the whole transaction back mid-batch, outcomes already
    //! computed describe writes that are gone: nobody may hear "claimed".
    let (f, outcomes) = claims_around_a_poisoned_insert("ROLLBACK").await;
    for outcome in outcomes {
        let err = outcome.expect_err("whole batch failed");
        assert!(err.to_string().contains("group commit of 3 operations failed"), "{err}");
    }
    assert!(f.stored("a").await.is_none() && f.stored("b").await.is_none());
    // The connection is usable again: the next batch commits.
    let next = futures::join!(f.store.claim(req("a")), f.store.claim(req("b")), f.store.claim(req("c")));
    assert!(claimed(&next.0) && claimed(&next.1) && claimed(&next.2), "{next:?}");
}

#[tokio::test]
async fn a_failed_commit_fails_every_caller_and_writes_nothing() {
    //! A COMMIT that fails (here a deferred foreign key; the bundled SQLite enforces
    //! foreign keys by default) must reach every caller of the batch as an error, and
    //! leave none of the batch behind.
    let f = fixture(2, |c| c);
    f.plant(
        "CREATE TABLE parent (x INTEGER PRIMARY KEY);
         CREATE TABLE child (x INTEGER REFERENCES parent (x) DEFERRABLE INITIALLY DEFERRED);
         CREATE TRIGGER dangling AFTER INSERT ON idem_records WHEN NEW.key = 'dangling'
         BEGIN INSERT INTO child VALUES (42); END;",
    );
    let (a, d) = futures::join!(f.store.claim(req("a")), f.store.claim(req("dangling")));
    for outcome in [a, d] {
        let err = outcome.expect_err("commit failed");
        assert!(err.to_string().contains("failed at commit"), "{err}");
    }
    assert!(f.stored("a").await.is_none() && f.stored("dangling").await.is_none());
}
