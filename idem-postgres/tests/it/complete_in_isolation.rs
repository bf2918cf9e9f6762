//! `complete_in` on a database whose default isolation is REPEATABLE READ, as organisations
//! set it: the handler's transaction then runs at REPEATABLE READ unless it asks otherwise,
//! while the layer renews the lease from another connection. Each test creates a private
//! database with `ALTER DATABASE ... SET default_transaction_isolation` and drops it; the
//! shared `test` database is never altered.

use crate::common;

use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idem_core::{
    ClaimOutcome, ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, Receipt, ReclaimOutcome, ReclaimRequest, Record,
    RecordState, Scope, Store, StoreError, StoredResponse, UnixMillis,
};
use idem_postgres::{Config, PostgresStore};

const LEASE: Duration = Duration::from_secs(30);

/// A database of its own whose sessions default to REPEATABLE READ; dropped (with any
/// session still on it) when the guard goes.
struct RepeatableReadDb {
    name: String,
}

impl RepeatableReadDb {
    async fn create() -> Self {
        let secs = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO).as_secs();
        let rand = uuid::Uuid::new_v4().simple().to_string();
        let name = format!("{}rr_{secs}_{}", common::SCHEMA_PREFIX, &rand[..12]);
        let mut admin = common::raw().await;
        // template0 accepts no connections, so no other session can make the copy fail.
        common::execute(&mut admin, &format!("CREATE DATABASE \"{name}\" TEMPLATE template0")).await;
        common::execute(
            &mut admin,
            &format!("ALTER DATABASE \"{name}\" SET default_transaction_isolation = 'repeatable read'"),
        )
        .await;
        Self { name }
    }

    /// The application's pool on this database: no option pins anything.
    async fn pool(&self) -> sqlx::PgPool {
        let options = sqlx::postgres::PgConnectOptions::from_str(&common::url()).expect("url").database(&self.name);
        sqlx::postgres::PgPoolOptions::new().max_connections(4).connect_with(options).await.expect("sqlx pool")
    }

    /// A store on the pool, and the handler's table.
    async fn store(&self) -> (sqlx::PgPool, PostgresStore) {
        let pool = self.pool().await;
        let store = PostgresStore::from_pool(pool.clone(), Config::default()).await.expect("store");
        let isolation: String = sqlx::query_scalar("SELECT current_setting('transaction_isolation')")
            .fetch_one(&pool)
            .await
            .expect("isolation");
        assert_eq!(isolation, "repeatable read", "the database's default reaches the pool's sessions");
        sqlx::raw_sql("CREATE TABLE handler_rows (op text NOT NULL)").execute(&pool).await.expect("table");
        (pool, store)
    }
}

impl Drop for RepeatableReadDb {
    fn drop(&mut self) {
        // As `SchemaGuard`: async work on a thread of its own, since Drop may run on (or
        // after) the test's runtime. FORCE ends the pools' sessions still open on it.
        let sql = format!("DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)", self.name);
        if !common::execute_on_a_thread_of_its_own(sql) {
            eprintln!("warning: could not drop test database {}; drop it by hand", self.name);
        }
    }
}

fn claim_req() -> ClaimRequest {
    ClaimRequest::new(
        Scope::new("p", Endpoint::new("POST", "/v1/workers")).expect("scope"),
        IdempotencyKey::parse(b"k").expect("key"),
        Fingerprint::of_bytes(b"{}"),
        LEASE,
        Duration::from_secs(3600),
    )
}

fn response() -> StoredResponse {
    StoredResponse::new(201, vec![], b"{\"id\":1}".to_vec())
}

async fn must_claim(store: &impl Store) -> Record {
    match store.claim(claim_req()).await.expect("claim") {
        ClaimOutcome::Claimed(r) => r,
        other => panic!("expected Claimed, got {other:?}"),
    }
}

/// The refusal `complete_in` must give a transaction at `level`: the typed error, not a
/// serialization failure, and not retryable.
fn assert_refused(result: Result<Receipt, StoreError>, level: &str) {
    let e = match result {
        Err(e @ StoreError::Unavailable { .. }) => e,
        other => panic!("{level}: expected complete_in to be refused with IsolationNotSupported, got {other:?}"),
    };
    let ours = std::error::Error::source(&e).and_then(|s| s.downcast_ref::<idem_postgres::Error>());
    match ours {
        Some(idem_postgres::Error::IsolationNotSupported { level: found }) => assert_eq!(found, level),
        _ => panic!("{level}: expected complete_in to be refused with IsolationNotSupported, got {e:?}"),
    }
    assert!(!e.is_retryable(), "{level}: the same transaction setup fails the same way");
    let message = e.to_string();
    assert!(message.contains("READ COMMITTED") && message.contains("renewal"), "{message}");
}

/// After a refusal and the handler's rollback: the record is the renewed claim, untouched
/// by the completion (in flight, same token, no response), and the handler's row is gone.
async fn assert_untouched(store: &impl Store, claim: &Record, renewed_until: UnixMillis, handler_rows: i64) {
    let now = store.get(claim.id).await.expect("get").expect("record");
    assert_eq!((now.state, now.token, now.response), (RecordState::InFlight, claim.token, None));
    assert_eq!(now.lease_expires_at, renewed_until, "the renewal that committed meanwhile stands");
    assert_eq!(handler_rows, 0, "the handler's rows rolled back with the refused completion");
}

// Regression: complete_in under REPEATABLE READ failed with a serialization error whenever
// the lease renewal committed during the handler's transaction (SQLSTATE 40001 from the
// completion's UPDATE of a row changed after the snapshot), so it worked or not depending on
// how long the handler ran. It must be refused, every time, with the typed error that says
// why, leaving the record as the renewal left it; and a transaction that asks for READ
// COMMITTED on the same database completes despite a renewal in the middle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn complete_in_on_a_repeatable_read_database_is_refused_with_a_typed_error() {
    let db = RepeatableReadDb::create().await;
    let (pool, store) = db.store().await;
    let count = "SELECT count(*) FROM handler_rows";
    let r = must_claim(&store).await;

    // The handler's transaction at the database's default; its first statement takes the
    // snapshot. Then the layer's renewal commits on the record from another connection.
    let mut tx = pool.begin().await.expect("begin");
    sqlx::query("INSERT INTO handler_rows (op) VALUES ('a')").execute(&mut *tx).await.expect("handler row");
    let renewed = store.extend(r.id, r.token, LEASE).await.expect("renewal");
    assert_refused(store.complete_in(&mut tx, r.id, r.token, response()).await, "repeatable read");
    tx.rollback().await.expect("rollback");
    let rows: i64 = sqlx::query_scalar(count).fetch_one(&pool).await.expect("count");
    assert_untouched(&store, &r, renewed.lease_expires_at, rows).await;

    // From here on the statement goes as PgBouncer users send it (inlined literals over the
    // simple query protocol), which must refuse and complete the same way.
    let unnamed =
        PostgresStore::from_pool(pool.clone(), Config::default().with_prepared_statements(false)).await.expect("store");

    // SERIALIZABLE is refused the same way, with no renewal needed to see it.
    let mut tx = pool.begin_with("BEGIN ISOLATION LEVEL SERIALIZABLE").await.expect("begin");
    sqlx::query("INSERT INTO handler_rows (op) VALUES ('b')").execute(&mut *tx).await.expect("handler row");
    assert_refused(unnamed.complete_in(&mut tx, r.id, r.token, response()).await, "serializable");
    tx.rollback().await.expect("rollback");

    // The fix the error names: the transaction asks for READ COMMITTED. A renewal commits
    // between the handler's write and the completion, and both commit together.
    let mut tx = pool.begin_with("BEGIN ISOLATION LEVEL READ COMMITTED").await.expect("begin");
    sqlx::query("INSERT INTO handler_rows (op) VALUES ('c')").execute(&mut *tx).await.expect("handler row");
    store.extend(r.id, r.token, LEASE).await.expect("renewal");
    let done = unnamed.complete_in(&mut tx, r.id, r.token, response()).await.expect("complete_in at READ COMMITTED");
    tx.commit().await.expect("commit");
    let now = store.get(r.id).await.expect("get").expect("record");
    assert_eq!(done, Receipt::of(&now), "the receipt reports the record as written");
    assert_eq!((now.state, now.token), (RecordState::Completed, r.token));
    assert_eq!((now.state, now.response), (RecordState::Completed, Some(response())));
    let rows: i64 = sqlx::query_scalar(count).fetch_one(&pool).await.expect("count");
    assert_eq!(rows, 1, "only the READ COMMITTED attempt's row committed");
    pool.close().await;
}

// Regression: complete_in under REPEATABLE READ failed with a serialization error whenever
// the lease renewal committed during the handler's transaction. After the refusal the record
// stays in flight under its owner, who can fail it so the client's retry reclaims it and,
// in a READ COMMITTED transaction, completes despite a renewal in the middle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_completion_leaves_the_claim_to_fail_and_the_retry_completes() {
    let db = RepeatableReadDb::create().await;
    let (pool, store) = db.store().await;
    let count = "SELECT count(*) FROM handler_rows";
    let r = must_claim(&store).await;

    let mut tx = pool.begin().await.expect("begin");
    sqlx::query("INSERT INTO handler_rows (op) VALUES ('a')").execute(&mut *tx).await.expect("handler row");
    let renewed = store.extend(r.id, r.token, LEASE).await.expect("renewal");
    assert_refused(store.complete_in(&mut tx, r.id, r.token, response()).await, "repeatable read");
    tx.rollback().await.expect("rollback");
    let rows: i64 = sqlx::query_scalar(count).fetch_one(&pool).await.expect("count");
    assert_untouched(&store, &r, renewed.lease_expires_at, rows).await;

    // What the layer does with a handler that did not complete: fail the record, so the
    // retry reclaims it at once rather than after the lease.
    store.fail(r.id, r.token).await.expect("fail");
    let req = ReclaimRequest {
        id: r.id,
        expected: r.token,
        fingerprint: r.fingerprint,
        lease_ttl: LEASE,
        retention: Duration::from_secs(3600),
    };
    let ReclaimOutcome::Reclaimed(retry) = store.reclaim(req).await.expect("reclaim") else { panic!("reclaimed") };

    // The retry's transaction asks for READ COMMITTED and completes, renewal and all.
    let mut tx = pool.begin_with("BEGIN ISOLATION LEVEL READ COMMITTED").await.expect("begin");
    sqlx::query("INSERT INTO handler_rows (op) VALUES ('b')").execute(&mut *tx).await.expect("handler row");
    store.extend(retry.id, retry.token, LEASE).await.expect("renewal");
    store.complete_in(&mut tx, retry.id, retry.token, response()).await.expect("complete_in at READ COMMITTED");
    tx.commit().await.expect("commit");
    let now = store.get(r.id).await.expect("get").expect("record");
    assert_eq!((now.state, now.token, now.response), (RecordState::Completed, retry.token, Some(response())));
    let rows: i64 = sqlx::query_scalar(count).fetch_one(&pool).await.expect("count");
    assert_eq!(rows, 1, "only the retry's row committed");
    pool.close().await;
}
