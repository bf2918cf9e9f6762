//! The conformance suite (every scenario, the model-based test) against the real Redis at
//! `IDEM_REDIS_URL` (default `redis://127.0.0.1:6379`). Fails, never skips, when Redis is
//! not reachable.

use crate::common;

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use idem_core::{ManualClock, Store};
use idem_redis::Config;

/// Each scenario gets a backend of its own; it remembers the random prefix it opened so a
/// peer opens a second, independent connection on the same records.
#[derive(Default)]
struct Redis {
    prefix: Mutex<Option<String>>,
}

#[async_trait]
impl idem_conformance::Backend for Redis {
    async fn open(&self, clock: ManualClock) -> Arc<dyn Store> {
        let prefix = common::fresh_prefix();
        *self.prefix.lock().expect("prefix lock") = Some(prefix.clone());
        Arc::new(common::connect(common::test_config(&prefix, Arc::new(clock))).await)
    }

    async fn open_peer(&self, _store: &Arc<dyn Store>, clock: ManualClock) -> Arc<dyn Store> {
        let prefix = self.prefix.lock().expect("prefix lock").clone().expect("open ran first");
        Arc::new(common::connect(common::test_config(&prefix, Arc::new(clock))).await)
    }

    /// The production configuration: every `now` is the server's `TIME`.
    async fn open_server_clock(&self) -> Option<Arc<dyn Store>> {
        let config = Config::default().with_prefix(common::fresh_prefix());
        Some(Arc::new(common::connect(config).await))
    }
}

idem_conformance::store_tests!(Redis::default());
