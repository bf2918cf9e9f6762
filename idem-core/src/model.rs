//! The reference model: the state machine over an ordinary map, synchronous, with `now`
//! as an argument. It is the oracle the conformance suite's model test compares every
//! backend against, and the engine of [`crate::MemoryStore`].

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, BinaryHeap, HashMap};

use crate::record::{FencingToken, Record, StoredResponse};
use crate::scope::RecordId;
use crate::store::{JournalWrite, StoreError, SweepOutcome};
use crate::time::UnixMillis;
use crate::transition::{self, ClaimOutcome, ClaimRequest, ReclaimOutcome, ReclaimRequest};

/// Records by id.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Model {
    // A hash map: point lookups on every operation stay flat at hundreds of thousands of
    // records (the memory store behind the HTTP layer); the sweep, the one ordered walk,
    // restores id order itself. Boxed, so that growing the table moves 40-byte entries,
    // not whole records.
    records: HashMap<RecordId, Box<Record>>,
    journal: BTreeMap<(RecordId, String), Vec<u8>>,
}

impl Model {
    /// An empty model.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// See [`crate::Store::claim`].
    pub fn claim(&mut self, req: &ClaimRequest, now: UnixMillis) -> ClaimOutcome {
        // One hash lookup for the read and the write.
        let entry = self.records.entry(req.id);
        let current = match &entry {
            Entry::Occupied(o) => Some(&**o.get()),
            Entry::Vacant(_) => None,
        };
        let (write, outcome) = transition::claim(current, req, now);
        if let Some(r) = write {
            // A claim that replaces an expired record starts with an empty journal.
            drop_journal(&mut self.journal, r.id);
            match entry {
                Entry::Occupied(mut o) => **o.get_mut() = r,
                Entry::Vacant(v) => {
                    v.insert(Box::new(r));
                }
            }
        }
        outcome
    }

    fn drop_journal(&mut self, id: RecordId) {
        drop_journal(&mut self.journal, id);
    }

    /// See [`crate::Store::journal_put`].
    ///
    /// # Errors
    /// [`StoreError::LeaseLost`] when `token` is not the current claim.
    pub fn journal_put(
        &mut self,
        id: RecordId,
        token: FencingToken,
        name: &str,
        value: Vec<u8>,
        overwrite: bool,
        now: UnixMillis,
    ) -> Result<JournalWrite, StoreError> {
        transition::check_journal_owner(self.records.get(&id).map(|r| &**r), id, token, now)
            .map_err(|l| StoreError::lease_lost(id, l))?;
        let k = (id, name.to_string());
        if !overwrite && let Some(v) = self.journal.get(&k) {
            return Ok(JournalWrite::Exists(v.clone()));
        }
        self.journal.insert(k, value);
        Ok(JournalWrite::Written)
    }

    /// See [`crate::Store::journal_get`].
    #[must_use]
    pub fn journal_get(&self, id: RecordId, name: &str, now: UnixMillis) -> Option<Vec<u8>> {
        self.get(id, now)?;
        self.journal.get(&(id, name.to_string())).cloned()
    }

    /// See [`crate::Store::reclaim`].
    pub fn reclaim(&mut self, req: &ReclaimRequest, now: UnixMillis) -> ReclaimOutcome {
        let slot = self.records.get_mut(&req.id);
        let (write, outcome) = transition::reclaim(slot.as_deref().map(|r| &**r), req, now);
        if let Some(r) = write {
            // A write only follows a present record, so `slot` is always `Some` here.
            match slot {
                Some(slot) => **slot = r,
                None => {
                    self.records.insert(r.id, Box::new(r));
                }
            }
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
        let slot = self.records.get_mut(&id);
        let r = transition::complete(slot.as_deref().map(|r| &**r), id, token, response, now)
            .map_err(|l| StoreError::lease_lost(id, l))?;
        // The transition only succeeds on a present record, so `slot` is always `Some` here.
        match slot {
            Some(slot) => Record::clone_from(slot, &r),
            None => {
                self.records.insert(id, Box::new(r.clone()));
            }
        }
        Ok(r)
    }

    /// See [`crate::Store::fail`].
    ///
    /// # Errors
    /// [`StoreError::LeaseLost`] when `token` is not the current claim.
    pub fn fail(&mut self, id: RecordId, token: FencingToken, now: UnixMillis) -> Result<Record, StoreError> {
        let slot = self.records.get_mut(&id);
        let r = transition::fail(slot.as_deref().map(|r| &**r), id, token, now)
            .map_err(|l| StoreError::lease_lost(id, l))?;
        // The transition only succeeds on a present record, so `slot` is always `Some` here.
        match slot {
            Some(slot) => Record::clone_from(slot, &r),
            None => {
                self.records.insert(id, Box::new(r.clone()));
            }
        }
        Ok(r)
    }

    /// See [`crate::Store::get`].
    #[must_use]
    pub fn get(&self, id: RecordId, now: UnixMillis) -> Option<Record> {
        self.records.get(&id).filter(|r| !r.is_expired(now)).map(|r| Record::clone(r))
    }

    /// See [`crate::Store::sweep`].
    ///
    /// Removes the expired records with the smallest ids first (the order is not part of
    /// the contract, but a fixed one keeps runs against other stores comparable). Memory is
    /// bounded by `limit`, not by the number of expired records.
    pub fn sweep(&mut self, limit: usize, now: UnixMillis) -> SweepOutcome {
        // The `limit + 1` smallest expired ids (one more than the batch, to tell `more`), kept
        // in a max-heap so the largest of them is the one a smaller id displaces.
        let keep = limit.saturating_add(1);
        let mut smallest: BinaryHeap<RecordId> = BinaryHeap::new();
        for r in self.records.values().filter(|r| r.is_expired(now)) {
            if smallest.len() < keep {
                smallest.push(r.id);
            } else if smallest.peek().is_some_and(|largest| r.id < *largest) {
                smallest.pop();
                smallest.push(r.id);
            }
        }
        let more = smallest.len() > limit;
        let expired = smallest.into_sorted_vec();
        let mut removed = 0;
        for id in expired.into_iter().take(limit) {
            self.records.remove(&id);
            self.drop_journal(id);
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

/// Removes every journal entry of record `id`.
fn drop_journal(journal: &mut BTreeMap<(RecordId, String), Vec<u8>>, id: RecordId) {
    if journal.is_empty() {
        return;
    }
    let names: Vec<_> =
        journal.range((id, String::new())..).take_while(|((i, _), _)| *i == id).map(|(k, _)| k.clone()).collect();
    for k in names {
        journal.remove(&k);
    }
}
