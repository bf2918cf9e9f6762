//! [`Oracle`]: one method per store operation, synchronous, with `now` as an argument. The
//! model test compares every store against one ([`crate::Spec`]); backends' own tests may
//! compare against it too.

use std::time::Duration;

use idem_core::{
    ClaimOutcome, ClaimRequest, FencingToken, JournalWrite, Receipt, ReclaimOutcome, ReclaimRequest, Record, RecordId,
    StoreError, StoredResponse, SweepOutcome, UnixMillis,
};

/// The store operations on a store held in memory, synchronous, with `now` as an argument
/// (see the matching [`idem_core::Store`] methods).
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
