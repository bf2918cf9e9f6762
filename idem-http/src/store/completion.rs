//! Completion retries ([`crate::deadline::CompletionRetry`]): a `complete`, `fail` or
//! journal write that missed its deadline or met an outage is sent again, with backoff
//! (25 ms, doubling, at most 1 s), for up to one lease TTL after the first attempt. Without
//! it the response goes out, the record stays in flight, and once the lease runs out a
//! retry reclaims the record and runs the handler a second time.
//!
//! A resend after an attempt that may have landed unheard (its deadline passed, or its
//! connection dropped) is refused with `LeaseLost`, because the record is no longer in
//! flight: the record is then read once, and if it carries this attempt's token in the
//! state asked for, the write was this attempt's own and the call reads as done (fencing
//! tokens never repeat for a record id, so no other attempt can have left that token).

use std::future::Future;
use std::time::Duration;

use idem_core::{FencingToken, JournalWrite, Receipt, RecordId, RecordState, StoreError};
use tokio::time::Instant;

use super::{LayerStore, Op, deadlines};
use crate::deadline::CompletionRetry;
use crate::lease::{RETRY_FIRST, RETRY_MAX};

/// Whether a write that failed with `error` may land if sent again: any
/// `StoreError::Unavailable`, the retryable ones (a blip, a busy timeout, a missed
/// deadline) and the others too (SQLite's full disk, redb's latched I/O failure), as lease
/// renewal treats them: the store may recover within the window, and the fence keeps a
/// late write harmless. Refusals (`LeaseLost`), corrupt records and unsupported operations
/// are final.
fn is_outage(error: &StoreError) -> bool {
    matches!(error, StoreError::Unavailable { .. })
}

/// The call that asks for state `want`, for the logs.
fn what(want: RecordState) -> &'static str {
    if want == RecordState::Completed { "complete" } else { "fail" }
}

/// The resends of one write.
struct Schedule {
    retry: CompletionRetry,
    window_end: Instant,
    pause: Duration,
    /// Whether an earlier attempt may have been applied without this call hearing so.
    ambiguous: bool,
}

impl Schedule {
    /// After an attempt that failed with `error`: waits out the pause and returns `Ok` when
    /// the write goes again, or returns the error when it is final (not an outage, the
    /// window closes first, retries off, or no tokio runtime to time the pause). `log` says
    /// what is sent again.
    async fn again(&mut self, error: StoreError, log: impl FnOnce(&StoreError)) -> Result<(), StoreError> {
        let retries = self.retry == CompletionRetry::WhileLeaseLasts && tokio::runtime::Handle::try_current().is_ok();
        if !retries || !is_outage(&error) || Instant::now() + self.pause >= self.window_end {
            return Err(error);
        }
        log(&error);
        self.ambiguous = true;
        tokio::time::sleep(self.pause).await;
        self.pause = (self.pause * 2).min(RETRY_MAX);
        Ok(())
    }
}

impl LayerStore {
    /// The resends of a write that starts now.
    fn schedule(&self) -> Schedule {
        Schedule {
            retry: self.deadlines.completion_retry,
            window_end: Instant::now() + self.resend_window,
            pause: RETRY_FIRST,
            ambiguous: false,
        }
    }

    /// A `complete` (`want` completed) or `fail` (`want` failed) of `id` under `token`,
    /// each attempt made by `attempt`, sent again after an outage (module docs).
    pub(super) async fn resend<F, A>(
        &self,
        id: RecordId,
        token: FencingToken,
        want: RecordState,
        mut attempt: A,
    ) -> Result<Receipt, StoreError>
    where
        A: FnMut() -> F + Send,
        F: Future<Output = Result<Receipt, StoreError>> + Send,
    {
        let mut schedule = self.schedule();
        let mut error = match attempt().await {
            Ok(receipt) => return Ok(receipt),
            Err(e) => e,
        };
        // The resends are a future of their own, boxed: a completion that lands at once,
        // the common case, carries none of their state.
        Box::pin(async move {
            loop {
                if let Some(end) = self.settle(&mut schedule, (id, token, want), error).await {
                    return end;
                }
                error = match attempt().await {
                    Ok(receipt) => return Ok(receipt),
                    Err(e) => e,
                };
            }
        })
        .await
    }

    /// A completion that failed with `error`: the final result, if this was the last
    /// attempt; `None` to send it again.
    async fn settle(
        &self,
        schedule: &mut Schedule,
        (id, token, want): (RecordId, FencingToken, RecordState),
        error: StoreError,
    ) -> Option<Result<Receipt, StoreError>> {
        if error.is_lease_lost() {
            if schedule.ambiguous
                && let Some(receipt) = self.own_write(id, token, want).await
            {
                tracing::debug!(record = %id, token = %token, what = what(want), "resent completion found already applied");
                return Some(Ok(receipt));
            }
            return Some(Err(error));
        }
        // Any outage is sent again, not only the retryable ones: a `complete` refused by a
        // full disk (SQLite) or by redb after a latched I/O failure lands once the store
        // recovers, and giving up at once left the record in flight, so the retry after
        // the lease ran the handler a second time. `fail` follows the same rule although a
        // lost `fail` never runs anything twice (the record stays in flight and a retry
        // reclaims it when the lease ends): a `fail` that lands once the store is back
        // frees the key at once instead of answering every retry 409 for the rest of the
        // lease, and it only holds back an error answer, which a retryable outage already
        // does for as long.
        let log = |e: &StoreError| {
            tracing::warn!(record = %id, token = %token, what = what(want), error = %e, "store completion failed; retrying");
        };
        schedule.again(error, log).await.err().map(Err)
    }

    /// The record's receipt, if it carries `token` in state `want`: this attempt's own
    /// earlier write. Read as stored (not opened): only its token and state count.
    async fn own_write(&self, id: RecordId, token: FencingToken, want: RecordState) -> Option<Receipt> {
        match deadlines::within(self.deadlines.read, Op::Get, self.store().get(id)).await {
            Ok(Some(record)) if record.token == token && record.state == want => Some(Receipt::of(&record)),
            _ => None,
        }
    }

    /// A journal entry (a step's outcome, an intent's `pending` or `done`), sent again like
    /// a completion for up to one lease TTL. The step's side effect has already happened
    /// when its outcome is written: giving up at the first failure (a full disk, a blip)
    /// fails the request with no outcome journalled, and the retry that reclaims the record
    /// runs the step again.
    ///
    /// A resend after an ambiguous success is safe: the write is fenced by `token`, a
    /// step's entry is written only if absent (the resend finds it and returns
    /// [`JournalWrite::Exists`] with the same value), and an intent's entry is overwritten
    /// with the same state. `LeaseLost` (another attempt owns the record) ends the resends.
    pub(super) async fn resend_journal(
        &self,
        id: RecordId,
        token: FencingToken,
        name: &str,
        value: Vec<u8>,
        overwrite: bool,
    ) -> Result<JournalWrite, StoreError> {
        let mut schedule = self.schedule();
        loop {
            let put = self.store().journal_put(id, token, name, value.clone(), overwrite);
            let error = match deadlines::within(self.deadlines.journal, Op::JournalPut, put).await {
                Ok(written) => return Ok(written),
                Err(e) => e,
            };
            let log = |e: &StoreError| {
                tracing::warn!(record = %id, token = %token, name, error = %e, "journal write failed; retrying");
            };
            schedule.again(error, log).await?;
        }
    }
}
