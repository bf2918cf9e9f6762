//! The reference model: the state machine over an ordinary map, synchronous, with `now`
//! as an argument. It is the oracle the conformance suite's model test compares every
//! backend against, and the engine of [`crate::MemoryStore`].

use std::collections::BTreeMap;

use crate::record::{FencingToken, Record, StoredResponse};
use crate::scope::RecordId;
use crate::store::{StoreError, SweepOutcome};
use crate::time::UnixMillis;
use crate::transition::{self, ClaimOutcome, ClaimRequest, ReclaimOutcome, ReclaimRequest};

/// Records by id.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Model {
    records: BTreeMap<RecordId, Record>,
}

impl Model {
    /// An empty model.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// See [`crate::Store::claim`].
    pub fn claim(&mut self, req: &ClaimRequest, now: UnixMillis) -> ClaimOutcome {
        let (write, outcome) = transition::claim(self.records.get(&req.id), req, now);
        if let Some(r) = write {
            self.records.insert(r.id, r);
        }
        outcome
    }

    /// See [`crate::Store::reclaim`].
    pub fn reclaim(&mut self, req: &ReclaimRequest, now: UnixMillis) -> ReclaimOutcome {
        let (write, outcome) = transition::reclaim(self.records.get(&req.id), req, now);
        if let Some(r) = write {
            self.records.insert(r.id, r);
        }
        outcome
    }

    /// See [`crate::Store::complete`].
    ///
    /// # Errors
    /// [`StoreError::LeaseLost`] when `token` is not the current claim.
    pub fn complete(
        &mut self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
        now: UnixMillis,
    ) -> Result<Record, StoreError> {
        let r = transition::complete(self.records.get(&id), id, token, response, now)
            .map_err(|l| StoreError::lease_lost(id, l))?;
        self.records.insert(id, r.clone());
        Ok(r)
    }

    /// See [`crate::Store::fail`].
    ///
    /// # Errors
    /// [`StoreError::LeaseLost`] when `token` is not the current claim.
    pub fn fail(&mut self, id: RecordId, token: FencingToken, now: UnixMillis) -> Result<Record, StoreError> {
        let r = transition::fail(self.records.get(&id), id, token, now).map_err(|l| StoreError::lease_lost(id, l))?;
        self.records.insert(id, r.clone());
        Ok(r)
    }

    /// See [`crate::Store::get`].
    #[must_use]
    pub fn get(&self, id: RecordId, now: UnixMillis) -> Option<Record> {
        self.records.get(&id).filter(|r| !r.is_expired(now)).cloned()
    }

    /// See [`crate::Store::sweep`].
    pub fn sweep(&mut self, limit: usize, now: UnixMillis) -> SweepOutcome {
        let expired: Vec<RecordId> =
            self.records.values().filter(|r| r.is_expired(now)).map(|r| r.id).take(limit.saturating_add(1)).collect();
        let more = expired.len() > limit;
        let mut removed = 0;
        for id in expired.into_iter().take(limit) {
            self.records.remove(&id);
            removed += 1;
        }
        SweepOutcome { removed, more }
    }

    /// Number of records held, expired or not (for tests of the sweep).
    #[must_use]
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// Whether no record is held.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }
}
