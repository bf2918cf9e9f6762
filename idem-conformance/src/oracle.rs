//! [`Oracle`]: one method per store operation on [`Model`], the reference model, for the
//! model test and for backends' own tests that compare against it.

use std::time::Duration;

use idem_core::{
    ClaimOutcome, ClaimRequest, FencingToken, JournalWrite, Model, Receipt, ReclaimOutcome, ReclaimRequest, Record,
    RecordId, StoreError, StoredResponse, SweepOutcome, UnixMillis, engine,
};

/// The map-backed table never fails, so the operations that only read or decide are
/// infallible here; those that check a fencing token return its refusal.
fn infallible<T>(result: Result<T, StoreError>) -> T {
    match result {
        Ok(v) => v,
        Err(e) => unreachable!("the in-memory record table failed: {e}"),
    }
}

/// The store operations on [`Model`], synchronous, with `now` as an argument (see the
/// matching [`idem_core::Store`] methods).
pub trait Oracle {
    /// [`idem_core::Store::claim`].
    fn claim(&mut self, req: &ClaimRequest, now: UnixMillis) -> ClaimOutcome;
    /// [`idem_core::Store::reclaim`].
    fn reclaim(&mut self, req: &ReclaimRequest, now: UnixMillis) -> ReclaimOutcome;
    /// [`idem_core::Store::complete`].
    ///
    /// # Errors
    /// [`StoreError::LeaseLost`] when `token` is not the current claim.
    fn complete(
        &mut self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
        now: UnixMillis,
    ) -> Result<Receipt, StoreError>;
    /// [`idem_core::Store::fail`].
    ///
    /// # Errors
    /// [`StoreError::LeaseLost`] when `token` is not the current claim.
    fn fail(&mut self, id: RecordId, token: FencingToken, now: UnixMillis) -> Result<Receipt, StoreError>;
    /// [`idem_core::Store::extend`].
    ///
    /// # Errors
    /// [`StoreError::LeaseLost`] when `token` is not the current claim.
    fn extend(
        &mut self,
        id: RecordId,
        token: FencingToken,
        lease_ttl: Duration,
        now: UnixMillis,
    ) -> Result<Receipt, StoreError>;
    /// [`idem_core::Store::get`].
    fn get(&self, id: RecordId, now: UnixMillis) -> Option<Record>;
    /// [`idem_core::Store::sweep`]: the oldest expiry first.
    fn sweep(&mut self, limit: usize, now: UnixMillis) -> SweepOutcome;
    /// [`idem_core::Store::journal_put`].
    ///
    /// # Errors
    /// [`StoreError::LeaseLost`] when `token` is not the current claim.
    fn journal_put(
        &mut self,
        id: RecordId,
        token: FencingToken,
        name: &str,
        value: Vec<u8>,
        overwrite: bool,
        now: UnixMillis,
    ) -> Result<JournalWrite, StoreError>;
    /// [`idem_core::Store::journal_get`].
    fn journal_get(&self, id: RecordId, name: &str, now: UnixMillis) -> Option<Vec<u8>>;
}

impl Oracle for Model {
    fn claim(&mut self, req: &ClaimRequest, now: UnixMillis) -> ClaimOutcome {
        infallible(engine::claim(self, req, now))
    }
    fn reclaim(&mut self, req: &ReclaimRequest, now: UnixMillis) -> ReclaimOutcome {
        infallible(engine::reclaim(self, req, now))
    }
    fn complete(
        &mut self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
        now: UnixMillis,
    ) -> Result<Receipt, StoreError> {
        engine::complete(self, id, token, response, now)
    }
    fn fail(&mut self, id: RecordId, token: FencingToken, now: UnixMillis) -> Result<Receipt, StoreError> {
        engine::fail(self, id, token, now)
    }
    fn extend(
        &mut self,
        id: RecordId,
        token: FencingToken,
        lease_ttl: Duration,
        now: UnixMillis,
    ) -> Result<Receipt, StoreError> {
        engine::extend(self, id, token, lease_ttl, now)
    }
    fn get(&self, id: RecordId, now: UnixMillis) -> Option<Record> {
        infallible(engine::get(self, id, now))
    }
    fn sweep(&mut self, limit: usize, now: UnixMillis) -> SweepOutcome {
        infallible(engine::sweep(self, limit, now))
    }
    fn journal_put(
        &mut self,
        id: RecordId,
        token: FencingToken,
        name: &str,
        value: Vec<u8>,
        overwrite: bool,
        now: UnixMillis,
    ) -> Result<JournalWrite, StoreError> {
        engine::journal_put(self, id, token, name, &value, overwrite, now)
    }
    fn journal_get(&self, id: RecordId, name: &str, now: UnixMillis) -> Option<Vec<u8>> {
        infallible(engine::journal_get(self, id, name, now))
    }
}
