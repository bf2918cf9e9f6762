//! [`Engine`]: `idem_core::engine` over an [`idem_core::Model`] table as an [`Oracle`], the
//! rules every in-process store runs. The decision-table rows run on it and on
//! [`idem_conformance::Spec`]; with `PLANTED` set it carries one wrong rule, for the test
//! that shows an oracle built on the engine cannot see one.

use std::time::Duration;

use idem_conformance::Oracle;
use idem_core::{
    ClaimOutcome, ClaimRequest, FencingToken, JournalWrite, Model, Receipt, ReclaimOutcome, ReclaimRequest, Record,
    RecordId, RecordRead, StoreError, StoredResponse, SweepOutcome, UnixMillis, engine,
};

/// The engine over a [`Model`]; `PLANTED` makes a reclaim ignore the fingerprint.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Engine<const PLANTED: bool = false>(Model);

/// The map-backed table never fails.
fn table<T>(result: Result<T, StoreError>) -> T {
    result.unwrap_or_else(|e| unreachable!("the in-memory table failed: {e}"))
}

impl<const PLANTED: bool> Oracle for Engine<PLANTED> {
    fn claim(&mut self, req: &ClaimRequest, now: UnixMillis) -> ClaimOutcome {
        table(engine::claim(&mut self.0, req, now))
    }
    fn reclaim(&mut self, req: &ReclaimRequest, now: UnixMillis) -> ReclaimOutcome {
        if PLANTED {
            // The planted rule: the engine is shown the stored fingerprint instead of the
            // request's, so its "fingerprints equal" precondition always holds.
            let stored = table(self.0.read(req.id)).map_or(req.fingerprint, |r| r.fingerprint);
            return table(engine::reclaim(&mut self.0, &ReclaimRequest { fingerprint: stored, ..req.clone() }, now));
        }
        table(engine::reclaim(&mut self.0, req, now))
    }
    fn complete(
        &mut self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
        now: UnixMillis,
    ) -> Result<Receipt, StoreError> {
        engine::complete(&mut self.0, id, token, response, now)
    }
    fn fail(&mut self, id: RecordId, token: FencingToken, now: UnixMillis) -> Result<Receipt, StoreError> {
        engine::fail(&mut self.0, id, token, now)
    }
    fn extend(
        &mut self,
        id: RecordId,
        token: FencingToken,
        lease_ttl: Duration,
        now: UnixMillis,
    ) -> Result<Receipt, StoreError> {
        engine::extend(&mut self.0, id, token, lease_ttl, now)
    }
    fn get(&self, id: RecordId, now: UnixMillis) -> Option<Record> {
        table(engine::get(&self.0, id, now))
    }
    fn sweep(&mut self, limit: usize, now: UnixMillis) -> SweepOutcome {
        table(engine::sweep(&mut self.0, limit, now))
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
        engine::journal_put(&mut self.0, id, token, name, &value, overwrite, now)
    }
    fn journal_get(&self, id: RecordId, name: &str, now: UnixMillis) -> Option<Vec<u8>> {
        table(engine::journal_get(&self.0, id, name, now))
    }
}
