//! TLS on both drivers against the real server: the store's own connections must be
//! encrypted when the caller asks for it (`sslmode=require`), and work as usual. The
//! project's test server uses Debian's self-signed certificate, so the connectors here
//! skip certificate verification; production passes a verifying connector.

mod common;

use std::time::Duration;

use idem_core::{ClaimOutcome, ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, Scope, Store, StoredResponse};
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
    let (client, conn) = tokio_postgres::connect(&common::url(), tokio_postgres::NoTls).await.expect("connect");
    tokio::spawn(conn);
    let row = client
        .query_one(
            "SELECT count(*) FILTER (WHERE s.ssl), count(*) FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
             WHERE a.application_name = $1",
            &[&app],
        )
        .await
        .expect("pg_stat_ssl");
    (row.get(0), row.get(1))
}

async fn round_trip<S: Store>(store: &S) {
    let ClaimOutcome::Claimed(rec) = store.claim(claim_req()).await.expect("claim") else { panic!("claimed") };
    store.complete(rec.id, rec.token, StoredResponse::new(201, vec![], b"made".to_vec())).await.expect("complete");
    let got = store.get(rec.id).await.expect("get").expect("record");
    let response = got.response.expect("response");
    assert_eq!(response.body_bytes().expect("decodes").as_deref(), Some(&b"made"[..]));
}

#[tokio::test]
async fn deadpool_connects_over_tls() {
    let guard = SchemaGuard::fresh().await;
    let app = format!("idem_tls_dp_{}", uuid::Uuid::new_v4().simple());
    let tls = native_tls::TlsConnector::builder().danger_accept_invalid_certs(true).build().expect("tls");
    let store = PostgresStore::connect_tls(
        &tls_url(&app),
        postgres_native_tls::MakeTlsConnector::new(tls),
        common::config(&guard.name, None, 2),
    )
    .await
    .expect("connect over TLS");
    round_trip(&store).await;
    let (encrypted, all) = sessions(&app).await;
    assert!(all >= 1, "the store holds no session named {app}");
    assert_eq!(encrypted, all, "a store session is not encrypted");
}

#[tokio::test]
async fn sqlx_connects_over_tls() {
    let guard = SchemaGuard::fresh().await;
    let app = format!("idem_tls_sqlx_{}", uuid::Uuid::new_v4().simple());
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(2).connect(&tls_url(&app)).await.expect("pool");
    let store = PostgresStore::from_sqlx(pool, common::config(&guard.name, None, 2)).await.expect("store");
    round_trip(&store).await;
    let (encrypted, all) = sessions(&app).await;
    assert!(all >= 1, "the store holds no session named {app}");
    assert_eq!(encrypted, all, "a store session is not encrypted");
}
