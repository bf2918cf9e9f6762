//! # idem-redb
//!
//! The idem [`Store`](idem_core::Store) on one embedded [redb](https://docs.rs/redb) file:
//! no server to run, records survive restarts, and concurrent requests share commits
//! through the group-commit executor of [`idem_core::group_commit`] (batching, linger,
//! what a failed or panicked batch does: all documented there, the same for every
//! embedded store).
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use idem_core::sweeper::{SweepConfig, Sweeper};
//! use idem_core::{ClaimOutcome, ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, Scope, Store,
//!     StoredResponse};
//! use idem_redb::{Config, RedbStore};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = tempfile::tempdir()?;
//! let store = Arc::new(RedbStore::open(dir.path().join("idem.redb"), Config::default())?);
//! // redb does not expire records by itself: remove those past their retention every 60 s.
//! let _sweeper = Sweeper::start(Arc::clone(&store), SweepConfig::default());
//!
//! let scope = Scope::new("token:ml-eval", Endpoint::new("POST", "/v1/workers"))?;
//! let key = IdempotencyKey::parse(b"7c3f5d1e-91a4")?;
//! let req = ClaimRequest::new(scope, key, Fingerprint::of_bytes(b"{}"),
//!     Duration::from_secs(300), Duration::from_secs(86_400));
//!
//! // The first request claims the key and runs the handler...
//! let ClaimOutcome::Claimed(record) = store.claim(req.clone()).await? else { unreachable!() };
//! let response = StoredResponse::new(201, vec![("location".into(), b"/v1/workers/w-1".to_vec())], b"{}".to_vec());
//! store.complete(record.id, record.token, response).await?;
//!
//! // ...and a retry finds the stored response to replay.
//! let ClaimOutcome::Existing { record, .. } = store.claim(req).await? else { unreachable!() };
//! assert_eq!(record.response.map(|r| r.status), Some(201));
//! # Ok(())
//! # }
//! ```
//!
//! # Layout
//! - [`config`]: [`Config`] (`Config::default().with_*(..)`: batching,
//!   [`Durability`], clock).
//! - [`store`]: [`RedbStore`], the [`Store`](idem_core::Store) impl and the claim path:
//!   a claim that finds a live record is answered from a read transaction, every other
//!   write goes to the group-commit writer.
//! - [`table`]: the three tables and the record-table seam over them
//!   ([`idem_core::table`]): [`table::RECORDS`] (`idem_records`: 32-byte record id ->
//!   encoded record), [`table::EXPIRY`] (`idem_expiry`: (`expires_at` ms, record id) ->
//!   `()`), which a sweep range-scans so it deletes expired records in bounded batches
//!   without reading the rest, and [`table::JOURNAL`] (`idem_journal`: (record id, entry
//!   name) -> bytes), the steps and intents of resumable handlers, removed with their
//!   record. The rules applied to them are [`idem_core::engine`]'s.
//! - [`error`]: [`Error`], redb's errors kept as `source` and mapped into
//!   [`StoreError::Unavailable`](idem_core::StoreError::Unavailable) with a retryable flag.
//!
//! Records are encoded with [`idem_core::codec`]: one format-version byte, then postcard.
//! A stored value that does not decode is
//! [`StoreError::Corrupt`](idem_core::StoreError::Corrupt), never a panic.
//!
//! # Sharing the file
//! The application may keep its own tables in the same file: open the [`redb::Database`]
//! yourself and pass it to [`RedbStore::from_database`], or take it from
//! [`RedbStore::database`]. The store only writes the tables named `idem_records`,
//! `idem_expiry` and `idem_journal`. The application's write transactions take turns with
//! the writer's batches (redb runs one write transaction at a time), so keep them short;
//! open one [`RedbStore`] per database (two would each batch on their own and take turns).
//! Two stores on one database, or processes sharing the file in redb's
//! [`redb::ConcurrencyMode::MultiWriter`] mode (each builds its store with
//! [`RedbStore::from_database`]), still claim each key once: every claim is decided
//! inside a write transaction, never from a store's memory (`tests/store.rs`,
//! `tests/two_processes.rs`).
//!
//! # Failures
//! - After an I/O failure (a commit that could not reach the disk, e.g. a full disk),
//!   redb refuses every later transaction of that `Database` (`PreviousIo`) until the file
//!   is opened again. A store opened with [`RedbStore::open`] does that by itself: the
//!   writer closes the database when it meets the latched failure, and the next write or
//!   read opens the file again (failed opens back off from 10 ms, doubling up to 1 s).
//!   Until an open succeeds every call answers
//!   [`StoreError::Unavailable`](idem_core::StoreError::Unavailable) (retryable; 503 at the
//!   HTTP layer): the store fails closed, and only committed batches were ever
//!   acknowledged, so nothing acknowledged is lost. Fencing tokens are computed from the
//!   stored record and the clock, never from memory, so they keep rising across the
//!   reopen. The reopen waits until no one holds the old database: hold the handle from
//!   [`RedbStore::database`] only for a transaction. A store built with [`RedbStore::from_database`] never reopens (drop it and every
//!   handle, open the file again and build a new store). `tests/full_disk.rs` fills a real
//!   tmpfs to prove both.
//! - A value over redb's size limit (3 GiB) fails only its own operation.
//! - A process killed at any point loses no acknowledged write under
//!   [`Durability::Immediate`] (see `tests/killed_process.rs`); redb repairs the file on
//!   the next open.
//!
//! # Performance
//! `cargo run --release -p idem-bench -- cycles --backend redb --concurrency 32` runs
//! claim -> complete -> replay cycles through this store and through a naive store that
//! commits every write on its own, in alternating slices of one process (see
//! `BENCHMARKS.md`, which has the measured ratios). Under load a write transaction holds
//! many claims and completions, and replays never reach the writer. A commit writes one
//! B-tree leaf per record it touches (record ids are hashes, so they scatter), so a group
//! commit costs more than a single-record one and the gain stays below the batch size;
//! the slower the fsync, the larger the gain.
//!
//! # Time
//! Every `now` comes from the configured clock ([`Config::with_clock`], the system clock
//! by default), in milliseconds since the epoch; tests inject a
//! [`idem_core::ManualClock`].

pub mod config;
pub mod error;
#[doc(hidden)]
pub mod fuzzing;
mod handle;
pub mod store;
pub mod table;

pub use config::{Config, Durability};
pub use error::Error;
pub use idem_core::group_commit::{BatchConfig, BatchStats};
pub use store::RedbStore;

/// The README's example, compiled as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
