//! `MySqlStore::complete_in`: the stored response commits or rolls back with the
//! handler's own transaction, a wrong token writes nothing, and a lease renewal committed
//! while the handler's transaction ran does not make the completion fail, at any
//! isolation level.

use std::time::Duration;

use idem_core::{
    ClaimOutcome, ClaimRequest, Endpoint, FencingToken, Fingerprint, IdempotencyKey, ManualClock, Record, RecordState,
    Scope, Store, StoreError, StoredResponse, UnixMillis,
};
use idem_mysql::sqlx::{self, Connection as _};

use crate::common;

fn req(key: &str) -> ClaimRequest {
    let scope = Scope::new("tenant-a", Endpoint::new("POST", "/v1/orders")).expect("principal");
    let key = IdempotencyKey::parse(key.as_bytes()).expect("key");
    ClaimRequest::new(scope, key, Fingerprint::of_bytes(b"{}"), Duration::from_secs(30), Duration::from_secs(3600))
}

async fn claimed(store: &impl Store, key: &str) -> Record {
    match store.claim(req(key)).await.expect("claim") {
        ClaimOutcome::Claimed(r) => r,
        other => panic!("expected Claimed, got {other:?}"),
    }
}

fn response() -> StoredResponse {
    StoredResponse::new(201, vec![("content-type".into(), b"application/json".to_vec())], b"{\"order\":7}".to_vec())
}

fn clock() -> ManualClock {
    ManualClock::new(UnixMillis(1_800_000_000_000))
}

/// A table of the handler's own, next to the store's.
async fn orders_table(pool: &sqlx::MySqlPool, prefix: &str) -> String {
    let name = format!("`{prefix}_orders`");
    let sql = format!("CREATE TABLE {name} (id INT PRIMARY KEY) ENGINE = InnoDB");
    sqlx::query(&sql).execute(pool).await.expect("orders table");
    name
}

async fn drop_table(pool: &sqlx::MySqlPool, name: &str) {
    let _ = sqlx::query(&format!("DROP TABLE IF EXISTS {name}")).execute(pool).await;
}

#[tokio::test]
async fn committed_with_the_handlers_writes() {
    let store = common::fresh_store(Some(clock()), 2).await;
    let pool = store.0.inner.pool().clone();
    let orders = orders_table(&pool, &store.0.guard.name).await;
    let r = claimed(&store, "commit").await;
    let mut tx = pool.begin().await.expect("begin");
    sqlx::query(&format!("INSERT INTO {orders} (id) VALUES (7)")).execute(&mut *tx).await.expect("order");
    let receipt = store.0.inner.complete_in(&mut tx, r.id, r.token, response()).await.expect("complete_in");
    assert_eq!(receipt.token, r.token);
    // Not visible before the commit.
    assert_eq!(store.get(r.id).await.expect("get").expect("live").state, RecordState::InFlight);
    tx.commit().await.expect("commit");
    let done = store.get(r.id).await.expect("get").expect("live");
    assert_eq!(done.state, RecordState::Completed);
    assert_eq!(done.response, Some(response()));
    let n: i64 = sqlx::query_scalar(&format!("SELECT COUNT(*) FROM {orders}")).fetch_one(&pool).await.expect("n");
    assert_eq!(n, 1);
    drop_table(&pool, &orders).await;
}

#[tokio::test]
async fn rolled_back_with_the_handlers_writes() {
    let store = common::fresh_store(Some(clock()), 2).await;
    let pool = store.0.inner.pool().clone();
    let orders = orders_table(&pool, &store.0.guard.name).await;
    let r = claimed(&store, "rollback").await;
    let mut tx = pool.begin().await.expect("begin");
    sqlx::query(&format!("INSERT INTO {orders} (id) VALUES (7)")).execute(&mut *tx).await.expect("order");
    store.0.inner.complete_in(&mut tx, r.id, r.token, response()).await.expect("complete_in");
    tx.rollback().await.expect("rollback");
    let back = store.get(r.id).await.expect("get").expect("live");
    assert_eq!(back.state, RecordState::InFlight);
    assert_eq!(back.token, r.token, "the claim still holds and can complete normally");
    store.complete(r.id, r.token, response()).await.expect("complete");
    let n: i64 = sqlx::query_scalar(&format!("SELECT COUNT(*) FROM {orders}")).fetch_one(&pool).await.expect("n");
    assert_eq!(n, 0);
    drop_table(&pool, &orders).await;
}

#[tokio::test]
async fn a_wrong_token_is_lease_lost_and_writes_nothing() {
    let store = common::fresh_store(Some(clock()), 2).await;
    let pool = store.0.inner.pool().clone();
    let r = claimed(&store, "wrong-token").await;
    let mut tx = pool.begin().await.expect("begin");
    let wrong = FencingToken(r.token.0 + 1);
    let err = store.0.inner.complete_in(&mut tx, r.id, wrong, response()).await.expect_err("lost");
    assert!(
        matches!(err, StoreError::LeaseLost { presented, current: Some(c), .. } if presented == wrong && c == r.token)
    );
    tx.commit().await.expect("commit");
    assert_eq!(store.get(r.id).await.expect("get").expect("live").state, RecordState::InFlight);
}

#[tokio::test]
async fn an_unknown_record_is_lease_lost() {
    let store = common::fresh_store(Some(clock()), 2).await;
    let mut tx = store.0.inner.pool().begin().await.expect("begin");
    let id = req("never-claimed").id();
    let err = store.0.inner.complete_in(&mut tx, id, FencingToken(1), response()).await.expect_err("lost");
    assert!(matches!(err, StoreError::LeaseLost { current: None, .. }), "{err:?}");
}

async fn renewal_during_the_handler(level: &str) {
    let store = common::fresh_store(Some(clock()), 3).await;
    let r = claimed(&store, "renewed").await;
    // The handler's transaction, on a connection of its own at `level`, reads first, so a
    // REPEATABLE READ snapshot is taken before the renewal commits.
    let mut conn = common::raw().await;
    common::execute(&mut conn, &format!("SET SESSION TRANSACTION ISOLATION LEVEL {level}")).await;
    let mut tx = conn.begin().await.expect("begin");
    let seen: i64 = sqlx::query_scalar(&format!("SELECT COUNT(*) FROM `{}_records`", store.0.guard.name))
        .fetch_one(&mut *tx)
        .await
        .expect("snapshot");
    assert_eq!(seen, 1);
    let renewed = store.extend(r.id, r.token, Duration::from_secs(60)).await.expect("renewal");
    let receipt = store.0.inner.complete_in(&mut tx, r.id, r.token, response()).await.expect("complete_in");
    assert_eq!(receipt.lease_expires_at, renewed.lease_expires_at, "the completion saw the renewal");
    tx.commit().await.expect("commit");
    assert_eq!(store.get(r.id).await.expect("get").expect("live").state, RecordState::Completed);
}

#[tokio::test]
async fn a_renewal_during_a_read_committed_handler_is_kept() {
    renewal_during_the_handler("READ COMMITTED").await;
}

#[tokio::test]
async fn a_renewal_during_a_repeatable_read_handler_is_kept() {
    renewal_during_the_handler("REPEATABLE READ").await;
}

#[tokio::test]
async fn a_renewal_during_a_serializable_handler_is_kept() {
    renewal_during_the_handler("SERIALIZABLE").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reclaim_waits_for_the_handlers_transaction() {
    let clock = clock();
    let store = common::fresh_store(Some(clock.clone()), 3).await;
    let r = claimed(&store, "held").await;
    let mut tx = store.0.inner.pool().begin().await.expect("begin");
    store.0.inner.complete_in(&mut tx, r.id, r.token, response()).await.expect("complete_in");
    // The lease ran out meanwhile; a retry's reclaim must wait for the row lock and then
    // see the completion, not take the record over.
    clock.advance(Duration::from_secs(60));
    let reclaim = {
        let store = store.clone();
        tokio::spawn(async move {
            let reclaim = idem_core::ReclaimRequest {
                id: r.id,
                expected: r.token,
                fingerprint: r.fingerprint,
                lease_ttl: Duration::from_secs(30),
                retention: Duration::from_secs(3600),
            };
            store.reclaim(reclaim).await
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!reclaim.is_finished(), "the reclaim waits for the row lock");
    tx.commit().await.expect("commit");
    match reclaim.await.expect("task").expect("reclaim") {
        idem_core::ReclaimOutcome::Conflict { current: Some(c), .. } => assert_eq!(c.state, RecordState::Completed),
        other => panic!("expected a conflict with the completed record, got {other:?}"),
    }
}
