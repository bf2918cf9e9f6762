//! The store under `default_transaction_isolation = repeatable read` (and
//! `serializable`), set per connection in the URL (`options=-c ...`), as organisations set
//! it on roles. Nothing here changes the shared server's configuration.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use idem_core::{
    ClaimOutcome, ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, ReclaimOutcome, ReclaimRequest, Record, Scope,
    Store, StoredResponse,
};
use idem_postgres::{Config, PostgresStore, Statement};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

use common::SchemaGuard;

/// `url()` with every connection defaulting to `level`.
fn url_at(level: &str) -> String {
    let base = common::url();
    let sep = if base.contains('?') { '&' } else { '?' };
    let level = level.replace(' ', "%5C%20");
    format!("{base}{sep}options=-c%20default_transaction_isolation%3D{level}")
}

/// The level a pooled connection's transactions run at.
async fn isolation(pool: &PgPool) -> String {
    sqlx::query_scalar("SELECT current_setting('transaction_isolation')").fetch_one(pool).await.expect("isolation")
}

/// A store on a pool of the application's own at `level`: the store cannot pin anything on it.
async fn store_on_pool(level: &str, guard: &SchemaGuard) -> PostgresStore {
    let pool = PgPoolOptions::new().max_connections(12).connect(&url_at(level)).await;
    let pool = pool.unwrap_or_else(|e| common::unreachable(&e));
    let store = PostgresStore::from_pool(pool, Config::default().with_schema(&guard.name))
        .await
        .unwrap_or_else(|e| common::unreachable(&e));
    assert_eq!(isolation(store.pool()).await, level, "the pool's connections run at {level}");
    store
}

fn claim_req(key: &str) -> ClaimRequest {
    let scope = Scope::new("p", Endpoint::new("POST", "/v1/workers")).expect("scope");
    ClaimRequest::new(
        scope,
        IdempotencyKey::parse(key.as_bytes()).expect("key"),
        Fingerprint::of_bytes(b"{}"),
        Duration::from_secs(300),
        Duration::from_secs(3600),
    )
}

fn response() -> StoredResponse {
    StoredResponse::new(201, vec![], b"{\"id\":1}".to_vec())
}

async fn must_claim(store: &impl Store, key: &str) -> Record {
    match store.claim(claim_req(key)).await.expect("claim") {
        ClaimOutcome::Claimed(r) => r,
        other => panic!("expected Claimed, got {other:?}"),
    }
}

// Regression: a claim that found a live record rewrote its row, so under REPEATABLE READ a
// complete whose snapshot predates that rewrite failed with SQLSTATE 40001, the record stayed
// in flight and the handler ran again after the lease. The claim must write nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_of_a_live_record_writes_no_row_version() {
    let guard = SchemaGuard::fresh().await;
    let store = store_on_pool("repeatable read", &guard).await;
    let r = must_claim(&store, "k").await;
    let mut admin = common::raw().await;
    let xmin = format!("SELECT xmin::text FROM \"{}\".records WHERE id = $1", guard.name);
    let id = &r.id.as_bytes()[..];
    let before: String = sqlx::query_scalar(&xmin).bind(id).fetch_one(&mut admin).await.expect("xmin");

    // A transaction at REPEATABLE READ takes its snapshot before the retry's claim, the way
    // the handler's completion in its own transaction does.
    let mut holder = common::raw().await;
    common::execute(&mut holder, "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT 1").await;

    for _ in 0..3 {
        assert!(matches!(store.claim(claim_req("k")).await.expect("claim"), ClaimOutcome::Existing { .. }));
    }
    let after: String = sqlx::query_scalar(&xmin).bind(id).fetch_one(&mut admin).await.expect("xmin");
    assert_eq!(before, after, "a claim of a live record wrote a new row version");

    // The completion's compare-and-set under the older snapshot goes through. It is sent by
    // hand: `complete_in` refuses a REPEATABLE READ transaction up front (a lease renewal
    // would conflict with it; tests/complete_in_isolation.rs), and what is pinned here is
    // that the claims left nothing for this statement to conflict with.
    let bytes = idem_core::codec::encode_response(&response());
    let token = i64::try_from(r.token.0).expect("token");
    let done = sqlx::query(store.sql(Statement::Complete))
        .bind(id)
        .bind(token)
        .bind(&bytes)
        .bind(None::<i64>)
        .fetch_optional(&mut holder)
        .await
        .expect("complete under the old snapshot");
    assert!(done.is_some(), "the compare-and-set matched the claim");
    common::execute(&mut holder, "COMMIT").await;
    assert_eq!(store.get(r.id).await.expect("get").expect("record").response, Some(response()));
}

// Regression: under REPEATABLE READ a compare-and-set whose row changed after its snapshot
// fails with 40001 instead of re-checking the row; the store must run it again (a fresh
// statement, a fresh snapshot) and report the real outcome, never the serialization error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_writers_under_repeatable_read_and_serializable_get_outcomes_not_errors() {
    for level in ["repeatable read", "serializable"] {
        let guard = SchemaGuard::fresh().await;
        let store = Arc::new(store_on_pool(level, &guard).await);
        for round in 0..20 {
            let key = format!("k{round}");
            let r = must_claim(store.as_ref(), &key).await;
            store.fail(r.id, r.token).await.expect("fail");
            // Eight reclaimers of the failed record and eight claimers race.
            let mut tasks = Vec::new();
            for i in 0..16 {
                let store = Arc::clone(&store);
                let key = key.clone();
                tasks.push(tokio::spawn(async move {
                    if i % 2 == 0 {
                        let c = claim_req(&key);
                        let req = ReclaimRequest {
                            id: c.id(),
                            expected: r.token,
                            fingerprint: c.fingerprint(),
                            lease_ttl: Duration::from_secs(300),
                            retention: Duration::from_secs(3600),
                        };
                        match store.reclaim(req).await {
                            Ok(ReclaimOutcome::Reclaimed(w)) => Ok(Some(w)),
                            Ok(ReclaimOutcome::Conflict { .. }) => Ok(None),
                            Err(e) => Err(e),
                        }
                    } else {
                        store.claim(claim_req(&key)).await.map(|_| None)
                    }
                }));
            }
            let mut winners = Vec::new();
            for t in tasks {
                match t.await.expect("task") {
                    Ok(Some(w)) => winners.push(w),
                    Ok(None) => {}
                    Err(e) => panic!("{level}: a racing store call failed instead of losing: {e}"),
                }
            }
            assert_eq!(winners.len(), 1, "{level}: exactly one reclaim wins");
            let w = &winners[0];
            // The winner completes while claims of the live record keep coming.
            let claims: Vec<_> = (0..8)
                .map(|_| {
                    let store = Arc::clone(&store);
                    let key = key.clone();
                    tokio::spawn(async move { store.claim(claim_req(&key)).await })
                })
                .collect();
            store.complete(w.id, w.token, response()).await.unwrap_or_else(|e| panic!("{level}: complete failed: {e}"));
            for c in claims {
                let outcome = c.await.expect("task").unwrap_or_else(|e| panic!("{level}: claim failed: {e}"));
                assert!(matches!(outcome, ClaimOutcome::Existing { .. }), "{level}: a live record was claimed again");
            }
        }
    }
}

// The store's own connections (connect) pin READ COMMITTED whatever the URL asks for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_pins_read_committed_over_the_url() {
    let guard = SchemaGuard::fresh().await;
    let store = PostgresStore::connect(&url_at("serializable"), Config::default().with_schema(&guard.name))
        .await
        .unwrap_or_else(|e| common::unreachable(&e));
    assert_eq!(isolation(store.pool()).await, "read committed");
    let off = PostgresStore::connect(
        &url_at("serializable"),
        Config::default().with_schema(&guard.name).with_isolation_pin(false),
    )
    .await
    .expect("connect");
    assert_eq!(isolation(off.pool()).await, "serializable", "with the pin off the URL's level stays");
}
