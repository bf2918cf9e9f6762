//! Shared helpers of the DynamoDB integration tests: the endpoint, a clear failure when it
//! is down, and stores on fresh tables.

#![allow(dead_code, reason = "each module uses a different subset of these helpers")]
#![allow(unreachable_pub, reason = "test helper module, not a public API")]

use std::sync::Arc;

use idem_core::Clock;
use idem_dynamodb::aws_sdk_dynamodb::config::timeout::TimeoutConfig;
use idem_dynamodb::aws_sdk_dynamodb::config::{BehaviorVersion, Credentials, Region};
use idem_dynamodb::aws_sdk_dynamodb::{self, Client};
use idem_dynamodb::{Config, DynamoStore};

/// The endpoint every test talks to: `IDEM_DYNAMODB_URL`, default the `moto_server` that
/// `scripts/services` starts on `http://127.0.0.1:5005`.
pub fn url() -> String {
    std::env::var("IDEM_DYNAMODB_URL").unwrap_or_else(|_| "http://127.0.0.1:5005".to_owned())
}

/// A client for [`url`]: region `us-east-1`, the credentials of the environment when set,
/// else the emulator's dummy ones.
pub fn client() -> Client {
    let key = std::env::var("AWS_ACCESS_KEY_ID").unwrap_or_else(|_| "test".to_owned());
    let secret = std::env::var("AWS_SECRET_ACCESS_KEY").unwrap_or_else(|_| "test".to_owned());
    let config = aws_sdk_dynamodb::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .endpoint_url(url())
        .credentials_provider(Credentials::new(key, secret, None, None, "idem-tests"))
        // The HTTP scenarios run under a paused tokio clock, which jumps ahead whenever
        // every task waits: an SDK connect or read timeout would fire at once there.
        .timeout_config(TimeoutConfig::disabled())
        .http_client(
            aws_smithy_http_client::Builder::new()
                .tls_provider(aws_smithy_http_client::tls::Provider::Rustls(
                    aws_smithy_http_client::tls::rustls_provider::CryptoMode::Ring,
                ))
                .build_https(),
        )
        .build();
    Client::from_conf(config)
}

/// A fresh table name for one scenario.
pub fn fresh_table() -> String {
    format!("idem-test-{}", uuid::Uuid::new_v4().simple())
}

/// Opens a store on `table` (created when missing) with `clock`, or fails the test with
/// the start-up hint.
pub async fn open(table: &str, clock: Arc<dyn Clock>) -> DynamoStore {
    let config = Config::default().with_table(table).with_clock(clock);
    match DynamoStore::from_client(client(), config).await {
        Ok(store) => store,
        Err(e) => panic!(
            "DynamoDB is not reachable at {} ({e}). These tests need a DynamoDB endpoint: run scripts/services \
             (moto_server on 127.0.0.1:5005), or point IDEM_DYNAMODB_URL at one.",
            url()
        ),
    }
}
