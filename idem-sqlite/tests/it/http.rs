//! The HTTP scenarios (`idem_conformance::http_tests!`: lease renewal, tenant isolation,
//! response shapes, sealed responses) on [`SqliteStore`], one fresh file per scenario,
//! with raw access through a connection of its own: the raw bytes are the `response`
//! column; a spoiled record has a key that does not parse.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use idem_core::{ManualClock, RecordId, Store};
use idem_sqlite::{Config, SqliteStore};

/// Opens each scenario's store on a fresh file in a temporary directory.
struct Sqlite {
    dir: tempfile::TempDir,
    /// The file `open` made: where the raw access reads and writes.
    path: Mutex<Option<PathBuf>>,
}

impl Default for Sqlite {
    fn default() -> Self {
        Self { dir: tempfile::tempdir().expect("temp dir"), path: Mutex::default() }
    }
}

impl Sqlite {
    fn connection(&self) -> rusqlite::Connection {
        let path = self.path.lock().expect("lock").clone().expect("open ran first");
        rusqlite::Connection::open(path).expect("open the file")
    }

    fn update(&self, sql: &str, params: impl rusqlite::Params) -> bool {
        assert_eq!(self.connection().execute(sql, params).expect("update"), 1, "{sql}");
        true
    }
}

#[async_trait]
impl idem_conformance::Backend for Sqlite {
    async fn open(&self, clock: ManualClock) -> Arc<dyn Store> {
        let path = self.dir.path().join("idem.sqlite3");
        *self.path.lock().expect("lock") = Some(path.clone());
        let config = Config::default().with_clock(Arc::new(clock));
        let store = tokio::task::spawn_blocking(move || SqliteStore::open(path, config))
            .await
            .expect("open task")
            .expect("open sqlite store");
        Arc::new(store)
    }

    async fn read_stored(&self, _store: &Arc<dyn Store>, id: RecordId) -> Option<Vec<u8>> {
        self.connection()
            .query_row("SELECT response FROM idem_records WHERE id = ?1", [&id.as_bytes()[..]], |r| r.get(0))
            .expect("the record is there")
    }

    async fn overwrite_stored(&self, _store: &Arc<dyn Store>, id: RecordId, bytes: Vec<u8>) -> bool {
        self.update("UPDATE idem_records SET response = ?1 WHERE id = ?2", rusqlite::params![bytes, &id.as_bytes()[..]])
    }

    async fn corrupt_stored(&self, _store: &Arc<dyn Store>, id: RecordId) -> bool {
        self.update("UPDATE idem_records SET key = 'not a key' WHERE id = ?1", [&id.as_bytes()[..]])
    }
}

idem_conformance::http_tests!(Sqlite::default());
