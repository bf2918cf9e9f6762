//! The conformance suite against [`RedbStore`], one fresh database per scenario.

use std::sync::Arc;

use async_trait::async_trait;
use idem_core::{ManualClock, Store};
use idem_redb::{Config, RedbStore};

/// Opens each scenario's store on its own anonymous temporary file (unlinked, so it
/// vanishes with the store), with group commit on and durable commits.
struct Redb;

#[async_trait]
impl idem_conformance::Backend for Redb {
    async fn open(&self, clock: ManualClock) -> Arc<dyn Store> {
        let file = tempfile::tempfile().expect("temporary file");
        let backend = redb::backends::FileBackend::new(file).expect("file backend");
        let db = redb::Database::builder().create_with_backend(backend).expect("redb database");
        let config = Config::default().with_clock(Arc::new(clock));
        Arc::new(RedbStore::from_database(Arc::new(db), config).expect("redb store"))
    }
}

idem_conformance::store_tests!(Redb);
