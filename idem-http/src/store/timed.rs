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

use idem_core::StoreError;

use super::Op;

/// The handles every call is timed and its failure counted with.
pub(super) struct Timing {
    /// The store's backend name: the `backend` label.
    backend: &'static str,
    /// A histogram per operation.
    calls: [OnceLock<metrics::Histogram>; Op::COUNT],
    /// An error counter per operation, then retryable (1) or not (0).
    errors: [[OnceLock<metrics::Counter>; 2]; Op::COUNT],
}

impl Timing {
    pub(super) fn new(backend: &'static str) -> Self {
        Self { backend, calls: Default::default(), errors: Default::default() }
    }

    /// `call`, timed, its error counted.
    pub(super) async fn observed<T>(
        &self,
        op: Op,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
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
