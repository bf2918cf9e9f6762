//! The conformance suite against [`RedbStore`], one fresh database per scenario. The peer
//! of a two-instance scenario is a second `RedbStore` (its own writer thread) on the same
//! `Database`, as two routers of one process would share it: the two race through redb's
//! one write transaction at a time for real.

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use idem_core::{ManualClock, Store};
use idem_redb::{Config, RedbStore};

/// Opens each scenario's store on its own anonymous temporary file (unlinked, so it
/// vanishes with the store), with group commit on and durable commits.
#[derive(Default)]
struct Redb {
    /// The database `open` made last: where `open_peer` opens.
    last: Mutex<Option<Arc<redb::Database>>>,
}

fn store_on(db: Arc<redb::Database>, clock: ManualClock) -> Arc<dyn Store> {
    Arc::new(RedbStore::from_database(db, Config::default().with_clock(Arc::new(clock))).expect("redb store"))
}

#[async_trait]
impl idem_conformance::Backend for Redb {
    async fn open(&self, clock: ManualClock) -> Arc<dyn Store> {
        let file = tempfile::tempfile().expect("temporary file");
        let backend = redb::backends::FileBackend::new(file).expect("file backend");
        let db = Arc::new(redb::Database::builder().create_with_backend(backend).expect("redb database"));
        *self.last.lock().expect("lock") = Some(Arc::clone(&db));
        store_on(db, clock)
    }

    async fn open_peer(&self, _store: &Arc<dyn Store>, clock: ManualClock) -> Arc<dyn Store> {
        let db = self.last.lock().expect("lock").clone().expect("open ran before open_peer");
        store_on(db, clock)
    }
}

idem_conformance::store_tests!(Redb::default());
