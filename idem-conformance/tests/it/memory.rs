//! The suite against the in-memory reference store.

use std::sync::Arc;

use async_trait::async_trait;
use idem_core::{ManualClock, MemoryStore, Store};

struct Memory;

#[async_trait]
impl idem_conformance::Backend for Memory {
    async fn open(&self, clock: ManualClock) -> Arc<dyn Store> {
        Arc::new(MemoryStore::with_clock(Arc::new(clock)))
    }
}

idem_conformance::store_tests!(Memory);
