//! The HTTP scenarios (`idem_conformance::http_tests!`: lease renewal, tenant isolation,
//! response shapes, sealed responses) on [`RedisStore`] against the real Redis at
//! `IDEM_REDIS_URL` (default `redis://127.0.0.1:6379`), one fresh key prefix per scenario
//! (its keys deleted afterwards), with raw access through the store's connection: the raw
//! bytes are the record hash's `r` field; a spoiled record has an unknown state in `h`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use idem_core::{ManualClock, RecordId, Store};
use idem_redis::{Config, RedisStore};
use redis::AsyncCommands;

fn url() -> String {
    std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// Opens each scenario's store under a fresh key prefix.
#[derive(Default)]
struct Redis {
    /// The store `open` made and its prefix.
    last: Mutex<Option<(RedisStore, String)>>,
}

impl Redis {
    fn store(&self) -> RedisStore {
        self.last.lock().expect("lock").as_ref().expect("open ran first").0.clone()
    }
}

#[async_trait]
impl idem_conformance::Backend for Redis {
    async fn open(&self, clock: ManualClock) -> Arc<dyn Store> {
        let (url, prefix) = (url(), format!("idem-test:http:{}:", uuid::Uuid::new_v4().simple()));
        let config = Config::default()
            .with_prefix(prefix.clone())
            .with_clock(Arc::new(clock))
            // The test clock runs ahead of the server's (a 30-minute flash): keys must
            // outlive its view.
            .with_expiry_grace(Duration::from_secs(3_600));
        let store = RedisStore::connect(&url, config)
            .await
            .unwrap_or_else(|e| panic!("Redis is not reachable at {url}: {e}; these tests need a real Redis"));
        *self.last.lock().expect("lock") = Some((store.clone(), prefix));
        Arc::new(store)
    }

    async fn read_stored(&self, _store: &Arc<dyn Store>, id: RecordId) -> Option<Vec<u8>> {
        let store = self.store();
        store.connection().hget(store.record_key(id), "r").await.expect("HGET")
    }

    async fn overwrite_stored(&self, _store: &Arc<dyn Store>, id: RecordId, bytes: Vec<u8>) -> bool {
        let store = self.store();
        store.connection().hset::<_, _, _, ()>(store.record_key(id), "r", bytes).await.expect("HSET");
        true
    }

    async fn corrupt_stored(&self, _store: &Arc<dyn Store>, id: RecordId) -> bool {
        let (store, key) = (self.store(), self.store().record_key(id));
        let mut conn = store.connection();
        let mut h: Vec<u8> = conn.hget(&key, "h").await.expect("HGET");
        h[1] = 9; // an unknown state
        conn.hset::<_, _, _, ()>(&key, "h", h).await.expect("HSET");
        true
    }
}

/// Deletes every key under the scenario's prefix.
impl Drop for Redis {
    fn drop(&mut self) {
        let Some((_, prefix)) = self.last.lock().expect("lock").take() else { return };
        let (url, pattern) = (url(), format!("{prefix}*"));
        // Drop may run on a runtime thread: do the I/O on a thread of its own.
        let done = std::thread::spawn(move || -> redis::RedisResult<()> {
            let mut conn = redis::Client::open(url.as_str())?.get_connection()?;
            let keys: Vec<String> = redis::cmd("KEYS").arg(&pattern).query(&mut conn)?;
            if !keys.is_empty() {
                redis::cmd("DEL").arg(keys).query::<()>(&mut conn)?;
            }
            Ok(())
        })
        .join();
        if !matches!(done, Ok(Ok(()))) {
            eprintln!("warning: could not delete the test keys {prefix}*; native expiry removes them");
        }
    }
}

idem_conformance::http_tests!(Redis::default());
