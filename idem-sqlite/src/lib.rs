#![doc = include_str!("../README.md")]
//!
//! # Layout
//! - `src/config.rs`: [`Config`].
//! - `src/store.rs`: [`SqliteStore`], an [`Embedded`](idem_core::group_commit::Embedded)
//!   store: the writer connection as the group-commit engine ([`idem_core::group_commit`])
//!   and the reader pool, from which `idem-core` makes the [`Store`](idem_core::Store) (a
//!   claim that finds a live record is answered by a pooled read connection).
//! - `src/table.rs`: the SQLite tables as [`idem_core::RecordTable`] (writer) and
//!   [`idem_core::RecordRead`] (readers): statements and the record/row mapping; the rules
//!   are [`idem_core::engine`]'s.
//! - `src/sql.rs`: migrations ([`MIGRATIONS`], [`SCHEMA_VERSION`]) and the version check.
//! - `src/error.rs`: [`Error`], converted into [`idem_core::StoreError`] with the rusqlite
//!   error kept as source and `is_retryable()` true for `SQLITE_BUSY` / `SQLITE_LOCKED`.
//! - `migrations/`: the schema as SQL files.
//! - `tests/it/`: the integration tests, one module per area (`docs/testing.md`; the test
//!   behind each failure: `docs/failures.md`).
//! - `benches/group_commit.rs`: throughput against a commit-per-statement baseline
//!   (`BENCHMARKS.md`).

mod config;
mod error;
mod sql;
mod store;
mod table;

pub use config::Config;
pub use error::Error;
pub use idem_core::group_commit::BatchConfig;
pub use sql::{MIGRATIONS, Migration, SCHEMA_VERSION};
pub use store::SqliteStore;
