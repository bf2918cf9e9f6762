//! TLS against the real server: the store's own connections must be encrypted when the URL
//! asks for it (`sslmode=require`), and work as usual. The project's test server uses
//! Debian's self-signed certificate, which `require` does not verify; production sets
//! `sslmode=verify-full` with `sslrootcert`.

use crate::common;

use std::time::Duration;

use idem_core::{ClaimOutcome, ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, Scope, Store as _, StoredResponse};
use idem_postgres::PostgresStore;

use common::SchemaGuard;

fn claim_req() -> ClaimRequest {
    ClaimRequest::new(
        Scope::new("p", Endpoint::new("POST", "/v1/workers")).expect("scope"),
        IdempotencyKey::parse(b"tls").expect("key"),
        Fingerprint::of_bytes(b"{}"),
        Duration::from_secs(30),
        Duration::from_secs(3600),
    )
}

/// `url` with `sslmode=require` and an `application_name` to find the store's sessions by.
fn tls_url(app: &str) -> String {
    let url = common::url();
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}sslmode=require&application_name={app}")
}

/// How many of the sessions named `app` are encrypted, and how many there are.
async fn sessions(app: &str) -> (i64, i64) {
    sqlx::query_as(
        "SELECT count(*) FILTER (WHERE s.ssl), count(*) FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
         WHERE a.application_name = $1",
    )
    .bind(app)
    .fetch_one(&mut common::raw().await)
    .await
    .expect("pg_stat_ssl")
}

// Pins: with `sslmode=require` in the URL, every session of the store's own pool is
// encrypted (sqlx's TLS feature, no connector to pass), and the store works as usual.
#[tokio::test]
async fn connect_with_sslmode_require_encrypts_every_session() {
    let guard = SchemaGuard::fresh().await;
    let app = format!("idem_tls_{}", uuid::Uuid::new_v4().simple());
    let store =
        PostgresStore::connect(&tls_url(&app), common::config(&guard.name, None, 2)).await.expect("connect over TLS");
    let ClaimOutcome::Claimed(rec) = store.claim(claim_req()).await.expect("claim") else { panic!("claimed") };
    store.complete(rec.id, rec.token, StoredResponse::new(201, vec![], b"made".to_vec())).await.expect("complete");
    let got = store.get(rec.id).await.expect("get").expect("record");
    let response = got.response.expect("response");
    assert_eq!(response.body_bytes().expect("decodes").as_deref(), Some(&b"made"[..]));
    let (encrypted, all) = sessions(&app).await;
    assert!(all >= 1, "the store holds no session named {app}");
    assert_eq!(encrypted, all, "a store session is not encrypted");
}
