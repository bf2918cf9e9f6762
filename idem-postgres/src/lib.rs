#![doc = include_str!("../README.md")]
//!
//! Any number of API servers share the records, and a record lives in the same database
//! as the resources it guards. Every operation is one statement (one round trip on the
//! common path), and time comes from the server's `clock_timestamp()`.
//!
//! Build it with [`PostgresStore::connect`] (a URL) or [`PostgresStore::from_pool`] (the
//! application's own deadpool `Pool`), and a [`Config`] from `Config::default()` and its
//! `with_*` methods. Either constructor migrates the schema first unless
//! [`Config::with_auto_migrate`] is off.
//!
//! # Schema
//! `<schema>.records`, keyed by the 32-byte record id (`bytea` primary key: the scope
//! key), with an index on `expires_at` for the sweep and a partial index on
//! `lease_expires_at` of in-flight records. All times are `bigint` milliseconds since the
//! epoch, UTC. The table is created by versioned SQL migrations shipped in
//! `migrations/` and applied by [`PostgresStore::migrate`], which building a store runs
//! unless [`Config::with_auto_migrate`] is off; the schema name is configurable
//! ([`Config::with_schema`]) and validated ([`validate_schema`]).
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
//! [`PostgresStore`]'s docs say how each operation is one atomic statement (the
//! `INSERT ... ON CONFLICT DO UPDATE ... RETURNING (xmax = 0)` claim, compare-and-set
//! `UPDATE ... WHERE token = $2` for reclaim, complete, extend and fail), and why no
//! transaction is held open across the handler. Driver failures become
//! [`StoreError::Unavailable`](idem_core::StoreError::Unavailable) with this crate's
//! [`Error`] as `source` (the driver's error as its `source`) and `retryable` set by
//! [`Error::is_retryable`] ([`is_retryable_pg`] for driver errors); the HTTP layer turns
//! them into 503 with `Retry-After` and never runs the handler without a claim.
//!
//! # Lease renewal
//! [`Store::extend`](idem_core::Store::extend) is one compare-and-set `UPDATE` like
//! complete: where the row is live, in flight and carries the token, `lease_expires_at =
//! GREATEST(lease_expires_at, now + lease)` and `expires_at = GREATEST(expires_at,
//! lease_expires_at)`, so a renewed claim is never swept while its lease runs. A refusal
//! reads the row in a fresh statement for the current token
//! ([`StoreError::LeaseLost`](idem_core::StoreError::LeaseLost)), as complete and fail do.
//!
//! # Fencing tokens and the server's clock
//! A claim of an absent record gets [`idem_core::FencingToken::first_at`] of the
//! statement's clock: `(ms)::bigint << 16` (ms clamped to 0 ..= 2^47 - 1, at least 1); a
//! claim that replaces an expired row still in the table takes `GREATEST(token + 1, that)`;
//! a reclaim adds 1. So the tokens of a new generation of a key are above every token of
//! every earlier generation, including generations the sweep deleted, as long as the
//! server's clock does not step back past a generation's life (the new claim's
//! `clock_timestamp()` reads a later millisecond than the earlier generation's claim did,
//! which a clock that never steps back guarantees for every generation that lived past the
//! millisecond it was claimed in, since the sweep removes a record only at or after its
//! `expires_at`) and no generation is reclaimed 65,536 times per millisecond it lived.
//! After a step back (an NTP step, a failover to a standby whose clock is behind the old
//! primary's, when the failover lost recent rows), a new generation claimed within the
//! step of an earlier one's claim may get lower tokens; a late owner still passes the fence
//! only on an equal token, that is when both claims read the same millisecond. Keep the
//! servers on NTP.
//!
//! # Layout
//! - `src/config.rs`: [`Config`].
//! - `src/store.rs`: [`PostgresStore`] and its [`idem_core::Store`] impl: the claim path
//!   and every other operation, how each is one atomic statement.
//! - `src/sql.rs`: the SQL: schema-name validation, the shipped [`MIGRATIONS`] and how
//!   they run, the text of every statement ([`Statements`]), and row decoding.
//! - `src/error.rs`: [`Error`] and the retryable classification.
//! - `migrations/*.sql`: the schema, one file per version.
//! - `tests/conformance.rs`: the shared conformance suite against a real server;
//!   `tests/postgres.rs`: backend-specific tests (connection loss, migrations, corrupt rows).
//! - `benches/claim_complete.rs`: library vs hand-sent statements, 1 and 32 callers.

mod config;
mod driver;
mod error;
mod sql;
mod store;

pub use config::Config;
#[cfg(feature = "sqlx")]
pub use driver::Sqlx;
pub use driver::{Deadpool, Driver};
#[cfg(feature = "sqlx")]
pub use error::is_retryable_sqlx;
pub use error::{Error, is_retryable_pg, is_retryable_pool};
pub use sql::{DEFAULT_SCHEMA, MIGRATIONS, Migration, Statements, validate_schema};
pub use store::PostgresStore;

/// The driver crates, re-exported so callers building their own pool use the same versions.
pub use deadpool_postgres;
/// sqlx, re-exported (feature `sqlx`) so callers build their `PgPool` with the same version.
#[cfg(feature = "sqlx")]
pub use sqlx;
pub use tokio_postgres;
