//! The reference model: the state machine over ordinary maps, synchronous, with `now` as an
//! argument. It is the oracle the conformance suite's model test compares every backend
//! against, and the engine of [`crate::MemoryStore`].
//!
//! It is also the smallest [`RecordTable`]: every operation below is the shared
//! [`crate::engine`] run on three maps (records, the expiry index, the journal), exactly as
//! redb and SQLite run it on their tables.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::engine;
use crate::record::{FencingToken, Record, StoredResponse};
use crate::scope::RecordId;
use crate::store::{JournalWrite, StoreError, SweepOutcome};
use crate::table::{Expired, RecordRead, RecordTable};
use crate::time::UnixMillis;
use crate::transition::{ClaimOutcome, ClaimRequest, ReclaimOutcome, ReclaimRequest};

/// Records by id.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Model {
    // A hash map: point lookups on every operation stay flat at hundreds of thousands of
    // records (the memory store behind the HTTP layer). Boxed, so that growing the table
    // moves pointers, not whole records.
    records: HashMap<RecordId, Box<Record>>,
    /// One entry per record, ordered by `expires_at`: a sweep visits only expired records.
    expiry: BTreeSet<Expired>,
    journal: BTreeMap<(RecordId, String), Vec<u8>>,
}

/// The maps never fail, so every engine call on them succeeds; this keeps the model's
/// methods infallible for the oracle's callers.
fn infallible<T>(result: Result<T, StoreError>) -> T {
    match result {
        Ok(v) => v,
        // No method of the map-backed table returns an error.
        Err(e) => unreachable!("the in-memory record table failed: {e}"),
    }
}

impl Model {
    /// An empty model.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// See [`crate::Store::claim`].
    pub fn claim(&mut self, req: &ClaimRequest, now: UnixMillis) -> ClaimOutcome {
        infallible(engine::claim(self, req, now))
    }

    /// See [`crate::Store::reclaim`].
    pub fn reclaim(&mut self, req: &ReclaimRequest, now: UnixMillis) -> ReclaimOutcome {
        infallible(engine::reclaim(self, req, now))
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
        engine::complete(self, id, token, response, now)
    }

    /// See [`crate::Store::fail`].
    ///
    /// # Errors
    /// [`StoreError::LeaseLost`] when `token` is not the current claim.
    pub fn fail(&mut self, id: RecordId, token: FencingToken, now: UnixMillis) -> Result<Record, StoreError> {
        engine::fail(self, id, token, now)
    }

    /// See [`crate::Store::extend`].
    ///
    /// # Errors
    /// [`StoreError::LeaseLost`] when `token` is not the current claim.
    pub fn extend(
        &mut self,
        id: RecordId,
        token: FencingToken,
        lease_ttl: std::time::Duration,
        now: UnixMillis,
    ) -> Result<Record, StoreError> {
        engine::extend(self, id, token, lease_ttl, now)
    }

    /// See [`crate::Store::get`].
    #[must_use]
    pub fn get(&self, id: RecordId, now: UnixMillis) -> Option<Record> {
        infallible(engine::get(self, id, now))
    }

    /// See [`crate::Store::sweep`]: the oldest expiry first, like every store with an
    /// expiry index. Memory is bounded by `limit`, not by the number of expired records.
    pub fn sweep(&mut self, limit: usize, now: UnixMillis) -> SweepOutcome {
        infallible(engine::sweep(self, limit, now))
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
        engine::journal_put(self, id, token, name, &value, overwrite, now)
    }

    /// See [`crate::Store::journal_get`].
    #[must_use]
    pub fn journal_get(&self, id: RecordId, name: &str, now: UnixMillis) -> Option<Vec<u8>> {
        infallible(engine::journal_get(self, id, name, now))
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

impl RecordRead for Model {
    fn read(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        Ok(self.records.get(&id).map(|r| Record::clone(r)))
    }

    fn journal_read(&self, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self.journal.get(&(id, name.to_owned())).cloned())
    }

    fn scan(&self, visit: &mut dyn FnMut(Record)) -> Result<(), StoreError> {
        for record in self.records.values() {
            visit(Record::clone(record));
        }
        Ok(())
    }
}

impl Model {
    /// Keeps the expiry index at one entry per record.
    fn index(&mut self, old: Option<&Record>, new: &Record) {
        if old.map(|o| o.expires_at) != Some(new.expires_at) {
            if let Some(o) = old {
                self.expiry.remove(&Expired { expires_at: o.expires_at, id: o.id });
            }
            self.expiry.insert(Expired { expires_at: new.expires_at, id: new.id });
        }
    }
}

impl RecordTable for Model {
    fn write(&mut self, old: Option<&Record>, new: &Record) -> Result<(), StoreError> {
        self.index(old, new);
        match self.records.get_mut(&new.id) {
            Some(slot) => Record::clone_from(slot, new),
            None => {
                self.records.insert(new.id, Box::new(new.clone()));
            }
        }
        Ok(())
    }

    fn write_owned(&mut self, old: Option<&Record>, new: Record) -> Result<(), StoreError> {
        self.index(old, &new);
        self.records.insert(new.id, Box::new(new));
        Ok(())
    }

    fn expired(&mut self, now: UnixMillis, limit: usize) -> Result<Vec<Expired>, StoreError> {
        Ok(self.expiry.iter().take_while(|e| e.expires_at <= now).take(limit).copied().collect())
    }

    fn remove(&mut self, expired: Expired) -> Result<(), StoreError> {
        self.expiry.remove(&expired);
        self.records.remove(&expired.id);
        Ok(())
    }

    fn journal_write(&mut self, id: RecordId, name: &str, value: &[u8]) -> Result<(), StoreError> {
        self.journal.insert((id, name.to_owned()), value.to_vec());
        Ok(())
    }

    fn journal_clear(&mut self, id: RecordId) -> Result<(), StoreError> {
        if self.journal.is_empty() {
            return Ok(());
        }
        let names: Vec<_> = self
            .journal
            .range((id, String::new())..)
            .take_while(|((of, _), _)| *of == id)
            .map(|(k, _)| k.clone())
            .collect();
        for k in names {
            self.journal.remove(&k);
        }
        Ok(())
    }
}
