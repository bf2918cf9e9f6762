#![doc = include_str!("../README.md")]
//!
//! # What it guarantees
//! Each operation is one statement in its own transaction, time is the server's
//! `clock_timestamp()` in whole milliseconds, and a lost compare-and-set is a typed outcome.
//! The statement behind each operation and why it is atomic, isolation levels, fencing
//! tokens on the server's clock: `docs/contract.md#postgresql` and `docs/contract.md#fencing-token`.
//! Running it (your own pool, TLS, migrations by a deploy step or your own tool,
//! PgBouncer, completion inside the handler's transaction and what each completion mode
//! leaves after a crash): `docs/operations.md#postgresql`. Failures it is tested against:
//! `docs/failures.md`.
//!
//! # Features
//! None of its own. TLS is sqlx's: enable `tls-rustls` or `tls-native-tls` on the
//! application's own `sqlx` dependency (features unify; [`sqlx`] is re-exported so the
//! versions match) and set `sslmode` in the URL. Without one, `sslmode=prefer` (the
//! default) connects in plain text and `require` fails.
//!
//! # Layout
//! - `src/store.rs`: [`PostgresStore`], its constructors, `complete_in`, and the
//!   [`idem_core::Store`] impl: the claim path and every compare-and-set.
//! - `src/sql.rs`: schema-name validation, the shipped [`MIGRATIONS`] and how they run,
//!   the text of every [`Statement`] (the comments say why each is atomic), how a
//!   statement is sent (prepared, or inlined for PgBouncer), and row decoding.
//! - `src/config.rs`: [`Config`].
//! - `src/error.rs`: [`Error`] and which failures are retryable.
//! - `migrations/*.sql`: the schema, one file per version.
//! - `tests/it/`: the integration tests, one module per area (`docs/testing.md`; the test
//!   behind each failure: `docs/failures.md`).
//! - `benches/claim_complete.rs`: the store against the same statements sent by hand
//!   through the same pool, ratio per round.

mod config;
mod error;
mod sql;
mod store;

pub use config::Config;
pub use error::Error;
pub use sql::{DEFAULT_SCHEMA, MIGRATIONS, Migration, Statement, validate_schema};
pub use store::PostgresStore;

/// sqlx, re-exported so callers build their `PgPool` and transactions with the same version.
pub use sqlx;
