#![doc = include_str!("../README.md")]
//!
//! # Layout
//! - `src/config.rs`: [`Config`] (`Config::default().with_*(..)`: batching, clock).
//! - `src/store.rs`: [`RedbStore`], an [`Embedded`](idem_core::group_commit::Embedded)
//!   store: its writer and its read transactions, from which `idem-core` makes the
//!   [`Store`](idem_core::Store) (a claim that finds a live record is answered from a read
//!   transaction, every write goes to the group-commit writer).
//! - [`table`]: the three tables ([`table::RECORDS`], [`table::EXPIRY`],
//!   [`table::JOURNAL`]) and the record-table seam over them ([`idem_core::table`]); the
//!   rules applied to them are [`idem_core::engine`]'s.
//! - `src/handle.rs`: the store's database, opened again after redb latched an I/O failure.
//! - `src/error.rs`: [`Error`], redb's errors kept as `source` and mapped into
//!   [`StoreError::Unavailable`](idem_core::StoreError::Unavailable) with a retryable flag;
//!   a stored value that does not decode is
//!   [`StoreError::Corrupt`](idem_core::StoreError::Corrupt), never a panic.
//!
//! # Features
//! - `test-util`: settings only tests use ([`Config`]'s `with_claim_reads` and
//!   `with_reopen`, and `idem-core`'s full batches).
//!
//! Performance against a store that commits every write on its own: `BENCHMARKS.md`.

mod config;
mod error;
mod handle;
mod store;
pub mod table;

pub use config::Config;
pub use error::Error;
pub use idem_core::group_commit::{BatchConfig, BatchStats};
pub use store::RedbStore;
