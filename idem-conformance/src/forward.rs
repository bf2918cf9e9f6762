//! Store wrappers that write only what they change: [`Forward`] has one provided method per
//! [`Store`] call, each passing the call to [`Forward::inner`]; [`Forwarding`] turns any
//! `Forward` into a `Store`. A test that counts completions, injects an outage or freezes
//! a clock overrides those calls and nothing else, so it cannot drop a method it never
//! thought about (a hand-written wrapper that forgets `list` or `journal_put` silently
//! answers `Unsupported` through the trait's defaults).
//!
//! ```
//! use std::sync::atomic::{AtomicUsize, Ordering};
//! use idem_conformance::{Forward, Forwarding};
//! use idem_core::{FencingToken, MemoryStore, Receipt, RecordId, Store, StoreError, StoredResponse};
//!
//! #[derive(Debug, Default)]
//! struct Counting {
//!     inner: MemoryStore,
//!     completes: AtomicUsize,
//! }
//!
//! #[async_trait::async_trait]
//! impl Forward for Counting {
//!     fn inner(&self) -> &dyn Store {
//!         &self.inner
//!     }
//!     async fn complete(&self, id: RecordId, token: FencingToken, r: StoredResponse) -> Result<Receipt, StoreError> {
//!         self.completes.fetch_add(1, Ordering::SeqCst);
//!         self.inner.complete(id, token, r).await
//!     }
//! }
//!
//! let store = Forwarding(Counting::default());
//! assert_eq!(store.capabilities(), MemoryStore::new().capabilities());
//! assert_eq!(store.completes.load(Ordering::SeqCst), 0);
//! ```

use std::fmt;
use std::ops::Deref;
use std::time::Duration;

use async_trait::async_trait;
use idem_core::{
    Capabilities, ClaimOutcome, ClaimRequest, FencingToken, JournalWrite, ListFilter, Listing, Receipt, ReclaimOutcome,
    ReclaimRequest, Record, RecordId, Settlements, Store, StoreError, StoredResponse, SweepOutcome,
};

/// A store wrapper's overrides; every call it does not override goes to [`Forward::inner`].
/// Wrap it in [`Forwarding`] to get a [`Store`].
#[async_trait]
pub trait Forward: Send + Sync + fmt::Debug + 'static {
    /// The store every call not overridden goes to.
    fn inner(&self) -> &dyn Store;

    /// [`Store::claim`].
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        self.inner().claim(req).await
    }
    /// [`Store::reclaim`].
    async fn reclaim(&self, req: ReclaimRequest) -> Result<ReclaimOutcome, StoreError> {
        self.inner().reclaim(req).await
    }
    /// [`Store::complete`].
    async fn complete(
        &self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Receipt, StoreError> {
        self.inner().complete(id, token, response).await
    }
    /// [`Store::fail`].
    async fn fail(&self, id: RecordId, token: FencingToken) -> Result<Receipt, StoreError> {
        self.inner().fail(id, token).await
    }
    /// [`Store::extend`].
    async fn extend(&self, id: RecordId, token: FencingToken, lease_ttl: Duration) -> Result<Receipt, StoreError> {
        self.inner().extend(id, token, lease_ttl).await
    }
    /// [`Store::get`].
    async fn get(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        self.inner().get(id).await
    }
    /// [`Store::sweep`].
    async fn sweep(&self, limit: usize) -> Result<SweepOutcome, StoreError> {
        self.inner().sweep(limit).await
    }
    /// [`Store::capabilities`].
    fn capabilities(&self) -> Capabilities {
        self.inner().capabilities()
    }
    /// [`Store::journal_put`].
    async fn journal_put(
        &self,
        id: RecordId,
        token: FencingToken,
        name: &str,
        value: Vec<u8>,
        overwrite: bool,
    ) -> Result<JournalWrite, StoreError> {
        self.inner().journal_put(id, token, name, value, overwrite).await
    }
    /// [`Store::journal_get`].
    async fn journal_get(&self, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.inner().journal_get(id, name).await
    }
    /// [`Store::list`].
    async fn list(&self, filter: ListFilter) -> Result<Listing, StoreError> {
        self.inner().list(filter).await
    }
    /// [`Store::settlements`].
    fn settlements(&self) -> Option<&Settlements> {
        self.inner().settlements()
    }
}

/// A [`Forward`] as a [`Store`]; derefs to the wrapper, so a test reads its counters and
/// switches through it.
#[derive(Clone, Debug, Default)]
pub struct Forwarding<W>(pub W);

impl<W> Deref for Forwarding<W> {
    type Target = W;
    fn deref(&self) -> &W {
        &self.0
    }
}

// Every call goes through the wrapper's `Forward` method, overridden or provided: the
// one list of store calls lives in `Forward`, not in each test's wrapper.
#[async_trait]
impl<W: Forward> Store for Forwarding<W> {
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        self.0.claim(req).await
    }
    async fn reclaim(&self, req: ReclaimRequest) -> Result<ReclaimOutcome, StoreError> {
        self.0.reclaim(req).await
    }
    async fn complete(
        &self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Receipt, StoreError> {
        self.0.complete(id, token, response).await
    }
    async fn fail(&self, id: RecordId, token: FencingToken) -> Result<Receipt, StoreError> {
        self.0.fail(id, token).await
    }
    async fn extend(&self, id: RecordId, token: FencingToken, lease_ttl: Duration) -> Result<Receipt, StoreError> {
        self.0.extend(id, token, lease_ttl).await
    }
    async fn get(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        self.0.get(id).await
    }
    async fn sweep(&self, limit: usize) -> Result<SweepOutcome, StoreError> {
        self.0.sweep(limit).await
    }
    fn capabilities(&self) -> Capabilities {
        self.0.capabilities()
    }
    async fn journal_put(
        &self,
        id: RecordId,
        token: FencingToken,
        name: &str,
        value: Vec<u8>,
        overwrite: bool,
    ) -> Result<JournalWrite, StoreError> {
        self.0.journal_put(id, token, name, value, overwrite).await
    }
    async fn journal_get(&self, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.0.journal_get(id, name).await
    }
    async fn list(&self, filter: ListFilter) -> Result<Listing, StoreError> {
        self.0.list(filter).await
    }
    fn settlements(&self) -> Option<&Settlements> {
        self.0.settlements()
    }
}
