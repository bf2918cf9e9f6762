//! Store call metrics (feature `metrics`, `docs/observability.md`): each call's latency as
//! the request saw it (`idem_store_call_seconds`: deadline, resends and sealing included)
//! and its failure (`idem_store_errors_total`; a refused fenced write, `LeaseLost`, is no
//! error), labelled with the store's backend name and the operation.
//!
//! The histogram and counter handles are registered on their first use with the recorder
//! installed then, and kept for the layer's life: install the recorder before serving.

use std::future::Future;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use idem_core::{
    ClaimOutcome, ClaimRequest, FencingToken, JournalWrite, Receipt, ReclaimOutcome, ReclaimRequest, Record, RecordId,
    StoreError, StoredResponse, SweepOutcome,
};

use super::Calls;

/// A store operation the layer times: the `operation` label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Claim,
    Reclaim,
    Complete,
    Fail,
    Extend,
    Get,
    Sweep,
    JournalPut,
    JournalGet,
}

impl Op {
    /// How many operations there are.
    const COUNT: usize = 9;

    const fn as_str(self) -> &'static str {
        match self {
            Self::Claim => "claim",
            Self::Reclaim => "reclaim",
            Self::Complete => "complete",
            Self::Fail => "fail",
            Self::Extend => "extend",
            Self::Get => "get",
            Self::Sweep => "sweep",
            Self::JournalPut => "journal_put",
            Self::JournalGet => "journal_get",
        }
    }
}

/// `inner`, every call timed and its failure counted.
pub(crate) struct Timed<S> {
    inner: S,
    /// The store's backend name: the `backend` label.
    backend: &'static str,
    /// A histogram per operation.
    calls: [OnceLock<metrics::Histogram>; Op::COUNT],
    /// An error counter per operation, then retryable (1) or not (0).
    errors: [[OnceLock<metrics::Counter>; 2]; Op::COUNT],
}

impl<S> Timed<S> {
    pub(crate) fn new(inner: S, backend: &'static str) -> Self {
        Self { inner, backend, calls: Default::default(), errors: Default::default() }
    }

    /// `call`, timed, its error counted.
    async fn observed<T>(&self, op: Op, call: impl Future<Output = Result<T, StoreError>>) -> Result<T, StoreError> {
        let started = Instant::now();
        let result = call.await;
        self.record(op, started.elapsed(), result.as_ref().err());
        result
    }

    fn record(&self, op: Op, took: Duration, error: Option<&StoreError>) {
        let backend = self.backend;
        self.calls[op as usize]
            .get_or_init(
                || metrics::histogram!("idem_store_call_seconds", "backend" => backend, "operation" => op.as_str()),
            )
            .record(took.as_secs_f64());
        if let Some(e) = error
            && !e.is_lease_lost()
        {
            let retryable = e.is_retryable();
            self.errors[op as usize][usize::from(retryable)]
                .get_or_init(|| {
                    let retryable = if retryable { "true" } else { "false" };
                    metrics::counter!(
                        "idem_store_errors_total",
                        "backend" => backend, "operation" => op.as_str(), "retryable" => retryable
                    )
                })
                .increment(1);
        }
    }
}

impl<S: Calls> Calls for Timed<S> {
    fn claim(&self, req: ClaimRequest) -> impl Future<Output = Result<ClaimOutcome, StoreError>> + Send {
        self.observed(Op::Claim, self.inner.claim(req))
    }

    fn reclaim(&self, req: ReclaimRequest) -> impl Future<Output = Result<ReclaimOutcome, StoreError>> + Send {
        self.observed(Op::Reclaim, self.inner.reclaim(req))
    }

    fn complete<R>(
        &self,
        id: RecordId,
        token: FencingToken,
        response: R,
    ) -> impl Future<Output = Result<Receipt, StoreError>> + Send
    where
        R: FnMut() -> StoredResponse + Send,
    {
        self.observed(Op::Complete, self.inner.complete(id, token, response))
    }

    fn fail(&self, id: RecordId, token: FencingToken) -> impl Future<Output = Result<Receipt, StoreError>> + Send {
        self.observed(Op::Fail, self.inner.fail(id, token))
    }

    fn extend(
        &self,
        id: RecordId,
        token: FencingToken,
        lease_ttl: Duration,
    ) -> impl Future<Output = Result<Receipt, StoreError>> + Send {
        self.observed(Op::Extend, self.inner.extend(id, token, lease_ttl))
    }

    fn get(&self, id: RecordId) -> impl Future<Output = Result<Option<Record>, StoreError>> + Send {
        self.observed(Op::Get, self.inner.get(id))
    }

    fn journal_put<'a>(
        &'a self,
        id: RecordId,
        token: FencingToken,
        name: &'a str,
        value: Vec<u8>,
        overwrite: bool,
    ) -> impl Future<Output = Result<JournalWrite, StoreError>> + Send {
        self.observed(Op::JournalPut, self.inner.journal_put(id, token, name, value, overwrite))
    }

    fn journal_get<'a>(
        &'a self,
        id: RecordId,
        name: &'a str,
    ) -> impl Future<Output = Result<Option<Vec<u8>>, StoreError>> + Send {
        self.observed(Op::JournalGet, self.inner.journal_get(id, name))
    }

    fn sweep(&self, limit: usize) -> impl Future<Output = Result<SweepOutcome, StoreError>> + Send {
        self.observed(Op::Sweep, self.inner.sweep(limit))
    }
}
