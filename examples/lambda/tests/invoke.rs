//! The function invoked locally, as the Lambda runtime would: API Gateway events (HTTP API
//! v2 and REST v1) parsed by `lambda_http`, a Lambda context with a deadline, the router
//! called with `oneshot`, records in DynamoDB at `IDEM_DYNAMODB_URL` (default the
//! `moto_server` of `scripts/moto` on 127.0.0.1:5005), one fresh table per test. Without
//! an endpoint every test fails with the hint, never skips.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use http_body_util::BodyExt;
use idem_dynamodb::aws_sdk_dynamodb::config::{BehaviorVersion, Credentials, Region};
use idem_dynamodb::aws_sdk_dynamodb::{self, Client};
use idem_dynamodb::{Config, DynamoStore};
use idem_example_lambda::{Workers, app};
use lambda_http::{Context, RequestExt};
use tower::ServiceExt;

fn url() -> String {
    std::env::var("IDEM_DYNAMODB_URL").unwrap_or_else(|_| "http://127.0.0.1:5005".to_owned())
}

/// A client for [`url`] with the emulator's dummy credentials (the environment's when set).
fn client() -> Client {
    let key = std::env::var("AWS_ACCESS_KEY_ID").unwrap_or_else(|_| "test".to_owned());
    let secret = std::env::var("AWS_SECRET_ACCESS_KEY").unwrap_or_else(|_| "test".to_owned());
    let config = aws_sdk_dynamodb::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .endpoint_url(url())
        .credentials_provider(Credentials::new(key, secret, None, None, "idem-lambda-tests"))
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

/// The function on a fresh table, and its state.
async fn function() -> (Router, Workers) {
    let table = format!("idem-lambda-test-{}", uuid::Uuid::new_v4().simple());
    let store = match DynamoStore::from_client(client(), Config::default().with_table(table)).await {
        Ok(store) => store,
        Err(e) => panic!(
            "DynamoDB is not reachable at {} ({e}). These tests need a DynamoDB endpoint: run scripts/moto \
             (moto_server on 127.0.0.1:5005), or point IDEM_DYNAMODB_URL at one.",
            url()
        ),
    };
    let workers = Workers::default();
    (app(Arc::new(store), workers.clone()), workers)
}

/// Which API Gateway sends the event.
#[derive(Clone, Copy)]
enum Gateway {
    /// HTTP API, payload format 2.0.
    Http,
    /// REST API, payload format 1.0.
    Rest,
}

/// An API Gateway event for `POST /v1/workers` with this key and body, parsed as the
/// runtime does, with a Lambda context whose deadline is `left` from now.
fn invocation(gateway: Gateway, key: &str, body: &serde_json::Value, left: Duration) -> lambda_http::Request {
    slow_invocation(gateway, key, body, left, Duration::ZERO)
}

/// [`invocation`], its provisioning taking `provision`.
fn slow_invocation(
    gateway: Gateway,
    key: &str,
    body: &serde_json::Value,
    left: Duration,
    provision: Duration,
) -> lambda_http::Request {
    let headers = serde_json::json!({
        "authorization": "Bearer token-of-ml-eval",
        "content-type": "application/json",
        "idempotency-key": key,
        "x-provision-ms": provision.as_millis().to_string(),
    });
    let body = body.to_string();
    let event = match gateway {
        Gateway::Http => serde_json::json!({
            "version": "2.0", "routeKey": "POST /v1/workers", "rawPath": "/v1/workers", "rawQueryString": "",
            "headers": headers, "body": body, "isBase64Encoded": false,
            "requestContext": {
                "accountId": "123456789012", "apiId": "api", "domainName": "api.example.com",
                "domainPrefix": "api", "requestId": "req", "routeKey": "POST /v1/workers", "stage": "$default",
                "time": "05/Dec/2026:15:00:00 +0000", "timeEpoch": 1_796_482_800_000_u64,
                "http": { "method": "POST", "path": "/v1/workers", "protocol": "HTTP/1.1",
                          "sourceIp": "192.0.2.1", "userAgent": "idem-test" },
            },
        }),
        Gateway::Rest => serde_json::json!({
            "resource": "/v1/workers", "path": "/v1/workers", "httpMethod": "POST",
            "headers": headers,
            "multiValueHeaders": headers.as_object().unwrap().iter()
                .map(|(k, v)| (k.clone(), serde_json::json!([v]))).collect::<serde_json::Map<_, _>>(),
            "queryStringParameters": null, "multiValueQueryStringParameters": null, "pathParameters": null,
            "stageVariables": null, "body": body, "isBase64Encoded": false,
            "requestContext": {
                // No `stage`: lambda_http would put it before the path (`/prod/v1/workers`);
                // the README's deployment sets AWS_LAMBDA_HTTP_IGNORE_STAGE_IN_PATH instead.
                "accountId": "123456789012", "resourceId": "res", "requestId": "req",
                "identity": { "sourceIp": "192.0.2.1" }, "resourcePath": "/v1/workers",
                "httpMethod": "POST", "apiId": "api", "path": "/v1/workers",
            },
        }),
    };
    let request = lambda_http::request::from_str(&event.to_string()).expect("an API Gateway event");
    let deadline = SystemTime::now() + left;
    let mut context = Context::default();
    context.deadline = deadline.duration_since(UNIX_EPOCH).unwrap().as_millis() as u64;
    request.with_lambda_context(context)
}

/// A response read whole.
struct Got {
    status: u16,
    headers: axum::http::HeaderMap,
    body: serde_json::Value,
}

impl Got {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }
}

async fn invoke(function: &Router, request: lambda_http::Request) -> Got {
    let response = function.clone().oneshot(request).await.unwrap();
    let (parts, body) = response.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    let body = serde_json::from_slice(&bytes).unwrap_or_else(|_| panic!("a JSON body: {bytes:?}"));
    Got { status: parts.status.as_u16(), headers: parts.headers, body }
}

const MINUTE: Duration = Duration::from_secs(60);

/// The client lost the first answer and sent the request again: the retry gets the same
/// worker, replayed, and the handler ran once.
#[tokio::test]
async fn a_lost_response_is_replayed() {
    let (function, workers) = function().await;
    let spec = serde_json::json!({ "name": "ml-eval-1" });
    for gateway in [Gateway::Http, Gateway::Rest] {
        let key = format!("lost-{}", uuid::Uuid::new_v4());
        let first = invoke(&function, invocation(gateway, &key, &spec, MINUTE)).await;
        assert_eq!(first.status, 201, "{}", first.body);
        let retry = invoke(&function, invocation(gateway, &key, &spec, MINUTE)).await;
        assert_eq!((retry.status, &retry.body), (201, &first.body));
        assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    }
    assert_eq!((workers.runs(), workers.created()), (2, 2), "one run per key");
}

/// The runtime stopped the first invocation at its deadline, mid-provisioning: the retry
/// right after the deadline reclaims the record and runs (no 409 for the five-minute
/// lease), and exactly one worker is created.
#[tokio::test]
async fn a_retry_after_a_timeout_reclaims_at_once() {
    let (function, workers) = function().await;
    let key = format!("timeout-{}", uuid::Uuid::new_v4());
    let spec = serde_json::json!({ "name": "ml-eval-2" });
    let left = Duration::from_millis(1_500);
    let first = tokio::spawn({
        let request = slow_invocation(Gateway::Http, &key, &spec, left, Duration::from_secs(600));
        let function = function.clone();
        async move { invoke(&function, request).await }
    });
    tokio::time::sleep(left + Duration::from_millis(100)).await;
    // The runtime's kill: the invocation's answer never comes and it writes nothing (its
    // provisioning sleeps on in its task, like a frozen sandbox).
    first.abort();
    assert_eq!((workers.runs(), workers.created()), (1, 0));
    let retry = invoke(&function, invocation(Gateway::Http, &key, &spec, MINUTE)).await;
    assert_eq!(retry.status, 201, "the retry after the deadline runs at once: {}", retry.body);
    assert_eq!(retry.header("idempotent-replayed"), None);
    assert_eq!((workers.runs(), workers.created()), (2, 1));
    let replay = invoke(&function, invocation(Gateway::Http, &key, &spec, MINUTE)).await;
    assert_eq!((replay.status, &replay.body), (201, &retry.body));
    assert_eq!(workers.runs(), 2);
}

/// A retry while the first invocation still provisions gets 409 `in-flight` with
/// `Retry-After`, never a second worker; once the first answers, the retry is its replay.
#[tokio::test]
async fn an_in_flight_retry_gets_409_then_the_replay() {
    let (function, workers) = function().await;
    let key = format!("in-flight-{}", uuid::Uuid::new_v4());
    let spec = serde_json::json!({ "name": "ml-eval-3" });
    let first = tokio::spawn({
        let request = slow_invocation(Gateway::Http, &key, &spec, MINUTE, Duration::from_secs(2));
        let function = function.clone();
        async move { invoke(&function, request).await }
    });
    while workers.runs() == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let busy = invoke(&function, invocation(Gateway::Http, &key, &spec, MINUTE)).await;
    assert_eq!(busy.status, 409, "{}", busy.body);
    assert_eq!(busy.header("content-type"), Some("application/problem+json"));
    assert_eq!(busy.body["type"], idem_http::ProblemKind::InFlight.type_uri());
    assert!(busy.header("retry-after").is_some_and(|secs| secs.parse::<u64>().unwrap() >= 1));
    let first = first.await.unwrap();
    assert_eq!(first.status, 201);
    let replay = invoke(&function, invocation(Gateway::Http, &key, &spec, MINUTE)).await;
    assert_eq!((replay.status, &replay.body), (201, &first.body));
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!((workers.runs(), workers.created()), (1, 1));
}

/// The same key with another body is the layer's mismatch (409, problem+json), never a
/// second worker and never the first one's replay.
#[tokio::test]
async fn the_same_key_with_another_body_is_a_mismatch() {
    let (function, workers) = function().await;
    let key = format!("mismatch-{}", uuid::Uuid::new_v4());
    let first = invoke(&function, invocation(Gateway::Rest, &key, &serde_json::json!({ "name": "a" }), MINUTE)).await;
    assert_eq!(first.status, 201, "{}", first.body);
    let other = invoke(&function, invocation(Gateway::Rest, &key, &serde_json::json!({ "name": "b" }), MINUTE)).await;
    assert_eq!(other.status, 409, "{}", other.body);
    assert_eq!(other.header("content-type"), Some("application/problem+json"));
    assert_eq!(other.body["type"], idem_http::ProblemKind::Mismatch.type_uri());
    assert_eq!((workers.runs(), workers.created()), (1, 1));
}
