//! The layer's store: the store it was given, with each call's concerns applied in one
//! place ([`compose`], called once when the layer prepares its pipeline).
//!
//! A call meets them outermost first:
//! 1. timing (feature `metrics`, `timed`): `idem_store_call_seconds` and
//!    `idem_store_errors_total`;
//! 2. sealing (feature `seal`): a response is sealed before `complete`, every record a
//!    call returns is opened (`docs/contract.md#sealed-responses`);
//! 3. resends (`completion`): `complete`, `fail` and journal writes are sent again after an
//!    outage ([`crate::deadline::CompletionRetry`]);
//! 4. a deadline per attempt (`deadlines`, [`crate::deadline::StoreDeadlines`]);
//!
//! then the store. Why in this order: a deadline bounds one attempt, and a resend is an
//! attempt; a response is sealed once, outside the resends, so every resend carries the
//! same sealed bytes (same nonce, same associated data), and the read-back of an ambiguous
//! completion compares token and state only; the timing is outermost, so it is the latency
//! the request saw, and a response that does not open counts as an error of its call, as a
//! record that does not decode does.
//!
//! Each concern is a function, not a wrapper type: without its feature it is not there at
//! all, and a call's future is not boxed beyond the store's own. [`LayerStore`] is also a
//! [`Store`], for whatever needs one (the handler's `IdempotencyContext::store`, its journal
//! steps, the drop guard's `fail`).

mod completion;
mod deadlines;
#[cfg(feature = "metrics")]
mod timed;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idem_core::{
    Capabilities, ClaimOutcome, ClaimRequest, FencingToken, JournalWrite, ListFilter, Listing, Receipt, ReclaimOutcome,
    ReclaimRequest, Record, RecordId, RecordState, Settlements, Store, StoreError, StoredResponse, SweepOutcome,
};

use crate::config::Settings;
use crate::deadline::StoreDeadlines;

named_enum! {
    /// A store operation: the `operation` label of the metrics, the name in logs and errors.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub(crate) enum Op {
        Claim => "claim",
        Reclaim => "reclaim",
        Complete => "complete",
        Fail => "fail",
        Extend => "extend",
        Get => "get",
        Sweep => "sweep",
        JournalPut => "journal_put",
        JournalGet => "journal_get",
    }
}

impl Op {
    /// How many operations there are.
    #[cfg(feature = "metrics")]
    const COUNT: usize = 9;
}

/// The store of one layer (module docs).
pub(crate) struct LayerStore {
    store: Arc<dyn Store>,
    deadlines: StoreDeadlines,
    /// How long completions and journal writes are sent again: the lease TTL.
    resend_window: Duration,
    #[cfg(feature = "seal")]
    sealing: Option<idem_core::seal::Sealing>,
    #[cfg(feature = "metrics")]
    timing: timed::Timing,
}

/// The layer's store over `settings.store`: deadlines and completion retries as set,
/// resends for up to one lease TTL, sealing and metrics when their features are on.
pub(crate) fn compose(settings: &Settings) -> LayerStore {
    LayerStore {
        store: Arc::clone(&settings.store),
        deadlines: settings.store_deadlines,
        resend_window: settings.policy.lease_ttl,
        #[cfg(feature = "seal")]
        sealing: settings.sealing.clone(),
        #[cfg(feature = "metrics")]
        timing: timed::Timing::new(settings.store.capabilities().backend),
    }
}

impl fmt::Debug for LayerStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LayerStore").field("store", &self.store).finish_non_exhaustive()
    }
}

impl LayerStore {
    /// The store itself, called through its vtable: `Arc<dyn Store>` is a `Store` too,
    /// whose every call would box one more future around the store's own.
    fn store(&self) -> &dyn Store {
        &*self.store
    }

    /// `call`, timed as `op` (feature `metrics`).
    #[cfg(feature = "metrics")]
    async fn timed<T>(&self, op: Op, call: impl Future<Output = Result<T, StoreError>>) -> Result<T, StoreError> {
        self.timing.observed(op, call).await
    }

    #[cfg(not(feature = "metrics"))]
    fn timed<F>(&self, _op: Op, call: F) -> F {
        call
    }

    /// A record as read from the store, opened if the layer seals (feature `seal`).
    fn open(&self, record: Record) -> Result<Record, StoreError> {
        #[cfg(feature = "seal")]
        if let Some(sealing) = &self.sealing {
            return sealing.open(record);
        }
        Ok(record)
    }

    pub(crate) async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        self.timed(Op::Claim, async {
            Ok(match deadlines::within(self.deadlines.claim, Op::Claim, self.store().claim(req)).await? {
                ClaimOutcome::Claimed(record) => ClaimOutcome::Claimed(self.open(record)?),
                ClaimOutcome::Existing { record, now } => ClaimOutcome::Existing { record: self.open(record)?, now },
            })
        })
        .await
    }

    pub(crate) async fn reclaim(&self, req: ReclaimRequest) -> Result<ReclaimOutcome, StoreError> {
        self.timed(Op::Reclaim, async {
            Ok(match deadlines::within(self.deadlines.claim, Op::Reclaim, self.store().reclaim(req)).await? {
                ReclaimOutcome::Reclaimed(record) => ReclaimOutcome::Reclaimed(self.open(record)?),
                ReclaimOutcome::Conflict { current, now } => {
                    ReclaimOutcome::Conflict { current: current.map(|r| self.open(r)).transpose()?, now }
                }
            })
        })
        .await
    }

    /// `response` makes the response one attempt sends; called once per attempt, so a
    /// resend builds it again from what its caller still holds (the body it returns to its
    /// client, the head) rather than every attempt sending a copy kept for a resend that
    /// almost never comes.
    pub(crate) async fn complete<R>(
        &self,
        id: RecordId,
        token: FencingToken,
        mut response: R,
    ) -> Result<Receipt, StoreError>
    where
        R: FnMut() -> StoredResponse + Send,
    {
        let limit = self.deadlines.complete;
        self.timed(Op::Complete, async {
            #[cfg(feature = "seal")]
            if let Some(sealing) = &self.sealing {
                let sealed = sealing.seal(id, token, &response());
                let attempt =
                    || deadlines::within(limit, Op::Complete, self.store().complete(id, token, sealed.clone()));
                return self.resend(id, token, RecordState::Completed, attempt).await;
            }
            let attempt = || deadlines::within(limit, Op::Complete, self.store().complete(id, token, response()));
            self.resend(id, token, RecordState::Completed, attempt).await
        })
        .await
    }

    pub(crate) async fn fail(&self, id: RecordId, token: FencingToken) -> Result<Receipt, StoreError> {
        let attempt = || deadlines::within(self.deadlines.complete, Op::Fail, self.store().fail(id, token));
        self.timed(Op::Fail, self.resend(id, token, RecordState::Failed, attempt)).await
    }

    pub(crate) async fn extend(&self, id: RecordId, token: FencingToken, ttl: Duration) -> Result<Receipt, StoreError> {
        self.timed(
            Op::Extend,
            deadlines::within(self.deadlines.extend, Op::Extend, self.store().extend(id, token, ttl)),
        )
        .await
    }

    pub(crate) async fn get(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        self.timed(Op::Get, async {
            let found = deadlines::within(self.deadlines.read, Op::Get, self.store().get(id)).await?;
            found.map(|record| self.open(record)).transpose()
        })
        .await
    }
}

#[async_trait]
impl Store for LayerStore {
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        LayerStore::claim(self, req).await
    }

    async fn reclaim(&self, req: ReclaimRequest) -> Result<ReclaimOutcome, StoreError> {
        LayerStore::reclaim(self, req).await
    }

    /// A handler's own completion: the response is the caller's, so each attempt sends a
    /// copy of it.
    async fn complete(
        &self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Receipt, StoreError> {
        LayerStore::complete(self, id, token, || response.clone()).await
    }

    async fn fail(&self, id: RecordId, token: FencingToken) -> Result<Receipt, StoreError> {
        LayerStore::fail(self, id, token).await
    }

    async fn extend(&self, id: RecordId, token: FencingToken, lease_ttl: Duration) -> Result<Receipt, StoreError> {
        LayerStore::extend(self, id, token, lease_ttl).await
    }

    async fn get(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        LayerStore::get(self, id).await
    }

    /// No deadline: the layer never sweeps (the sweeper in `idem_core::sweeper` does).
    async fn sweep(&self, limit: usize) -> Result<SweepOutcome, StoreError> {
        self.timed(Op::Sweep, self.store().sweep(limit)).await
    }

    fn capabilities(&self) -> Capabilities {
        self.store().capabilities()
    }

    async fn journal_put(
        &self,
        id: RecordId,
        token: FencingToken,
        name: &str,
        value: Vec<u8>,
        overwrite: bool,
    ) -> Result<JournalWrite, StoreError> {
        self.timed(Op::JournalPut, self.resend_journal(id, token, name, value, overwrite)).await
    }

    async fn journal_get(&self, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let call = deadlines::within(self.deadlines.read, Op::JournalGet, self.store().journal_get(id, name));
        self.timed(Op::JournalGet, call).await
    }

    /// An operator's listing: no request waits on it, so no deadline (like `sweep`).
    async fn list(&self, filter: ListFilter) -> Result<Listing, StoreError> {
        self.store().list(filter).await
    }

    fn settlements(&self) -> Option<&Settlements> {
        self.store().settlements()
    }
}
