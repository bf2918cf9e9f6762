//! The in-memory reference store: the [`Model`] behind a mutex, timed by an injected
//! clock. For tests, docs and single-process prototypes; nothing survives the process.

use std::sync::{Arc, Mutex, MutexGuard};

use async_trait::async_trait;

use crate::model::Model;
use crate::record::{FencingToken, Record, StoredResponse};
use crate::scope::RecordId;
use crate::store::{Capabilities, JournalWrite, Store, StoreError, SweepOutcome};
use crate::time::{Clock, SystemClock};
use crate::transition::{ClaimOutcome, ClaimRequest, ReclaimOutcome, ReclaimRequest};

/// In-memory [`Store`]. Clones share the same records.
#[derive(Clone, Debug)]
pub struct MemoryStore {
    model: Arc<Mutex<Model>>,
    clock: Arc<dyn Clock>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// A store on the system clock.
    #[must_use]
    pub fn new() -> Self {
        Self::with_clock(Arc::new(SystemClock))
    }

    /// A store on `clock` (tests pass a [`crate::ManualClock`]).
    #[must_use]
    pub fn with_clock(clock: Arc<dyn Clock>) -> Self {
        Self { model: Arc::new(Mutex::new(Model::new())), clock }
    }

    fn lock(&self) -> MutexGuard<'_, Model> {
        // A panic while holding the lock cannot leave a half-applied transition (each one
        // is a single insert), so a poisoned lock is still consistent.
        self.model.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[async_trait]
impl Store for MemoryStore {
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let now = self.clock.now();
        Ok(self.lock().claim(&req, now))
    }

    async fn reclaim(&self, req: ReclaimRequest) -> Result<ReclaimOutcome, StoreError> {
        let now = self.clock.now();
        Ok(self.lock().reclaim(&req, now))
    }

    async fn complete(
        &self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Record, StoreError> {
        let now = self.clock.now();
        self.lock().complete(id, token, response, now)
    }

    async fn fail(&self, id: RecordId, token: FencingToken) -> Result<Record, StoreError> {
        let now = self.clock.now();
        self.lock().fail(id, token, now)
    }

    async fn get(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        let now = self.clock.now();
        Ok(self.lock().get(id, now))
    }

    async fn sweep(&self, limit: usize) -> Result<SweepOutcome, StoreError> {
        let now = self.clock.now();
        Ok(self.lock().sweep(limit, now))
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::new().with_journal(true)
    }

    async fn journal_put(
        &self,
        id: RecordId,
        token: FencingToken,
        name: &str,
        value: Vec<u8>,
        overwrite: bool,
    ) -> Result<JournalWrite, StoreError> {
        let now = self.clock.now();
        self.lock().journal_put(id, token, name, value, overwrite, now)
    }

    async fn journal_get(&self, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let now = self.clock.now();
        Ok(self.lock().journal_get(id, name, now))
    }
}
