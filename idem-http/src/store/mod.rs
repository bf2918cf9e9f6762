//! The layer's store: the store it was given, behind single-purpose wrappers composed once
//! per layer ([`compose`], called when the layer prepares its pipeline).
//!
//! A call goes through them outermost first:
//! 1. `timed` (feature `metrics`): `idem_store_call_seconds` and `idem_store_errors_total`;
//! 2. `sealed` (feature `seal`): seals a response before `complete`, opens every record a
//!    call returns;
//! 3. `completion`: sends `complete`, `fail` and journal writes again after an outage
//!    ([`crate::deadline::CompletionRetry`]);
//! 4. `deadlines`: a deadline per call ([`crate::deadline::StoreDeadlines`]);
//!
//! then the store. Why in this order: a deadline bounds one attempt, and a resend is an
//! attempt; a response is sealed once, outside the resends, so every resend carries the
//! same sealed bytes, and the read-back of an ambiguous completion compares token and
//! state only; the timing is outermost, so it is the latency the request saw, and a
//! response that does not open counts as an error of its call, as a record that does not
//! decode does.
//!
//! The wrappers are plain generic structs that call each other through [`Calls`], whose
//! futures are not boxed: a call through all of them costs one boxed future, the store's
//! own. [`LayerStore`] is also a [`Store`], for whatever needs one (the handler's
//! `IdempotencyContext::store`, its journal steps, the drop guard's `fail`).

mod completion;
mod deadlines;
#[cfg(feature = "seal")]
mod sealed;
#[cfg(feature = "metrics")]
mod timed;

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idem_core::{
    Capabilities, ClaimOutcome, ClaimRequest, FencingToken, JournalWrite, ListFilter, Listing, Receipt, ReclaimOutcome,
    ReclaimRequest, Record, RecordId, Store, StoreError, StoredResponse, SweepOutcome,
};

use crate::config::Settings;

/// The store operations, as the wrappers pass them to each other: each wrapper adds its
/// one concern to the call and hands it on.
pub(crate) trait Calls: Send + Sync + 'static {
    fn claim(&self, req: ClaimRequest) -> impl Future<Output = Result<ClaimOutcome, StoreError>> + Send;

    fn reclaim(&self, req: ReclaimRequest) -> impl Future<Output = Result<ReclaimOutcome, StoreError>> + Send;

    /// `response` makes the response one attempt sends; called once per attempt, so a
    /// resend builds it again from what its caller still holds (the body it returns to its
    /// client, the head) rather than every attempt sending a copy kept for a resend that
    /// almost never comes.
    fn complete<R>(
        &self,
        id: RecordId,
        token: FencingToken,
        response: R,
    ) -> impl Future<Output = Result<Receipt, StoreError>> + Send
    where
        R: FnMut() -> StoredResponse + Send;

    fn fail(&self, id: RecordId, token: FencingToken) -> impl Future<Output = Result<Receipt, StoreError>> + Send;

    fn extend(
        &self,
        id: RecordId,
        token: FencingToken,
        lease_ttl: Duration,
    ) -> impl Future<Output = Result<Receipt, StoreError>> + Send;

    fn get(&self, id: RecordId) -> impl Future<Output = Result<Option<Record>, StoreError>> + Send;

    fn journal_put<'a>(
        &'a self,
        id: RecordId,
        token: FencingToken,
        name: &'a str,
        value: Vec<u8>,
        overwrite: bool,
    ) -> impl Future<Output = Result<JournalWrite, StoreError>> + Send;

    fn journal_get<'a>(
        &'a self,
        id: RecordId,
        name: &'a str,
    ) -> impl Future<Output = Result<Option<Vec<u8>>, StoreError>> + Send;

    fn sweep(&self, limit: usize) -> impl Future<Output = Result<SweepOutcome, StoreError>> + Send;
}

/// The wrappers, innermost first; without a feature its wrapper is not there at all.
type Resent = completion::Resent<deadlines::Deadlined>;
#[cfg(feature = "seal")]
type Opened = sealed::Sealed<Resent>;
#[cfg(not(feature = "seal"))]
type Opened = Resent;
#[cfg(feature = "metrics")]
type Stack = timed::Timed<Opened>;
#[cfg(not(feature = "metrics"))]
type Stack = Opened;

/// The store of one layer: the given store behind its wrappers (module docs).
pub(crate) struct LayerStore {
    /// Every call the layer makes goes through these.
    pub(crate) calls: Stack,
    /// The given store, for what no wrapper concerns: its capabilities, an operator's
    /// listing.
    store: Arc<dyn Store>,
}

/// The layer's store over `settings.store`: deadlines and completion retries as set,
/// resends for up to one lease TTL, sealing and metrics when their features are on.
pub(crate) fn compose(settings: &Settings) -> LayerStore {
    let deadlined = deadlines::Deadlined::new(Arc::clone(&settings.store), settings.store_deadlines);
    let resent =
        completion::Resent::new(deadlined, settings.store_deadlines.completion_retry, settings.policy.lease_ttl);
    #[cfg(feature = "seal")]
    let opened = sealed::Sealed::new(resent, settings.sealing.clone());
    #[cfg(not(feature = "seal"))]
    let opened = resent;
    #[cfg(feature = "metrics")]
    let calls = timed::Timed::new(opened, settings.store.capabilities().backend);
    #[cfg(not(feature = "metrics"))]
    let calls = opened;
    LayerStore { calls, store: Arc::clone(&settings.store) }
}

impl fmt::Debug for LayerStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LayerStore").field("store", &self.store).finish_non_exhaustive()
    }
}

#[async_trait]
impl Store for LayerStore {
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        self.calls.claim(req).await
    }

    async fn reclaim(&self, req: ReclaimRequest) -> Result<ReclaimOutcome, StoreError> {
        self.calls.reclaim(req).await
    }

    /// A handler's own completion: the response is the caller's, so each attempt sends a
    /// copy of it.
    async fn complete(
        &self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Receipt, StoreError> {
        self.calls.complete(id, token, || response.clone()).await
    }

    async fn fail(&self, id: RecordId, token: FencingToken) -> Result<Receipt, StoreError> {
        self.calls.fail(id, token).await
    }

    async fn extend(&self, id: RecordId, token: FencingToken, lease_ttl: Duration) -> Result<Receipt, StoreError> {
        self.calls.extend(id, token, lease_ttl).await
    }

    async fn get(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        self.calls.get(id).await
    }

    async fn sweep(&self, limit: usize) -> Result<SweepOutcome, StoreError> {
        self.calls.sweep(limit).await
    }

    fn capabilities(&self) -> Capabilities {
        (*self.store).capabilities()
    }

    async fn journal_put(
        &self,
        id: RecordId,
        token: FencingToken,
        name: &str,
        value: Vec<u8>,
        overwrite: bool,
    ) -> Result<JournalWrite, StoreError> {
        self.calls.journal_put(id, token, name, value, overwrite).await
    }

    async fn journal_get(&self, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.calls.journal_get(id, name).await
    }

    /// An operator's listing: no request waits on it, so no deadline (like `sweep`).
    async fn list(&self, filter: ListFilter) -> Result<Listing, StoreError> {
        (*self.store).list(filter).await
    }
}
