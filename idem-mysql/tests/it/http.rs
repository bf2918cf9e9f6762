//! The HTTP scenarios (`idem_conformance::http_tests!`: lease renewal, tenant isolation,
//! response shapes, sealed responses) on [`MySqlStore`] against the real server at
//! `IDEM_MYSQL_URL`, fresh `idem_test_*` tables per scenario (dropped afterwards), with raw
//! access through the store's pool: the raw bytes are the `response` column; a spoiled
//! record has a key that names another record.

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use idem_core::{ManualClock, RecordId, Store};
use idem_mysql::MySqlStore;
use idem_mysql::sqlx::{self, MySqlPool};

use crate::common::{self, PrefixGuard};

/// Opens each scenario's store on fresh tables.
#[derive(Default)]
struct MySql {
    /// The pool and tables of the store `open` made.
    last: Mutex<Option<(MySqlPool, Arc<PrefixGuard>)>>,
}

impl MySql {
    fn last(&self) -> (MySqlPool, Arc<PrefixGuard>) {
        self.last.lock().expect("lock").clone().expect("open ran first")
    }

    async fn update(&self, set: &str, id: RecordId, bytes: Option<Vec<u8>>) -> bool {
        let (pool, guard) = self.last();
        let prefix = &guard.name;
        let sql = match bytes {
            Some(_) => format!("UPDATE `{prefix}_records` SET {set} = ? WHERE id = ?"),
            None => format!("UPDATE `{prefix}_records` SET {set} WHERE id = ?"),
        };
        let query = sqlx::query(&sql);
        let query = match bytes {
            Some(bytes) => query.bind(bytes),
            None => query,
        };
        let query = query.bind(&id.as_bytes()[..]);
        assert_eq!(query.execute(&pool).await.expect("update").rows_affected(), 1, "{sql}");
        true
    }
}

#[async_trait]
impl idem_conformance::Backend for MySql {
    async fn open(&self, clock: ManualClock) -> Arc<dyn Store> {
        let guard = PrefixGuard::fresh().await;
        let store: MySqlStore = common::connect(&guard.name, Some(clock), 4).await;
        *self.last.lock().expect("lock") = Some((store.pool().clone(), guard));
        Arc::new(store)
    }

    async fn read_stored(&self, _store: &Arc<dyn Store>, id: RecordId) -> Option<Vec<u8>> {
        let (pool, guard) = self.last();
        let sql = format!("SELECT response FROM `{}_records` WHERE id = ?", guard.name);
        sqlx::query_scalar(&sql).bind(&id.as_bytes()[..]).fetch_one(&pool).await.expect("the record is there")
    }

    async fn overwrite_stored(&self, _store: &Arc<dyn Store>, id: RecordId, bytes: Vec<u8>) -> bool {
        self.update("response", id, Some(bytes)).await
    }

    async fn corrupt_stored(&self, _store: &Arc<dyn Store>, id: RecordId) -> bool {
        self.update("idem_key = 'not-this-record'", id, None).await
    }
}

idem_conformance::http_tests!(MySql::default());
