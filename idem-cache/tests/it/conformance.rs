//! The conformance suite against [`CachedStore`] in front of a store. A peer (a second
//! API server) is a second cache in front of a second handle on the same records, so the
//! scenarios where two servers share one backend check that no process answers from a
//! stale copy. The cache measures time with the suite's `ManualClock`, as the store does.

use std::sync::Arc;

use async_trait::async_trait;
use idem_cache::CachedStore;
use idem_core::{ManualClock, MemoryStore, Store};

/// Enough for every scenario's records: nothing is evicted during a scenario.
const BYTES: u64 = 64 << 20;

fn cached(store: impl Store + 'static, clock: ManualClock) -> Arc<dyn Store> {
    Arc::new(CachedStore::new(store, BYTES).with_clock(Arc::new(clock)))
}

mod memory {
    use super::*;

    struct CachedMemory;

    #[async_trait]
    impl idem_conformance::Backend for CachedMemory {
        async fn open(&self, clock: ManualClock) -> Arc<dyn Store> {
            cached(MemoryStore::with_clock(Arc::new(clock.clone())), clock)
        }
    }

    idem_conformance::store_tests!(CachedMemory);
}

#[cfg(feature = "live-tests")]
mod redis {
    use std::sync::Mutex;
    use std::time::Duration;

    use super::*;

    /// A cache per handle, each on its own connection to the records of one prefix.
    #[derive(Default)]
    struct CachedRedis {
        prefix: Mutex<Option<String>>,
    }

    async fn connect(prefix: &str, clock: ManualClock) -> Arc<dyn Store> {
        let url = std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
        // The suite moves its clock ahead of the server's: keys outlive `expires_at` by
        // that much so the clock, not Redis, decides when a record is gone.
        let config = idem_redis::Config::default()
            .with_prefix(prefix)
            .with_clock(Arc::new(clock.clone()))
            .with_expiry_grace(Duration::from_secs(600));
        let store = idem_redis::RedisStore::connect(&url, config)
            .await
            .unwrap_or_else(|e| panic!("Redis at {url} (scripts/services starts it): {e}"));
        cached(store, clock)
    }

    #[async_trait]
    impl idem_conformance::Backend for CachedRedis {
        async fn open(&self, clock: ManualClock) -> Arc<dyn Store> {
            let prefix = format!("idem-test:{}:", uuid::Uuid::new_v4().simple());
            *self.prefix.lock().expect("lock") = Some(prefix.clone());
            connect(&prefix, clock).await
        }

        async fn open_peer(&self, _store: &Arc<dyn Store>, clock: ManualClock) -> Arc<dyn Store> {
            let prefix = self.prefix.lock().expect("lock").clone().expect("open ran first");
            connect(&prefix, clock).await
        }

        /// The production configuration: the server's `TIME` behind, the system clock in
        /// the cache.
        async fn open_server_clock(&self) -> Option<Arc<dyn Store>> {
            let url = std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
            let config =
                idem_redis::Config::default().with_prefix(format!("idem-test:{}:", uuid::Uuid::new_v4().simple()));
            let store = idem_redis::RedisStore::connect(&url, config).await.expect("Redis");
            Some(Arc::new(CachedStore::new(store, BYTES)))
        }
    }

    idem_conformance::store_tests!(CachedRedis::default());
}

#[cfg(feature = "live-tests")]
mod postgres {
    use std::sync::Mutex;
    use std::time::{SystemTime, UNIX_EPOCH};

    use super::*;

    fn server() -> String {
        std::env::var("IDEM_POSTGRES_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
    }

    /// A cache per handle, each on its own pool; every scenario on a fresh schema, named
    /// as the Postgres suites name theirs (`idem_test_<unix seconds>_...`) so a run that
    /// dies before dropping them is cleaned up by their next run.
    #[derive(Default)]
    struct CachedPostgres {
        schemas: Mutex<Vec<String>>,
    }

    async fn connect(schema: &str, clock: ManualClock) -> Arc<dyn Store> {
        let config = idem_postgres::Config::default()
            .with_schema(schema)
            .with_clock(Arc::new(clock.clone()))
            .with_max_connections(4);
        let store = idem_postgres::PostgresStore::connect(&server(), config)
            .await
            .unwrap_or_else(|e| panic!("PostgreSQL at {} (scripts/services starts it): {e}", server()));
        cached(store, clock)
    }

    #[async_trait]
    impl idem_conformance::Backend for CachedPostgres {
        async fn open(&self, clock: ManualClock) -> Arc<dyn Store> {
            let secs = SystemTime::now().duration_since(UNIX_EPOCH).expect("clock").as_secs();
            let schema = format!("idem_test_{secs}_cache{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
            self.schemas.lock().expect("lock").push(schema.clone());
            connect(&schema, clock).await
        }

        async fn open_peer(&self, _store: &Arc<dyn Store>, clock: ManualClock) -> Arc<dyn Store> {
            let schema = self.schemas.lock().expect("lock").last().cloned().expect("open ran first");
            connect(&schema, clock).await
        }

        /// The production configuration: the server's clock behind, the system clock in
        /// the cache.
        async fn open_server_clock(&self) -> Option<Arc<dyn Store>> {
            let secs = SystemTime::now().duration_since(UNIX_EPOCH).expect("clock").as_secs();
            let schema = format!("idem_test_{secs}_cache{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
            self.schemas.lock().expect("lock").push(schema.clone());
            let config = idem_postgres::Config::default().with_schema(&schema).with_max_connections(2);
            let store = idem_postgres::PostgresStore::connect(&server(), config).await.expect("PostgreSQL");
            Some(Arc::new(CachedStore::new(store, BYTES)))
        }
    }

    /// Drops the scenario's schemas when the test is done with the backend.
    impl Drop for CachedPostgres {
        fn drop(&mut self) {
            let schemas = std::mem::take(&mut *self.schemas.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
            if schemas.is_empty() {
                return;
            }
            // Its own thread and runtime: drop may run inside the test's runtime.
            let dropped = std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
                rt.block_on(async move {
                    let Ok(pool) = idem_postgres::sqlx::PgPool::connect(&server()).await else { return };
                    for schema in schemas {
                        let drop = format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE");
                        let _ = idem_postgres::sqlx::raw_sql(&drop).execute(&pool).await;
                    }
                });
            });
            let _ = dropped.join();
        }
    }

    idem_conformance::store_tests!(CachedPostgres::default());
}
