//! The whole idem conformance suite (every scenario plus the model test) against the
//! file-per-record store: one `Backend` impl and one macro line.

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use idem_core::{ManualClock, Store};
use idem_example_file_store::FileStore;

/// Each scenario gets a store in its own temporary directory.
#[derive(Default)]
struct TempFileStores {
    /// What `open` returned, to open peers on the same directory.
    opened: Mutex<Vec<(Arc<dyn Store>, FileStore)>>,
}

#[async_trait]
impl idem_conformance::Backend for TempFileStores {
    async fn open(&self, clock: ManualClock) -> Arc<dyn Store> {
        let store = idem_example_file_store::temporary(Arc::new(clock)).expect("a temporary store");
        let handle: Arc<dyn Store> = Arc::new(store.clone());
        self.opened.lock().expect("not poisoned").push((Arc::clone(&handle), store));
        handle
    }

    /// A second, independent handle on the same directory, as a second API server would
    /// open it; the process-wide lock keeps the two atomic with respect to each other.
    async fn open_peer(&self, store: &Arc<dyn Store>, clock: ManualClock) -> Arc<dyn Store> {
        let _ = clock;
        let opened = self.opened.lock().expect("not poisoned");
        let (_, file_store) = opened.iter().find(|(h, _)| Arc::ptr_eq(h, store)).expect("a store this backend opened");
        Arc::new(file_store.clone())
    }
}

idem_conformance::store_tests!(TempFileStores::default());
