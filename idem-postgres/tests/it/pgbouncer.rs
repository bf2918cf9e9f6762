//! PgBouncer in transaction mode (`scripts/pgbouncer`, 127.0.0.1:6401): why the store needs
//! `Config::with_prepared_statements(false)` there. The whole conformance suite through it
//! is in `conformance_pgbouncer*.rs`.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::{SchemaGuard, Via};
use idem_core::{ClaimOutcome, ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, Scope, Store, StoredResponse};

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

/// Runs 64 claim + complete cycles from 16 tasks; returns how many store calls failed.
async fn failures(store: Arc<dyn Store>) -> usize {
    let tasks: Vec<_> = (0..16)
        .map(|t| {
            let store = Arc::clone(&store);
            tokio::spawn(async move {
                let mut failed = 0;
                for i in 0..4 {
                    match store.claim(claim_req(&format!("k{t}-{i}"))).await {
                        Ok(ClaimOutcome::Claimed(r)) => {
                            if store.complete(r.id, r.token, StoredResponse::new(201, vec![], vec![])).await.is_err() {
                                failed += 1;
                            }
                        }
                        Ok(_) => {}
                        Err(_) => failed += 1,
                    }
                }
                failed
            })
        })
        .collect();
    let mut total = 0;
    for t in tasks {
        total += t.await.expect("task");
    }
    total
}

// Pins: behind PgBouncer in transaction mode (1.18), named prepared statements (the default)
// reach server connections that never prepared them and store calls fail; with prepared
// statements off, none does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn named_statements_fail_behind_pgbouncer_and_unnamed_ones_do_not() {
    let guard = SchemaGuard::fresh().await;
    // Migrate straight to the server first, so every run below starts on a ready schema.
    drop(common::store(Via::Direct, &guard.name, None, 2).await);

    let url = Via::PgBouncer.url();
    let named =
        idem_postgres::PostgresStore::connect(&url, common::config(&guard.name, None, 16).with_isolation_pin(false))
            .await
            .expect("connect through PgBouncer (scripts/pgbouncer)");
    let named: Arc<dyn Store> = Arc::new(named);
    assert!(failures(named).await > 0, "named prepared statements should break behind PgBouncer 1.18 transaction mode");

    let unnamed: Arc<dyn Store> = Arc::new(common::store(Via::PgBouncer, &guard.name, None, 16).await);
    assert_eq!(failures(unnamed).await, 0);
}
