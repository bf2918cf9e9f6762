//! The conformance suite's `Backend` for MySQL/MariaDB.

use std::sync::{Arc, Mutex, Weak};

use async_trait::async_trait;
use idem_core::{ManualClock, Store};

use crate::common::{self, PrefixGuard};

/// Connections per store handle: enough for real races (32 tasks share them), few enough
/// that parallel test threads stay far below the server's `max_connections` (151 on MariaDB and MySQL).
const POOL: usize = 6;

/// A handle this backend opened, and the table prefix it lives in.
type Opened = (Weak<dyn Store>, Weak<PrefixGuard>);

/// Opens stores on fresh table prefixes; remembers which table prefix each handle uses so that
/// `open_peer` can open a second pool on it.
pub(crate) struct MySql {
    opened: Mutex<Vec<Opened>>,
}

impl MySql {
    pub(crate) fn new() -> Self {
        Self { opened: Mutex::default() }
    }

    fn remember(&self, store: &Arc<dyn Store>, guard: &Arc<PrefixGuard>) {
        let mut opened = self.opened.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        opened.retain(|(s, _)| s.strong_count() > 0);
        opened.push((Arc::downgrade(store), Arc::downgrade(guard)));
    }

    fn guard_of(&self, store: &Arc<dyn Store>) -> Option<Arc<PrefixGuard>> {
        let opened = self.opened.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        opened
            .iter()
            .find(|(s, _)| s.upgrade().is_some_and(|s| std::ptr::addr_eq(Arc::as_ptr(&s), Arc::as_ptr(store))))
            .and_then(|(_, g)| g.upgrade())
    }
}

#[async_trait]
impl idem_conformance::Backend for MySql {
    async fn open(&self, clock: ManualClock) -> Arc<dyn Store> {
        let guard = PrefixGuard::fresh().await;
        let store = common::open(&guard, Some(clock), POOL).await;
        self.remember(&store, &guard);
        store
    }

    async fn open_peer(&self, store: &Arc<dyn Store>, clock: ManualClock) -> Arc<dyn Store> {
        let guard = self.guard_of(store).expect("open_peer is given a store this backend opened");
        let peer = common::open(&guard, Some(clock), POOL).await;
        self.remember(&peer, &guard);
        peer
    }

    async fn open_server_clock(&self) -> Option<Arc<dyn Store>> {
        // No pinned clock: the statements fall back to the server's clock_timestamp().
        let guard = PrefixGuard::fresh().await;
        Some(common::open(&guard, None, 2).await)
    }
}
