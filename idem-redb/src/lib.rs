//! # idem-redb
//!
//! The idem [`Store`](idem_core::Store) on one embedded [redb](https://docs.rs/redb) file:
//! no server to run, records survive restarts, and concurrent requests share commits.
//!
//! A durable redb commit costs one fsync (about 0.4 ms on a typical disk), so a store that
//! commits every claim and every completion on its own tops out near 1,000 requests per
//! second. [`RedbStore`] uses group commit instead: one writer thread applies every
//! operation that is waiting (up to [`RedbConfig::max_batch`]) in one write transaction
//! and commits once; each caller still gets its own outcome, and only after the commit
//! that holds its write is durable.
//!
//! ```
//! use std::time::Duration;
//! use idem_core::{ClaimOutcome, ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, Scope, Store,
//!     StoredResponse};
//! use idem_redb::{RedbConfig, RedbStore};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = tempfile::tempdir()?;
//! let store = RedbStore::open(dir.path().join("idem.redb"), RedbConfig::default())?;
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
//! - [`store`]: [`RedbStore`], [`RedbConfig`], [`Linger`], [`Durability`], and the tables:
//!   [`store::RECORDS`] (`idem_records`: 32-byte record id -> encoded record),
//!   [`store::EXPIRY`] (`idem_expiry`: (`expires_at` ms, record id) -> `()`), which `sweep`
//!   range-scans so it deletes expired records in bounded batches without reading the rest;
//!   and [`store::JOURNAL`] (`idem_journal`: (record id, entry name) -> bytes), the steps
//!   and intents of resumable handlers, removed with their record.
//! - `writer` (private): the group-commit writer thread. Every write is a read-compute-write
//!   through [`idem_core::transition`], the same rules the in-memory store runs.
//! - `queue` (private): the hand-off from async callers to the writer.
//! - [`error`]: [`RedbStoreError`], redb's errors kept as `source` and mapped into
//!   [`StoreError::Unavailable`](idem_core::StoreError::Unavailable) with a retryable flag.
//!
//! Records are encoded with [`idem_core::codec`]: one format-version byte, then postcard.
//! A stored value that does not decode is
//! [`StoreError::Corrupt`](idem_core::StoreError::Corrupt), never a panic.
//!
//! # Sharing the file
//! The application may keep its own tables in the same file: open the [`redb::Database`]
//! yourself and pass it to [`RedbStore::open_with`], or take it from
//! [`RedbStore::database`]. The store only writes the tables named `idem_records`,
//! `idem_expiry` and `idem_journal`. The application's write transactions take turns with
//! the writer's batches (redb runs one write transaction at a time), so keep them short;
//! open one [`RedbStore`] per database (two would each batch on their own and take turns).
//!
//! # Failures
//! - A commit that fails (I/O error, full disk) fails every operation of its batch with
//!   [`StoreError::Unavailable`](idem_core::StoreError::Unavailable); nothing of the batch
//!   was applied, so no caller holds a claim it was not told about.
//! - redb then refuses every later write transaction (`PreviousIo`, reported as not
//!   retryable) until the file is opened again; reads keep working. The HTTP layer fails
//!   closed (503) in the meantime; restart the process, or open a new store on the file.
//! - A process killed at any point loses no acknowledged write under
//!   [`Durability::Immediate`] (see `tests/killed_process.rs`); redb repairs the file on
//!   the next open.
//!
//! # Performance
//! `cargo run --release -p idem-bench -- cycles --backend redb --concurrency 32` runs
//! claim -> complete -> replay cycles through this store and through a naive store that
//! commits every write on its own, in alternating slices of one process (see
//! `BENCHMARKS.md`). Two things keep commits few:
//! - group commit: at 32 callers a write transaction holds about 23 claims and
//!   completions;
//! - a claim that finds a live record (a replay) is answered from a read transaction and
//!   never waits for a commit ([`RedbConfig::claim_reads`]), and a batch that wrote
//!   nothing is aborted rather than committed.
//!
//! Measured on a shared 2-core VM whose fsync takes 0.08-0.25 ms (medians of 3 runs,
//! interleaved with the build before these two changes): 10.3-11.9x the naive store at
//! 32 callers in two sets of runs (7.6-8.5x before), 21x at 128, 5.4x at 8, 1.4x at 1.
//! A commit writes one B-tree leaf per record it touches (record ids are hashes, so they
//! scatter), so a group commit costs more than a single-record one (0.71 ms against
//! 0.25 ms here) and the gain stays below the batch size; the slower the fsync, the
//! larger the gain.
//!
//! # Time
//! Every `now` comes from [`RedbConfig::clock`] (the system clock by default), in
//! milliseconds since the epoch; tests inject a [`idem_core::ManualClock`].

pub mod error;
mod queue;
pub mod store;
mod writer;

pub use error::RedbStoreError;
pub use store::{BatchStats, Durability, Linger, RedbConfig, RedbStore};
