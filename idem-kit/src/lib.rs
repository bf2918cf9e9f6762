//! # idem
//!
//! Safe retries for infrastructure APIs (deploy, provisioning, reboot, firmware flash), the
//! way payment APIs already have them: a client sends an `Idempotency-Key`; the server
//! claims it under the caller's principal and endpoint, fingerprints the request, runs the
//! handler once and replays the stored response to every retry.
//!
//! This crate is the one an application names: it re-exports what an application uses
//! from the workspace's crates, chosen by features.
//!
//! | feature | brings | crate |
//! |---|---|---|
//! | `axum` (default) | [`IdempotencyLayer`] and the HTTP settings | `idem-http` |
//! | `redb` | [`redb`]: the embedded store for a single-node agent | `idem-redb` |
//! | `sqlite` | [`sqlite`]: the embedded store several processes may share | `idem-sqlite` |
//! | `redis` | [`redis`]: the shared store on one Redis node (or a one-primary cluster) | `idem-redis` |
//! | `redis-cluster` | `redis` on a Redis Cluster too (`RedisStore::connect_cluster`) | `idem-redis`, feature `cluster` |
//! | `postgres` | [`postgres`]: the shared store in a team's database, on a `sqlx::PgPool` | `idem-postgres` |
//! | `mysql` | [`mysql`]: the shared store in MySQL 8 or MariaDB 10.11, on a `sqlx::MySqlPool` | `idem-mysql` |
//! | `dynamodb` | [`dynamodb`]: the shared store in one DynamoDB table, on the official AWS SDK | `idem-dynamodb` |
//! | `client` | [`client`]: one key per operation, retries honouring `Retry-After` | `idem-client` |
//! | `seal` | sealed stored responses: `IdempotencyLayer::with_sealing`, `Sealing`, `SealingKeys` | `idem-http/seal` |
//! | `grpc` | gRPC rendering in the layer (without it gRPC is plain HTTP to the layer) | `idem-http/grpc` |
//! | `canonical-json` | `FingerprintMode::CanonicalJson` | `idem-core/canonical-json` |
//!
//! Always here: the [`Store`] contract and its types, the in-memory [`MemoryStore`], and
//! the [`Sweeper`] that removes expired records from any store.
//!
//! ```no_run
//! use std::sync::Arc;
//! use axum::{Router, routing::post};
//! use idem_kit::{IdempotencyLayer, MemoryStore, SweepConfig, Sweeper};
//!
//! # #[tokio::main] async fn main() {
//! let store = Arc::new(MemoryStore::new());
//! let _sweeper = Sweeper::start(store.clone(), SweepConfig::default());
//! let app: Router = Router::new()
//!     .route("/v1/workers", post(|| async { "created" }))
//!     .route_layer(IdempotencyLayer::new(store));
//! # }
//! ```
//!
//! The contract these crates implement is in the repository's `docs/` (contract, state
//! machine, decision table, failure catalogue).
//!
//! # Layout
//! - Crate root: the core types ([`Store`], [`StoreError`], [`Policy`], [`MemoryStore`],
//!   [`Sweeper`], keys, scopes, records) and, with `axum`, the layer and its settings.
//! - [`core`], [`http`]: the underlying crates whole, for what the root does not name.
//! - [`redb`], [`sqlite`], [`redis`], [`postgres`], [`mysql`], [`dynamodb`]: one module per
//!   store.
//! - [`client`]: the client side.

pub use idem_core as core;
pub use idem_core::{
    Capabilities, ClaimOutcome, ClaimRequest, Clock, Endpoint, FencingToken, Fingerprint, FingerprintMode,
    IdempotencyKey, ManualClock, MemoryStore, Policy, Principal, Record, RecordId, RecordState, Scope, Store,
    StoreError, StoredResponse, SweepConfig, Sweeper, SystemClock, UnixMillis,
};

#[cfg(feature = "axum")]
pub use idem_http as http;
#[cfg(feature = "axum")]
pub use idem_http::{
    BearerToken, CompletionRetry, HandlerExecution, IdempotencyContext, IdempotencyLayer, KeyRequirement,
    LeaseDeadline, LeaseRenewal, MismatchStatus, MissingPrincipal, PrincipalResolver, Problem, ProblemKind,
    ResponseCaching, Resumable, StoreDeadlines, StoreFailureMode, SubKey,
};
#[cfg(feature = "seal")]
pub use idem_http::{Sealing, SealingKeys};

/// The embedded redb store (feature `redb`): see [`idem_redb`].
#[cfg(feature = "redb")]
pub mod redb {
    pub use idem_redb::*;
}

/// The embedded SQLite store (feature `sqlite`): see [`idem_sqlite`].
#[cfg(feature = "sqlite")]
pub mod sqlite {
    pub use idem_sqlite::*;
}

/// The shared Redis store (feature `redis`): see [`idem_redis`].
#[cfg(feature = "redis")]
pub mod redis {
    pub use idem_redis::*;
}

/// The shared PostgreSQL store (feature `postgres`): see [`idem_postgres`].
#[cfg(feature = "postgres")]
pub mod postgres {
    pub use idem_postgres::*;
}

/// The shared MySQL and MariaDB store (feature `mysql`): see [`idem_mysql`].
#[cfg(feature = "mysql")]
pub mod mysql {
    pub use idem_mysql::*;
}

/// The shared DynamoDB store (feature `dynamodb`): see [`idem_dynamodb`].
#[cfg(feature = "dynamodb")]
pub mod dynamodb {
    pub use idem_dynamodb::*;
}

/// The client side (feature `client`): see [`idem_client`].
#[cfg(feature = "client")]
pub mod client {
    pub use idem_client::*;
}

/// The repository README's Rust examples, compiled as doctests so they cannot drift from
/// the API (they need the `redb`, `postgres` and `axum` features, which the workspace's
/// test run enables through the demo's dependency on this crate).
#[cfg(all(doctest, feature = "redb", feature = "postgres", feature = "axum"))]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;
