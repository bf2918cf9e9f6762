//! # idem-example-grpc
//!
//! A unary gRPC service (tonic) behind the same [`idem_http::IdempotencyLayer`] as the HTTP
//! routes: `idem.example.Workers/Create` creates a worker, once per idempotency key.
//!
//! - The client sends the key in the `idempotency-key` metadata entry and its token in
//!   `authorization` (`Bearer ...`), as gRPC metadata is HTTP/2 header fields.
//! - A retry with the same key gets the first attempt's reply message and `grpc-status`
//!   (trailers are stored and replayed), plus `idempotent-replayed: true` metadata.
//! - The layer's own answers are gRPC statuses, not problem bodies (a request is gRPC when
//!   its `content-type` starts with `application/grpc`); see
//!   [`idem_http::grpc_code_for`] for the mapping: in flight `ABORTED`, mismatch
//!   `FAILED_PRECONDITION`, missing or invalid key `INVALID_ARGUMENT`, store unavailable
//!   `UNAVAILABLE`.
//!
//! The messages derive [`prost::Message`] by hand (no `protoc` at build time); the
//! matching `.proto` is
//!
//! ```proto
//! package idem.example;
//! service Workers { rpc Create(CreateWorker) returns (Worker); }
//! message CreateWorker { string name = 1; string size = 2; }
//! message Worker { uint64 id = 1; string name = 2; string size = 3; }
//! ```
//!
//! # Layout
//! - [`router`]: the axum router serving the RPC over HTTP/2 behind the layer.
//! - [`key_from_message`]: the key taken from the request message instead of metadata.
//! - [`WorkersClient`]: a real tonic client ([`tonic::client::Grpc`] over a
//!   [`tonic::transport::Channel`]).
//! - `src/main.rs`: serves on a port and makes one call with a retry.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Router;
use http::uri::PathAndQuery;
use idem_http::IdempotencyLayer;
use tonic::codegen::BoxFuture;
use tonic::server::{Grpc, UnaryService};
use tonic::{Request, Response, Status};
use tonic_prost::ProstCodec;

/// The RPC's path (`/package.Service/Method`).
pub const CREATE_PATH: &str = "/idem.example.Workers/Create";

/// `CreateWorker` request message.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CreateWorker {
    /// The worker's name.
    #[prost(string, tag = "1")]
    pub name: String,
    /// Machine size, e.g. `large`.
    #[prost(string, tag = "2")]
    pub size: String,
}

/// `Worker` reply message.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Worker {
    /// Id given by the service: one per execution, so a replay shows the same id.
    #[prost(uint64, tag = "1")]
    pub id: u64,
    /// The worker's name.
    #[prost(string, tag = "2")]
    pub name: String,
    /// Machine size.
    #[prost(string, tag = "3")]
    pub size: String,
}

/// The service's state: how many times `Create` ran (an execution gives the next id).
#[derive(Clone, Debug, Default)]
pub struct Workers {
    executions: Arc<AtomicU64>,
    /// When set, `Create` waits here before answering (tests hold an attempt in flight).
    gate: Option<Arc<tokio::sync::Semaphore>>,
}

impl Workers {
    /// A service whose `Create` answers at once.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// A service whose `Create` waits for a permit of `gate` before answering.
    #[must_use]
    pub fn gated(gate: Arc<tokio::sync::Semaphore>) -> Self {
        Self { executions: Arc::default(), gate: Some(gate) }
    }

    /// How many times `Create` ran.
    #[must_use]
    pub fn executions(&self) -> u64 {
        self.executions.load(Ordering::SeqCst)
    }
}

impl UnaryService<CreateWorker> for Workers {
    type Response = Worker;
    type Future = BoxFuture<Response<Worker>, Status>;

    fn call(&mut self, request: Request<CreateWorker>) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            let msg = request.into_inner();
            if msg.name.is_empty() {
                // A lasting refusal: stored and replayed like a 4xx.
                return Err(Status::invalid_argument("name must not be empty"));
            }
            let id = this.executions.fetch_add(1, Ordering::SeqCst) + 1;
            if let Some(gate) = &this.gate {
                // The permit is only a signal; a closed semaphore just answers.
                drop(gate.acquire().await);
            }
            Ok(Response::new(Worker { id, name: msg.name, size: msg.size }))
        })
    }
}

/// A key source for clients that cannot set metadata: the key is `create-{name}` from the
/// `CreateWorker` message itself (one worker per name), read from the gRPC frame (a flag
/// byte, a 4-byte big-endian length, the message). A frame that is compressed or does not
/// decode has no key, and the call is answered `INVALID_ARGUMENT` like a missing key.
#[must_use]
pub fn key_from_message() -> idem_http::KeySource {
    idem_http::KeySource::from_fn(|_, body| {
        let (&[0, ..], Some(message)) = (body, body.get(5..)) else { return None };
        let msg = <CreateWorker as prost::Message>::decode(message).ok()?;
        (!msg.name.is_empty()).then(|| format!("create-{}", msg.name))
    })
}

/// The axum router serving `Workers/Create` (HTTP/2, as gRPC needs) behind `layer`.
pub fn router(workers: Workers, layer: IdempotencyLayer) -> Router {
    let rpc = tower::service_fn(move |req: http::Request<axum::body::Body>| {
        let workers = workers.clone();
        async move {
            let mut grpc = Grpc::new(ProstCodec::<Worker, CreateWorker>::default());
            Ok::<_, std::convert::Infallible>(grpc.unary(workers, req).await)
        }
    });
    Router::new().route_service(CREATE_PATH, rpc).layer(layer)
}

/// A tonic client for `Workers/Create`.
#[derive(Debug, Clone)]
pub struct WorkersClient {
    grpc: tonic::client::Grpc<tonic::transport::Channel>,
}

impl WorkersClient {
    /// Connects to `uri` (e.g. `http://127.0.0.1:50051`).
    ///
    /// # Errors
    /// The transport's error when the server cannot be reached.
    pub async fn connect(uri: String) -> Result<Self, tonic::transport::Error> {
        let channel = tonic::transport::Endpoint::from_shared(uri)?.connect().await?;
        Ok(Self { grpc: tonic::client::Grpc::new(channel) })
    }

    /// Calls `Create` with `idempotency-key: key` and `authorization: Bearer token` metadata
    /// (either left out when `None`).
    ///
    /// # Errors
    /// The call's gRPC status when it is not `OK`.
    pub async fn create(
        &mut self,
        msg: CreateWorker,
        key: Option<&str>,
        token: Option<&str>,
    ) -> Result<Response<Worker>, Status> {
        let mut request = Request::new(msg);
        if let Some(key) = key {
            request.metadata_mut().insert("idempotency-key", key.parse().map_err(|_| Status::invalid_argument("key"))?);
        }
        if let Some(token) = token {
            let value = format!("Bearer {token}").parse().map_err(|_| Status::invalid_argument("token"))?;
            request.metadata_mut().insert("authorization", value);
        }
        self.grpc.ready().await.map_err(|e| Status::unavailable(e.to_string()))?;
        self.grpc.unary(request, PathAndQuery::from_static(CREATE_PATH), ProstCodec::default()).await
    }
}
