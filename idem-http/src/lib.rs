//! # idem-http
//!
//! Tower middleware that makes retried HTTP requests safe: a client sends an
//! `Idempotency-Key` with a request that changes something, and every retry of it with the
//! same key gets the first attempt's response instead of doing the work again
//! (draft-ietf-httpapi-idempotency-key-header, Stripe's semantics). Records live in any
//! [`idem_core::Store`], scoped by principal and endpoint, the request fingerprinted so a
//! key reused for another request is a mismatch, never someone else's replay; what a
//! retry gets is [`idem_core::decide`]'s decision. While a handler runs, the layer renews
//! its lease, so a lease of seconds covers a long operation and a dead process frees its
//! key within one lease.
//!
//! ```
//! use std::sync::Arc;
//! use axum::{Router, body::Body, http::{Request, StatusCode}, routing::post};
//! use idem_core::MemoryStore;
//! use idem_http::IdempotencyLayer;
//! use tower::ServiceExt;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let app = Router::new()
//!     .route("/v1/workers", post(|| async {
//!         (StatusCode::CREATED, [("location", "/v1/workers/7")], r#"{"id":7}"#)
//!     }))
//!     .layer(IdempotencyLayer::new(Arc::new(MemoryStore::new())));
//!
//! let request = || Request::post("/v1/workers")
//!     .header("authorization", "Bearer token-of-ml-eval")
//!     .header("idempotency-key", "7c3f5d1e-91a4")
//!     .header("content-type", "application/json")
//!     .body(Body::from(r#"{"size":"large"}"#))
//!     .unwrap();
//!
//! let first = app.clone().oneshot(request()).await.unwrap();
//! assert_eq!(first.status(), StatusCode::CREATED);
//! let retry = app.oneshot(request()).await.unwrap();
//! assert_eq!(retry.status(), StatusCode::CREATED);
//! assert_eq!(retry.headers()["location"], "/v1/workers/7");
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//! # }
//! ```
//!
//! # Settings
//! The record rules (retention, lease TTL, which statuses are stored, what a stored
//! response keeps) are one [`Policy`] value, set with [`IdempotencyLayer::with_policy`];
//! every other setting is a `with_*` method of [`IdempotencyLayer`], whose docs list the
//! defaults. Durations are [`std::time::Duration`]; sizes are bytes.
//!
//! # Behaviour
//! Written once, in the repository's `docs/`, and pinned by this crate's tests:
//! - `docs/decision-table.md`: what each request gets (claim, replay, in flight, mismatch,
//!   reclaim, busy, store outages), the answers before the table, the problem types, the
//!   headers the layer writes, retry hints and gRPC answers;
//! - `docs/contract.md`: keys, principals, endpoints and fingerprints; what is stored and
//!   when (cacheable statuses, headers, bodies, failure marking, detached handlers); the
//!   lease TTL, how to pick it, and lease renewal; streamed responses, trailers and gRPC;
//!   sealed responses; sub-keys, steps and intents for handlers whose side effects must
//!   converge ([`IdempotencyContext::resumable`]);
//! - `docs/observability.md`: the `idempotency` span and the metrics;
//! - `docs/failures.md`: the failures the tests pin, one section each.
//!
//! # Features
//! | feature | default | what it adds | what it costs |
//! |---|---|---|---|
//! | `axum` | on | the endpoint from axum's `MatchedPath` (the route template); [`Problem`] as an axum response | the `axum` crate |
//! | `seal` | off | `IdempotencyLayer::with_sealing`: stored responses encrypted and bound to their record (`docs/contract.md#sealed-responses`) | `chacha20` and `ring` (through `idem-core/seal`); about 350 lines of `idem_core::seal` and 130 here (`src/store/sealed.rs`) |
//! | `grpc` | off | gRPC rendering (module `grpc`): only a lasting `grpc-status` is stored, a streamed response keeps its claim until its status, the layer answers gRPC statuses. Without it a gRPC request is plain HTTP to the layer: stored by its HTTP status (200 whatever its `grpc-status`) and answered with problem bodies | no crate; about 800 lines (`src/grpc/`) |
//! | `canonical-json` | off | `FingerprintMode::CanonicalJson`: a JSON body fingerprinted in its RFC 8785 form | `serde_json_canonicalizer` and `serde_json` (through `idem-core/canonical-json`); about 40 lines |
//! | `metrics` | off | counters and histograms through the `metrics` facade (`docs/observability.md`) | the `metrics` crate; about 200 lines (`src/store/timed.rs`, `src/observe.rs`) |
//!
//! # Layout
//! A request walks one pipeline (`pipeline/`), a file per step (`intake`, `acquire`, `run`
//! with `lease` and `future`, `capture`, `keep`: its module docs say what each does); its
//! one typed answer (`answer`: the handler's response, a replay or a refusal) is made a
//! response once, at the end, in `body`'s forms (passed through, buffered, or streamed
//! after a read prefix).
//! - [`IdempotencyLayer`] (`layer`) holds every setting and prepares the pipeline once per
//!   layer; `config` holds the setting types; [`Idempotency`] (`service`) is the service.
//! - `store/`: the layer's store, the given one behind single-purpose wrappers
//!   (deadlines, completion retries, sealing, metrics); [`deadline`]: their settings,
//!   [`StoreDeadlines`] and [`CompletionRetry`].
//! - [`principal`]: [`PrincipalResolver`], [`BearerToken`].
//! - [`problem`]: RFC 9457 bodies, [`ProblemKind`]; [`hints`]: [`RetryHints`].
//! - `context`: [`IdempotencyContext`], the request extension a claimed handler sees, and
//!   [`ResponseCaching`], the response extension it may set.
//! - `streaming` (when a storable response streams instead), `observe` (the span and the
//!   metrics), `headers` (header names, the HTTP-date, the fields a record keeps), `grpc/`
//!   (feature `grpc`: what is lasting, the answers as statuses, streamed responses).
//! - Re-exported from `idem_core`: [`Policy`], [`FingerprintMode`], and the resumable
//!   handler types [`Resumable`], [`SubKey`], [`Reconciled`], [`StepError`], [`LeaseWatch`].

/// A field-less enum whose variants each have a fixed name (`as_str`), written on the
/// variant's own line: `Variant => "name",`.
macro_rules! named_enum {
    ($(#[$meta:meta])* $vis:vis enum $name:ident { $($(#[$doc:meta])* $variant:ident => $str:literal,)+ }) => {
        $(#[$meta])*
        $vis enum $name {
            $($(#[$doc])* $variant,)+
        }

        impl $name {
            /// The name it has in the `decision`/`outcome` field and metric label.
            #[must_use]
            $vis const fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $str,)+
                }
            }
        }
    };
}

mod answer;
mod body;
mod config;
mod context;
pub mod deadline;
mod future;
#[cfg(feature = "grpc")]
pub mod grpc;
mod headers;
pub mod hints;
mod layer;
mod lease;
mod observe;
mod pipeline;
pub mod principal;
pub mod problem;
mod select;
mod service;
mod store;
mod streaming;

pub use body::ResponseBody;
pub use config::{HandlerExecution, KeyRequirement, LeaseRenewal, MismatchStatus, MissingPrincipal, StoreFailureMode};
pub use context::{IdempotencyContext, ResponseCaching};
pub use deadline::{CompletionRetry, StoreDeadlines};
pub use future::ResponseFuture;
#[cfg(feature = "grpc")]
pub use grpc::grpc_code_for;
pub use headers::{IDEMPOTENCY_KEY, IDEMPOTENCY_KEY_EXPIRES, IDEMPOTENT_REPLAYED, IDEMPOTENT_STORED};
pub use hints::{RetryHints, STRIPE_SHOULD_RETRY, X_SHOULD_RETRY};
pub use idem_core::resume::{LeaseWatch, Reconciled, Resumable, StepError, SubKey};
#[cfg(feature = "seal")]
pub use idem_core::seal::{Sealing, SealingKeys};
pub use idem_core::{FingerprintMode, Policy};
pub use layer::IdempotencyLayer;
pub use lease::LeaseDeadline;
pub use observe::{DecisionKind, Event, Outcome, Step};
pub use principal::{BearerToken, PrincipalResolver};
pub use problem::{DEFAULT_TYPE_BASE, PROBLEM_JSON, Problem, ProblemKind, set_type_base};
pub use select::{FingerprintBody, KeySource};
pub use service::Idempotency;

/// The README's example, compiled as a doctest so the registry page cannot drift from the
/// API.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
