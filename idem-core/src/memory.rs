//! Stores that run the engine under one mutex: [`TableStore`], for any [`RecordTable`]
//! whose every operation may run whole under a lock, and [`MemoryStore`], the model
//! behind it (for tests, docs and single-process prototypes; nothing survives the
//! process).

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;

use crate::engine;
use crate::list::{ListFilter, Listing};
use crate::model::Model;
use crate::record::{FencingToken, Record, StoredResponse};
use crate::scope::RecordId;
use crate::settle::Settlements;
use crate::store::{Capabilities, JournalWrite, Receipt, Store, StoreError, SweepOutcome};
use crate::table::RecordTable;
use crate::time::{Clock, SystemClock, UnixMillis};
use crate::transition::{ClaimOutcome, ClaimRequest, ReclaimOutcome, ReclaimRequest};

/// A [`Store`] over a [`RecordTable`] behind one mutex: each operation locks it, reads
/// `now` from the clock and runs the [`crate::engine`] function, so the lock is the
/// transaction. Clones share the table. Right for in-memory tables and for simple custom
/// stores (the file-store example); an engine with real transactions and fsyncs wants
/// the group-commit executor instead.
pub struct TableStore<T> {
    table: Arc<Mutex<T>>,
    clock: Arc<dyn Clock>,
    capabilities: Capabilities,
    settlements: Arc<Settlements>,
}

/// The in-memory reference store: the [`Model`] behind a mutex.
pub type MemoryStore = TableStore<Model>;

impl<T> Clone for TableStore<T> {
    fn clone(&self) -> Self {
        let (table, clock, settlements) =
            (Arc::clone(&self.table), Arc::clone(&self.clock), Arc::clone(&self.settlements));
        Self { table, clock, capabilities: self.capabilities, settlements }
    }
}

impl<T> fmt::Debug for TableStore<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TableStore")
            .field("table", &std::any::type_name::<T>())
            .field("clock", &self.clock)
            .finish_non_exhaustive()
    }
}

impl<T> TableStore<T> {
    /// A store on `table`, timed by `clock`, offering the journal (every table has one)
    /// and no other capability.
    #[must_use]
    pub fn from_table(table: T, clock: Arc<dyn Clock>) -> Self {
        Self {
            table: Arc::new(Mutex::new(table)),
            clock,
            capabilities: Capabilities { backend: "memory", journal: true, ..Capabilities::NONE },
            settlements: Arc::default(),
        }
    }

    /// What the table's engine offers beyond the journal.
    #[must_use]
    pub(crate) fn with_capabilities(mut self, capabilities: Capabilities) -> Self {
        self.capabilities = capabilities;
        self
    }

    fn lock(&self) -> MutexGuard<'_, T> {
        // The engine decides before it writes, and each write replaces a whole entry: a
        // panic under the lock cannot leave half a transition, so a poisoned lock is
        // still consistent.
        self.table.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn run<R>(&self, op: impl FnOnce(&mut T, UnixMillis) -> Result<R, StoreError>) -> Result<R, StoreError> {
        let mut table = self.lock();
        op(&mut table, self.clock.now())
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// An empty in-memory store on the system clock.
    #[must_use]
    pub fn new() -> Self {
        Self::with_clock(Arc::new(SystemClock))
    }

    /// An empty in-memory store on `clock` (tests pass a [`crate::ManualClock`]).
    #[must_use]
    pub fn with_clock(clock: Arc<dyn Clock>) -> Self {
        // The model can enumerate its map, so the memory store lists records too.
        Self::from_table(Model::new(), clock).with_capabilities(Capabilities {
            backend: "memory",
            journal: true,
            list: true,
            ..Capabilities::NONE
        })
    }
}

#[async_trait]
impl<T: RecordTable + Send + 'static> Store for TableStore<T> {
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        self.run(|t, now| engine::claim(t, &req, now))
    }

    async fn reclaim(&self, req: ReclaimRequest) -> Result<ReclaimOutcome, StoreError> {
        self.run(|t, now| engine::reclaim(t, &req, now))
    }

    async fn complete(
        &self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Receipt, StoreError> {
        self.run(|t, now| engine::complete(t, id, token, response, now)).inspect(|_| self.settlements.settle(id))
    }

    async fn fail(&self, id: RecordId, token: FencingToken) -> Result<Receipt, StoreError> {
        self.run(|t, now| engine::fail(t, id, token, now)).inspect(|_| self.settlements.settle(id))
    }

    async fn extend(&self, id: RecordId, token: FencingToken, lease_ttl: Duration) -> Result<Receipt, StoreError> {
        self.run(|t, now| engine::extend(t, id, token, lease_ttl, now))
    }

    async fn get(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        self.run(|t, now| engine::get(t, id, now))
    }

    async fn sweep(&self, limit: usize) -> Result<SweepOutcome, StoreError> {
        self.run(|t, now| engine::sweep(t, limit, now))
    }

    fn capabilities(&self) -> Capabilities {
        self.capabilities
    }

    async fn journal_put(
        &self,
        id: RecordId,
        token: FencingToken,
        name: &str,
        value: Vec<u8>,
        overwrite: bool,
    ) -> Result<JournalWrite, StoreError> {
        self.run(|t, now| engine::journal_put(t, id, token, name, &value, overwrite, now))
    }

    async fn journal_get(&self, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.run(|t, now| engine::journal_get(t, id, name, now))
    }

    /// Through [`crate::table::RecordRead::list`] under the lock: a table that cannot scan
    /// answers `Unsupported` (and its store should leave [`Capabilities::list`] unset).
    async fn list(&self, filter: ListFilter) -> Result<Listing, StoreError> {
        self.run(|t, now| t.list(&filter, now))
    }

    /// Settled by this handle and its clones, which share the table.
    fn settlements(&self) -> Option<&Settlements> {
        Some(&self.settlements)
    }
}
