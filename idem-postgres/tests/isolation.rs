//! The store under `default_transaction_isolation = repeatable read` (and
//! `serializable`), set per connection in the URL (`options=-c ...`), as organisations set
//! it on roles. Nothing here changes the shared server's configuration.

mod common;

use std::sync::Arc;
use std::time::Duration;

use idem_core::{
    ClaimOutcome, ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, ReclaimOutcome, ReclaimRequest, Record, Scope,
    Store, StoredResponse,
};
use idem_postgres::deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use idem_postgres::{Config, PostgresStore, tokio_postgres};

use common::SchemaGuard;

/// `url()` with every connection defaulting to `level`.
fn url_at(level: &str) -> String {
    let base = common::url();
    let sep = if base.contains('?') { '&' } else { '?' };
    let level = level.replace(' ', "%5C%20");
    format!("{base}{sep}options=-c%20default_transaction_isolation%3D{level}")
}

/// A deadpool pool of the application's own, at `level`: the store cannot pin anything on it.
fn pool_at(level: &str) -> Pool {
    let pg: tokio_postgres::Config = url_at(level).parse().expect("url");
    let manager =
        Manager::from_config(pg, tokio_postgres::NoTls, ManagerConfig { recycling_method: RecyclingMethod::Fast });
    Pool::builder(manager).max_size(12).build().expect("pool")
}

async fn store_on_pool(level: &str, guard: &SchemaGuard) -> PostgresStore {
    let store = PostgresStore::from_pool(pool_at(level), Config::default().with_schema(&guard.name))
        .await
        .unwrap_or_else(|e| common::unreachable(&e));
    assert_eq!(store.isolation(), level, "the pool's connections run at {level}");
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
    let admin = common::raw().await;
    let xmin = format!("SELECT xmin::text FROM \"{}\".records WHERE id = $1", guard.name);
    let before: String = admin.query_one(&xmin, &[&&r.id.0[..]]).await.expect("xmin").get(0);

    // A transaction at REPEATABLE READ takes its snapshot before the retry's claim, the way
    // the handler's completion in its own transaction does.
    let mut holder = common::raw().await;
    let tx = holder
        .build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
        .start()
        .await
        .expect("begin");
    tx.query_one("SELECT 1", &[]).await.expect("snapshot");

    for _ in 0..3 {
        assert!(matches!(store.claim(claim_req("k")).await.expect("claim"), ClaimOutcome::Existing { .. }));
    }
    let after: String = admin.query_one(&xmin, &[&&r.id.0[..]]).await.expect("xmin").get(0);
    assert_eq!(before, after, "a claim of a live record wrote a new row version");

    // The completion's compare-and-set under the older snapshot goes through. It is sent by
    // hand: `complete_in` refuses a REPEATABLE READ transaction up front (a lease renewal
    // would conflict with it; tests/complete_in_isolation.rs), and what is pinned here is
    // that the claims left nothing for this statement to conflict with.
    let bytes = idem_core::codec::encode_response(&response());
    let token = i64::try_from(r.token.0).expect("token");
    let done = tx
        .query_opt(store.statements().complete(), &[&&r.id.0[..], &token, &bytes, &None::<i64>])
        .await
        .expect("complete under the old snapshot");
    assert!(done.is_some(), "the compare-and-set matched the claim");
    tx.commit().await.expect("commit");
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
                            id: c.id,
                            expected: r.token,
                            fingerprint: c.fingerprint,
                            lease_ttl: c.lease_ttl,
                            retention: c.retention,
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
    assert_eq!(store.isolation(), "read committed");
    let off = PostgresStore::connect(
        &url_at("serializable"),
        Config::default().with_schema(&guard.name).with_isolation_pin(false),
    )
    .await
    .expect("connect");
    assert_eq!(off.isolation(), "serializable", "with the pin off the URL's level stays");
}
