//! # idem-postgres
//!
//! An idem [`Store`](idem_core::Store) in PostgreSQL: a records table with three indices
//! (and a journal table for resumable handlers), every
//! operation one statement (one round trip on the common path), time from the server's
//! `clock_timestamp()`. Use it where a control plane already keeps its state in Postgres:
//! any number of API servers share the records, and a record lives in the same database
//! as the resources it guards.
//!
//! ```no_run
//! use std::time::Duration;
//! use idem_core::{ClaimOutcome, ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, Scope, Store, StoredResponse};
//! use idem_postgres::{PostgresConfig, PostgresStore, spawn_sweeper};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let store = PostgresStore::connect(
//!     "postgres://postgres@127.0.0.1:5432/test",
//!     PostgresConfig::default().with_schema("idem"),
//! )
//! .await?;
//! store.migrate().await?; // creates idem.records on first start; no-op afterwards
//! let _sweeper = spawn_sweeper(store.clone(), Duration::from_secs(60), 1_000);
//!
//! let scope = Scope::new("token:ml-eval", Endpoint::new("POST", "/v1/workers"))?;
//! let key = IdempotencyKey::parse(b"7c3f5d1e-91a4")?;
//! let req = ClaimRequest::new(scope, key, Fingerprint::of_bytes(b"{}"),
//!     Duration::from_secs(300), Duration::from_secs(86_400));
//! if let ClaimOutcome::Claimed(record) = store.claim(req).await? {
//!     // ... run the handler, then store its response under the fencing token:
//!     store.complete(record.id, record.token, StoredResponse::new(201, vec![], b"{}".to_vec())).await?;
//! }
//! # Ok(()) }
//! ```
//!
//! # Schema
//! `<schema>.records`, keyed by the 32-byte record id (`bytea` primary key: the scope
//! key), with an index on `expires_at` for the sweep and a partial index on
//! `lease_expires_at` of in-flight records. All times are `bigint` milliseconds since the
//! epoch, UTC. The table is created by versioned SQL migrations shipped in
//! `migrations/` and applied by [`PostgresStore::migrate`]; the schema name is
//! configurable ([`PostgresConfig::with_schema`]) and validated ([`validate_schema`]).
//! Responses are stored as `bytea`: a version byte and postcard, byte-exact.
//!
//! `<schema>.journal` (migration 2) holds the journal of resumable handlers' steps and
//! intents ([`Store::journal_put`](idem_core::Store::journal_put)): one row per (record
//! id, entry name), name and value `bytea`, a foreign key to `records` with `ON DELETE
//! CASCADE` so the sweep removes a record's entries in the same statement, and the
//! `created_at` of the record generation that wrote the row, so that a claim replacing an
//! expired record (an upsert, which no cascade sees) starts with an empty journal: rows of
//! an older generation read as absent and are overwritten by the next put.
//!
//! # Guarantees
//! The module docs of [`store`] say how each operation is one atomic statement (the
//! `INSERT ... ON CONFLICT DO UPDATE ... RETURNING (xmax = 0)` claim, compare-and-set
//! `UPDATE ... WHERE token = $2` for reclaim, complete and fail), and why no transaction is
//! held open across the handler. Driver failures become
//! [`StoreError::Unavailable`](idem_core::StoreError::Unavailable) with the driver's
//! error as `source` and `retryable` set by [`is_retryable_pg`]; the HTTP layer turns them
//! into 503 with `Retry-After` and never runs the handler without a claim.
//!
//! # Layout
//! - [`store`]: [`PostgresStore`], [`PostgresConfig`], the SQL ([`Statements`]) and the
//!   response encoding.
//! - [`schema`]: schema-name validation and the shipped [`MIGRATIONS`].
//! - [`error`]: [`Error`] (set-up failures) and the retryable classification.
//! - [`sweeper`]: [`spawn_sweeper`], the periodic bounded sweep.
//! - `migrations/*.sql`: the schema, one file per version.
//! - `tests/conformance.rs`: the shared conformance suite against a real server;
//!   `tests/postgres.rs`: backend-specific tests (connection loss, migrations, corrupt rows).
//! - `benches/claim_complete.rs`: library vs hand-sent statements, 1 and 32 callers.

pub mod error;
pub mod schema;
pub mod store;
pub mod sweeper;

pub use error::{Error, is_retryable_pg, is_retryable_pool};
pub use schema::{DEFAULT_SCHEMA, MIGRATIONS, Migration, validate_schema};
pub use store::{PostgresConfig, PostgresStore, RESPONSE_FORMAT_VERSION, Statements, decode_response, encode_response};
pub use sweeper::spawn_sweeper;

/// The driver crates, re-exported so callers building their own pool use the same versions.
pub use deadpool_postgres;
pub use tokio_postgres;
