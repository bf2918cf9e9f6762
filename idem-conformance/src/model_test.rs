//! The model-based test: random sequences of claim, reclaim, complete, fail, extend, get,
//! sweep, journal put and get (on stores with [`idem_core::Capabilities::journal`]; on others both
//! must return `StoreError::Unsupported`) and clock moves (including moves to exactly a lease end or an `expires_at`, and one ms either
//! side), issued by several simulated owners over a small key space, run against a store and
//! against [`Spec`] (the oracle). Every outcome is compared.
//!
//! The oracle is not the engine the memory, redb and SQLite stores and the file-store
//! example run (`idem_core::engine` over `idem_core::transition`): [`Spec`] states the rules
//! of `docs/state-machine.md` a second time, so a wrong rule in the shared engine shows up
//! as a divergence instead of being repeated by the oracle. The `*_with` entry points take
//! another oracle, for a test that shows what one would miss.
//!
//! What the contract leaves free, and only that, is not compared exactly:
//! - which expired records a partial sweep picks, and whether a full batch sets `more`:
//!   after every sweep the test checks the batch stayed within its limit, that `more` was
//!   set while expired records remained, then drains both sides and compares the totals;
//! - stores with [`idem_core::Capabilities::native_expiry`] must sweep nothing (zero,
//!   `more = false`); the model is then not swept either.
//!
//! Each case opens a fresh store (so sweep totals can be compared) and uses a random
//! namespace; on stores without native expiry the clock starts one day in the past, like
//! [`crate::Env::sweep_session`], so its sweeps only remove records already expired in real
//! time.
//!
//! A second, concurrent part ([`run_batches`]) releases two to four operations at once on
//! their own tasks and checks the store's outcomes are those of some sequential order of
//! the same operations on the model (linearizability); non-atomic claims and
//! compare-and-sets fail it. One relaxation: the record a refusal reports
//! (`Conflict::current`, `LeaseLost::current`) may be read right after the refusal, so it
//! may show a write that landed later in the same race. Racing journal overwrites all
//! return `Written`, so their order shows only in the journal they leave: when orders that
//! explain the outcomes leave different model states, the test reads the store's journal
//! after the race and keeps an order that explains it as well.
//!
//! The case count is `IDEM_MODEL_CASES` (default [`DEFAULT_CASES`]; the concurrent part runs
//! half as many); failures are shrunk to a minimal operation list by proptest and printed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::{Oracle, Spec};
use arbitrary::Arbitrary;
use idem_core::{
    ClaimOutcome, ClaimRequest, Clock, Endpoint, FencingToken, Fingerprint, IdempotencyKey, JournalWrite, ManualClock,
    Receipt, ReclaimOutcome, ReclaimRequest, Record, RecordId, RecordState, Scope, Store, StoreError, StoredBody,
    StoredResponse, UnixMillis,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestError, TestRunner};

use crate::Backend;

/// Cases per run unless `IDEM_MODEL_CASES` says otherwise.
pub const DEFAULT_CASES: u32 = 128;
/// Longest generated operation sequence.
pub const MAX_OPS: usize = 64;
/// Simulated owners (API servers holding tokens).
pub const OWNERS: usize = 3;
/// Records in play: 2 principals x 2 keys.
pub const KEYS: usize = 4;
/// Lease lengths an operation picks from, ms (zero must still give a finite lease: `docs/failures.md#zero-lease-means-no-deadline`).
pub const LEASES_MS: [u64; 3] = [0, 1_000, 5_000];
/// Retention windows an operation picks from, ms (1 s is shorter than a 5 s lease: raised).
pub const RETENTIONS_MS: [u64; 3] = [1_000, 10_000, 60_000];
/// Renewals an extend picks from, ms: zero (never moves a lease earlier), a usual lease,
/// and one past most retention windows (raises `expires_at`).
pub const EXTENSIONS_MS: [u64; 3] = [0, 5_000, 30_000];
/// Distinct request fingerprints.
pub const FINGERPRINTS: u8 = 2;
/// Journal entry names an operation picks from (a step, an intent, a non-ASCII name).
pub const JOURNAL_NAMES: [&str; 3] = ["s:allocate", "i:boot", "s:ステップ"];

/// The journal values an operation picks from: empty, text, bytes that are not UTF-8.
#[must_use]
pub fn journal_values() -> [Vec<u8>; 4] {
    [Vec::new(), b"node-1".to_vec(), b"node-2".to_vec(), vec![0, 0xff, 0xfe, 0]]
}

/// Which token an owner presents.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Arbitrary)]
pub enum TokenChoice {
    /// The token the owner won with its last claim or reclaim of the key (1 if none).
    Held,
    /// The token of the last record the owner saw for the key (1 if none).
    Seen,
    /// A token near the current one: `current + n % 8 - 4`, so up to 4 below it (stale),
    /// the current one, or up to 3 above it (from the future). With no live record,
    /// "current" is the token a claim would take now ([`FencingToken::first_at`]).
    Near(u8),
    /// The token of the key's live record as the model holds it ([`FencingToken::first_at`]
    /// the store's `now` if none): the current owner's token while the record is in flight.
    /// Journal puts use it so that entries get written, then found (`Exists`) and read.
    Current,
}

/// Which edge of a record [`Op::AdvanceTo`] moves to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Arbitrary)]
pub enum Edge {
    /// `lease_expires_at`.
    Lease,
    /// `expires_at`.
    Expiry,
}

/// One step of a model-test sequence. Indices wrap (`owner % OWNERS`, `key % KEYS`, ...).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Arbitrary)]
pub enum Op {
    /// `claim` with a fingerprint, lease and retention picked by index.
    Claim {
        /// Owner index.
        owner: u8,
        /// Key index.
        key: u8,
        /// Fingerprint index.
        fingerprint: u8,
        /// Index into [`LEASES_MS`].
        lease: u8,
        /// Index into [`RETENTIONS_MS`].
        retention: u8,
    },
    /// `reclaim` presenting a token.
    Reclaim {
        /// Owner index.
        owner: u8,
        /// Key index.
        key: u8,
        /// Fingerprint index.
        fingerprint: u8,
        /// The expected token.
        token: TokenChoice,
        /// Index into [`LEASES_MS`].
        lease: u8,
        /// Index into [`RETENTIONS_MS`].
        retention: u8,
    },
    /// `complete` with a response picked by index.
    Complete {
        /// Owner index.
        owner: u8,
        /// Key index.
        key: u8,
        /// The token presented.
        token: TokenChoice,
        /// Response index.
        response: u8,
    },
    /// `fail`.
    Fail {
        /// Owner index.
        owner: u8,
        /// Key index.
        key: u8,
        /// The token presented.
        token: TokenChoice,
    },
    /// `extend` (lease renewal) by a renewal picked by index.
    Extend {
        /// Owner index.
        owner: u8,
        /// Key index.
        key: u8,
        /// The token presented.
        token: TokenChoice,
        /// Index into [`EXTENSIONS_MS`].
        lease: u8,
    },
    /// `get`.
    Get {
        /// Owner index.
        owner: u8,
        /// Key index.
        key: u8,
    },
    /// `journal_put` of a name and value picked by index.
    JournalPut {
        /// Owner index.
        owner: u8,
        /// Key index.
        key: u8,
        /// The token presented.
        token: TokenChoice,
        /// Index into [`JOURNAL_NAMES`].
        name: u8,
        /// Index into [`journal_values`].
        value: u8,
        /// Replace an existing entry.
        overwrite: bool,
    },
    /// `journal_get` of a name picked by index.
    JournalGet {
        /// Owner index.
        owner: u8,
        /// Key index.
        key: u8,
        /// Index into [`JOURNAL_NAMES`].
        name: u8,
    },
    /// `sweep(limit % 6)`.
    Sweep {
        /// Batch limit.
        limit: u8,
    },
    /// Moves the clock forward by `ms % 12_001` ms.
    Advance {
        /// Milliseconds.
        ms: u16,
    },
    /// Moves the clock to a live record's edge plus `delta.signum()` ms (never backwards).
    AdvanceTo {
        /// Key index.
        key: u8,
        /// Which edge.
        edge: Edge,
        /// -1, 0 or +1 ms around the edge.
        delta: i8,
    },
}

/// The responses a `Complete` picks from: plain, cached 4xx, compressed, not retained, empty.
#[must_use]
pub fn responses() -> [StoredResponse; 5] {
    [
        StoredResponse::new(201, vec![("location".to_owned(), b"/r/1".to_vec())], b"{\"id\":1}".to_vec()),
        StoredResponse::new(422, vec![("content-type".to_owned(), b"application/problem+json".to_vec())], vec![0xff]),
        StoredResponse::compressed_over(200, vec![], b"abc".repeat(400), 64),
        StoredResponse {
            status: 201,
            headers: vec![],
            body: StoredBody::NotRetained { len: Some(1 << 30) },
            trailers: vec![],
        },
        StoredResponse::new(204, vec![], vec![]),
    ]
}

/// The proptest strategy for one store operation (claim, reclaim, complete, fail, extend,
/// get, journal put and get).
pub fn store_op_strategy() -> impl Strategy<Value = Op> {
    let owner = || 0..OWNERS as u8;
    // Skewed towards key 0, so one record sees long histories; the others check isolation.
    let key = || prop_oneof![4 => Just(0u8), 1 => Just(1u8), 1 => Just(2u8), 1 => Just(3u8)];
    // Weighted towards the choices that can win (the token last seen, the first
    // fingerprint), so reclaims and completes apply often enough to matter.
    let token = || {
        prop_oneof![
            3 => Just(TokenChoice::Held),
            3 => Just(TokenChoice::Seen),
            1 => (0u8..8).prop_map(TokenChoice::Near),
        ]
    };
    let fingerprint = || prop_oneof![4 => Just(0u8), 1 => 0..FINGERPRINTS];
    // Journal puts mostly present the current token, so entries get written and then read,
    // found (`Exists`) and fenced; names favour the first, so one entry sees long histories.
    let journal_token = || {
        prop_oneof![
            4 => Just(TokenChoice::Current),
            2 => Just(TokenChoice::Held),
            1 => Just(TokenChoice::Seen),
            1 => (0u8..8).prop_map(TokenChoice::Near),
        ]
    };
    let name = || prop_oneof![3 => Just(0u8), 1 => Just(1u8), 1 => Just(2u8)];
    prop_oneof![
        4 => (owner(), key(), fingerprint(), 0..3u8, 0..3u8).prop_map(|(owner, key, fingerprint, lease, retention)| {
            Op::Claim { owner, key, fingerprint, lease, retention }
        }),
        3 => (owner(), key(), fingerprint(), token(), 0..3u8, 0..3u8).prop_map(
            |(owner, key, fingerprint, token, lease, retention)| Op::Reclaim { owner, key, fingerprint, token, lease, retention }
        ),
        3 => (owner(), key(), token(), 0..5u8).prop_map(|(owner, key, token, response)| Op::Complete { owner, key, token, response }),
        2 => (owner(), key(), token()).prop_map(|(owner, key, token)| Op::Fail { owner, key, token }),
        3 => (owner(), key(), token(), 0..3u8).prop_map(|(owner, key, token, lease)| Op::Extend { owner, key, token, lease }),
        2 => (owner(), key()).prop_map(|(owner, key)| Op::Get { owner, key }),
        6 => (owner(), key(), journal_token(), name(), 0..4u8, prop_oneof![3 => Just(false), 1 => Just(true)]).prop_map(
            |(owner, key, token, name, value, overwrite)| Op::JournalPut { owner, key, token, name, value, overwrite }
        ),
        3 => (owner(), key(), name()).prop_map(|(owner, key, name)| Op::JournalGet { owner, key, name }),
    ]
}

/// The proptest strategy for a clock move or a sweep; clock moves favour the interesting
/// edges (a lease end or `expires_at` exactly, and one ms either side).
pub fn time_op_strategy() -> impl Strategy<Value = Op> {
    let key = prop_oneof![4 => Just(0u8), 1 => Just(1u8), 1 => Just(2u8), 1 => Just(3u8)];
    let ms = prop_oneof![0u16..=2, 999u16..=1_001, 4_999u16..=5_001, 0u16..=6_000];
    let edge = prop_oneof![3 => Just(Edge::Lease), 1 => Just(Edge::Expiry)];
    prop_oneof![
        1 => (0u8..6).prop_map(|limit| Op::Sweep { limit }),
        3 => ms.prop_map(|ms| Op::Advance { ms }),
        3 => (key, edge, prop_oneof![1 => Just(-1i8), 2 => Just(0i8), 1 => Just(1i8)])
            .prop_map(|(key, edge, delta)| Op::AdvanceTo { key, edge, delta }),
    ]
}

/// The proptest strategy for one operation of any kind.
pub fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![14 => store_op_strategy(), 7 => time_op_strategy()]
}

/// The strategy for a whole sequence (1 to [`MAX_OPS`] operations).
pub fn ops_strategy() -> impl Strategy<Value = Vec<Op>> {
    proptest::collection::vec(op_strategy(), 1..MAX_OPS)
}

/// The case count: `IDEM_MODEL_CASES` if set and valid, else [`DEFAULT_CASES`].
#[must_use]
pub fn cases_from_env() -> u32 {
    std::env::var("IDEM_MODEL_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(DEFAULT_CASES)
}

/// Runs the model test for the backend `make` builds (called once, inside the test's own
/// runtime) and panics with the shrunk failing sequence on a divergence. This is what
/// `store_tests!` expands `model_based` into.
pub fn run(make: impl FnOnce() -> Arc<dyn Backend>) {
    let cases = cases_from_env();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime for the model test");
    let backend = {
        let _entered = rt.enter();
        make()
    };
    let started = Instant::now();
    match check(&rt, &backend, cases) {
        Ok(stats) => {
            eprintln!("idem-conformance model_based: {cases} cases passed in {:.2?}: {stats:?}", started.elapsed())
        }
        Err(e) => panic!("{e}"),
    }
    let concurrent = cases.div_ceil(2);
    let started = Instant::now();
    match check_concurrent(&rt, &backend, concurrent) {
        Ok(stats) => eprintln!(
            "idem-conformance model_based: {concurrent} concurrent cases passed in {:.2?}: {stats:?}",
            started.elapsed()
        ),
        Err(e) => panic!("{e}"),
    }
}

/// Runs `cases` random sequences against fresh stores of `backend`; `Err` carries the
/// shrunk failing sequence and the first divergence.
///
/// Returns the outcome counts over all cases.
///
/// # Errors
/// A description of the divergence when the store and the model disagree.
pub fn check(rt: &tokio::runtime::Runtime, backend: &Arc<dyn Backend>, cases: u32) -> Result<RunStats, String> {
    check_with::<Spec>(rt, backend, cases)
}

/// [`check`] against the oracle `O` instead of [`Spec`] (a test that shows what another
/// oracle would miss).
///
/// # Errors
/// As [`check`].
pub fn check_with<O: Oracle + Clone + Default + PartialEq>(
    rt: &tokio::runtime::Runtime,
    backend: &Arc<dyn Backend>,
    cases: u32,
) -> Result<RunStats, String> {
    let _sweeps = crate::blocking_sweep_lock();
    let total = std::sync::Mutex::new(RunStats::default());
    let config = Config { cases, failure_persistence: None, ..Config::default() };
    let mut runner = TestRunner::new(config);
    let outcome = runner.run(&ops_strategy(), |ops| {
        rt.block_on(async {
            let clock = ManualClock::starting_now();
            let store = backend.open(clock.clone()).await;
            if !store.capabilities().native_expiry {
                clock.set(UnixMillis(clock.now_ms() - crate::SWEEP_REWIND_MS));
            }
            let namespace = format!("model-{}", uuid::Uuid::new_v4().simple());
            run_ops_with::<O>(store.as_ref(), &clock, &namespace, &ops).await
        })
        .map(|stats| total.lock().unwrap_or_else(std::sync::PoisonError::into_inner).add(&stats))
        .map_err(TestCaseError::fail)
    });
    match outcome {
        Ok(()) => Ok(total.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner)),
        Err(TestError::Fail(reason, ops)) => {
            Err(format!("the store diverged from the model: {reason}\nminimal failing sequence: {ops:#?}"))
        }
        Err(e) => Err(format!("model test aborted: {e}")),
    }
}

/// The record request parts of key index `k`.
fn key_parts(namespace: &str, k: usize) -> (Scope, IdempotencyKey) {
    let scope =
        Scope::new(format!("{namespace}/p{}", k / 2), Endpoint::new("POST", "/model")).expect("non-empty principal");
    let key = IdempotencyKey::parse(format!("k{}", k % 2).as_bytes()).expect("valid key");
    (scope, key)
}

fn fingerprint(i: u8) -> Fingerprint {
    Fingerprint::of_bytes(&[b'f', i % FINGERPRINTS])
}

fn ms(table: &[u64; 3], i: u8) -> Duration {
    Duration::from_millis(table[usize::from(i) % table.len()])
}

/// Record invariants that hold for every record a store returns, whatever the history.
fn check_record(r: &Record) -> Result<(), String> {
    if r.response.is_some() != (r.state == RecordState::Completed) {
        return Err(format!("a response is stored iff completed: {r:?}"));
    }
    if r.token < FencingToken::FIRST {
        return Err(format!("token below 1: {r:?}"));
    }
    if r.started_at < r.created_at || r.expires_at < r.lease_expires_at {
        return Err(format!("timestamps out of order: {r:?}"));
    }
    Ok(())
}

/// Compares a complete's, fail's or extend's outcome on the store and the model; when it
/// applied, also the record as written, read back from both (a receipt carries only the
/// times).
async fn same_write<O: Oracle>(
    op: usize,
    id: RecordId,
    now: UnixMillis,
    (store, model): (Result<Receipt, StoreError>, Result<Receipt, StoreError>),
    (on_store, on_model): (&dyn Store, &O),
    stats: &mut RunStats,
) -> Result<(), String> {
    match (&store, &model) {
        (Ok(a), Ok(b)) if a == b => {
            stats.writes += 1;
            let written = on_store.get(id).await.map_err(|e| format!("op #{op}: get after a write failed: {e}"))?;
            let expected = on_model.get(id, now);
            if written != expected {
                return Err(format!("op #{op}: the store wrote {written:?}, the model {expected:?}"));
            }
            match written {
                Some(r) if Receipt::of(&r) == *a => check_record(&r),
                other => Err(format!("op #{op}: receipt {a:?} does not match the record written, {other:?}")),
            }
        }
        (
            Err(StoreError::LeaseLost { id: a, presented: b, current: c }),
            Err(StoreError::LeaseLost { id: x, presented: y, current: z }),
        ) if (a, b, c) == (x, y, z) => {
            stats.lease_lost += 1;
            Ok(())
        }
        _ => Err(format!("op #{op}: store returned {store:?}, the model {model:?}")),
    }
}

/// A journal put's outcome, comparable between store and model: `Err` is
/// `LeaseLost { id, presented, current }`.
type JournalPutOutcome = Result<JournalWrite, (RecordId, FencingToken, Option<FencingToken>)>;

/// Splits a journal put's result into its comparable outcome; any error other than
/// `LeaseLost` is a failure of the run.
fn journal_put_outcome(r: Result<JournalWrite, StoreError>) -> Result<JournalPutOutcome, String> {
    match r {
        Ok(w) => Ok(Ok(w)),
        Err(e) => lease_lost_parts(e).map(Err).map_err(|e| format!("journal_put: {e}")),
    }
}

/// A store without [`idem_core::Capabilities::journal`] must refuse journal operations as
/// `Unsupported` (a declared capability, never a silent no-op).
fn unsupported(op: usize, operation: &str, r: Result<(), StoreError>, stats: &mut RunStats) -> Result<(), String> {
    match r {
        Err(StoreError::Unsupported { .. }) => {
            stats.journal_unsupported += 1;
            Ok(())
        }
        other => Err(format!(
            "op #{op}: a store without Capabilities::journal answered {operation} with {other:?}, not Unsupported"
        )),
    }
}

/// How often each outcome occurred: shows a run was not vacuous (printed by [`run`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RunStats {
    /// Operations run.
    pub ops: u64,
    /// Claims that won.
    pub claimed: u64,
    /// Claims that found a live record.
    pub existing: u64,
    /// Reclaims that won.
    pub reclaimed: u64,
    /// Reclaims that conflicted.
    pub reclaim_conflicts: u64,
    /// Completes, fails and extends that applied.
    pub writes: u64,
    /// Extends that applied (also counted in `writes`).
    pub extended: u64,
    /// Completes, fails and extends refused with `LeaseLost`.
    pub lease_lost: u64,
    /// Gets that found a record.
    pub hits: u64,
    /// Records removed by sweeps.
    pub swept: u64,
    /// Journal puts that wrote.
    pub journal_written: u64,
    /// Journal puts that found the entry (`Exists`).
    pub journal_exists: u64,
    /// Journal puts refused with `LeaseLost`.
    pub journal_lease_lost: u64,
    /// Journal gets that found an entry.
    pub journal_hits: u64,
    /// Journal operations refused as `Unsupported` (stores without the capability).
    pub journal_unsupported: u64,
}

impl RunStats {
    fn count_journal_put(&mut self, outcome: &JournalPutOutcome) {
        match outcome {
            Ok(JournalWrite::Written) => self.journal_written += 1,
            Ok(JournalWrite::Exists(_)) => self.journal_exists += 1,
            Err(_) => self.journal_lease_lost += 1,
        }
    }

    /// Adds `other` into `self`.
    pub fn add(&mut self, other: &RunStats) {
        self.ops += other.ops;
        self.claimed += other.claimed;
        self.existing += other.existing;
        self.reclaimed += other.reclaimed;
        self.reclaim_conflicts += other.reclaim_conflicts;
        self.writes += other.writes;
        self.extended += other.extended;
        self.lease_lost += other.lease_lost;
        self.hits += other.hits;
        self.swept += other.swept;
        self.journal_written += other.journal_written;
        self.journal_exists += other.journal_exists;
        self.journal_lease_lost += other.journal_lease_lost;
        self.journal_hits += other.journal_hits;
        self.journal_unsupported += other.journal_unsupported;
    }
}

/// Per-owner, per-key tokens the simulated owners hold and have seen.
#[derive(Debug, Default)]
struct Owners {
    held: [[Option<FencingToken>; KEYS]; OWNERS],
    seen: [[Option<FencingToken>; KEYS]; OWNERS],
}

impl Owners {
    /// The token `owner` presents for `key`; `current` is the key's live token, or the one
    /// a claim would take now.
    fn token(&self, owner: usize, key: usize, choice: TokenChoice, current: FencingToken) -> FencingToken {
        match choice {
            TokenChoice::Current => current,
            TokenChoice::Held => self.held[owner][key].unwrap_or(FencingToken::FIRST),
            TokenChoice::Seen => self.seen[owner][key].unwrap_or(FencingToken::FIRST),
            TokenChoice::Near(n) => FencingToken((current.0 + u64::from(n % 8)).saturating_sub(4)),
        }
    }
}

/// The token of record `id`'s live record in `model`, or, with none, the token a claim
/// would take at `now`.
fn current_token(model: &impl Oracle, id: RecordId, now: UnixMillis) -> FencingToken {
    model.get(id, now).map_or(FencingToken::first_at(now), |r| r.token)
}

/// Runs `ops` against `store` (timed by `clock`) and a fresh [`Spec`], comparing every
/// outcome; records live under `namespace`. Used by the model test and the
/// `model_vs_redb` fuzz target ([`crate::fuzz_targets::model_vs_store`]).
///
/// Returns how often each outcome occurred.
///
/// # Errors
/// The first divergence (or store error, or broken record invariant), described.
pub async fn run_ops(store: &dyn Store, clock: &ManualClock, namespace: &str, ops: &[Op]) -> Result<RunStats, String> {
    run_ops_with::<Spec>(store, clock, namespace, ops).await
}

/// [`run_ops`] against the oracle `O` instead of [`Spec`].
///
/// # Errors
/// As [`run_ops`].
pub async fn run_ops_with<O: Oracle + Clone + Default>(
    store: &dyn Store,
    clock: &ManualClock,
    namespace: &str,
    ops: &[Op],
) -> Result<RunStats, String> {
    let native = store.capabilities().native_expiry;
    let journal = store.capabilities().journal;
    let values = journal_values();
    let mut stats = RunStats { ops: ops.len() as u64, ..RunStats::default() };
    let mut model = O::default();
    let mut owners = Owners::default();
    let parts: Vec<(Scope, IdempotencyKey)> = (0..KEYS).map(|k| key_parts(namespace, k)).collect();
    let ids: Vec<RecordId> = parts.iter().map(|(s, k)| s.record_id(k)).collect();
    let responses = responses();
    for (i, op) in ops.iter().enumerate() {
        let now = clock.now();
        match *op {
            Op::Claim { owner, key, fingerprint: f, lease, retention } => {
                let (o, k) = (usize::from(owner) % OWNERS, usize::from(key) % KEYS);
                let (scope, idem_key) = parts[k].clone();
                let req = ClaimRequest::new(
                    scope,
                    idem_key,
                    fingerprint(f),
                    ms(&LEASES_MS, lease),
                    ms(&RETENTIONS_MS, retention),
                );
                let m = model.claim(&req, now);
                let s = store.claim(req).await.map_err(|e| format!("op #{i} {op:?}: claim failed: {e}"))?;
                if s != m {
                    return Err(format!("op #{i} {op:?}: store returned {s:?}, the model {m:?}"));
                }
                match m {
                    ClaimOutcome::Claimed(r) => {
                        stats.claimed += 1;
                        check_record(&r)?;
                        owners.held[o][k] = Some(r.token);
                        owners.seen[o][k] = Some(r.token);
                    }
                    ClaimOutcome::Existing { record, .. } => {
                        stats.existing += 1;
                        check_record(&record)?;
                        owners.seen[o][k] = Some(record.token);
                    }
                }
            }
            Op::Reclaim { owner, key, fingerprint: f, token, lease, retention } => {
                let (o, k) = (usize::from(owner) % OWNERS, usize::from(key) % KEYS);
                let req = ReclaimRequest {
                    id: ids[k],
                    expected: owners.token(o, k, token, current_token(&model, ids[k], now)),
                    fingerprint: fingerprint(f),
                    lease_ttl: ms(&LEASES_MS, lease),
                    retention: ms(&RETENTIONS_MS, retention),
                };
                let m = model.reclaim(&req, now);
                let s = store.reclaim(req).await.map_err(|e| format!("op #{i} {op:?}: reclaim failed: {e}"))?;
                if s != m {
                    return Err(format!("op #{i} {op:?}: store returned {s:?}, the model {m:?}"));
                }
                match m {
                    ReclaimOutcome::Reclaimed(r) => {
                        stats.reclaimed += 1;
                        check_record(&r)?;
                        owners.held[o][k] = Some(r.token);
                        owners.seen[o][k] = Some(r.token);
                    }
                    ReclaimOutcome::Conflict { current, .. } => {
                        stats.reclaim_conflicts += 1;
                        if let Some(r) = current {
                            owners.seen[o][k] = Some(r.token);
                        }
                    }
                }
            }
            Op::Complete { owner, key, token, response } => {
                let (o, k) = (usize::from(owner) % OWNERS, usize::from(key) % KEYS);
                let t = owners.token(o, k, token, current_token(&model, ids[k], now));
                let resp = responses[usize::from(response) % responses.len()].clone();
                let m = model.complete(ids[k], t, resp.clone(), now);
                let s = store.complete(ids[k], t, resp).await;
                same_write(i, ids[k], now, (s, m), (store, &model), &mut stats).await?;
            }
            Op::Fail { owner, key, token } => {
                let (o, k) = (usize::from(owner) % OWNERS, usize::from(key) % KEYS);
                let t = owners.token(o, k, token, current_token(&model, ids[k], now));
                let m = model.fail(ids[k], t, now);
                let s = store.fail(ids[k], t).await;
                same_write(i, ids[k], now, (s, m), (store, &model), &mut stats).await?;
            }
            Op::Extend { owner, key, token, lease } => {
                let (o, k) = (usize::from(owner) % OWNERS, usize::from(key) % KEYS);
                let t = owners.token(o, k, token, current_token(&model, ids[k], now));
                let lease = ms(&EXTENSIONS_MS, lease);
                let m = model.extend(ids[k], t, lease, now);
                let applied = m.is_ok();
                let s = store.extend(ids[k], t, lease).await;
                same_write(i, ids[k], now, (s, m), (store, &model), &mut stats).await?;
                stats.extended += u64::from(applied);
            }
            Op::Get { owner, key } => {
                let (o, k) = (usize::from(owner) % OWNERS, usize::from(key) % KEYS);
                let m = model.get(ids[k], now);
                let s = store.get(ids[k]).await.map_err(|e| format!("op #{i} {op:?}: get failed: {e}"))?;
                if s != m {
                    return Err(format!("op #{i} {op:?}: store returned {s:?}, the model {m:?}"));
                }
                if let Some(r) = &m {
                    stats.hits += 1;
                    check_record(r)?;
                    owners.seen[o][k] = Some(r.token);
                }
            }
            Op::JournalPut { owner, key, token, name, value, overwrite } => {
                let (o, k) = (usize::from(owner) % OWNERS, usize::from(key) % KEYS);
                let t = owners.token(o, k, token, current_token(&model, ids[k], now));
                let name = JOURNAL_NAMES[usize::from(name) % JOURNAL_NAMES.len()];
                let value = values[usize::from(value) % values.len()].clone();
                let s = store.journal_put(ids[k], t, name, value.clone(), overwrite).await;
                if !journal {
                    unsupported(i, "journal_put", s.map(|_| ()), &mut stats)?;
                    continue;
                }
                let m = journal_put_outcome(model.journal_put(ids[k], t, name, value, overwrite, now))?;
                let s = journal_put_outcome(s).map_err(|e| format!("op #{i} {op:?}: {e}"))?;
                if s != m {
                    return Err(format!("op #{i} {op:?}: store returned {s:?}, the model {m:?}"));
                }
                stats.count_journal_put(&m);
            }
            Op::JournalGet { owner: _, key, name } => {
                let k = usize::from(key) % KEYS;
                let name = JOURNAL_NAMES[usize::from(name) % JOURNAL_NAMES.len()];
                let s = store.journal_get(ids[k], name).await;
                if !journal {
                    unsupported(i, "journal_get", s.map(|_| ()), &mut stats)?;
                    continue;
                }
                let s = s.map_err(|e| format!("op #{i} {op:?}: journal_get failed: {e}"))?;
                let m = model.journal_get(ids[k], name, now);
                if s != m {
                    return Err(format!("op #{i} {op:?}: store returned {s:?}, the model {m:?}"));
                }
                stats.journal_hits += u64::from(m.is_some());
            }
            Op::Sweep { limit } => {
                stats.swept += sweep(i, store, &mut model, now, usize::from(limit % 6), native).await?
            }
            Op::Advance { ms } => clock.advance_ms(i64::from(ms % 12_001)),
            Op::AdvanceTo { key, edge, delta } => {
                if let Some(r) = model.get(ids[usize::from(key) % KEYS], now) {
                    let at = match edge {
                        Edge::Lease => r.lease_expires_at,
                        Edge::Expiry => r.expires_at,
                    };
                    let target = at.0 + i64::from(delta.signum());
                    if target > now.0 {
                        clock.set(UnixMillis(target));
                    }
                }
            }
        }
    }
    Ok(stats)
}

/// One sweep, compared as far as the contract fixes it (see the module docs).
async fn sweep<O: Oracle + Clone>(
    i: usize,
    store: &dyn Store,
    model: &mut O,
    now: UnixMillis,
    limit: usize,
    native: bool,
) -> Result<u64, String> {
    let out = store.sweep(limit).await.map_err(|e| format!("op #{i} sweep({limit}) failed: {e}"))?;
    if native {
        if (out.removed, out.more) != (0, false) {
            return Err(format!("op #{i}: a store with native expiry swept {out:?}; it must report zero"));
        }
        return Ok(0);
    }
    let expired = model.clone().sweep(usize::MAX, now).removed;
    if out.removed > expired.min(limit as u64) {
        return Err(format!("op #{i}: sweep({limit}) removed {} with {expired} expired records", out.removed));
    }
    if out.removed < expired && !out.more {
        return Err(format!(
            "op #{i}: sweep({limit}) removed {} of {expired} expired records and said no more",
            out.removed
        ));
    }
    let mut total = out.removed;
    let mut more = out.more;
    let mut calls = 0;
    while more {
        calls += 1;
        if calls > 100 {
            return Err(format!("op #{i}: sweep still says more after 100 drain calls"));
        }
        let next = store.sweep(64).await.map_err(|e| format!("op #{i} draining sweep failed: {e}"))?;
        total += next.removed;
        more = next.more;
    }
    let removed = model.sweep(usize::MAX, now).removed;
    if total != removed {
        return Err(format!("op #{i}: sweeps removed {total} records in all, the model {removed}"));
    }
    Ok(total)
}

/// One step of the concurrent model test: two to four store operations released together
/// by a barrier, each on its own task, then one clock move or sweep.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    /// Claim, reclaim, complete, fail, extend, get and journal operations racing each other.
    pub ops: Vec<Op>,
    /// Runs alone after the race: `Advance`, `AdvanceTo` or `Sweep`.
    pub then: Op,
}

/// Longest generated batch list.
pub const MAX_BATCHES: usize = 16;

/// The strategy for a concurrent run (1 to [`MAX_BATCHES`] batches of 2 to 4 racing operations).
pub fn batches_strategy() -> impl Strategy<Value = Vec<Batch>> {
    let batch = (proptest::collection::vec(store_op_strategy(), 2..=4), time_op_strategy())
        .prop_map(|(ops, then)| Batch { ops, then });
    proptest::collection::vec(batch, 1..MAX_BATCHES)
}

/// A store operation with its request fixed (tokens resolved before the race).
#[derive(Clone, Debug)]
enum Prepared {
    Claim(ClaimRequest),
    Reclaim(ReclaimRequest),
    Complete(RecordId, FencingToken, StoredResponse),
    Fail(RecordId, FencingToken),
    Extend(RecordId, FencingToken, Duration),
    Get(RecordId),
    JournalPut(RecordId, FencingToken, &'static str, Vec<u8>, bool),
    JournalGet(RecordId, &'static str),
}

impl Prepared {
    fn id(&self) -> RecordId {
        match self {
            Prepared::Claim(r) => r.id(),
            Prepared::Reclaim(r) => r.id,
            Prepared::Complete(id, ..)
            | Prepared::Fail(id, _)
            | Prepared::Extend(id, ..)
            | Prepared::Get(id)
            | Prepared::JournalPut(id, ..)
            | Prepared::JournalGet(id, _) => *id,
        }
    }
}

/// Whether the store's outcome `s` is the model's `m`. A refusal's report of the current
/// record (`Conflict::current`, `LeaseLost::current`) may have been read just after the
/// refusal (a second statement), so it may also be the record as it stood at any later
/// point of the same race (`later`, in order); the refusal itself must be exact.
fn same_outcome(m: &Outcome, s: &Outcome, later: &[Option<Record>]) -> bool {
    if m == s {
        return true;
    }
    match (m, s) {
        (
            Outcome::Reclaim(ReclaimOutcome::Conflict { now: a, .. }),
            Outcome::Reclaim(ReclaimOutcome::Conflict { current, now: b }),
        ) => a == b && later.iter().any(|r| r == current),
        (Outcome::Write(Err((id_a, presented_a, _))), Outcome::Write(Err((id_b, presented_b, current))))
        | (Outcome::JournalPut(Err((id_a, presented_a, _))), Outcome::JournalPut(Err((id_b, presented_b, current)))) => {
            (id_a, presented_a) == (id_b, presented_b) && later.iter().any(|r| r.as_ref().map(|r| r.token) == *current)
        }
        _ => false,
    }
}

/// What one operation returned, comparable between store and model.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Outcome {
    Claim(ClaimOutcome),
    Reclaim(ReclaimOutcome),
    /// `Err` is `LeaseLost { id, presented, current }`.
    Write(Result<Receipt, (RecordId, FencingToken, Option<FencingToken>)>),
    Get(Option<Record>),
    JournalPut(JournalPutOutcome),
    JournalGet(Option<Vec<u8>>),
    /// A journal operation on a store without the capability.
    Unsupported,
}

fn lease_lost_parts(e: StoreError) -> Result<(RecordId, FencingToken, Option<FencingToken>), String> {
    match e {
        StoreError::LeaseLost { id, presented, current } => Ok((id, presented, current)),
        other => Err(format!("store error: {other}")),
    }
}

fn on_model(model: &mut impl Oracle, p: &Prepared, now: UnixMillis, journal: bool) -> Outcome {
    let lost = |e: StoreError| match e {
        StoreError::LeaseLost { id, presented, current } => (id, presented, current),
        // The model only ever refuses with LeaseLost.
        _ => (RecordId::from_bytes([0; 32]), FencingToken(0), None),
    };
    match p {
        Prepared::Claim(req) => Outcome::Claim(model.claim(req, now)),
        Prepared::Reclaim(req) => Outcome::Reclaim(model.reclaim(req, now)),
        Prepared::Complete(id, t, resp) => Outcome::Write(model.complete(*id, *t, resp.clone(), now).map_err(lost)),
        Prepared::Fail(id, t) => Outcome::Write(model.fail(*id, *t, now).map_err(lost)),
        Prepared::Extend(id, t, lease) => Outcome::Write(model.extend(*id, *t, *lease, now).map_err(lost)),
        Prepared::Get(id) => Outcome::Get(model.get(*id, now)),
        Prepared::JournalPut(..) | Prepared::JournalGet(..) if !journal => Outcome::Unsupported,
        Prepared::JournalPut(id, t, name, value, overwrite) => {
            Outcome::JournalPut(model.journal_put(*id, *t, name, value.clone(), *overwrite, now).map_err(lost))
        }
        Prepared::JournalGet(id, name) => Outcome::JournalGet(model.journal_get(*id, name, now)),
    }
}

async fn on_store(store: &dyn Store, p: Prepared) -> Result<Outcome, String> {
    let write = |r: Result<Receipt, StoreError>| match r {
        Ok(r) => Ok(Outcome::Write(Ok(r))),
        Err(e) => lease_lost_parts(e).map(|l| Outcome::Write(Err(l))),
    };
    match p {
        Prepared::Claim(req) => store.claim(req).await.map(Outcome::Claim).map_err(|e| format!("claim: {e}")),
        Prepared::Reclaim(req) => store.reclaim(req).await.map(Outcome::Reclaim).map_err(|e| format!("reclaim: {e}")),
        Prepared::Complete(id, t, resp) => write(store.complete(id, t, resp).await),
        Prepared::Fail(id, t) => write(store.fail(id, t).await),
        Prepared::Extend(id, t, lease) => write(store.extend(id, t, lease).await),
        Prepared::Get(id) => store.get(id).await.map(Outcome::Get).map_err(|e| format!("get: {e}")),
        Prepared::JournalPut(id, t, name, value, overwrite) => {
            match store.journal_put(id, t, name, value, overwrite).await {
                Err(StoreError::Unsupported { .. }) => Ok(Outcome::Unsupported),
                r => journal_put_outcome(r).map(Outcome::JournalPut),
            }
        }
        Prepared::JournalGet(id, name) => match store.journal_get(id, name).await {
            Err(StoreError::Unsupported { .. }) => Ok(Outcome::Unsupported),
            r => r.map(Outcome::JournalGet).map_err(|e| format!("journal_get: {e}")),
        },
    }
}

/// Every order of `0..n`.
fn permutations(n: usize) -> Vec<Vec<usize>> {
    if n == 0 {
        return vec![vec![]];
    }
    let mut out = Vec::new();
    for rest in permutations(n - 1) {
        for at in 0..=rest.len() {
            let mut p = rest.clone();
            p.insert(at, n - 1);
            out.push(p);
        }
    }
    out
}

/// The shared state of a run: the model, what owners hold, the key space.
struct World<O> {
    model: O,
    owners: Owners,
    parts: Vec<(Scope, IdempotencyKey)>,
    ids: Vec<RecordId>,
    responses: [StoredResponse; 5],
    values: [Vec<u8>; 4],
    journal: bool,
}

impl<O: Oracle + Default> World<O> {
    fn new(namespace: &str, journal: bool) -> Self {
        let parts: Vec<(Scope, IdempotencyKey)> = (0..KEYS).map(|k| key_parts(namespace, k)).collect();
        let ids = parts.iter().map(|(s, k)| s.record_id(k)).collect();
        Self {
            model: O::default(),
            owners: Owners::default(),
            parts,
            ids,
            responses: responses(),
            values: journal_values(),
            journal,
        }
    }

    /// Fixes `op`'s request; `None` for clock moves and sweeps.
    fn prepare(&self, op: &Op, now: UnixMillis) -> Option<(usize, usize, Prepared)> {
        let ok = |owner: u8, key: u8| (usize::from(owner) % OWNERS, usize::from(key) % KEYS);
        let resolve =
            |o: usize, k: usize, choice| self.owners.token(o, k, choice, current_token(&self.model, self.ids[k], now));
        Some(match *op {
            Op::Claim { owner, key, fingerprint: f, lease, retention } => {
                let (o, k) = ok(owner, key);
                let (scope, idem_key) = self.parts[k].clone();
                let req = ClaimRequest::new(
                    scope,
                    idem_key,
                    fingerprint(f),
                    ms(&LEASES_MS, lease),
                    ms(&RETENTIONS_MS, retention),
                );
                (o, k, Prepared::Claim(req))
            }
            Op::Reclaim { owner, key, fingerprint: f, token, lease, retention } => {
                let (o, k) = ok(owner, key);
                let req = ReclaimRequest {
                    id: self.ids[k],
                    expected: resolve(o, k, token),
                    fingerprint: fingerprint(f),
                    lease_ttl: ms(&LEASES_MS, lease),
                    retention: ms(&RETENTIONS_MS, retention),
                };
                (o, k, Prepared::Reclaim(req))
            }
            Op::Complete { owner, key, token, response } => {
                let (o, k) = ok(owner, key);
                let resp = self.responses[usize::from(response) % self.responses.len()].clone();
                (o, k, Prepared::Complete(self.ids[k], resolve(o, k, token), resp))
            }
            Op::Fail { owner, key, token } => {
                let (o, k) = ok(owner, key);
                (o, k, Prepared::Fail(self.ids[k], resolve(o, k, token)))
            }
            Op::Extend { owner, key, token, lease } => {
                let (o, k) = ok(owner, key);
                (o, k, Prepared::Extend(self.ids[k], resolve(o, k, token), ms(&EXTENSIONS_MS, lease)))
            }
            Op::Get { owner, key } => {
                let (o, k) = ok(owner, key);
                (o, k, Prepared::Get(self.ids[k]))
            }
            Op::JournalPut { owner, key, token, name, value, overwrite } => {
                let (o, k) = ok(owner, key);
                let name = JOURNAL_NAMES[usize::from(name) % JOURNAL_NAMES.len()];
                let value = self.values[usize::from(value) % self.values.len()].clone();
                (o, k, Prepared::JournalPut(self.ids[k], resolve(o, k, token), name, value, overwrite))
            }
            Op::JournalGet { owner, key, name } => {
                let (o, k) = ok(owner, key);
                (o, k, Prepared::JournalGet(self.ids[k], JOURNAL_NAMES[usize::from(name) % JOURNAL_NAMES.len()]))
            }
            Op::Sweep { .. } | Op::Advance { .. } | Op::AdvanceTo { .. } => return None,
        })
    }

    /// Records what owner `o` learnt about key `k` from `outcome`, and counts it.
    fn learn(&mut self, o: usize, k: usize, outcome: &Outcome, stats: &mut RunStats) -> Result<(), String> {
        let (held, seen, record) = match outcome {
            Outcome::Claim(ClaimOutcome::Claimed(r)) => {
                stats.claimed += 1;
                (true, true, Some(r))
            }
            Outcome::Claim(ClaimOutcome::Existing { record, .. }) => {
                stats.existing += 1;
                (false, true, Some(record))
            }
            Outcome::Reclaim(ReclaimOutcome::Reclaimed(r)) => {
                stats.reclaimed += 1;
                (true, true, Some(r))
            }
            Outcome::Reclaim(ReclaimOutcome::Conflict { current, .. }) => {
                stats.reclaim_conflicts += 1;
                (false, true, current.as_ref())
            }
            Outcome::Write(Ok(r)) => {
                stats.writes += 1;
                if r.token < FencingToken::FIRST || r.expires_at < r.lease_expires_at {
                    return Err(format!("receipt out of order: {r:?}"));
                }
                (false, false, None)
            }
            Outcome::Write(Err(_)) => {
                stats.lease_lost += 1;
                (false, false, None)
            }
            Outcome::Get(r) => {
                stats.hits += u64::from(r.is_some());
                (false, true, r.as_ref())
            }
            Outcome::JournalPut(w) => {
                stats.count_journal_put(w);
                (false, false, None)
            }
            Outcome::JournalGet(v) => {
                stats.journal_hits += u64::from(v.is_some());
                (false, false, None)
            }
            Outcome::Unsupported => {
                stats.journal_unsupported += 1;
                (false, false, None)
            }
        };
        if let Some(r) = record {
            check_record(r)?;
            if held {
                self.owners.held[o][k] = Some(r.token);
            }
            if seen {
                self.owners.seen[o][k] = Some(r.token);
            }
        }
        Ok(())
    }

    /// A clock move (the model's records give the edges).
    fn move_clock(&self, clock: &ManualClock, op: &Op) {
        let now = clock.now();
        match *op {
            Op::Advance { ms } => clock.advance_ms(i64::from(ms % 12_001)),
            Op::AdvanceTo { key, edge, delta } => {
                if let Some(r) = self.model.get(self.ids[usize::from(key) % KEYS], now) {
                    let at = match edge {
                        Edge::Lease => r.lease_expires_at,
                        Edge::Expiry => r.expires_at,
                    };
                    let target = at.0 + i64::from(delta.signum());
                    if target > now.0 {
                        clock.set(UnixMillis(target));
                    }
                }
            }
            _ => {}
        }
    }
}

/// Runs `batches` against `store`: each batch's operations race on their own tasks, then
/// the outcomes must be those of some sequential order of the same operations on the model
/// (linearizability, checked over every order of at most 4 operations); the model adopts
/// that order. Claims, reclaims, completes and fails that are not atomic show up here.
///
/// # Errors
/// The first batch no order explains (or a store error, or a broken record invariant).
pub async fn run_batches(
    store: Arc<dyn Store>,
    clock: &ManualClock,
    namespace: &str,
    batches: &[Batch],
) -> Result<RunStats, String> {
    run_batches_with::<Spec>(store, clock, namespace, batches).await
}

/// [`run_batches`] against the oracle `O` instead of [`Spec`].
///
/// # Errors
/// As [`run_batches`].
pub async fn run_batches_with<O: Oracle + Clone + Default + PartialEq>(
    store: Arc<dyn Store>,
    clock: &ManualClock,
    namespace: &str,
    batches: &[Batch],
) -> Result<RunStats, String> {
    let native = store.capabilities().native_expiry;
    let mut world = World::<O>::new(namespace, store.capabilities().journal);
    let mut stats = RunStats::default();
    for (b, batch) in batches.iter().enumerate() {
        let now = clock.now();
        let prepared: Vec<(usize, usize, Prepared)> =
            batch.ops.iter().filter_map(|op| world.prepare(op, now)).collect();
        stats.ops += prepared.len() as u64 + 1;
        let barrier = Arc::new(tokio::sync::Barrier::new(prepared.len()));
        let tasks: Vec<_> = prepared
            .iter()
            .map(|(_, _, p)| {
                let (store, barrier, p) = (Arc::clone(&store), Arc::clone(&barrier), p.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    on_store(store.as_ref(), p).await
                })
            })
            .collect();
        let mut seen = Vec::with_capacity(tasks.len());
        for t in tasks {
            let outcome = t.await.map_err(|e| format!("batch #{b}: a task died: {e}"))?;
            seen.push(outcome.map_err(|e| format!("batch #{b} {:?}: {e}", batch.ops))?);
        }
        let mut explaining: Vec<(O, Vec<usize>)> = permutations(prepared.len())
            .into_iter()
            .filter_map(|order| {
                let mut model = world.model.clone();
                // Each operation's model outcome, and the records its key held from its turn on.
                let mut outcomes: Vec<Option<Outcome>> = vec![None; prepared.len()];
                let mut later: Vec<Vec<Option<Record>>> = vec![Vec::new(); prepared.len()];
                for (pos, &i) in order.iter().enumerate() {
                    outcomes[i] = Some(on_model(&mut model, &prepared[i].2, now, world.journal));
                    for &j in &order[..=pos] {
                        later[j].push(model.get(prepared[j].2.id(), now));
                    }
                }
                let explains = outcomes
                    .iter()
                    .zip(&seen)
                    .zip(&later)
                    .all(|((m, s), later)| m.as_ref().is_some_and(|m| same_outcome(m, s, later)));
                explains.then_some((model, order))
            })
            .collect();
        if explaining.is_empty() {
            return Err(format!(
                "batch #{b}: no sequential order of the racing operations {:?} explains what the store returned: {seen:#?}",
                batch.ops
            ));
        }
        // Racing journal puts that all return `Written` (overwrites) leave a journal that
        // depends on the order, which their outcomes do not reveal: read what the store
        // holds and keep an order that explains it too.
        if explaining.iter().any(|(m, _)| *m != explaining[0].0) {
            let mut held = Vec::new();
            for &id in &world.ids {
                for name in JOURNAL_NAMES {
                    match store.journal_get(id, name).await {
                        Ok(v) => held.push((id, name, v)),
                        Err(StoreError::Unsupported { .. }) => {}
                        Err(e) => return Err(format!("batch #{b}: journal_get after the race: {e}")),
                    }
                }
            }
            explaining.retain(|(m, _)| held.iter().all(|(id, name, v)| m.journal_get(*id, name, now) == *v));
            if explaining.is_empty() {
                return Err(format!(
                    "batch #{b}: no sequential order of the racing operations {:?} explains the journal the store \
                     holds afterwards: {held:?}",
                    batch.ops
                ));
            }
        }
        let (model, order) = explaining.remove(0);
        world.model = model;
        for i in order {
            let (o, k, ref p) = prepared[i];
            if matches!((p, &seen[i]), (Prepared::Extend(..), Outcome::Write(Ok(_)))) {
                stats.extended += 1;
            }
            world.learn(o, k, &seen[i], &mut stats)?;
        }
        match batch.then {
            Op::Sweep { limit } => {
                stats.swept += sweep(b, store.as_ref(), &mut world.model, now, usize::from(limit % 6), native).await?;
            }
            ref op => world.move_clock(clock, op),
        }
    }
    Ok(stats)
}

/// Runs `cases` random batch lists against fresh stores of `backend` (see [`run_batches`]).
///
/// # Errors
/// The shrunk failing batch list and the first unexplained batch.
pub fn check_concurrent(
    rt: &tokio::runtime::Runtime,
    backend: &Arc<dyn Backend>,
    cases: u32,
) -> Result<RunStats, String> {
    check_concurrent_with::<Spec>(rt, backend, cases)
}

/// [`check_concurrent`] against the oracle `O` instead of [`Spec`].
///
/// # Errors
/// As [`check_concurrent`].
pub fn check_concurrent_with<O: Oracle + Clone + Default + PartialEq>(
    rt: &tokio::runtime::Runtime,
    backend: &Arc<dyn Backend>,
    cases: u32,
) -> Result<RunStats, String> {
    let _sweeps = crate::blocking_sweep_lock();
    let total = std::sync::Mutex::new(RunStats::default());
    let config = Config { cases, failure_persistence: None, ..Config::default() };
    let mut runner = TestRunner::new(config);
    let outcome = runner.run(&batches_strategy(), |batches| {
        rt.block_on(async {
            let clock = ManualClock::starting_now();
            let store = backend.open(clock.clone()).await;
            if !store.capabilities().native_expiry {
                clock.set(UnixMillis(clock.now_ms() - crate::SWEEP_REWIND_MS));
            }
            let namespace = format!("model-{}", uuid::Uuid::new_v4().simple());
            run_batches_with::<O>(store, &clock, &namespace, &batches).await
        })
        .map(|stats| total.lock().unwrap_or_else(std::sync::PoisonError::into_inner).add(&stats))
        .map_err(TestCaseError::fail)
    });
    match outcome {
        Ok(()) => Ok(total.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner)),
        Err(TestError::Fail(reason, batches)) => Err(format!(
            "the store is not linearizable against the model: {reason}\nminimal failing batches: {batches:#?}"
        )),
        Err(e) => Err(format!("concurrent model test aborted: {e}")),
    }
}
