//! The idem conformance suite against SQLite: a fresh database file per scenario, and a
//! second `SqliteStore` (its own writer thread and connections) on the same file as the
//! peer, so the two-instance scenarios race through SQLite's file locks for real.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use idem_core::{
    Capabilities, ClaimOutcome, ClaimRequest, FencingToken, JournalWrite, ManualClock, ReclaimOutcome, ReclaimRequest,
    Record, RecordId, Store, StoreError, StoredResponse, SweepOutcome,
};
use idem_sqlite::SqliteStore;

/// Opens stores on a temporary directory that lives as long as the scenario's stores.
#[derive(Default)]
struct Sqlite {
    /// The file of the last `open`, for `open_peer`.
    opened: Mutex<Option<(PathBuf, Arc<tempfile::TempDir>)>>,
}

async fn open_blocking(path: PathBuf, clock: ManualClock) -> SqliteStore {
    tokio::task::spawn_blocking(move || SqliteStore::builder(path).clock(Arc::new(clock)).open())
        .await
        .expect("open task")
        .expect("open sqlite store")
}

#[async_trait]
impl idem_conformance::Backend for Sqlite {
    async fn open(&self, clock: ManualClock) -> Arc<dyn Store> {
        let dir = Arc::new(tempfile::tempdir().expect("temp dir"));
        let path = dir.path().join("idem.sqlite3");
        let store = open_blocking(path.clone(), clock).await;
        *self.opened.lock().expect("lock") = Some((path, Arc::clone(&dir)));
        Arc::new(TempStore { store, _dir: dir })
    }

    async fn open_peer(&self, _store: &Arc<dyn Store>, clock: ManualClock) -> Arc<dyn Store> {
        let (path, dir) = self.opened.lock().expect("lock").clone().expect("open ran before open_peer");
        let store = open_blocking(path, clock).await;
        Arc::new(TempStore { store, _dir: dir })
    }
}

/// A store that keeps its temporary directory alive.
#[derive(Debug)]
struct TempStore {
    store: SqliteStore,
    _dir: Arc<tempfile::TempDir>,
}

#[async_trait]
impl Store for TempStore {
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        self.store.claim(req).await
    }
    async fn reclaim(&self, req: ReclaimRequest) -> Result<ReclaimOutcome, StoreError> {
        self.store.reclaim(req).await
    }
    async fn complete(
        &self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Record, StoreError> {
        self.store.complete(id, token, response).await
    }
    async fn fail(&self, id: RecordId, token: FencingToken) -> Result<Record, StoreError> {
        self.store.fail(id, token).await
    }
    async fn get(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        self.store.get(id).await
    }
    async fn sweep(&self, limit: usize) -> Result<SweepOutcome, StoreError> {
        self.store.sweep(limit).await
    }
    fn capabilities(&self) -> Capabilities {
        self.store.capabilities()
    }
    async fn journal_put(
        &self,
        id: RecordId,
        token: FencingToken,
        name: &str,
        value: Vec<u8>,
        overwrite: bool,
    ) -> Result<JournalWrite, StoreError> {
        self.store.journal_put(id, token, name, value, overwrite).await
    }
    async fn journal_get(&self, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.store.journal_get(id, name).await
    }
}

idem_conformance::store_tests!(Sqlite::default());
