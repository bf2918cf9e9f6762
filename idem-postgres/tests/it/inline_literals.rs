//! Without prepared statements (PgBouncer in transaction mode) the store inlines every
//! value into the statement text: values full of quotes, backslashes, NUL bytes and
//! non-ASCII must round-trip unchanged whatever the session's string settings.

use crate::common;

use std::time::Duration;

use idem_core::{ClaimOutcome, ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, Scope, Store, StoredResponse};
use idem_postgres::{Config, PostgresStore};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use common::SchemaGuard;

// Pins: an inlined literal that depended on standard_conforming_strings (backslash escapes)
// or on quoting would corrupt or inject through the unnamed path; with the setting off
// every byte must still come back as written.
#[tokio::test]
async fn hostile_values_round_trip_with_standard_conforming_strings_off() {
    let guard = SchemaGuard::fresh().await;
    let options: PgConnectOptions = common::url().parse().expect("url");
    let options = options.options([("standard_conforming_strings", "off"), ("escape_string_warning", "off")]);
    let pool =
        PgPoolOptions::new().max_connections(2).connect_with(options).await.unwrap_or_else(|e| common::unreachable(&e));
    let on: (String,) = sqlx::query_as("SHOW standard_conforming_strings").fetch_one(&pool).await.expect("show");
    assert_eq!(on.0, "off", "the session runs with the setting off");
    let store =
        PostgresStore::from_pool(pool, Config::default().with_schema(&guard.name).with_prepared_statements(false))
            .await
            .expect("store");

    let principal = "o'; DROP TABLE x; -- \\' \\\\ \"q\" é 漢 $1 $$";
    let scope = Scope::new(principal, Endpoint::new("POST", "/v1/'\\")).expect("scope");
    let key = IdempotencyKey::parse(b"k'\\1$2").expect("key");
    let req = ClaimRequest::new(
        scope.clone(),
        key.clone(),
        Fingerprint::of_bytes(b"\0'\\\xff"),
        Duration::from_secs(300),
        Duration::from_secs(3600),
    );
    let ClaimOutcome::Claimed(record) = store.claim(req).await.expect("claim") else {
        panic!("a fresh key is claimed")
    };
    let body = b"\0\\x00'\\\\\xff\xfe".to_vec();
    let response = StoredResponse::new(201, vec![("x-h".into(), b"a'\\b\0".to_vec())], body);
    store.complete(record.id, record.token, response.clone()).await.expect("complete");

    let got = store.get(record.id).await.expect("get").expect("the record");
    assert_eq!(got.scope, scope);
    assert_eq!(got.key, key);
    assert_eq!(got.fingerprint, Fingerprint::of_bytes(b"\0'\\\xff"));
    assert_eq!(got.response, Some(response));
}
