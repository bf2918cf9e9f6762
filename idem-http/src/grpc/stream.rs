//! The claim of a gRPC response that streams before its `grpc-status` is known
//! (`docs/contract.md#grpc`, "Streamed"): held by the response body, which has the
//! record completed or failed when the stream ends and only then passes the trailers on.

use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use futures::future::BoxFuture;
use http::{HeaderMap, HeaderValue};
use http_body::{Body, Frame};
use idem_core::{FencingToken, Policy, RecordId, StoredBody, StoredResponse};
use tracing::Instrument;

use super::keeper::{Keeper, Progress};
use super::lasting_code;
use crate::future::FailGuard;
use crate::headers::kept_fields;
use crate::lease::{Lease, LeaseState, renew};
use crate::observe::{Observer, Outcome};
use crate::store::LayerStore;

/// The claim of a gRPC response that streams before its `grpc-status` is known
/// (`docs/contract.md#grpc`, "Streamed"): held by the response body, which has the record written
/// when the stream ends and only then passes the trailers on.
pub(crate) struct StreamEnd {
    /// Keeps the lease fresh while the stream flows and its client reads: a stream may
    /// outlast any lease. Declared first, so a dropped stream stops renewing before its
    /// guard fails the record.
    keeper: Keeper,
    /// The body's polls and its end, shared with the keeper's idle watch; `None` when
    /// nothing renews, so there is no renewal to stop.
    progress: Option<Arc<Progress>>,
    /// The runtime the claim was made on, where the final write runs so that it outlives
    /// the body; `None` outside tokio.
    runtime: Option<tokio::runtime::Handle>,
    state: EndState,
}

enum EndState {
    /// The stream flows; the claim is held and renewed.
    Open(Box<OpenClaim>),
    /// The stream ended: the record is being written; `trailers` go out after it.
    Writing {
        /// Resolves once the record is written, to whether the trailers must say that the
        /// status was not stored. In a mutex only so that the body stays `Sync`: polled
        /// through `get_mut`, never locked.
        write: Mutex<BoxFuture<'static, bool>>,
        trailers: Option<HeaderMap>,
    },
    /// Written (or abandoned): the body has ended.
    Done,
}

/// What completing or failing the record takes.
pub(crate) struct OpenClaim {
    pub(crate) store: Arc<LayerStore>,
    pub(crate) id: RecordId,
    pub(crate) token: FencingToken,
    /// Armed: a stream dropped before it ended fails the record.
    pub(crate) guard: FailGuard<'static>,
    /// The HTTP status and the kept headers of the response.
    pub(crate) status: u16,
    pub(crate) headers: Vec<(String, Vec<u8>)>,
    /// `grpc-status` in the head, which a trailers-only answer carries.
    pub(crate) head_status: Option<HeaderValue>,
    /// Which trailer fields the record keeps.
    pub(crate) policy: Policy,
    /// Body bytes sent so far: the length the record states.
    pub(crate) len: u64,
    pub(crate) lease: LeaseState,
    pub(crate) obs: Observer,
}

impl StreamEnd {
    /// Holds `claim` until the stream ends, renewing its `lease` meanwhile (`None` when
    /// the layer does not renew; nothing renews without a tokio runtime either). The
    /// renewal counts from the claim, so after a handler that ran longer than one interval
    /// it renews at once: the handler's own renewal ended with the handler.
    pub(crate) fn new(claim: OpenClaim, lease: Option<Lease>) -> Self {
        let runtime = tokio::runtime::Handle::try_current().ok();
        let (keeper, progress) = match (lease, &runtime) {
            (Some(lease), Some(runtime)) => {
                let progress = Arc::new(Progress::new());
                let (store, state) = (Arc::clone(&claim.store), claim.lease.clone());
                let renewal = async move { renew(&store, lease, &state).await };
                let keeper = Keeper::start(renewal, lease, Arc::clone(&progress), runtime, claim.obs.span.clone());
                (keeper, Some(progress))
            }
            _ => (Keeper::default(), None),
        };
        Self { keeper, progress, runtime, state: EndState::Open(Box::new(claim)) }
    }

    /// Whether the body has ended: the record is written and nothing is held back.
    pub(crate) fn is_done(&self) -> bool {
        matches!(self.state, EndState::Done)
    }

    /// The body handed the client a frame the layer had read before the stream: the
    /// client reads.
    pub(crate) fn read_frame_sent(&self) {
        if let Some(progress) = &self.progress {
            progress.polled(false);
        }
    }

    /// The next frame of `rest`, the body after the part the layer read. Data passes
    /// through; the end (trailers, or none) waits for the record to be written.
    pub(crate) fn poll_frame<B>(
        &mut self,
        rest: Pin<&mut B>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>>
    where
        B: Body<Data = Bytes>,
    {
        let poll = self.poll_end(rest, cx);
        if let Some(progress) = &self.progress {
            progress.polled(poll.is_pending());
        }
        poll
    }

    fn poll_end<B>(
        &mut self,
        mut rest: Pin<&mut B>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>>
    where
        B: Body<Data = Bytes>,
    {
        loop {
            if matches!(self.state, EndState::Open(_)) && self.progress.as_ref().is_some_and(|p| p.is_gone()) {
                return Poll::Ready(Some(Ok(Frame::trailers(self.lapse()))));
            }
            match &mut self.state {
                EndState::Done => return Poll::Ready(None),
                EndState::Writing { write, trailers } => {
                    let not_stored = ready!(write.get_mut().unwrap_or_else(PoisonError::into_inner).as_mut().poll(cx));
                    let mut trailers = trailers.take();
                    if not_stored {
                        // As on an HTTP response the layer could not store: a retry of the
                        // key will not replay this status.
                        trailers
                            .get_or_insert_with(HeaderMap::new)
                            .insert(crate::headers::IDEMPOTENT_STORED, HeaderValue::from_static("false"));
                    }
                    self.state = EndState::Done;
                    return Poll::Ready(trailers.map(|t| Ok(Frame::trailers(t))));
                }
                EndState::Open(claim) => match ready!(rest.as_mut().poll_frame(cx)) {
                    Some(Ok(frame)) => match frame.into_data() {
                        Ok(data) => {
                            claim.len = claim.len.saturating_add(data.len() as u64);
                            return Poll::Ready(Some(Ok(Frame::data(data))));
                        }
                        Err(frame) => match frame.into_trailers() {
                            Ok(trailers) => {
                                if let Some(lapsed) = self.end(Some(trailers)) {
                                    return Poll::Ready(Some(Ok(Frame::trailers(lapsed))));
                                }
                            }
                            // Neither data nor trailers: not ours to judge.
                            Err(frame) => return Poll::Ready(Some(Ok(frame))),
                        },
                    },
                    None => {
                        if let Some(lapsed) = self.end(None) {
                            return Poll::Ready(Some(Ok(Frame::trailers(lapsed))));
                        }
                    }
                    Some(Err(error)) => {
                        // The error cannot wait for a write: it goes to the client now,
                        // and the claim's guard marks the record failed on its own.
                        self.abandon();
                        return Poll::Ready(Some(Err(error)));
                    }
                },
            }
        }
    }

    /// The stream ended with `trailers`: starts writing the record. Returns the trailers
    /// that end the call instead when the idle watch gave the claim up first.
    fn end(&mut self, trailers: Option<HeaderMap>) -> Option<HeaderMap> {
        if self.progress.as_ref().is_some_and(|p| !p.end()) {
            return Some(self.lapse());
        }
        let EndState::Open(claim) = std::mem::replace(&mut self.state, EndState::Done) else { return None };
        let OpenClaim { store, id, token, mut guard, status, headers, head_status, policy, len, lease, obs } = *claim;
        let keeper = std::mem::take(&mut self.keeper);
        let status_field = trailers.as_ref().and_then(|t| t.get("grpc-status")).or(head_status.as_ref());
        let lasting = lasting_code(status_field);
        let stored = lasting.then(|| {
            let kept = trailers.as_ref().map_or_else(Vec::new, |t| kept_fields(&policy, t));
            StoredResponse { status, headers, body: StoredBody::NotRetained { len: Some(len) }, trailers: kept }
        });
        let span = obs.span.clone();
        // The renewal runs on until the write returns: `complete` is resent for up to a
        // lease while the store is out, and a lease that ran out meanwhile would let a
        // retry reclaim the record and run the call again.
        let write = async move {
            let outcome = match stored {
                Some(stored) => {
                    let written = store.complete(id, token, || stored.clone()).await;
                    // Landed or given up, the write is over: a failed one leaves the record
                    // in flight until its lease ends, as for an HTTP response.
                    guard.disarm();
                    // Stopped, and awaited, before the lost flag is read: a renewal sent
                    // while the write was under way may still be answered.
                    keeper.stop().await;
                    match written {
                        // The write under this attempt's token landed, so the lease was
                        // this attempt's: a renewal refused after it (`extend` moves only
                        // a lease in flight) lost nothing.
                        Ok(_) => Outcome::NotRetained,
                        Err(e) if e.is_lease_lost() || lease.is_lost() => {
                            tracing::warn!(
                                record = %id, token = %token, error = %e,
                                "lease lost before the gRPC stream ended: another attempt owns the record now; its \
                                 status is not stored"
                            );
                            Outcome::LeaseLost
                        }
                        Err(e) => {
                            tracing::error!(
                                record = %id, token = %token, error = %e,
                                "could not store the gRPC stream's status; the record stays in flight until its \
                                 lease ends, after which a retry reclaims it and runs the handler again"
                            );
                            Outcome::NotStored
                        }
                    }
                }
                None => {
                    guard.fail_now("gRPC stream ended without a lasting status").await;
                    keeper.stop().await;
                    if lease.is_lost() { Outcome::LeaseLost } else { Outcome::Failed }
                }
            };
            obs.outcome(outcome, lease.renewals());
            lasting && matches!(outcome, Outcome::LeaseLost | Outcome::NotStored)
        };
        let write: BoxFuture<'static, bool> = match &self.runtime {
            // On a task of its own, which owns the guard: a client that goes away while the
            // store is slow drops the body, and with it only this wait, never the write. A
            // dropped write would fail the record of a stream that ended `OK`, and the retry
            // would run it again. A task that did not finish (it panicked, or the runtime
            // shut down) may not have stored the status.
            Some(runtime) => {
                let task = runtime.spawn(write.instrument(span));
                Box::pin(async move { task.await.unwrap_or(lasting) })
            }
            // Outside tokio nothing can run it but this body, and nothing renews either.
            None => Box::pin(write),
        };
        self.state = EndState::Writing { write: Mutex::new(write), trailers };
        None
    }

    /// The stream failed: the claim's guard marks the record failed (on the runtime, in
    /// the background), and the renewal stops with it.
    fn abandon(&mut self) {
        self.keeper = Keeper::default();
        if let EndState::Open(claim) = std::mem::replace(&mut self.state, EndState::Done) {
            claim.observe_failed();
        }
    }

    /// The client read again after the idle watch gave the claim up: the call ends now,
    /// with a status the client can read, rather than with the rest of a call whose record
    /// another attempt may own by now. The claim's guard marks the record failed; fenced by
    /// this attempt's token, it changes nothing once another attempt reclaimed it.
    fn lapse(&mut self) -> HeaderMap {
        self.abandon();
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from(super::code::ABORTED));
        trailers.insert(
            "grpc-message",
            HeaderValue::from_static(
                "the response was not read for longer than the idempotency lease; its outcome is not stored and a \
                 retry may run the call again",
            ),
        );
        trailers.insert(crate::headers::IDEMPOTENT_STORED, HeaderValue::from_static("false"));
        trailers
    }
}

impl OpenClaim {
    fn observe_failed(&self) {
        let outcome = if self.lease.is_lost() { Outcome::LeaseLost } else { Outcome::Failed };
        self.obs.outcome(outcome, self.lease.renewals());
    }
}

impl Drop for StreamEnd {
    fn drop(&mut self) {
        // Dropped mid-stream (the client went away): the guard, dropped with the claim,
        // marks the record failed, so a retry runs the call again.
        if let EndState::Open(claim) = &self.state {
            claim.observe_failed();
        }
    }
}
