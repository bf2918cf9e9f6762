//! A value the engine refuses before writing anything (redb's value-size limit) fails only
//! its own caller: the rest of its batch is committed and the batch does not count as
//! failed. A refused write must not count as a change.
#![cfg(feature = "group-commit")]

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use idem_core::engine::Write;
use idem_core::group_commit::{BatchConfig, Engine, GroupCommit, Linger, TransactionFailed};
use idem_core::{
    ClaimOutcome, ClaimRequest, Clock, Endpoint, Expired, Fingerprint, IdempotencyKey, ManualClock, Model, Record,
    RecordId, RecordRead, RecordTable, Scope, StoreError, UnixMillis,
};

/// The model as a table that refuses, before changing anything, every write of one record.
struct Refusing<'m> {
    model: &'m mut Model,
    refuse: RecordId,
}

impl RecordRead for Refusing<'_> {
    fn read(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        self.model.read(id)
    }
    fn journal_read(&self, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.model.journal_read(id, name)
    }
}

impl RecordTable for Refusing<'_> {
    fn write(&mut self, old: Option<&Record>, new: &Record) -> Result<(), StoreError> {
        if new.id == self.refuse {
            return Err(StoreError::unavailable("model", "value too large", false, "refused before writing"));
        }
        self.model.write(old, new)
    }
    fn expired(&mut self, now: UnixMillis, limit: usize) -> Result<Vec<Expired>, StoreError> {
        self.model.expired(now, limit)
    }
    fn remove(&mut self, expired: Expired) -> Result<(), StoreError> {
        self.model.remove(expired)
    }
    fn journal_write(&mut self, id: RecordId, name: &str, value: &[u8]) -> Result<(), StoreError> {
        self.model.journal_write(id, name, value)
    }
    fn journal_clear(&mut self, id: RecordId) -> Result<(), StoreError> {
        self.model.journal_clear(id)
    }
}

/// Transactions on a copy of the committed model, swapped in on commit.
struct ModelEngine {
    committed: Arc<Mutex<Model>>,
    refuse: RecordId,
}

impl Engine for ModelEngine {
    fn backend(&self) -> &'static str {
        "model"
    }

    fn transaction(
        &mut self,
        _durable: bool,
        apply: &mut dyn FnMut(&mut dyn RecordTable) -> bool,
    ) -> Result<(), TransactionFailed> {
        let mut working = self.committed.lock().unwrap_or_else(PoisonError::into_inner).clone();
        if apply(&mut Refusing { model: &mut working, refuse: self.refuse }) {
            *self.committed.lock().unwrap_or_else(PoisonError::into_inner) = working;
        }
        Ok(())
    }
}

fn req(key: &str) -> ClaimRequest {
    let scope = Scope::new("tenant", Endpoint::new("POST", "/v1/workers")).expect("scope");
    let key = IdempotencyKey::parse(key.as_bytes()).expect("key");
    ClaimRequest::new(scope, key, Fingerprint::of_bytes(b"{}"), Duration::from_secs(5), Duration::from_secs(60))
}

#[tokio::test]
async fn a_refused_write_fails_only_its_caller() {
    let (big, small) = (req("big"), req("small"));
    let committed = Arc::new(Mutex::new(Model::new()));
    let clock = ManualClock::new(UnixMillis(1_800_000_000_000));
    let engine = ModelEngine { committed: Arc::clone(&committed), refuse: big.id };
    // Two operations per batch, and a linger long enough that only a full batch runs.
    let config = BatchConfig::default().with_max_batch(2).with_linger(Linger::Fixed(Duration::from_secs(30)));
    let writer = GroupCommit::start(engine, Arc::new(clock.clone()), config).expect("writer");

    let (refused, claimed) =
        tokio::join!(writer.submit(Write::Claim(big.clone())), writer.submit(Write::Claim(small.clone())));
    assert!(matches!(refused, Err(StoreError::Unavailable { .. })), "the refused caller gets its error: {refused:?}");
    let claimed = claimed.expect("the other claim").into_claim("model").expect("a claim outcome");
    assert!(matches!(claimed, ClaimOutcome::Claimed(_)), "the other claim of the batch is applied: {claimed:?}");

    let stats = writer.stats();
    assert_eq!((stats.batches, stats.failed_batches, stats.read_only_batches), (1, 0, 0));
    let model = committed.lock().expect("model");
    assert!(model.get(small.id, clock.now()).is_some(), "the batch was committed");
    assert!(model.get(big.id, clock.now()).is_none(), "nothing of the refused claim");
}
