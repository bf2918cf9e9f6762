//! The idem conformance suite against SQLite: a fresh database file per scenario, and a
//! second `SqliteStore` (its own writer thread and connections) on the same file as the
//! peer, so the two-instance scenarios race through SQLite's file locks for real.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use idem_core::{ManualClock, Store};
use idem_sqlite::{Config, SqliteStore};

/// Opens stores in a temporary directory that lives as long as the backend, which the
/// suite keeps for as long as the scenario's stores.
struct Sqlite {
    dir: tempfile::TempDir,
    /// The files opened so far; the last one is where `open_peer` opens.
    files: Mutex<Vec<PathBuf>>,
}

impl Default for Sqlite {
    fn default() -> Self {
        Self { dir: tempfile::tempdir().expect("temp dir"), files: Mutex::default() }
    }
}

async fn open_blocking(path: PathBuf, clock: ManualClock) -> Arc<dyn Store> {
    let store =
        tokio::task::spawn_blocking(move || SqliteStore::open(path, Config::default().with_clock(Arc::new(clock))))
            .await
            .expect("open task")
            .expect("open sqlite store");
    Arc::new(store)
}

#[async_trait]
impl idem_conformance::Backend for Sqlite {
    async fn open(&self, clock: ManualClock) -> Arc<dyn Store> {
        let path = {
            let mut files = self.files.lock().expect("lock");
            let path = self.dir.path().join(format!("idem-{}.sqlite3", files.len()));
            files.push(path.clone());
            path
        };
        open_blocking(path, clock).await
    }

    async fn open_peer(&self, _store: &Arc<dyn Store>, clock: ManualClock) -> Arc<dyn Store> {
        let path = self.files.lock().expect("lock").last().cloned().expect("open ran before open_peer");
        open_blocking(path, clock).await
    }
}

idem_conformance::store_tests!(Sqlite::default());
