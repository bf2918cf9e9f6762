//! # idem-conformance
//!
//! The suite every [`Store`] must pass, ours and yours. A backend implements [`Backend`]
//! (how to open a store on fresh storage with a clock the test owns) and writes one line:
//!
//! ```ignore
//! idem_conformance::store_tests!(MyBackend::new());
//! ```
//!
//! which expands into one named `#[tokio::test]` per scenario (see [`scenarios`] for the
//! list, grouped by what they check) plus `model_based`, a property test that drives
//! random operation sequences from several simulated owners against the store and against
//! [`Spec`], a second statement of the rules of `docs/state-machine.md` independent of the
//! engine the in-process stores share, and compares every outcome, then races batches of
//! operations on separate tasks and checks every outcome is explained by some sequential
//! order on the spec (see [`model_test`]).
//!
//! # What it checks
//!
//! | group | scenarios | what must hold |
//! |---|---:|---|
//! | [`scenarios::claim`] | 10 | create-if-absent; of N concurrent claims exactly one wins |
//! | [`scenarios::replay`] | 8 | a completed record keeps status, headers (order, repeats) and body bytes exactly; a mismatch changes nothing |
//! | [`scenarios::inflight`] | 9 | a fresh lease blocks takeover; an expired one is reclaimed by compare-and-set; a passing lease changes nothing by itself |
//! | [`scenarios::reclaim`] | 8 | 8 racing reclaimers, one winner; completed, mismatched, absent and future-token reclaims conflict |
//! | [`scenarios::fencing`] | 10 | complete, fail and reclaim with a stale token get the exact `LeaseLost`/`Conflict` and change nothing (before == after) |
//! | [`scenarios::failed`](mod@scenarios::failed) | 5 | a failed record is reclaimable at once, by the same fingerprint only |
//! | [`scenarios::retention`] | 11 | absent from `expires_at` on, swept or not; sweeps keep live records, batch, say `more`, and race claims safely |
//! | [`scenarios::scope`](mod@scenarios::scope) | 6 | principals and endpoints isolate keys |
//! | [`scenarios::limits`] | 13 | 255-byte keys, non-ASCII and control characters in scopes, all byte values, empty and 4 MiB bodies, 200 headers, compressed and not-retained bodies |
//! | [`scenarios::clock`] | 9 | lease and retention edges to the millisecond, 4.999 s / 5.001 s, zero lease, clock steps back |
//! | [`scenarios::peers`] | 6 | two handles on one store: a fresh claim is never taken over, a dead owner's claim is freed by its lease, a stale owner is fenced, racing first claims have one winner, settling a record wakes its waiter (on the other handle of a server store) |
//! | [`scenarios::capability`] | 4 | declared capabilities hold: native expiry, server clock and sharing match what the backend does; peer handles |
//! | [`scenarios::extend`] | 13 | lease renewal is fenced like `complete`, moves the lease from `now` but never earlier, raises `expires_at` with it, keeps token, state and journal; a renewed lease refuses retries until its new end |
//! | [`scenarios::generation`] | 5 | a key reused after retention (record swept, expired natively, or still stored) gets a token above every earlier generation's; earlier tokens are refused everywhere; sub-keys change per generation |
//! | [`scenarios::list`] | 2 | operators' listing: live records only, in id order, by state, age and principal; pages resume after the cursor; stores without the capability refuse with `Unsupported` |
//! | [`scenarios::journal`] | 18 | journal entries are fenced like `complete`, first write wins unless overwritten, survive a reclaim, die with their record (expiry, sweep, replacing claim); `Resumable` steps and intents resume on the store; stores without the capability refuse with `Unsupported` |
//!
//! `store_tests!(backend)` also requires the store to declare the journal of resumable
//! handlers (`declares_the_journal`); a store without one writes
//! `store_tests!(backend, without_journal)` and runs the "journal unsupported" variants.
//! `tests/registry.rs` checks every scenario written is listed in the macro (and that
//! there are at least 60); `tests/broken.rs` checks the suite fails stores with known bugs.
//!
//! # Layout
//! - [`Backend`], [`Env`]: how a scenario gets its store and clock.
//! - [`scenarios`]: the named scenarios, plain `pub async fn(Env)`, one doc line each
//!   saying what must hold.
//! - [`model_test`]: the model-based (oracle) test and its operation language.
//! - [`Spec`]: its oracle, the rules of `docs/state-machine.md` written out again without
//!   the engine the in-process stores share; [`Oracle`]: the operations an oracle answers.
//! - [`fuzz_targets`]: the bodies of the `fuzz/` targets, shared with the corpus replay
//!   test so every committed corpus file runs on stable Rust.
//! - [`store_tests!`]: the macro.
//! - [`Forward`], [`Forwarding`]: store wrappers for tests that write only their overrides.
//! - `http` (feature `http`): the HTTP scenarios and [`http_tests!`](crate#http-scenarios).
//! - [`killed_process`]: a SIGKILL crash test for stores on a local file (the `main` of a
//!   test target without the test harness).
//!
//! # Test your own backend
//!
//! 1. Implement [`idem_core::Store`] for your engine. Read the contract on each method of
//!    the trait: every write is atomic, complete, fail and extend are compare-and-set on the
//!    fencing token, a lost race is a typed outcome (`Existing`, `Conflict`,
//!    `StoreError::LeaseLost`), all times are milliseconds from one clock.
//! 2. Let the store read an injected [`idem_core::Clock`] for every `now`. In production
//!    that may be the server's clock; under test the suite hands you a
//!    [`ManualClock`] and moves it instead of sleeping.
//! 3. Implement [`Backend`]: `open` returns a store on storage no other scenario uses (a
//!    temporary file, a fresh key prefix, a fresh table or schema). If several processes
//!    can share your storage, override [`Backend::open_peer`] to return a second,
//!    independent handle (another connection) on the same storage.
//! 4. Declare what the store offers in [`idem_core::Capabilities`]; the suite runs the
//!    matching variant (for example "records vanish on their own" instead of "sweep
//!    removes them") and prints a `variant:` line saying which one ran. Nothing is
//!    skipped silently. If the store can run on the server's own clock, also implement
//!    [`Backend::open_server_clock`]; the server-clock scenario then checks leases
//!    against that clock.
//! 5. Add dev-dependencies on `idem-conformance`, `async-trait` and `tokio` (features
//!    `macros`, `rt-multi-thread`; the expanded tests are `#[tokio::test]`s), and one file
//!    `tests/conformance.rs`:
//!
//! ```ignore
//! struct MyBackend;
//!
//! #[async_trait::async_trait]
//! impl idem_conformance::Backend for MyBackend {
//!     async fn open(&self, clock: idem_core::ManualClock) -> std::sync::Arc<dyn idem_core::Store> {
//!         std::sync::Arc::new(MyStore::open_temporary(std::sync::Arc::new(clock)).await)
//!     }
//! }
//!
//! idem_conformance::store_tests!(MyBackend);
//! ```
//!
//! `cargo test --test conformance` then runs every scenario and the model test. Set
//! `IDEM_MODEL_CASES=5000` for a long model run. `examples/file-store` in the repository
//! is a complete, deliberately simple custom backend (one file per record) that does
//! exactly this; `tests/broken.rs` in this crate shows the suite failing stores that
//! claim by check-then-insert, complete without checking the token, or sweep live records,
//! renew a lease without checking the token, renew a completed or failed record, move a
//! lease earlier or leave `expires_at` behind it, restart tokens for a new generation, and
//! journals that ignore the token, let the last write win, keep a replaced record's
//! entries, or are declared but not implemented.
//!
//! The journal ([`idem_core::Store::journal_put`]) is optional for stores written
//! elsewhere: a store that leaves [`idem_core::Capabilities::journal`] unset runs the
//! "journal unsupported" variant (both methods must answer `StoreError::Unsupported`).
//! Every store in this repository declares it; `tests/registry.rs` checks that.
//!
//! # HTTP scenarios
//!
//! With the feature `http`, the module `http` holds scenarios that put idem-http's
//! `IdempotencyLayer` in front of the backend's store and drive it as clients do: lease
//! renewal under a paused clock (a 30-minute handler under a 10 s lease runs once, killed
//! and stalled holders, the bounded in-flight wait), tenant isolation in every row of the
//! decision table, response shapes (endless streams, large and binary bodies, trailers, a
//! corrupt completed record under `FailOpen`) and sealed responses. One more line runs
//! them all, one named test each, beside `store_tests!`:
//!
//! ```ignore
//! idem_conformance::http_tests!(MyBackend::new());
//! ```
//!
//! The crate running them needs dev-dependencies on `idem-conformance` with
//! `features = ["http"]` and on `tokio` (the tests are `#[tokio::test(start_paused =
//! true)]`; the feature turns on tokio's `test-util`).
//!
//! A few scenarios write behind the store's back: garbage in a completed record, a sealed
//! response moved onto another record or flipped by one byte. They use the optional raw
//! access of [`Backend`]: [`Backend::read_stored`] and [`Backend::overwrite_stored`] (the
//! bytes of a record's stored response, or of the whole record where the backend keeps it
//! as one value) and [`Backend::corrupt_stored`] (spoil another part of a record). A
//! backend that leaves them at their defaults runs everything else and prints a
//! `variant: no raw access: ...` line for each check it skipped.
//!
//! # Running against a shared server
//!
//! Every scenario works inside its own random namespace (principals start with
//! `conformance-<uuid>/`), writes only records it made, and keeps retention windows short
//! (at most a few minutes), so it is safe to point the suite at a server that holds other
//! data. Sweeps are the one operation that touches records a scenario did not make, so
//! scenarios that sweep first move their clock one day into the past
//! ([`Env::sweep_session`]): a sweep then only removes records that had already expired in
//! real time, and the other scenarios' records (which expire in the future) are never
//! touched. Sweep scenarios in one test binary run one at a time, and they assert on their
//! own records, never on global counts.

use std::sync::Arc;

use async_trait::async_trait;
use idem_core::{Capabilities, ManualClock, RecordId, Store, UnixMillis};

mod forward;
pub mod fuzz_targets;
#[cfg(feature = "http")]
pub mod http;
pub mod killed_process;
pub mod model_test;
mod oracle;
pub mod racing_processes;
pub mod scenarios;
mod spec;

pub use forward::{Forward, Forwarding};
pub use oracle::Oracle;
pub use spec::Spec;

/// How the suite opens stores of one backend.
#[async_trait]
pub trait Backend: Send + Sync + 'static {
    /// Opens a store on storage that no other scenario uses (a fresh file, a fresh key
    /// prefix, a fresh schema), timed by `clock`: the store must read `clock` for every
    /// `now`, including stores that use the server's clock in production.
    async fn open(&self, clock: ManualClock) -> Arc<dyn Store>;

    /// Opens a second, independent handle on the same storage as `store` (another
    /// connection, another process-level instance), used by the scenarios where two API
    /// servers share one backend. The default returns the same handle, which is right for
    /// embedded stores that allow one opener per file.
    async fn open_peer(&self, store: &Arc<dyn Store>, clock: ManualClock) -> Arc<dyn Store> {
        let _ = clock;
        Arc::clone(store)
    }

    /// Opens a store that reads the server's own clock (Postgres `clock_timestamp()`,
    /// Redis `TIME`) instead of an injected one, for the scenario that checks leases and
    /// retention are computed from that clock. `None` (the default) means the backend has
    /// no server clock; the scenario then reports that it ran the "no server clock"
    /// variant.
    async fn open_server_clock(&self) -> Option<Arc<dyn Store>> {
        None
    }

    /// Raw access, for the HTTP scenarios that write behind the store's back (feature
    /// `http`, [`http`](crate#http-scenarios)): the bytes this backend keeps for the stored
    /// response of record `id` of `store` (a store [`Backend::open`] returned), read with
    /// the backend's own commands, not through [`Store`]. A backend that keeps each record
    /// as one value ([`idem_core::codec::encode`]) returns that whole value. `None` (the
    /// default) means no raw access: the scenarios then report the parts they skipped.
    async fn read_stored(&self, store: &Arc<dyn Store>, id: RecordId) -> Option<Vec<u8>> {
        let _ = (store, id);
        None
    }

    /// Raw access: replaces what [`Backend::read_stored`] reads for record `id` with
    /// `bytes` (which may be garbage), behind the store's back. Returns false (the default)
    /// if the backend has no raw access.
    async fn overwrite_stored(&self, store: &Arc<dyn Store>, id: RecordId, bytes: Vec<u8>) -> bool {
        let _ = (store, id, bytes);
        false
    }

    /// Raw access: spoils one part of record `id` other than its response (its key, its
    /// state; the backend picks), behind the store's back, so that reading the record is
    /// [`idem_core::StoreError::Corrupt`]. Returns false (the default) if the backend has
    /// no raw access.
    async fn corrupt_stored(&self, store: &Arc<dyn Store>, id: RecordId) -> bool {
        let _ = (store, id);
        false
    }
}

/// How far [`Env::sweep_session`] moves the clock back: one day, in ms.
pub const SWEEP_REWIND_MS: i64 = 86_400_000;

/// Sweep scenarios (and the model test) in one process run one at a time, so that no
/// sweep removes records another sweep scenario still relies on.
static SWEEP_LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// What a scenario runs against.
#[derive(Clone)]
pub struct Env {
    /// The store under test.
    pub store: Arc<dyn Store>,
    /// The store's clock; scenarios move it instead of sleeping.
    pub clock: ManualClock,
    /// A random namespace for this scenario: every principal it uses starts with it, so
    /// scenarios never touch each other's (or a user's) records on a shared server.
    pub namespace: String,
    scenario: &'static str,
    backend: Arc<dyn Backend>,
}

impl std::fmt::Debug for Env {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Env")
            .field("scenario", &self.scenario)
            .field("store", &self.store)
            .field("namespace", &self.namespace)
            .finish_non_exhaustive()
    }
}

impl Env {
    /// Opens a fresh store of `backend` with a manual clock started at the current wall
    /// time (plausible timestamps, so native expiry on a real server behaves).
    pub async fn open(backend: Arc<dyn Backend>) -> Self {
        Self::open_named(backend, "scenario").await
    }

    /// [`Env::open`] for the scenario called `scenario` (used in [`Env::report`] lines).
    pub async fn open_named(backend: Arc<dyn Backend>, scenario: &'static str) -> Self {
        let clock = ManualClock::starting_now();
        let store = backend.open(clock.clone()).await;
        let namespace = format!("conformance-{}", uuid::Uuid::new_v4().simple());
        Self { store, clock, namespace, scenario, backend }
    }

    /// A second handle on the same storage (see [`Backend::open_peer`]).
    pub async fn peer(&self) -> Arc<dyn Store> {
        self.backend.open_peer(&self.store, self.clock.clone()).await
    }

    /// The backend's server-clock store, if it has one (see [`Backend::open_server_clock`]).
    pub async fn server_clock_store(&self) -> Option<Arc<dyn Store>> {
        self.backend.open_server_clock().await
    }

    /// A principal inside this scenario's namespace.
    #[must_use]
    pub fn principal(&self, name: &str) -> String {
        format!("{}/{name}", self.namespace)
    }

    /// The store's capabilities.
    #[must_use]
    pub fn capabilities(&self) -> Capabilities {
        self.store.capabilities()
    }

    /// Says which variant of a capability-dependent scenario ran, on stderr:
    /// `idem-conformance <scenario>: variant: <what>`. Shown by `cargo test -- --nocapture`
    /// and with every failure.
    pub fn report(&self, variant: &str) {
        eprintln!("idem-conformance {}: variant: {variant}", self.scenario);
    }

    /// Prepares a scenario that sweeps: waits until no other sweep scenario of this process
    /// runs and, unless the store expires records natively (then sweep is a no-op), moves
    /// the clock [`SWEEP_REWIND_MS`] into the past, so the scenario's sweeps can only remove
    /// records that already expired in real time. Call it first, before making records;
    /// keep the returned session alive until the scenario ends.
    pub async fn sweep_session(&self) -> SweepSession {
        let guard = SWEEP_LOCK.lock().await;
        let native = self.capabilities().native_expiry;
        if !native {
            self.clock.set(UnixMillis(self.clock.now_ms() - SWEEP_REWIND_MS));
        }
        SweepSession { native_expiry: native, _guard: guard }
    }
}

/// Held by a scenario that sweeps (see [`Env::sweep_session`]).
#[derive(Debug)]
pub struct SweepSession {
    /// Whether the store expires records natively (sweep is then a no-op returning zero).
    pub native_expiry: bool,
    _guard: tokio::sync::MutexGuard<'static, ()>,
}

/// Takes the sweep lock from synchronous code (the model test), rewinding nothing.
pub(crate) fn blocking_sweep_lock() -> tokio::sync::MutexGuard<'static, ()> {
    SWEEP_LOCK.blocking_lock()
}

/// Expands into one `#[tokio::test]` per scenario for the backend built by `$backend`
/// (an expression evaluated once per test), plus a `model_based` test (see
/// [`model_test`]; `IDEM_MODEL_CASES` sets its case count).
#[macro_export]
macro_rules! store_tests {
    // A complete store keeps the journal of resumable handlers: the suite says so out loud,
    // so a store that stops declaring `Capabilities::journal` fails here instead of
    // quietly running the "journal unsupported" variants.
    ($backend:expr) => {
        $crate::store_tests!($backend, without_journal);

        #[::tokio::test]
        async fn declares_the_journal() {
            let backend: ::std::sync::Arc<dyn $crate::Backend> = ::std::sync::Arc::new($backend);
            let env = $crate::Env::open_named(backend, "declares_the_journal").await;
            assert!(
                env.store.capabilities().journal,
                "the store must declare Capabilities::journal (or run `store_tests!(backend, without_journal)`)"
            );
        }
    };
    // A store without a journal: the journal scenarios check that it refuses journal calls
    // with `StoreError::Unsupported`.
    ($backend:expr, without_journal) => {
        $crate::__for_each_scenario!($crate::__store_test, $backend);

        /// The model-based test: random operation sequences against the store and
        /// `idem_conformance::Spec`, every outcome compared.
        #[test]
        fn model_based() {
            $crate::model_test::run(|| -> ::std::sync::Arc<dyn $crate::Backend> { ::std::sync::Arc::new($backend) });
        }
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __store_test {
    ($backend:expr, $group:ident :: $name:ident) => {
        #[::tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn $name() {
            let backend: ::std::sync::Arc<dyn $crate::Backend> = ::std::sync::Arc::new($backend);
            let env = $crate::Env::open_named(backend, ::std::stringify!($name)).await;
            $crate::scenarios::$group::$name(env).await;
        }
    };
}
