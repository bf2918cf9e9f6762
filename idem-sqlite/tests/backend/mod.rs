//! The conformance suite's SQLite backend: a fresh database file per scenario. With
//! deferred claims (the default) the store must be its file's only user, so the peer of a
//! two-instance scenario is the same store; with durable claims the peer is a second
//! `SqliteStore` (its own writer thread and connections) on the same file, so those
//! scenarios race through SQLite's file locks for real.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use idem_core::{ManualClock, Store};
use idem_sqlite::{Config, SqliteStore};

/// Opens stores in a temporary directory that lives as long as the backend, which the
/// suite keeps for as long as the scenario's stores.
pub(crate) struct Sqlite {
    dir: tempfile::TempDir,
    durable_claims: bool,
    /// The files opened so far; the last one is where `open_peer` opens.
    files: Mutex<Vec<PathBuf>>,
}

impl Sqlite {
    pub(crate) fn new(durable_claims: bool) -> Self {
        Self { dir: tempfile::tempdir().expect("temp dir"), durable_claims, files: Mutex::default() }
    }

    async fn open_blocking(&self, path: PathBuf, clock: ManualClock) -> Arc<dyn Store> {
        let config = Config::default().with_clock(Arc::new(clock)).with_durable_claims(self.durable_claims);
        let store = tokio::task::spawn_blocking(move || SqliteStore::open(path, config))
            .await
            .expect("open task")
            .expect("open sqlite store");
        Arc::new(store)
    }
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
        self.open_blocking(path, clock).await
    }

    async fn open_peer(&self, store: &Arc<dyn Store>, clock: ManualClock) -> Arc<dyn Store> {
        if !self.durable_claims {
            return Arc::clone(store);
        }
        let path = self.files.lock().expect("lock").last().cloned().expect("open ran before open_peer");
        self.open_blocking(path, clock).await
    }
}
