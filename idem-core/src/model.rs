//! The reference model: the smallest [`RecordTable`], three ordinary maps (records, the
//! expiry index, the journal). [`crate::engine`] runs every store operation on it
//! synchronously, with `now` as an argument, exactly as on redb's and SQLite's tables; it
//! is the table of [`crate::MemoryStore`]. It is not the conformance suite's oracle: that
//! is `idem_conformance::Spec`, which restates the rules instead of running them.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::record::Record;
use crate::scope::RecordId;
use crate::store::StoreError;
use crate::table::{Expired, RecordRead, RecordTable};
use crate::time::UnixMillis;

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

impl Model {
    /// An empty model.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
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

    fn create(&mut self, new: &Record) -> Result<Option<Record>, StoreError> {
        // One hash lookup whichever way it goes.
        match self.records.entry(new.id) {
            Entry::Occupied(stored) => Ok(Some(Record::clone(stored.get()))),
            Entry::Vacant(slot) => {
                slot.insert(Box::new(new.clone()));
                self.expiry.insert(Expired { expires_at: new.expires_at, id: new.id });
                Ok(None)
            }
        }
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
