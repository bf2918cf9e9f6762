//! Opening a store from a `--store` spec and running the server.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use idem_core::{MemoryStore, Policy, Store};
use idem_redb::{RedbConfig, RedbStore};
use redb::Database;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::app::{Faults, router};
use crate::state::Infra;

/// Where records go: `redb:PATH` (or a bare path ending in `.redb`) or `memory`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreSpec {
    /// One redb file holding both the idempotency records and the simulated infra.
    Redb(PathBuf),
    /// Records in memory (lost on restart); infra state in the `--state` redb file.
    Memory,
}

impl std::str::FromStr for StoreSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "memory" {
            Ok(StoreSpec::Memory)
        } else if let Some(p) = s.strip_prefix("redb:") {
            Ok(StoreSpec::Redb(PathBuf::from(p)))
        } else if s.ends_with(".redb") {
            Ok(StoreSpec::Redb(PathBuf::from(s)))
        } else {
            Err(format!("unknown store {s:?}: use redb:PATH or memory"))
        }
    }
}

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The store or state file could not be opened.
    #[error("opening {what}: {message}")]
    Open {
        /// What was being opened.
        what: String,
        /// The reason.
        message: String,
    },
    /// Binding or serving failed.
    #[error("serving: {0}")]
    Io(#[from] std::io::Error),
}

fn open_err(what: impl Into<String>, e: impl std::fmt::Display) -> ServerError {
    ServerError::Open { what: what.into(), message: e.to_string() }
}

/// Opens the store and the infra state.
///
/// # Errors
/// [`ServerError::Open`] when a file cannot be opened.
pub fn open(spec: &StoreSpec, state_path: &Path) -> Result<(Arc<dyn Store>, Infra), ServerError> {
    match spec {
        StoreSpec::Redb(path) => {
            let store = RedbStore::open(path, RedbConfig::default()).map_err(|e| open_err(path.display().to_string(), e))?;
            let infra = Infra::new(store.database()).map_err(|e| open_err("infra tables", e))?;
            Ok((Arc::new(store), infra))
        }
        StoreSpec::Memory => {
            let db = Database::create(state_path).map_err(|e| open_err(state_path.display().to_string(), e))?;
            let infra = Infra::new(Arc::new(db)).map_err(|e| open_err("infra tables", e))?;
            Ok((Arc::new(MemoryStore::new()), infra))
        }
    }
}

/// A running server.
#[derive(Debug)]
pub struct Server {
    /// Where it listens.
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<std::io::Result<()>>,
}

impl Server {
    /// Serves `router(infra, store, policy, faults)` on `listener` until [`Server::stop`].
    ///
    /// # Errors
    /// When the listener has no local address.
    pub fn start(
        listener: TcpListener,
        store: Arc<dyn Store>,
        infra: Infra,
        policy: Policy,
        faults: Faults,
    ) -> Result<Self, ServerError> {
        let addr = listener.local_addr()?;
        let app = router(infra, store, policy, faults);
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    let _ = rx.await;
                })
                .await
        });
        Ok(Self { addr, stop: Some(tx), task })
    }

    /// The base URL, `http://127.0.0.1:PORT`.
    #[must_use]
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops accepting, finishes the requests in flight, and releases the store.
    ///
    /// # Errors
    /// When serving failed.
    pub async fn stop(mut self) -> Result<(), ServerError> {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        match self.task.await {
            Ok(r) => Ok(r?),
            Err(e) => Err(ServerError::Io(std::io::Error::other(e))),
        }
    }

    /// Waits until the server ends (Ctrl-C handling is the caller's).
    ///
    /// # Errors
    /// When serving failed.
    pub async fn wait(self) -> Result<(), ServerError> {
        match self.task.await {
            Ok(r) => Ok(r?),
            Err(e) => Err(ServerError::Io(std::io::Error::other(e))),
        }
    }
}
