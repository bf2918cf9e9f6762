//! Sealed stored responses (feature `seal`, `IdempotencyLayer::with_sealing`): a response
//! is sealed before `complete` and every record a call returns is opened, so nothing above
//! this wrapper sees a sealed body and nothing below it sees a plain one.
//!
//! The response is sealed once per completion, outside the resends: every resend carries
//! the same bytes (same nonce, same associated data). A record that does not open is a
//! `StoreError::Corrupt` of the call that returned it: answered 503, never by running the
//! handler again (`docs/contract.md#sealed-responses`).

use std::future::Future;
use std::time::Duration;

use futures::future::Either;
use idem_core::seal::Sealing;
use idem_core::{
    ClaimOutcome, ClaimRequest, FencingToken, JournalWrite, Receipt, ReclaimOutcome, ReclaimRequest, Record, RecordId,
    StoreError, StoredResponse, SweepOutcome,
};

use super::Calls;

/// `inner`, its responses sealed and opened with `sealing` (nothing when it is `None`).
pub(crate) struct Sealed<S> {
    inner: S,
    sealing: Option<Sealing>,
}

impl<S> Sealed<S> {
    pub(crate) fn new(inner: S, sealing: Option<Sealing>) -> Self {
        Self { inner, sealing }
    }

    fn open(&self, record: Record) -> Result<Record, StoreError> {
        match &self.sealing {
            Some(sealing) => sealing.open(record),
            None => Ok(record),
        }
    }
}

impl<S: Calls> Calls for Sealed<S> {
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        Ok(match self.inner.claim(req).await? {
            ClaimOutcome::Claimed(record) => ClaimOutcome::Claimed(self.open(record)?),
            ClaimOutcome::Existing { record, now } => ClaimOutcome::Existing { record: self.open(record)?, now },
        })
    }

    async fn reclaim(&self, req: ReclaimRequest) -> Result<ReclaimOutcome, StoreError> {
        Ok(match self.inner.reclaim(req).await? {
            ReclaimOutcome::Reclaimed(record) => ReclaimOutcome::Reclaimed(self.open(record)?),
            ReclaimOutcome::Conflict { current, now } => {
                ReclaimOutcome::Conflict { current: current.map(|r| self.open(r)).transpose()?, now }
            }
        })
    }

    fn complete<R>(
        &self,
        id: RecordId,
        token: FencingToken,
        mut response: R,
    ) -> impl Future<Output = Result<Receipt, StoreError>> + Send
    where
        R: FnMut() -> StoredResponse + Send,
    {
        match &self.sealing {
            Some(sealing) => {
                let sealed = sealing.seal(id, token, &response());
                Either::Left(async move { self.inner.complete(id, token, || sealed.clone()).await })
            }
            None => Either::Right(self.inner.complete(id, token, response)),
        }
    }

    fn fail(&self, id: RecordId, token: FencingToken) -> impl Future<Output = Result<Receipt, StoreError>> + Send {
        self.inner.fail(id, token)
    }

    fn extend(
        &self,
        id: RecordId,
        token: FencingToken,
        lease_ttl: Duration,
    ) -> impl Future<Output = Result<Receipt, StoreError>> + Send {
        self.inner.extend(id, token, lease_ttl)
    }

    async fn get(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        self.inner.get(id).await?.map(|record| self.open(record)).transpose()
    }

    fn journal_put<'a>(
        &'a self,
        id: RecordId,
        token: FencingToken,
        name: &'a str,
        value: Vec<u8>,
        overwrite: bool,
    ) -> impl Future<Output = Result<JournalWrite, StoreError>> + Send {
        self.inner.journal_put(id, token, name, value, overwrite)
    }

    fn journal_get<'a>(
        &'a self,
        id: RecordId,
        name: &'a str,
    ) -> impl Future<Output = Result<Option<Vec<u8>>, StoreError>> + Send {
        self.inner.journal_get(id, name)
    }

    fn sweep(&self, limit: usize) -> impl Future<Output = Result<SweepOutcome, StoreError>> + Send {
        self.inner.sweep(limit)
    }
}
