//! [`Spec`]: the record state machine of `docs/state-machine.md` written out a second time,
//! as plain values, for the model test's oracle.
//!
//! The memory, redb and SQLite stores and the file-store example all run
//! `idem_core::engine`, which runs the rules of `idem_core::transition`. An oracle that ran
//! them too would agree with a wrong rule in them. So nothing here calls the engine, the
//! transition functions, or a helper of `idem_core` that encodes a rule (the effective
//! retention, record expiry, lease freshness, the next token): every comparison and every
//! field written is spelled out below, each with the row of the page it follows.

use std::collections::BTreeMap;
use std::time::Duration;

use idem_core::{
    ClaimOutcome, ClaimRequest, FencingToken, JournalWrite, Receipt, ReclaimOutcome, ReclaimRequest, Record, RecordId,
    RecordState, StoreError, StoredResponse, SweepOutcome, UnixMillis,
};

use crate::Oracle;

/// The records and journal entries a store holds, expired ones included until a sweep or a
/// replacing claim removes them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Spec {
    records: BTreeMap<RecordId, Record>,
    journal: BTreeMap<(RecordId, String), Vec<u8>>,
}

impl Spec {
    /// An empty store.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// The record `id` if it is live: "absent" is also a record with `now >= expires_at`.
    fn live(&self, id: RecordId, now: UnixMillis) -> Option<&Record> {
        self.records.get(&id).filter(|r| now < r.expires_at)
    }

    /// The owner check of `complete` (also fail, extend, journal put): live, in flight,
    /// this token. Refusal: `LeaseLost`, naming the live record's token or none.
    fn owned(&mut self, id: RecordId, token: FencingToken, now: UnixMillis) -> Result<&mut Record, StoreError> {
        let current = self.live(id, now).map(|r| r.token);
        match self.records.get_mut(&id) {
            Some(r) if now < r.expires_at && r.state == RecordState::InFlight && r.token == token => Ok(r),
            _ => Err(StoreError::LeaseLost { id, presented: token, current }),
        }
    }
}

/// "Notation": a duration in whole ms, saturating at 2^63 − 1.
fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// "Notation": additions saturate at 2^63 − 1 ms.
fn plus(now: UnixMillis, d: Duration) -> UnixMillis {
    UnixMillis(now.0.saturating_add(ms(d)))
}

/// "Notation": `retention` is `max(retention, lease)`, so the retention never ends before
/// the lease.
fn retention(lease: Duration, retention: Duration) -> Duration {
    retention.max(lease)
}

/// "claim": `first_at(now)` is the clock in ms shifted left by 16 bits, at least 1; the
/// clock counts from 0 and is capped at 2^47 − 1 ms so the token fits a signed 64-bit
/// column (contract.md, "Fencing token").
fn first_at(now: UnixMillis) -> FencingToken {
    let clock = u64::try_from(now.0).unwrap_or(0).min((1 << 47) - 1);
    FencingToken((clock << 16).max(1))
}

/// What a fenced write reports: the times of the record as written.
fn receipt(r: &Record) -> Receipt {
    Receipt { token: r.token, lease_expires_at: r.lease_expires_at, expires_at: r.expires_at }
}

impl Oracle for Spec {
    fn claim(&mut self, req: &ClaimRequest, now: UnixMillis) -> ClaimOutcome {
        // "claim, Otherwise": a live record, whatever its state or lease, is returned as is.
        if let Some(record) = self.live(req.id(), now) {
            return ClaimOutcome::Existing { record: record.clone(), now };
        }
        // "claim, token": from the clock; over an expired record still stored, also above
        // its token.
        let token = match self.records.get(&req.id()) {
            None => first_at(now),
            Some(old) => first_at(now).max(FencingToken(old.token.0.saturating_add(1))),
        };
        let record = Record {
            id: req.id(),
            scope: req.scope().clone(),
            key: req.key().clone(),
            fingerprint: req.fingerprint(),
            state: RecordState::InFlight,
            token,
            response: None,
            created_at: now,
            started_at: now,
            lease_expires_at: plus(now, req.lease_ttl()),
            expires_at: plus(now, retention(req.lease_ttl(), req.retention())),
        };
        // "claim": journal entries of a replaced record are removed.
        self.journal.retain(|(of, _), _| *of != req.id());
        self.records.insert(req.id(), record.clone());
        ClaimOutcome::Claimed(record)
    }

    fn reclaim(&mut self, req: &ReclaimRequest, now: UnixMillis) -> ReclaimOutcome {
        let current = self.live(req.id, now).cloned();
        // "reclaim, Precondition": live, same token, same fingerprint, and failed or in
        // flight with the lease passed; a completed record never.
        let reclaimable = current.as_ref().is_some_and(|r| {
            r.token == req.expected
                && r.fingerprint == req.fingerprint
                && match r.state {
                    RecordState::Failed => true,
                    RecordState::InFlight => now >= r.lease_expires_at,
                    RecordState::Completed => false,
                }
        });
        let (true, Some(mut r)) = (reclaimable, current.clone()) else {
            return ReclaimOutcome::Conflict { current, now };
        };
        // "reclaim, Effect": token + 1, a new lease from now, retention never earlier;
        // `created_at`, the fingerprint and the journal stay.
        r.state = RecordState::InFlight;
        r.token = FencingToken(r.token.0.saturating_add(1));
        r.response = None;
        r.started_at = now;
        r.lease_expires_at = plus(now, req.lease_ttl);
        r.expires_at = r.expires_at.max(plus(now, retention(req.lease_ttl, req.retention)));
        self.records.insert(req.id, r.clone());
        ReclaimOutcome::Reclaimed(r)
    }

    fn complete(
        &mut self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
        now: UnixMillis,
    ) -> Result<Receipt, StoreError> {
        // "complete, Effect": the response is stored; every time and the token stay.
        let r = self.owned(id, token, now)?;
        r.state = RecordState::Completed;
        r.response = Some(response);
        Ok(receipt(r))
    }

    fn fail(&mut self, id: RecordId, token: FencingToken, now: UnixMillis) -> Result<Receipt, StoreError> {
        // "fail, Effect": no response; the lease ends now if it had not already.
        let r = self.owned(id, token, now)?;
        r.state = RecordState::Failed;
        r.response = None;
        r.lease_expires_at = r.lease_expires_at.min(now);
        Ok(receipt(r))
    }

    fn extend(
        &mut self,
        id: RecordId,
        token: FencingToken,
        lease_ttl: Duration,
        now: UnixMillis,
    ) -> Result<Receipt, StoreError> {
        // "extend, Effect": the lease never moves earlier; retention reaches the new lease end.
        let r = self.owned(id, token, now)?;
        r.lease_expires_at = r.lease_expires_at.max(plus(now, lease_ttl));
        r.expires_at = r.expires_at.max(r.lease_expires_at);
        Ok(receipt(r))
    }

    fn get(&self, id: RecordId, now: UnixMillis) -> Option<Record> {
        // "retention passes": a record past `expires_at` is absent.
        self.live(id, now).cloned()
    }

    fn sweep(&mut self, limit: usize, now: UnixMillis) -> SweepOutcome {
        // "retention passes, sweep": up to `limit` records with `now >= expires_at`, the
        // oldest expiry first, with their journals; `more` while expired records remain.
        let mut expired: Vec<(UnixMillis, RecordId)> =
            self.records.values().filter(|r| now >= r.expires_at).map(|r| (r.expires_at, r.id)).collect();
        expired.sort();
        let more = expired.len() > limit;
        expired.truncate(limit);
        for (_, id) in &expired {
            self.records.remove(id);
            self.journal.retain(|(of, _), _| of != id);
        }
        SweepOutcome { removed: expired.len() as u64, more }
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
        // "journal put": the owner check first, so a stale owner never learns the value;
        // then first write wins unless `overwrite`.
        self.owned(id, token, now)?;
        let key = (id, name.to_owned());
        if !overwrite && let Some(stored) = self.journal.get(&key) {
            return Ok(JournalWrite::Exists(stored.clone()));
        }
        self.journal.insert(key, value);
        Ok(JournalWrite::Written)
    }

    fn journal_get(&self, id: RecordId, name: &str, now: UnixMillis) -> Option<Vec<u8>> {
        // "retention passes": entries of an absent or expired record read as none.
        self.live(id, now)?;
        self.journal.get(&(id, name.to_owned())).cloned()
    }
}
