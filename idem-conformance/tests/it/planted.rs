//! A wrong rule in the shared engine was invisible to the model test, whose oracle ran the same engine.
//!
//! The memory, redb and SQLite stores and the file-store example all run
//! `idem_core::engine`. Here a store is exactly that engine over an [`idem_core::Model`]
//! table, with one rule planted wrong: a reclaim ignores the fingerprint, so a different
//! request takes over a failed or abandoned attempt (and would replay its response to the
//! first client). The model test alone, against its oracle [`Spec`], must fail it; the
//! same test against an oracle that runs the same mutated engine passes it, which is the
//! blind spot an engine-based oracle had.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use idem_conformance::{Backend, Oracle, model_test};

use crate::engine::Engine;
use idem_core::{
    Capabilities, ClaimOutcome, ClaimRequest, Clock, FencingToken, JournalWrite, ManualClock, MemoryStore, Receipt,
    ReclaimOutcome, ReclaimRequest, Record, RecordId, Store, StoreError, StoredResponse, SweepOutcome, UnixMillis,
};

/// Enough cases that a run meets the planted rule many times over (a case meets it only
/// when a reclaim with the other fingerprint presents the current token of a failed or
/// abandoned record), few enough to run in seconds.
const CASES: u32 = 500;

/// The engine with the planted rule.
type Mutant = Engine<true>;

/// [`Mutant`] as a store: every operation under one lock, at the clock's `now`.
#[derive(Debug)]
struct MutantStore {
    table: Mutex<Mutant>,
    clock: ManualClock,
}

impl MutantStore {
    fn with<T>(&self, op: impl FnOnce(&mut Mutant, UnixMillis) -> T) -> T {
        op(&mut self.table.lock().unwrap_or_else(PoisonError::into_inner), self.clock.now())
    }
}

#[async_trait]
impl Store for MutantStore {
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        Ok(self.with(|m, now| m.claim(&req, now)))
    }
    async fn reclaim(&self, req: ReclaimRequest) -> Result<ReclaimOutcome, StoreError> {
        Ok(self.with(|m, now| m.reclaim(&req, now)))
    }
    async fn complete(
        &self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Receipt, StoreError> {
        self.with(|m, now| m.complete(id, token, response, now))
    }
    async fn fail(&self, id: RecordId, token: FencingToken) -> Result<Receipt, StoreError> {
        self.with(|m, now| m.fail(id, token, now))
    }
    async fn extend(&self, id: RecordId, token: FencingToken, lease_ttl: Duration) -> Result<Receipt, StoreError> {
        self.with(|m, now| m.extend(id, token, lease_ttl, now))
    }
    async fn get(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        Ok(self.with(|m, now| m.get(id, now)))
    }
    async fn sweep(&self, limit: usize) -> Result<SweepOutcome, StoreError> {
        Ok(self.with(|m, now| m.sweep(limit, now)))
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities { backend: "planted", journal: true, ..Capabilities::NONE }
    }
    async fn journal_put(
        &self,
        id: RecordId,
        token: FencingToken,
        name: &str,
        value: Vec<u8>,
        overwrite: bool,
    ) -> Result<JournalWrite, StoreError> {
        self.with(|m, now| m.journal_put(id, token, name, value, overwrite, now))
    }
    async fn journal_get(&self, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self.with(|m, now| m.journal_get(id, name, now)))
    }
}

/// The mutant store, or (the control) the memory store, which runs the engine unchanged.
struct Planted {
    mutant: bool,
}

#[async_trait]
impl Backend for Planted {
    async fn open(&self, clock: ManualClock) -> Arc<dyn Store> {
        if self.mutant {
            Arc::new(MutantStore { table: Mutex::default(), clock })
        } else {
            Arc::new(MemoryStore::with_clock(Arc::new(clock)))
        }
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("a runtime")
}

#[test]
fn the_model_test_alone_fails_an_engine_with_a_planted_wrong_rule() {
    let rt = runtime();
    let mutant: Arc<dyn Backend> = Arc::new(Planted { mutant: true });
    let failure = model_test::check(&rt, &mutant, CASES).expect_err("the model test passed the planted rule");
    eprintln!("{failure}");
    // The divergence is the planted rule's: a reclaim with the other fingerprint won.
    assert!(failure.contains("Reclaim") && failure.contains("Reclaimed"), "{failure}");
    // The control: the unchanged engine passes the same run.
    let memory: Arc<dyn Backend> = Arc::new(Planted { mutant: false });
    model_test::check(&rt, &memory, CASES).expect("the unchanged engine passes");
}

#[test]
fn an_oracle_running_the_same_engine_passes_the_planted_rule() {
    let rt = runtime();
    let mutant: Arc<dyn Backend> = Arc::new(Planted { mutant: true });
    let stats = model_test::check_with::<Mutant>(&rt, &mutant, CASES).expect("the mutant agrees with itself");
    // Not vacuous: reclaims won, so the planted rule was exercised.
    assert!(stats.reclaimed > 0, "{stats:?}");
    model_test::check_concurrent_with::<Mutant>(&rt, &mutant, CASES / 4).expect("the mutant agrees with itself");
}
