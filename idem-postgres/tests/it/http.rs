//! The HTTP scenarios (`idem_conformance::http_tests!`: lease renewal, tenant isolation,
//! response shapes, sealed responses) on [`PostgresStore`] against the real PostgreSQL at
//! `IDEM_POSTGRES_URL` (default `postgres://postgres@127.0.0.1:5432/test`), one fresh
//! `idem_test_*` schema per scenario (dropped afterwards), with raw access through the
//! store's pool: the raw bytes are the `response` column; a spoiled record has a key that
//! does not parse.

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use idem_core::{ManualClock, RecordId, Store};
use idem_postgres::sqlx::{self, Connection as _, PgPool};
use idem_postgres::{Config, PostgresStore};

fn url() -> String {
    std::env::var("IDEM_POSTGRES_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// Opens each scenario's store in a fresh schema.
#[derive(Default)]
struct Postgres {
    /// The pool and schema of the store `open` made.
    last: Mutex<Option<(PgPool, String)>>,
}

impl Postgres {
    fn last(&self) -> (PgPool, String) {
        self.last.lock().expect("lock").clone().expect("open ran first")
    }

    async fn update(&self, set: &str, id: RecordId, bytes: Option<Vec<u8>>) -> bool {
        let (pool, schema) = self.last();
        let sql = match bytes {
            Some(_) => format!("UPDATE \"{schema}\".records SET {set} = $2 WHERE id = $1"),
            None => format!("UPDATE \"{schema}\".records SET {set} WHERE id = $1"),
        };
        let query = sqlx::query(&sql).bind(&id.as_bytes()[..]);
        let query = match bytes {
            Some(bytes) => query.bind(bytes),
            None => query,
        };
        assert_eq!(query.execute(&pool).await.expect("update").rows_affected(), 1, "{sql}");
        true
    }
}

#[async_trait]
impl idem_conformance::Backend for Postgres {
    async fn open(&self, clock: ManualClock) -> Arc<dyn Store> {
        let url = url();
        let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_secs();
        let schema = format!("idem_test_{secs}_{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
        let config = Config::default().with_schema(schema.clone()).with_clock(Arc::new(clock)).with_max_connections(4);
        let store = PostgresStore::connect(&url, config)
            .await
            .unwrap_or_else(|e| panic!("PostgreSQL is not reachable at {url}: {e}; these tests need a real server"));
        *self.last.lock().expect("lock") = Some((store.pool().clone(), schema));
        Arc::new(store)
    }

    async fn read_stored(&self, _store: &Arc<dyn Store>, id: RecordId) -> Option<Vec<u8>> {
        let (pool, schema) = self.last();
        let sql = format!("SELECT response FROM \"{schema}\".records WHERE id = $1");
        sqlx::query_scalar(&sql).bind(&id.as_bytes()[..]).fetch_one(&pool).await.expect("the record is there")
    }

    async fn overwrite_stored(&self, _store: &Arc<dyn Store>, id: RecordId, bytes: Vec<u8>) -> bool {
        self.update("response", id, Some(bytes)).await
    }

    async fn corrupt_stored(&self, _store: &Arc<dyn Store>, id: RecordId) -> bool {
        self.update("key = 'not a key'", id, None).await
    }
}

/// Drops the scenario's schema.
impl Drop for Postgres {
    fn drop(&mut self) {
        let Some((_, schema)) = self.last.lock().expect("lock").take() else { return };
        let url = url();
        let sql = format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE");
        // Drop may run on a runtime thread: do the I/O on a thread and a runtime of its own.
        let done = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
            rt.block_on(async {
                let mut conn = sqlx::PgConnection::connect(&url).await.ok()?;
                sqlx::Executor::execute(&mut conn, sqlx::raw_sql(&sql)).await.ok().map(drop)
            })
        })
        .join();
        if !matches!(done, Ok(Some(()))) {
            eprintln!("warning: could not drop the test schema {schema}");
        }
    }
}

idem_conformance::http_tests!(Postgres::default());
