//! The conformance suite's `Backend` for PostgreSQL, reached directly or through PgBouncer.

use std::sync::{Arc, Mutex, Weak};

use async_trait::async_trait;
use idem_core::{ManualClock, Store};

use crate::common::{self, SchemaGuard, Via};

/// Connections per store handle: enough for real races (32 tasks share them), few enough
/// that parallel test threads stay far below the server's `max_connections` (100).
const POOL: usize = 6;

/// A handle this backend opened, and the schema it lives in.
type Opened = (Weak<dyn Store>, Weak<SchemaGuard>);

/// Opens stores on fresh schemas; remembers which schema each handle uses so that
/// `open_peer` can open a second pool on it.
pub(crate) struct Postgres {
    via: Via,
    opened: Mutex<Vec<Opened>>,
}

impl Postgres {
    pub(crate) fn new(via: Via) -> Self {
        Self { via, opened: Mutex::default() }
    }

    fn remember(&self, store: &Arc<dyn Store>, guard: &Arc<SchemaGuard>) {
        let mut opened = self.opened.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        opened.retain(|(s, _)| s.strong_count() > 0);
        opened.push((Arc::downgrade(store), Arc::downgrade(guard)));
    }

    fn guard_of(&self, store: &Arc<dyn Store>) -> Option<Arc<SchemaGuard>> {
        let opened = self.opened.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        opened
            .iter()
            .find(|(s, _)| s.upgrade().is_some_and(|s| std::ptr::addr_eq(Arc::as_ptr(&s), Arc::as_ptr(store))))
            .and_then(|(_, g)| g.upgrade())
    }
}

#[async_trait]
impl idem_conformance::Backend for Postgres {
    async fn open(&self, clock: ManualClock) -> Arc<dyn Store> {
        let guard = SchemaGuard::fresh().await;
        let store = common::open(self.via, &guard, Some(clock), POOL).await;
        self.remember(&store, &guard);
        store
    }

    async fn open_peer(&self, store: &Arc<dyn Store>, clock: ManualClock) -> Arc<dyn Store> {
        let guard = self.guard_of(store).expect("open_peer is given a store this backend opened");
        let peer = common::open(self.via, &guard, Some(clock), POOL).await;
        self.remember(&peer, &guard);
        peer
    }

    async fn open_server_clock(&self) -> Option<Arc<dyn Store>> {
        // No pinned clock: the statements fall back to the server's clock_timestamp().
        let guard = SchemaGuard::fresh().await;
        Some(common::open(self.via, &guard, None, 2).await)
    }
}
