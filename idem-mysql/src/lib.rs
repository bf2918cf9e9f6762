#![doc = include_str!("../README.md")]
//!
//! # Why the claim is atomic
//! A claim is one InnoDB transaction at READ COMMITTED:
//! 1. `SELECT ... FROM <prefix>_records WHERE id = ? FOR UPDATE`. If the row exists, the
//!    transaction now holds its exclusive lock, and a locking read returns the last
//!    committed version of the row, not a snapshot: every other claim, reclaim, complete,
//!    fail, extend or sweep of this id waits until this transaction ends.
//! 2. `now`: the server's clock (`UTC_TIMESTAMP(6)`, read after the lock was granted) or
//!    the pinned test clock.
//! 3. idem-core's pure rule ([`idem_core::transition::claim`]) decides: a live row is
//!    returned as `Existing` and nothing is written; an expired row is replaced by a new
//!    generation with an `UPDATE` under the lock held since step 1.
//! 4. If there was no row, the claim `INSERT`s one. Nothing was locked in step 1 (READ
//!    COMMITTED takes no gap locks), so two claims of a new id can both get here. The
//!    primary key decides: the second `INSERT` waits on the first's uncommitted row, and
//!    fails with a duplicate-key error (1062) once the first commits (or succeeds if it
//!    rolls back). The loser rolls back, having written nothing, and runs the claim
//!    again from step 1, which now locks and returns the winner's row.
//!
//! So no two callers ever hold one key: a row is created only by an `INSERT` the primary
//! key allows once, and changed only under its exclusive row lock by a transaction that
//! read the committed row after taking the lock. Reclaim, complete, fail and extend are
//! the same shape (lock, `now`, the pure compare-and-set rule on the fencing token, one
//! `UPDATE`), so a lost compare-and-set is decided on the committed row and reported as
//! [`idem_core::StoreError::LeaseLost`] or [`idem_core::ReclaimOutcome::Conflict`].
//!
//! A MySQL `INSERT ... ON DUPLICATE KEY UPDATE` with conditional assignments would save
//! round trips, but its assignments run left to right and see the columns already
//! assigned, and its affected-rows count depends on the client's `CLIENT_FOUND_ROWS`
//! flag: correct forms exist but are fragile; the locking read is plain to check.
//!
//! The journal of resumable handlers lives in `<prefix>_journal`; a sweep deletes a
//! record's entries with it, in one transaction; every journal write holds the record's
//! row lock and checks the fencing token on the locked row first.
//!
//! # Isolation
//! READ COMMITTED, pinned by [`MySqlStore::connect`] on each session it opens
//! (`SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED`, [`pin_read_committed`]);
//! [`MySqlStore::from_pool`] checks a pool the caller gives and refuses any other level
//! with [`Error::IsolationNotSupported`]. At REPEATABLE READ (InnoDB's default) the
//! locking read of an absent id takes a gap lock, and two claims of unrelated new ids in
//! one gap deadlock on each other's inserts.
//!
//! # Retries
//! A transaction is run again from `BEGIN` only when nothing of it can have been
//! committed: after a deadlock (1213: the server rolled the whole transaction back), a
//! lock-wait timeout (1205: the statement was rolled back and the store rolls back the
//! rest), or a claim's `INSERT` that lost to a concurrent one (1062); and once after the
//! session died before `COMMIT` was sent (the server rolls back a transaction whose
//! session is gone; an idle pooled connection killed by `wait_timeout` costs nothing). A
//! failed `COMMIT` is never resent: whether it committed is unknown.
//!
//! # MySQL 8 and MariaDB 10.11
//! The same SQL runs on both: no `RETURNING`, no `FOR UPDATE OF`, no `SKIP LOCKED`, no
//! sequences. Where they differ: the isolation variable is `transaction_isolation` on
//! MySQL 8 (and MariaDB 11.1+) and `tx_isolation` on MariaDB 10.11 (the store tries the
//! first, then the second); CHECK constraints are enforced by MariaDB since 10.2 and MySQL
//! since 8.0.16 (before that MySQL parses and ignores them).
//!
//! # Layout
//! - `src/store.rs`: [`MySqlStore`], its constructors, `complete_in`, and the
//!   [`idem_core::Store`] impl: each operation's transaction and its retry.
//! - `src/sql.rs`: table-prefix validation, the shipped [`MIGRATIONS`] and how they run,
//!   the statements, and row decoding.
//! - `src/config.rs`: [`Config`].
//! - `src/error.rs`: [`Error`] and which failures are retryable.
//! - `migrations/*.sql`: the schema, one file per version (records; the journal; the key
//!   column's length).
//! - `tests/it/`: the integration tests (feature `live-tests`), one module per area.

mod config;
mod error;
mod sql;
mod store;

pub use config::Config;
pub use error::Error;
pub use sql::{DEFAULT_PREFIX, MIGRATIONS, Migration, validate_prefix};
pub use store::{MySqlStore, SWEEP_BATCH, pin_read_committed};

/// sqlx, re-exported so callers build their `MySqlPool` and transactions with the same
/// version.
pub use sqlx;
