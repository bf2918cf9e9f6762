//! A gRPC service behind the layer lost its status on a replay (trailers were not stored),
//! and the layer's own answers were HTTP problem bodies a gRPC client cannot read. A real
//! tonic client over a socket: one execution and an identical reply on retry, and each
//! layer answer as its gRPC status.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idem_core::{
    Capabilities, ClaimOutcome, ClaimRequest, FencingToken, MemoryStore, ReclaimOutcome, ReclaimRequest, Record,
    RecordId, Store, StoreError, StoredResponse, SweepOutcome,
};
use idem_example_grpc::{CreateWorker, Workers, WorkersClient, key_from_message, router};
use idem_http::IdempotencyLayer;
use tonic::Code;

async fn serve(workers: Workers, layer: IdempotencyLayer) -> WorkersClient {
    let app = router(workers, layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    WorkersClient::connect(format!("http://{addr}")).await.expect("connect")
}

fn msg(name: &str) -> CreateWorker {
    CreateWorker { name: name.into(), size: "large".into() }
}

fn memory() -> IdempotencyLayer {
    IdempotencyLayer::new(Arc::new(MemoryStore::new()))
}

/// A retried unary RPC ran twice, or its replay differed in message or status.
#[tokio::test]
async fn a_retried_create_runs_once_and_replays_message_and_status() {
    let workers = Workers::new();
    let mut client = serve(workers.clone(), memory()).await;
    let first = client.create(msg("gpu-7"), Some("k-1"), Some("ops")).await.expect("first call");
    assert!(first.metadata().get("idempotent-replayed").is_none());
    let retry = client.create(msg("gpu-7"), Some("k-1"), Some("ops")).await.expect("retry: grpc-status 0 replayed");
    assert_eq!(retry.metadata().get("idempotent-replayed").map(|v| v.to_str().unwrap()), Some("true"));
    assert_eq!(retry.get_ref(), first.get_ref());
    assert_eq!(workers.executions(), 1);
    // Another key is another operation.
    let other = client.create(msg("gpu-7"), Some("k-2"), Some("ops")).await.expect("other key");
    assert_eq!(other.get_ref().id, 2);
}

/// A lasting gRPC error (INVALID_ARGUMENT) is stored and replayed with its status and
/// message; the replay says so in metadata.
#[tokio::test]
async fn a_lasting_grpc_error_is_replayed_with_its_status() {
    let mut client = serve(Workers::new(), memory()).await;
    let first = client.create(msg(""), Some("k-empty"), Some("ops")).await.expect_err("empty name");
    assert_eq!(first.code(), Code::InvalidArgument);
    let retry = client.create(msg(""), Some("k-empty"), Some("ops")).await.expect_err("replayed");
    assert_eq!((retry.code(), retry.message()), (first.code(), first.message()));
    assert_eq!(retry.metadata().get("idempotent-replayed").map(|v| v.to_str().unwrap()), Some("true"));
}

/// In flight: a duplicate of a running call is ABORTED (retry the whole call later).
#[tokio::test]
async fn a_duplicate_of_a_running_call_is_aborted() {
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let workers = Workers::gated(Arc::clone(&gate));
    let client = serve(workers.clone(), memory()).await;
    let mut holder = client.clone();
    let first = tokio::spawn(async move { holder.create(msg("gpu-7"), Some("k-1"), Some("ops")).await });
    while workers.executions() == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let dup = client.clone().create(msg("gpu-7"), Some("k-1"), Some("ops")).await.expect_err("in flight");
    assert_eq!(dup.code(), Code::Aborted, "{dup:?}");
    assert_eq!(
        dup.metadata().get("idem-problem").unwrap().to_str().unwrap(),
        idem_http::ProblemKind::InFlight.type_uri()
    );
    assert_eq!(dup.metadata().get("x-should-retry").unwrap(), "true");
    gate.add_permits(1);
    first.await.expect("task").expect("first call");
    assert_eq!(workers.executions(), 1);
}

/// Mismatch: the same key with another message is FAILED_PRECONDITION, marked never-retry.
#[tokio::test]
async fn a_reused_key_is_failed_precondition() {
    let mut client = serve(Workers::new(), memory()).await;
    client.create(msg("gpu-7"), Some("k-1"), Some("ops")).await.expect("first");
    let other = client.create(msg("gpu-8"), Some("k-1"), Some("ops")).await.expect_err("mismatch");
    assert_eq!(other.code(), Code::FailedPrecondition, "{other:?}");
    assert!(other.message().contains("different request"), "{}", other.message());
    assert_eq!(other.metadata().get("x-should-retry").unwrap(), "false");
}

/// No key is INVALID_ARGUMENT; no principal is UNAUTHENTICATED.
#[tokio::test]
async fn a_missing_key_or_principal_is_refused_with_grpc_codes() {
    let workers = Workers::new();
    let mut client = serve(workers.clone(), memory()).await;
    let no_key = client.create(msg("gpu-7"), None, Some("ops")).await.expect_err("no key");
    assert_eq!(no_key.code(), Code::InvalidArgument, "{no_key:?}");
    let bad_key = client.create(msg("gpu-7"), Some("with space"), Some("ops")).await.expect_err("bad key");
    assert_eq!(bad_key.code(), Code::InvalidArgument, "{bad_key:?}");
    let anonymous = client.create(msg("gpu-7"), Some("k-1"), None).await.expect_err("no principal");
    assert_eq!(anonymous.code(), Code::Unauthenticated, "{anonymous:?}");
    assert_eq!(workers.executions(), 0);
}

/// A request over `max_request_body` is RESOURCE_EXHAUSTED, nothing claimed.
#[tokio::test]
async fn a_request_over_the_body_limit_is_resource_exhausted() {
    let workers = Workers::new();
    let mut client = serve(workers.clone(), memory().with_max_request_body(8)).await;
    let err = client.create(msg("a-name-longer-than-eight-bytes"), Some("k-1"), Some("ops")).await.expect_err("413");
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    assert_eq!(workers.executions(), 0);
}

/// A reply over `max_stored_body` reaches the first caller whole (message and status), and
/// its retry is ALREADY_EXISTS (done, reply not kept), never a second execution.
#[tokio::test]
async fn a_reply_that_was_not_retained_is_already_exists_on_retry() {
    let workers = Workers::new();
    let mut policy = idem_http::Policy::default();
    policy.max_stored_body = 4;
    let mut client = serve(workers.clone(), memory().with_policy(policy)).await;
    let first = client.create(msg("gpu-7"), Some("k-1"), Some("ops")).await.expect("first call, streamed");
    assert_eq!(first.get_ref().name, "gpu-7");
    let retry = client.create(msg("gpu-7"), Some("k-1"), Some("ops")).await.expect_err("not retained");
    assert_eq!(retry.code(), Code::AlreadyExists, "{retry:?}");
    assert_eq!(retry.metadata().get("x-should-retry").unwrap(), "false");
    assert_eq!(workers.executions(), 1);
}

/// The store is down: UNAVAILABLE, handler not run (fail closed).
#[tokio::test]
async fn an_unavailable_store_is_unavailable() {
    let workers = Workers::new();
    let mut client = serve(workers.clone(), IdempotencyLayer::new(Arc::new(Down))).await;
    let err = client.create(msg("gpu-7"), Some("k-1"), Some("ops")).await.expect_err("store down");
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert_eq!(err.metadata().get("x-should-retry").unwrap(), "true");
    assert_eq!(workers.executions(), 0);
}

/// A store whose every call fails as an unreachable server's would.
#[derive(Debug)]
struct Down;

fn down() -> StoreError {
    StoreError::unavailable("down", "connect", true, std::io::Error::from(std::io::ErrorKind::ConnectionRefused))
}

#[async_trait]
impl Store for Down {
    async fn claim(&self, _: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        Err(down())
    }
    async fn reclaim(&self, _: ReclaimRequest) -> Result<ReclaimOutcome, StoreError> {
        Err(down())
    }
    async fn complete(
        &self,
        _: RecordId,
        _: FencingToken,
        _: StoredResponse,
    ) -> Result<idem_core::Receipt, StoreError> {
        Err(down())
    }
    async fn extend(&self, _: RecordId, _: FencingToken, _: Duration) -> Result<idem_core::Receipt, StoreError> {
        Err(down())
    }
    async fn fail(&self, _: RecordId, _: FencingToken) -> Result<idem_core::Receipt, StoreError> {
        Err(down())
    }
    async fn get(&self, _: RecordId) -> Result<Option<Record>, StoreError> {
        Err(down())
    }
    async fn sweep(&self, _: usize) -> Result<SweepOutcome, StoreError> {
        Err(down())
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
    }
}

/// A key taken from the message was not read, so a client without metadata ran the RPC per
/// attempt; the application's event callback missed the replay.
#[tokio::test]
async fn a_key_from_the_message_replays_and_is_heard() {
    use idem_http::{DecisionKind, Step};
    let (workers, steps) = (Workers::new(), Arc::new(std::sync::Mutex::new(Vec::new())));
    let seen = Arc::clone(&steps);
    let layer = memory().with_key_source(key_from_message()).with_events(move |e| seen.lock().unwrap().push(e.step));
    let mut client = serve(workers.clone(), layer).await;
    let first = client.create(msg("gpu-9"), None, Some("ops")).await.expect("first call");
    let retry = client.create(msg("gpu-9"), None, Some("ops")).await.expect("retry");
    assert_eq!((retry.get_ref(), workers.executions()), (first.get_ref(), 1));
    assert!(retry.metadata().get("idempotent-replayed").is_some());
    let refused = client.create(msg(""), None, Some("ops")).await.expect_err("no name, no key");
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert_eq!(workers.executions(), 1);
    let decided: Vec<_> = steps
        .lock()
        .unwrap()
        .iter()
        .filter_map(|s| match s {
            Step::Decided(d) => Some(*d),
            _ => None,
        })
        .collect();
    assert_eq!(decided, [DecisionKind::Claimed, DecisionKind::Replayed, DecisionKind::Rejected]);
}
