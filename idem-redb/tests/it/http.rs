//! The HTTP scenarios (`idem_conformance::http_tests!`: lease renewal, tenant isolation,
//! response shapes, sealed responses) on [`RedbStore`], one fresh database per scenario,
//! with raw access to the records table: redb keeps each record as one value, so the raw
//! bytes are the whole encoded record.

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use idem_core::{ManualClock, RecordId, Store};
use idem_redb::{Config, RedbStore};
use redb::ReadableDatabase;

/// Opens each scenario's store on its own anonymous temporary file (unlinked, so it
/// vanishes with the store).
#[derive(Default)]
struct Redb {
    /// The database `open` made: where the raw access reads and writes.
    db: Mutex<Option<Arc<redb::Database>>>,
}

impl Redb {
    fn db(&self) -> Arc<redb::Database> {
        self.db.lock().expect("lock").clone().expect("open ran first")
    }

    fn write(&self, id: RecordId, bytes: &[u8]) {
        let db = self.db();
        let tx = db.begin_write().expect("write tx");
        tx.open_table(idem_redb::table::RECORDS).expect("table").insert(id.as_bytes(), bytes).expect("insert");
        tx.commit().expect("commit");
    }
}

#[async_trait]
impl idem_conformance::Backend for Redb {
    async fn open(&self, clock: ManualClock) -> Arc<dyn Store> {
        let file = tempfile::tempfile().expect("temporary file");
        let backend = redb::backends::FileBackend::new(file).expect("file backend");
        let db = Arc::new(redb::Database::builder().create_with_backend(backend).expect("redb database"));
        *self.db.lock().expect("lock") = Some(Arc::clone(&db));
        Arc::new(RedbStore::from_database(db, Config::default().with_clock(Arc::new(clock))).expect("redb store"))
    }

    /// The whole record, as redb keeps it.
    async fn read_stored(&self, _store: &Arc<dyn Store>, id: RecordId) -> Option<Vec<u8>> {
        let tx = self.db().begin_read().expect("read tx");
        let table = tx.open_table(idem_redb::table::RECORDS).expect("table");
        let value = table.get(id.as_bytes()).expect("get").expect("the record is there").value().to_vec();
        Some(value)
    }

    async fn overwrite_stored(&self, _store: &Arc<dyn Store>, id: RecordId, bytes: Vec<u8>) -> bool {
        self.write(id, &bytes);
        true
    }

    /// One byte after the encoded record (`CodecError::Trailing`).
    async fn corrupt_stored(&self, store: &Arc<dyn Store>, id: RecordId) -> bool {
        let mut bytes = self.read_stored(store, id).await.expect("raw access");
        bytes.push(0);
        self.write(id, &bytes);
        true
    }
}

idem_conformance::http_tests!(Redb::default());
