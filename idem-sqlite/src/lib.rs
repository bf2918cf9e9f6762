//! # idem-sqlite
//!
//! An idem [`Store`](idem_core::Store) in one SQLite file: for platform agents and
//! single-node services that already carry SQLite and want retries to be safe without
//! running a database server. SQLite is compiled in (rusqlite's `bundled` feature), so no
//! system library is needed.
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use idem_core::sweeper::{SweepConfig, Sweeper};
//! use idem_core::{ClaimOutcome, ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, Scope, Store,
//!     StoredResponse};
//! use idem_sqlite::{Config, SqliteStore};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = tempfile::tempdir()?;
//! // Opening blocks on file I/O: do it before the runtime starts (or in spawn_blocking).
//! let store = Arc::new(SqliteStore::open(dir.path().join("idem.sqlite3"), Config::default())?);
//! tokio::runtime::Runtime::new()?.block_on(async {
//!     // Deletes expired records every minute for as long as `_sweeper` lives.
//!     let _sweeper = Sweeper::start(Arc::clone(&store), SweepConfig::default());
//!     let scope = Scope::new("token:ml-eval", Endpoint::new("POST", "/v1/workers"))?;
//!     let key = IdempotencyKey::parse(b"7c3f5d1e-91a4")?;
//!     let req = ClaimRequest::new(scope, key, Fingerprint::of_bytes(b"{}"),
//!         Duration::from_secs(300), Duration::from_secs(86_400));
//!     let ClaimOutcome::Claimed(record) = store.claim(req.clone()).await? else { unreachable!() };
//!     // ... run the handler, then store its response for every retry:
//!     let response = StoredResponse::new(201, vec![("location".into(), b"/v1/workers/42".to_vec())], b"{}".to_vec());
//!     store.complete(record.id, record.token, response).await?;
//!     // A retry finds the completed record and replays it.
//!     let ClaimOutcome::Existing { record, .. } = store.claim(req).await? else { unreachable!() };
//!     assert_eq!(record.response.map(|r| r.status), Some(201));
//!     Ok::<_, Box<dyn std::error::Error>>(())
//! })
//! # }
//! ```
//!
//! # How it works
//! - **One writer, group commit.** Claims, reclaims, completions, fails, sweeps and
//!   journal writes go to the shared group-commit executor ([`idem_core::group_commit`]:
//!   batching, linger, abandoned claims, read-only batches, panics and failed commits are
//!   documented there), which runs each batch in one `BEGIN IMMEDIATE` transaction on the
//!   only writing connection, on its own thread. Each operation is the shared
//!   [`idem_core::engine`] on the SQLite tables (`src/table.rs`); nothing here restates a
//!   rule.
//! - **Readers never wait for the writer.** [`Store::get`](idem_core::Store::get) and
//!   journal reads run on `spawn_blocking` with a small pool of read connections; a claim
//!   that finds a live record (a replay) is answered by a pooled reader on the caller's
//!   thread ([`Config::with_max_readers`]). WAL mode lets them read while the writer
//!   writes, and every acknowledged write is visible to them.
//!
//! ## Why the claim is atomic
//! SQLite has no `xmax` to tell an insert from a conflict, and needs none here. Every
//! batch runs in `BEGIN IMMEDIATE`, which takes the database's write lock (the RESERVED
//! lock; in WAL mode the WAL write lock) *before* the first read. Only one connection, in
//! any process that opened the file, can hold it; the others wait (busy timeout) until it
//! commits or rolls back. A write transaction in WAL mode also only ever starts from the
//! newest committed snapshot (SQLite refuses a stale one with `SQLITE_BUSY_SNAPSHOT`, and
//! `BEGIN IMMEDIATE` takes the lock before anything is read). So between a claim reading
//! "no live record" and writing its in-flight record, no other connection can write: of N
//! concurrent claims of one id, exactly one sees the row absent. The same holds for the
//! compare-and-set on the fencing token in reclaim, complete and fail. Within one process
//! the writer thread serialises the operations anyway; the lock is what makes several
//! processes sharing the file safe (`tests/two_processes.rs` races child processes for the
//! same keys). A claim answered by a reader wrote nothing: it found a live record, which
//! no later write can make absent before its expiry.
//!
//! ## Durability
//! [`Synchronous::Full`] (default) fsyncs the write-ahead log on every commit: an
//! acknowledged claim or completion survives power loss. [`Synchronous::Normal`] skips that
//! fsync (it happens at checkpoints): still consistent after any crash and durable across a
//! process crash, but a power loss or OS crash can roll back the newest commits, so a
//! handler may run again for a key whose claim was acknowledged. Group commit is what keeps
//! `Full` fast under concurrency.
//!
//! ## Time and expiry
//! Every `now` comes from the injected [`idem_core::Clock`] ([`idem_core::SystemClock`] by
//! default, [`Config::with_clock`]), read by the writer when it applies each operation.
//! All times are stored as INTEGER milliseconds since the Unix epoch. A record past
//! `expires_at` counts as absent at once; [`Store::sweep`](idem_core::Store::sweep) deletes
//! up to `limit` of them, oldest first, through the `expires_at` index;
//! [`idem_core::sweeper::Sweeper`] runs it on a period.
//!
//! ## Clocks of processes sharing a file
//! SQLite has no server and so no server clock: each process that opens the file reads its
//! own (SQLite's own `unixepoch()` would read the same operating-system clock), and stamps
//! claims and leases with it. Between processes on one host that is one clock and nothing
//! can go wrong; the rule below matters when a process runs with a different clock (a
//! container or VM with its own time, a clock stepped by hand). The store therefore
//! states a bound and measures the skew it can see, rather than pretending to a shared
//! clock:
//! - **The bound.** Leases are honoured exactly when the clocks of the processes sharing
//!   the file agree within much less than a lease: a process whose clock runs `d` ahead
//!   sees every other process's lease end `d` early, and with lease renewal every lease /
//!   3, a handler is safe while `d` stays under two thirds of the lease TTL minus one
//!   renewal's latency. NTP on a healthy host keeps `d` in milliseconds.
//! - **The measurement.** [`SqliteStore::open`] reads the newest claim time in the file
//!   (in-flight claims and the 1 000 newest rows); if it lies ahead of this process's
//!   clock by more than [`Config::with_max_clock_skew`] (default 1 s), the open fails with
//!   [`Error::ClockBehind`]; a smaller skew is logged and kept in
//!   [`SqliteStore::clock_skew_at_open_ms`]. This catches the process whose clock is
//!   *behind* (the one whose claims the others would reclaim early), when it starts after
//!   a faster process wrote; a process whose clock is ahead is caught when a slower one
//!   (re)starts. It cannot catch a clock that drifts while every process keeps running:
//!   that is what the bound and NTP are for.
//!
//! ## Schema and migrations
//! One table, `idem_records`, one column per record field (the response as a postcard
//! blob, [`idem_core::codec::encode_response`]), with three indices: the scope key
//! `(principal, endpoint, key)`, `expires_at` for the sweep, and a partial index on
//! `lease_expires_at` of in-flight records. A second table, `idem_journal`, holds the
//! per-record journal of resumable handlers
//! ([`Store::journal_put`](idem_core::Store::journal_put)); a trigger deletes a record's
//! entries with it. The SQL lives in `migrations/` ([`MIGRATIONS`]) and the version in
//! `PRAGMA user_version`. [`SqliteStore::open`] applies what is missing, in one
//! `BEGIN IMMEDIATE` transaction; with [`Config::with_auto_migrate`]`(false)` it only
//! checks the version ([`Error::SchemaOutdated`]) and [`SqliteStore::migrate`] is the
//! explicit step, e.g. in a deployment job.
//!
//! ## Performance
//! `benches/group_commit.rs` measures claim + complete pairs against a baseline that
//! commits each statement on its own (same schema, WAL, `synchronous = FULL`). At 1 caller
//! both pay about one fsync per commit; at 32 callers the baseline's commits queue for the
//! write lock one fsync at a time, while group commit shares each fsync among a batch
//! (`BENCHMARKS.md` has the measured ratios).
//!
//! ## Wiring it into a server
//! Open the store once at start-up and share it: `Arc::new(SqliteStore::open(path,
//! Config::default())?)` is an `Arc<dyn Store>` for the HTTP layer
//! (`idem_http::IdempotencyLayer::new(store)`); start the
//! [`Sweeper`](idem_core::sweeper::Sweeper) next to it, as above. Several server processes
//! may open the same file on one host (not over a network file system: WAL needs shared
//! memory).
//!
//! # Layout
//! - `src/config.rs`: [`Config`] and [`Synchronous`].
//! - `src/store.rs`: [`SqliteStore`]: the claim path, the writer connection as the
//!   group-commit engine, the reader pool.
//! - `src/table.rs`: the SQLite tables as [`idem_core::RecordTable`] (writer) and
//!   [`idem_core::RecordRead`] (readers): statements and the record/row mapping.
//! - `src/sql.rs`: migrations ([`MIGRATIONS`], [`SCHEMA_VERSION`]) and the version check.
//! - `src/error.rs`: [`Error`], converted into [`idem_core::StoreError`] with the rusqlite
//!   error kept as source and `is_retryable()` true for `SQLITE_BUSY` / `SQLITE_LOCKED`.
//! - `migrations/`: the schema as SQL files.
//! - `tests/conformance.rs`: the idem conformance suite; `tests/two_processes.rs`: child
//!   processes racing for the same keys; `tests/killed_process.rs`: acknowledged claims
//!   survive SIGKILL; `tests/sqlite.rs`: file, schema, lock and journal behaviour;
//!   `benches/group_commit.rs`: throughput against a commit-per-statement baseline.

mod config;
mod error;
#[doc(hidden)]
pub mod fuzzing;
mod sql;
mod store;
mod table;

pub use config::{Config, DEFAULT_MAX_CLOCK_SKEW, Synchronous};
pub use error::Error;
pub use idem_core::group_commit::BatchConfig;
pub use sql::{MIGRATIONS, Migration, SCHEMA_VERSION};
pub use store::SqliteStore;

/// The README's example, compiled with the doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeExample;
