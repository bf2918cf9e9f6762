#![doc = include_str!("../README.md")]
//!
//! Any number of API servers share the records, and a record lives in the same database
//! as the resources it guards. Every operation is one statement (one round trip on the
//! common path), and time comes from the server's `clock_timestamp()`.
//!
//! Build it with [`PostgresStore::connect`] (a URL; [`PostgresStore::connect_tls`] with a
//! TLS connector), [`PostgresStore::from_pool`] (the application's own deadpool `Pool`), or,
//! with the `sqlx` feature, [`PostgresStore::from_sqlx`] (the application's own
//! `sqlx::PgPool`), and a [`Config`] from `Config::default()` and its `with_*` methods.
//! Each constructor migrates the schema first unless [`Config::with_auto_migrate`] is off.
//!
//! # Postgres the way teams run it
//!
//! ## Your own pool: deadpool or sqlx
//! [`PostgresStore`] is generic over its [`Driver`]: `PostgresStore` (=
//! `PostgresStore<Deadpool>`) runs on a `deadpool_postgres::Pool` of tokio-postgres
//! connections; `PostgresStore<Sqlx>` (feature `sqlx`) on a `sqlx::PgPool`, the pool most
//! axum services already hold. Both run the same statements ([`Statements`]), pass the same
//! conformance suite, and share the pool with the application: each store call takes a
//! connection for one statement (two on a lost compare-and-set) and gives it back.
//!
//! ```rust,ignore
//! // Cargo.toml: idem-postgres = { version = "0.1", features = ["sqlx"] }
//! let pool = sqlx::PgPool::connect("postgres://app@db/app").await?;
//! let store = idem_postgres::PostgresStore::from_sqlx(pool.clone(), idem_postgres::Config::default()).await?;
//! ```
//!
//! ## TLS
//! - deadpool: [`PostgresStore::connect_tls`] takes any tokio-postgres TLS connector
//!   (`postgres_native_tls::MakeTlsConnector`, `tokio_postgres_rustls::MakeRustlsConnect`);
//!   `sslmode=require` in the URL refuses a plain connection. Or build the deadpool
//!   `Manager` with the connector yourself and pass the pool to
//!   [`PostgresStore::from_pool`].
//! - sqlx: enable sqlx's `tls-rustls` (or `tls-native-tls`) feature in your own
//!   `Cargo.toml` (features unify: this crate's sqlx is yours) and set
//!   `PgConnectOptions::ssl_mode(PgSslMode::Require)` (or `VerifyFull` with
//!   `ssl_root_cert`), or `?sslmode=require` in the URL.
//!
//! This crate picks no TLS library: the choice (and its certificate store) is the
//! application's. Both paths are tested against the real server (`tests/tls.rs`:
//! native-tls on each driver, `sslmode=require`, every store session checked encrypted in
//! `pg_stat_ssl`).
//!
//! ## Migrations
//! Applied on start by default ([`Config::with_auto_migrate`]), through the store's pool,
//! whichever driver: one transaction under an advisory lock, safe from several replicas
//! at once. A deploy step can run them alone ([`PostgresStore::migrate`] on a deadpool
//! pool, [`PostgresStore::migrate_sqlx`] on a sqlx pool), and a team with its own
//! migration tool (sqlx-cli, refinery, Flyway) takes the SQL instead: [`MIGRATIONS`], each
//! with [`Migration::sql_for`] for the schema, recording each applied version in
//! `<schema>.schema_migrations` (`version`, `name`) so that stores built with
//! auto-migration off find it.
//!
//! ## Isolation
//! The statements are written for READ COMMITTED, PostgreSQL's default, and stay correct
//! under REPEATABLE READ and SERIALIZABLE, which some organisations set as the default of
//! every role:
//! - a claim that finds a live record writes nothing (its upsert's `DO UPDATE` applies only
//!   to an expired row), so it never invalidates the snapshot of a concurrent
//!   compare-and-set;
//! - every store statement is its own implicit transaction, so one rolled back by a
//!   serialization failure or a deadlock (SQLSTATE 40001, 40P01) runs again, with a fresh
//!   snapshot, up to 8 times (1, 4, 9, ... ms apart) before the error is returned
//!   (retryable);
//! - [`PostgresStore::connect`] pins READ COMMITTED on the connections it opens (startup
//!   option `-c default_transaction_isolation=read\ committed`, [`Config::with_isolation_pin`]);
//!   a pool you pass in is left as it is, its isolation level read at start
//!   ([`PostgresStore::isolation`]) and logged as a warning when it is not READ COMMITTED:
//!   the store is still correct, but contended records cost retries.
//!
//! [`PostgresStore::complete_in`] is the exception: it runs in your transaction, and needs
//! that transaction at READ COMMITTED. While the handler runs, the layer renews the lease
//! with an `UPDATE` of the record from another connection, and a REPEATABLE READ or
//! SERIALIZABLE transaction whose snapshot predates that renewal cannot update the row
//! (PostgreSQL fails any such update with 40001, whatever its `WHERE` says): the completion
//! would succeed or fail depending on whether a renewal committed while the handler ran.
//! Making it work at those levels would need the renewal to write somewhere other than the
//! record's row, a schema change; instead `complete_in` reads the transaction's level in
//! its own statement and refuses anything above READ COMMITTED, every time and before it
//! touches the row, with [`Error::IsolationNotSupported`] (inside a
//! [`StoreError::Unavailable`](idem_core::StoreError::Unavailable) that is not retryable).
//! Where a role or database defaults higher, start the handler's transaction with
//! `BEGIN ISOLATION LEVEL READ COMMITTED` (sqlx: `pool.begin_with(..)`; tokio-postgres:
//! `build_transaction().isolation_level(IsolationLevel::ReadCommitted)`).
//!
//! ## Behind PgBouncer (transaction mode)
//! The store keeps no session state: no `SET`, no temporary tables, no session advisory
//! locks (the migration lock is transaction-scoped), and each statement is its own
//! transaction. What breaks behind PgBouncer in transaction mode is named prepared
//! statements (before PgBouncer 1.21, or with `max_prepared_statements = 0`): a statement
//! prepared on one server connection is unknown on the next. Build the store with
//! `Config::default().with_prepared_statements(false)`: statements are then sent unnamed, in
//! one round trip each (deadpool: parse, bind and execute of the unnamed statement in one
//! batch; sqlx: the simple query protocol with the values as hex and decimal literals,
//! because sqlx prepares even an unnamed statement in a round trip of its own). PgBouncer
//! refuses the `options` startup parameter that pins the isolation level, so turn
//! [`Config::with_isolation_pin`] off there too (or list `options` in PgBouncer's
//! `ignore_startup_parameters`, which drops it). For sqlx, list `extra_float_digits` in
//! `ignore_startup_parameters` (sqlx sends it at startup). The conformance suite runs
//! through a real PgBouncer 1.18 in transaction mode for both drivers
//! (`tests/conformance_pgbouncer*.rs`, `scripts/pgbouncer`).
//!
//! ## Completion inside the handler's transaction
//! A handler whose side effects are rows in the same database can make them and the
//! stored response commit together: [`PostgresStore::complete_in`] runs the completion's
//! compare-and-set inside the handler's own transaction (a deadpool/tokio-postgres
//! `Transaction`, or `sqlx::Transaction` with the `sqlx` feature). The claim is not part of
//! that transaction: the layer claims with its own statement before the handler starts,
//! so no transaction is held open while the claim waits, and the handler's transaction
//! starts only when the handler does. That transaction must run at READ COMMITTED (see
//! "Isolation": the lease renewal updates the record meanwhile). With `idem_http`, the
//! handler returns its response with the `ResponseCaching::CompletedByHandler` extension
//! after the commit, and the layer writes nothing more:
//!
//! ```rust,ignore
//! async fn create(State(app): State<App>, Extension(ctx): Extension<IdempotencyContext>) -> Response {
//!     let mut tx = app.pool.begin().await?;
//!     let id: i64 = sqlx::query_scalar("INSERT INTO workers (op) VALUES ($1) RETURNING id")
//!         .bind(ctx.key().as_str()).fetch_one(&mut *tx).await?;
//!     let body = serde_json::to_vec(&json!({ "id": id }))?;
//!     let stored = StoredResponse::new(201, vec![("content-type".into(), b"application/json".to_vec())], body.clone());
//!     // LeaseLost: another attempt owns the record; return (tx rolls back on drop).
//!     // `stored_form` seals it when the layer seals (`with_sealing`); as is otherwise.
//!     app.store.complete_in(&mut tx, ctx.record_id(), ctx.token(), ctx.stored_form(stored)).await?;
//!     tx.commit().await?;
//!     (StatusCode::CREATED, [(CONTENT_TYPE, "application/json")], Extension(ResponseCaching::CompletedByHandler), body)
//!         .into_response()
//! }
//! ```
//!
//! The completion locks the record's row until the transaction ends, so no retry can
//! reclaim the record between the completion and the commit; a completion refused with
//! `LeaseLost` (the lease ran out and a retry took the record) means this attempt's rows
//! must roll back. The stored response is the one the handler passes: return the same
//! status, headers and body.
//!
//! What each mode guarantees when the process dies (SIGKILL, power loss) at any point:
//!
//! | crash | separate completion (the layer completes after the handler) | completion in the handler's transaction |
//! |---|---|---|
//! | before the handler's commit | no rows, record in flight: the retry runs again after the lease | the same: no rows, no response, the retry runs again |
//! | after the handler's commit, before the completion | **rows committed, record in flight: the retry runs the handler again after the lease (a second set of rows)** | cannot happen: rows and response commit together |
//! | after both | rows and response: the retry replays | rows and response: the retry replays |
//!
//! So separate completion gives at-least-once execution of the handler's writes (exactly
//! once when nothing crashes between commit and completion; make the writes idempotent by
//! [`idem_core::SubKey`] to close the gap), and completion in the handler's transaction
//! gives exactly-once for writes to this database. Side effects outside the database (an
//! HTTP call, a queue) are outside any transaction either way: journal them as steps or
//! intents. The crash test `examples/leasebroker/tests/pg_crash.rs` kills a server 100 times
//! at these points and checks one worker row and one stored response per operation, and
//! shows the duplicate rows of separate completion.
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
//! - `src/driver.rs`: [`Driver`], [`Deadpool`] and [`Sqlx`]: acquiring a connection and
//!   running one statement on either pool (prepared, or unnamed for PgBouncer).
//! - `src/store.rs`: [`PostgresStore`] and its [`idem_core::Store`] impl: the claim path
//!   and every other operation, how each is one atomic statement.
//! - `src/sql.rs`: the SQL: schema-name validation, the shipped [`MIGRATIONS`] and how
//!   they run, the text of every statement ([`Statements`]), and row decoding.
//! - `src/error.rs`: [`Error`] and the retryable classification.
//! - `migrations/*.sql`: the schema, one file per version.
//! - `tests/conformance.rs`: the shared conformance suite against a real server;
//!   `tests/conformance_sqlx.rs`, `tests/conformance_pgbouncer.rs`,
//!   `tests/conformance_pgbouncer_sqlx.rs`: the same on a sqlx pool and through PgBouncer;
//!   `tests/isolation.rs`: REPEATABLE READ and SERIALIZABLE as the connections' default;
//!   `tests/complete_in_isolation.rs`: `complete_in` on a database whose default is
//!   REPEATABLE READ, with the lease renewed during the handler's transaction;
//!   `tests/pgbouncer.rs`: named statements against unnamed ones behind PgBouncer;
//!   `tests/postgres.rs`: backend-specific tests (connection loss, migrations, corrupt rows).
//! - `benches/claim_complete.rs`: library vs hand-sent statements, 1 and 32 callers.

// The docs name the sqlx driver, which exists only with the feature.
#![cfg_attr(not(feature = "sqlx"), allow(rustdoc::broken_intra_doc_links))]

mod config;
mod driver;
mod error;
#[doc(hidden)]
pub mod fuzzing;
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
