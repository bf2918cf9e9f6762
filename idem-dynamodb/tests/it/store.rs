//! DynamoDB-specific behaviour: the team's own `SdkConfig` with an endpoint override, a
//! missing table without auto-migrate, and a table with another key schema.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use idem_core::{ClaimOutcome, ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, ManualClock, Scope, Store};
use idem_dynamodb::aws_config::{self, BehaviorVersion, Region};
use idem_dynamodb::aws_sdk_dynamodb::config::Credentials;
use idem_dynamodb::aws_sdk_dynamodb::types::{
    AttributeDefinition, BillingMode, KeySchemaElement, KeyType, ScalarAttributeType,
};
use idem_dynamodb::{Config, DynamoStore, Error};

fn claim_req(key: &str) -> ClaimRequest {
    let scope = Scope::new(format!("dynamo-{}", uuid::Uuid::new_v4().simple()), Endpoint::new("POST", "/t"))
        .expect("principal");
    ClaimRequest::new(
        scope,
        IdempotencyKey::parse(key.as_bytes()).expect("key"),
        Fingerprint::of_bytes(b"body"),
        Duration::from_secs(10),
        Duration::from_secs(60),
    )
}

/// A store built from the application's own `SdkConfig` (credentials, region, endpoint
/// override, its HTTP client) claims and reads back.
#[tokio::test]
async fn the_applications_sdk_config_with_an_endpoint_override_works() {
    let sdk = aws_config::defaults(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .credentials_provider(Credentials::new("test", "test", None, None, "idem-tests"))
        .endpoint_url(common::url())
        .http_client(
            aws_smithy_http_client::Builder::new()
                .tls_provider(aws_smithy_http_client::tls::Provider::Rustls(
                    aws_smithy_http_client::tls::rustls_provider::CryptoMode::Ring,
                ))
                .build_https(),
        )
        .load()
        .await;
    let config = Config::default().with_table(common::fresh_table()).with_clock(Arc::new(ManualClock::starting_now()));
    let store = DynamoStore::from_sdk_config(&sdk, config)
        .await
        .unwrap_or_else(|e| panic!("DynamoDB at {} (run scripts/services): {e}", common::url()));
    let req = claim_req("k");
    let ClaimOutcome::Claimed(r) = store.claim(req.clone()).await.expect("claim") else { panic!("first claim") };
    assert_eq!(store.get(req.id()).await.expect("get"), Some(r));
}

/// Without auto-migrate a missing table is refused when the store is built, not retryable.
#[tokio::test]
async fn a_missing_table_is_refused_without_auto_migrate() {
    let config = Config::default().with_table(common::fresh_table()).with_auto_migrate(false);
    let e = DynamoStore::from_client(common::client(), config).await.expect_err("no such table");
    assert!(!e.is_retryable(), "{e}");
    assert_eq!(e.code(), Some("ResourceNotFoundException"), "{e:?}");
}

/// A table with another key schema is refused, with or without auto-migrate.
#[tokio::test]
async fn a_table_with_another_key_schema_is_refused() {
    let table = common::fresh_table();
    let client = common::client();
    client
        .create_table()
        .table_name(&table)
        .billing_mode(BillingMode::PayPerRequest)
        .key_schema(KeySchemaElement::builder().attribute_name("id").key_type(KeyType::Hash).build().expect("key"))
        .attribute_definitions(
            AttributeDefinition::builder()
                .attribute_name("id")
                .attribute_type(ScalarAttributeType::S)
                .build()
                .expect("attribute"),
        )
        .send()
        .await
        .unwrap_or_else(|e| panic!("DynamoDB at {} (run scripts/services): {e}", common::url()));
    for auto in [true, false] {
        let config = Config::default().with_table(&table).with_auto_migrate(auto);
        let e = DynamoStore::from_client(common::client(), config).await.expect_err("wrong key schema");
        assert!(matches!(e, Error::Table { .. }), "auto_migrate={auto}: {e:?}");
    }
    // Creating it again is idempotent and reports that it did not create it.
    let other = common::fresh_table();
    assert!(DynamoStore::migrate(&client, &other).await.expect("create"));
    assert!(!DynamoStore::migrate(&client, &other).await.expect("again"));
}
