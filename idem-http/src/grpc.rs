//! gRPC behind the layer (feature `grpc`): which handler outcomes are stored, and the
//! layer's own answers as gRPC statuses. Without the feature a gRPC request is plain HTTP
//! to the layer: stored by its HTTP status (200, whatever its `grpc-status`), answered
//! with problem bodies.
//!
//! gRPC runs over HTTP/2 with `content-type: application/grpc` (or `application/grpc+proto`
//! and the like); metadata are header fields, so the key travels as `idempotency-key`
//! metadata and the principal as `authorization`, exactly as over HTTP. A unary RPC
//! answers HTTP 200, one message, and its status in the `grpc-status` trailer (or, with no
//! message, in the headers: "trailers-only"). The layer stores the trailers with the
//! message and replays both, so a retry gets the same message and the same `grpc-status`.
//!
//! **What is stored.** HTTP 200 says nothing about a gRPC call's outcome, so a gRPC
//! response is stored only when its `grpc-status` is a lasting one, the gRPC counterpart
//! of "2xx and lasting 4xx": `OK`, `INVALID_ARGUMENT`, `NOT_FOUND`, `ALREADY_EXISTS`,
//! `FAILED_PRECONDITION`, `OUT_OF_RANGE`. Every other code (`UNAVAILABLE`, `INTERNAL`,
//! `DEADLINE_EXCEEDED`, `ABORTED`, `RESOURCE_EXHAUSTED`, `UNAUTHENTICATED`,
//! `PERMISSION_DENIED`, `UNKNOWN`, `CANCELLED`, `DATA_LOSS`, `UNIMPLEMENTED`) or a missing
//! status marks the record failed, so a retry runs the handler again. A handler's
//! [`crate::ResponseCaching`] still decides for one response. gRPC-Web
//! (`application/grpc-web[-text]`) answers an error trailers-only too: a `grpc-status`
//! header that is not lasting marks the record failed the same way. A gRPC-Web response
//! with a message carries its status inside the body, which the layer does not parse: it
//! is stored by its HTTP status. The layer's own answers to a gRPC-Web request are
//! problem bodies, not gRPC statuses.
//!
//! **Streamed responses.** A gRPC response that streams (longer than `max_stored_body`,
//! or still open at the buffering deadline) sends its `grpc-status` last, so its record is
//! not completed when the body starts to stream, as an HTTP response's is: the attempt
//! keeps its claim, its lease renewed, until the stream ends, and the trailers reach the
//! client only after the record is written. A lasting status completes the record as not
//! retained, the status kept in its trailers: a retry gets `ALREADY_EXISTS`. Any other
//! status, no status, a body that fails, or a client that goes away before the trailers
//! marks the record failed: a retry runs the handler again. While the stream flows, a
//! retry gets `ABORTED` (in flight), however long the stream lasts. Once the stream has
//! ended, the record is written on a task of its own, its lease still renewed until the
//! write returns: a client that goes away while the store is slow to take the status does
//! not cancel the write, so a stream that ended `OK` is never run again. A status the
//! store did not take (an outage longer than the completion retries, a lost lease) reaches
//! the client with `idempotent-stored: false` among its trailers, as an HTTP response's
//! [`crate::IDEMPOTENT_STORED`]. A client that stops reading for one lease TTL is treated
//! as gone (a half-open connection would otherwise hold the key claimed for ever): the
//! lease is no longer renewed and lapses, so a retry reclaims the record and runs the call
//! again; should that client read again, its call ends at once with `ABORTED` and
//! `idempotent-stored: false`. A client waiting for a handler that is slow to send is
//! reading: only a body left unpolled after a frame counts as idle. Why hold the claim
//! rather than store the final status: `complete` and `fail` only change a record in
//! flight, so a record completed when the stream started cannot take its status later,
//! and a stored `UNAVAILABLE` replayed to every retry would still never run the call
//! again. A handler's `ResponseCaching::Store` completes the record when the body starts
//! to stream, as for HTTP, whatever the status.
//!
//! **The layer's answers.** For a gRPC request the layer answers trailers-only (HTTP 200,
//! `grpc-status`, `grpc-message`), never a problem body a gRPC client cannot read:
//!
//! | layer answer | gRPC status |
//! |---|---|
//! | missing, invalid or duplicate key; unreadable request | `INVALID_ARGUMENT` (3) |
//! | missing principal | `UNAUTHENTICATED` (16) |
//! | request body over `max_request_body` | `RESOURCE_EXHAUSTED` (8) |
//! | in flight, busy | `ABORTED` (10): retry the whole call later, per the gRPC status guide |
//! | mismatch | `FAILED_PRECONDITION` (9): do not retry until the request is fixed |
//! | store unavailable | `UNAVAILABLE` (14) |
//! | record does not decode | `DATA_LOSS` (15): retrying cannot mend it, and gRPC retry policies retry `UNAVAILABLE` |
//! | replay of a response that was not retained | `ALREADY_EXISTS` (6): the operation was done |
//! | the handler's body failed | `INTERNAL` (13) |
//!
//! The problem's `detail` becomes `grpc-message` (percent-encoded, as the gRPC HTTP/2
//! protocol requires), the problem's `type` URI the `idem-problem` metadata entry, and
//! `Retry-After`, `idempotency-key-expires` and the retry hints stay as metadata.

use std::pin::{Pin, pin};
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use futures::future::{BoxFuture, Either, select};
use http::{HeaderMap, HeaderValue, Response, StatusCode, header};
use http_body::{Body, Frame};
use idem_core::{FencingToken, Policy, RecordId, Store, StoredBody, StoredResponse};
use tokio::sync::oneshot;
use tokio::time::Instant;
use tracing::Instrument;

use crate::body::ResponseBody;
use crate::future::FailGuard;
use crate::lease::{LeaseState, Renewal};
use crate::observe::{Observer, Outcome};
use crate::problem::{Problem, ProblemKind};

/// gRPC status codes the layer uses or reads (grpc/doc/statuscodes.md).
mod code {
    pub(super) const OK: u32 = 0;
    pub(super) const INVALID_ARGUMENT: u32 = 3;
    pub(super) const NOT_FOUND: u32 = 5;
    pub(super) const ALREADY_EXISTS: u32 = 6;
    pub(super) const RESOURCE_EXHAUSTED: u32 = 8;
    pub(super) const FAILED_PRECONDITION: u32 = 9;
    pub(super) const ABORTED: u32 = 10;
    pub(super) const OUT_OF_RANGE: u32 = 11;
    pub(super) const INTERNAL: u32 = 13;
    pub(super) const UNAVAILABLE: u32 = 14;
    pub(super) const DATA_LOSS: u32 = 15;
    pub(super) const UNAUTHENTICATED: u32 = 16;
}

/// Whether a request (or response) with `headers` is gRPC: `content-type` is
/// `application/grpc` or `application/grpc+<format>`.
pub(crate) fn is_grpc(headers: &HeaderMap) -> bool {
    headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).is_some_and(|ct| {
        let media = ct.split(';').next().unwrap_or_default().trim().to_ascii_lowercase();
        media == "application/grpc" || media.starts_with("application/grpc+")
    })
}

/// The gRPC status code the layer answers a gRPC request with instead of a problem of
/// `kind` (the table in this module's docs). The 503 for a stored record that does not
/// decode is a `StoreUnavailable` problem, yet answers `DATA_LOSS` (15), not this code.
#[must_use]
pub fn grpc_code_for(kind: ProblemKind) -> u32 {
    match kind {
        ProblemKind::MissingKey | ProblemKind::InvalidKey | ProblemKind::DuplicateKey | ProblemKind::UnreadableBody => {
            code::INVALID_ARGUMENT
        }
        ProblemKind::MissingPrincipal => code::UNAUTHENTICATED,
        ProblemKind::BodyTooLarge | ProblemKind::HeadersTooLarge => code::RESOURCE_EXHAUSTED,
        ProblemKind::InFlight | ProblemKind::Busy => code::ABORTED,
        ProblemKind::Mismatch => code::FAILED_PRECONDITION,
        ProblemKind::StoreUnavailable => code::UNAVAILABLE,
        ProblemKind::ResponseNotRetained => code::ALREADY_EXISTS,
        _ => code::INTERNAL,
    }
}

/// Whether a response with `headers` is gRPC-Web: `content-type` is
/// `application/grpc-web`, `application/grpc-web-text`, or either with `+<format>`.
fn is_grpc_web(headers: &HeaderMap) -> bool {
    headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).is_some_and(|ct| {
        let media = ct.split(';').next().unwrap_or_default().trim().to_ascii_lowercase();
        ["application/grpc-web", "application/grpc-web-text"]
            .iter()
            .any(|t| media == *t || media.strip_prefix(t).is_some_and(|rest| rest.starts_with('+')))
    })
}

/// Whether a finished response is a lasting outcome: `true` for any response that is not
/// gRPC (its HTTP status already decided), and for a gRPC one whose `grpc-status`
/// (trailers first, then headers) is lasting (module docs).
pub(crate) fn is_lasting(headers: &HeaderMap, trailers: Option<&HeaderMap>) -> bool {
    if is_grpc_web(headers) {
        // gRPC-Web (tonic-web, Envoy's filter) also answers errors with HTTP 200, as a
        // trailers-only response whose `grpc-status` is a header. A response with a
        // message carries its status in a trailer frame inside the body, which the layer
        // does not parse: stored by its HTTP status, as any other response.
        return match headers.get("grpc-status") {
            None => true,
            status => lasting_code(status),
        };
    }
    if !is_grpc(headers) {
        return true;
    }
    lasting_code(trailers.and_then(|t| t.get("grpc-status")).or_else(|| headers.get("grpc-status")))
}

/// Whether `grpc-status` value `status` is a lasting outcome (module docs).
fn lasting_code(status: Option<&HeaderValue>) -> bool {
    let status = status.and_then(|v| v.to_str().ok()?.trim().parse::<u32>().ok());
    matches!(
        status,
        Some(
            code::OK
                | code::INVALID_ARGUMENT
                | code::NOT_FOUND
                | code::ALREADY_EXISTS
                | code::FAILED_PRECONDITION
                | code::OUT_OF_RANGE
        )
    )
}

/// The claim of a gRPC response that streams before its `grpc-status` is known (module
/// docs, "Streamed responses"): held by the response body, which has the record written
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
    pub(crate) store: Arc<dyn Store>,
    pub(crate) id: RecordId,
    pub(crate) token: FencingToken,
    /// Armed: a stream dropped before it ended fails the record.
    pub(crate) guard: FailGuard,
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
    /// Holds `claim` until the stream ends, renewing its lease meanwhile (`renewal` is
    /// `None` when the layer does not renew, or has no tokio runtime to do it on). The
    /// renewal counts from the claim, so after a handler that ran longer than one interval
    /// it renews at once: the handler's own renewal ended with the handler.
    pub(crate) fn new(claim: OpenClaim, renewal: Option<Renewal>) -> Self {
        let runtime = tokio::runtime::Handle::try_current().ok();
        let (keeper, progress) = match (renewal, &runtime) {
            (Some(renewal), Some(runtime)) => {
                let progress = Arc::new(Progress::new());
                let keeper = Keeper::start(renewal, Arc::clone(&progress), runtime, claim.obs.span.clone());
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
            let kept = trailers.as_ref().map_or_else(Vec::new, |t| crate::service::kept_fields(&policy, t));
            StoredResponse { status, headers, body: StoredBody::NotRetained { len: Some(len) } }.with_trailers(kept)
        });
        let span = obs.span.clone();
        // The renewal runs on until the write returns: `complete` is resent for up to a
        // lease while the store is out, and a lease that ran out meanwhile would let a
        // retry reclaim the record and run the call again.
        let write = async move {
            let outcome = match stored {
                Some(stored) => {
                    let written = store.complete(id, token, stored).await;
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
        trailers.insert("grpc-status", HeaderValue::from(code::ABORTED));
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

/// [`Progress::phase`]: the stream flows.
const LIVE: u8 = 0;
/// [`Progress::phase`]: the stream ended; the renewal covers the final write.
const ENDED: u8 = 1;
/// [`Progress::phase`]: the client was taken for gone; the renewal stopped.
const GONE: u8 = 2;

/// How long past one lease TTL without a poll the idle watch looks: idle means longer than
/// one lease TTL, so a client that reads once per lease TTL still reads; one tick of
/// tokio's millisecond timers.
const IDLE_GRACE: Duration = Duration::from_millis(1);

/// How a stream's client reads, shared by the body (which records each poll, and the end)
/// and the idle watch beside the renewal (which may take the client for gone). The renewal
/// runs on its own task and would otherwise renew for as long as the body exists, read or
/// not: a client that stops reading without closing its connection (half-open, no HTTP/2
/// keepalive) would hold the key claimed for ever.
struct Progress {
    /// Origin of [`Self::last_poll`].
    base: Instant,
    /// The last poll of the body: nanoseconds after `base`, shifted left by one, the low
    /// bit set when that poll returned `Pending`. One word, so the watch never reads the
    /// time of one poll with the outcome of another.
    last_poll: AtomicU64,
    /// [`LIVE`], [`ENDED`] or [`GONE`]. The body's end and the idle watch each move it from
    /// `LIVE`, and the first decides: an ended stream's write keeps its renewal, and a
    /// client taken for gone cannot end its stream with a write its lease no longer covers.
    phase: AtomicU8,
}

impl Progress {
    fn new() -> Self {
        Self { base: Instant::now(), last_poll: AtomicU64::new(0), phase: AtomicU8::new(LIVE) }
    }

    /// Records a poll of the body, now, and whether it returned `Pending`.
    fn polled(&self, pending: bool) {
        let nanos = u64::try_from(self.base.elapsed().as_nanos()).unwrap_or(u64::MAX).min(u64::MAX >> 1);
        self.last_poll.store((nanos << 1) | u64::from(pending), Ordering::Release);
    }

    /// When the body was last polled, and whether that poll returned `Pending`.
    fn last_poll(&self) -> (Instant, bool) {
        let word = self.last_poll.load(Ordering::Acquire);
        (self.base + Duration::from_nanos(word >> 1), word & 1 == 1)
    }

    fn is_gone(&self) -> bool {
        self.phase.load(Ordering::Acquire) == GONE
    }

    /// The stream ended: `true` unless the client was taken for gone first.
    fn end(&self) -> bool {
        self.phase.compare_exchange(LIVE, ENDED, Ordering::AcqRel, Ordering::Acquire).is_ok()
    }

    /// Resolves once the body has been left unpolled after a frame for longer than `ttl`,
    /// having taken the client for gone; never once the stream ended.
    async fn idle(self: Arc<Self>, ttl: Duration) {
        while self.phase.load(Ordering::Acquire) == LIVE {
            let (at, pending) = self.last_poll();
            let now = Instant::now();
            if pending {
                // The client waits for the handler's next frame: a handler slow to send is
                // no sign of a client gone. Looked at again a lease later; the poll that
                // hands that frame over moves `at`.
                tokio::time::sleep_until(now + ttl).await;
            } else if now.saturating_duration_since(at) > ttl {
                if self.phase.compare_exchange(LIVE, GONE, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                    return;
                }
            } else {
                tokio::time::sleep_until(at + ttl + IDLE_GRACE).await;
            }
        }
        std::future::pending::<()>().await;
    }
}

/// A stream's lease renewal and the idle watch that stops it, on a task of their own (not
/// polled with the body, or a client that reads slowly would let the lease run out under
/// a live stream). Aborted when dropped, the renewal with it: a stream dropped half-way
/// stops renewing, so its lease runs out.
#[derive(Default)]
struct Keeper {
    task: Option<tokio::task::JoinHandle<()>>,
    stop: Option<oneshot::Sender<()>>,
}

impl Keeper {
    fn start(renewal: Renewal, progress: Arc<Progress>, runtime: &tokio::runtime::Handle, span: tracing::Span) -> Self {
        let (id, token, ttl) = (renewal.id, renewal.token, renewal.lease_ttl);
        let (stop, stopped) = oneshot::channel();
        let keep = async move {
            // A renewal that ended (lease lost, or the store cannot extend) leaves the
            // watch alone until the stop.
            let renew = async move {
                renewal.run().await;
                std::future::pending::<()>().await;
            };
            let (idle, renew) = (pin!(progress.idle(ttl)), pin!(renew));
            let watched = select(idle, renew);
            // Returning drops the renewal, wherever it is: stopped, or the client gone.
            if let Either::Left(_) = select(watched, stopped).await {
                tracing::warn!(
                    record = %id, token = %token,
                    "the client has not read the gRPC stream for longer than a lease TTL and is taken for gone: the \
                     lease is no longer renewed, and once it lapses a retry runs the call again"
                );
            }
        };
        Self { task: Some(runtime.spawn(keep.instrument(span))), stop: Some(stop) }
    }

    /// Stops the renewal and waits until it has: a renewal refused after the record was
    /// written would read as a lost lease.
    async fn stop(mut self) {
        if let (Some(stop), Some(task)) = (self.stop.take(), self.task.take()) {
            let _ = stop.send(());
            let _ = task.await;
        }
    }
}

impl Drop for Keeper {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// Marks the layer's 503 for a stored record that does not decode: a gRPC request gets
/// `DATA_LOSS`, which gRPC retry policies do not retry, rather than `UNAVAILABLE`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Unrecoverable;

/// The layer's answer `res` (a problem) as a trailers-only gRPC response.
pub(crate) fn problem_to_status<B>(res: Response<ResponseBody<B>>, problem: &Problem) -> Response<ResponseBody<B>> {
    let (mut head, _) = res.into_parts();
    let code = if head.extensions.remove::<Unrecoverable>().is_some() {
        code::DATA_LOSS
    } else {
        grpc_code_for(problem.kind())
    };
    head.status = StatusCode::OK;
    head.headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    head.headers.insert("grpc-status", HeaderValue::from(code));
    if let Ok(message) = HeaderValue::from_str(&percent_encode(problem.detail())) {
        head.headers.insert("grpc-message", message);
    }
    if let Ok(kind) = HeaderValue::from_str(&problem.kind().type_uri()) {
        head.headers.insert("idem-problem", kind);
    }
    Response::from_parts(head, ResponseBody::full(Bytes::new()))
}

/// `grpc-message` encoding: bytes outside printable ASCII, and `%`, as `%XX` (UTF-8).
fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_content_types_are_recognised() {
        let ct = |v: &'static str| {
            let mut h = HeaderMap::new();
            h.insert(header::CONTENT_TYPE, HeaderValue::from_static(v));
            is_grpc(&h)
        };
        assert!(ct("application/grpc") && ct("application/grpc+proto") && ct("Application/GRPC; charset=x"));
        assert!(!ct("application/grpc-web") && !ct("application/json"));
        assert!(!is_grpc(&HeaderMap::new()));
    }

    /// A gRPC error answered with HTTP 200 was stored and replayed to every retry.
    #[test]
    fn only_lasting_grpc_statuses_are_stored() {
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        let with = |s: &'static str| {
            let mut t = HeaderMap::new();
            t.insert("grpc-status", HeaderValue::from_static(s));
            is_lasting(&h, Some(&t))
        };
        for s in ["0", "3", "5", "6", "9", "11"] {
            assert!(with(s), "{s}");
        }
        for s in ["1", "2", "4", "7", "8", "10", "12", "13", "14", "15", "16", "x"] {
            assert!(!with(s), "{s}");
        }
        assert!(!is_lasting(&h, None), "no status at all is a broken response");
        let mut trailers_only = h.clone();
        trailers_only.insert("grpc-status", HeaderValue::from_static("5"));
        assert!(is_lasting(&trailers_only, None));
        assert!(is_lasting(&HeaderMap::new(), None), "not gRPC: the HTTP status decided");
    }

    /// A gRPC-Web error (HTTP 200, trailers-only, `grpc-status: 14` as a header) was
    /// stored as a lasting outcome and replayed to every retry: `is_lasting` knew only
    /// `application/grpc`.
    #[test]
    fn a_grpc_web_error_is_not_lasting() {
        for ct in ["application/grpc-web", "application/grpc-web+proto", "application/grpc-web-text"] {
            let mut h = HeaderMap::new();
            h.insert(header::CONTENT_TYPE, HeaderValue::from_static(ct));
            assert!(is_lasting(&h, None), "{ct}: a message, its status in the body: stored");
            h.insert("grpc-status", HeaderValue::from_static("14"));
            assert!(!is_lasting(&h, None), "{ct}: UNAVAILABLE");
            h.insert("grpc-status", HeaderValue::from_static("5"));
            assert!(is_lasting(&h, None), "{ct}: NOT_FOUND");
        }
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/grpc-webby"));
        h.insert("grpc-status", HeaderValue::from_static("14"));
        assert!(is_lasting(&h, None), "not gRPC-Web: the HTTP status decided");
    }

    /// The documented mapping drifted from the code.
    #[test]
    fn every_layer_answer_has_its_documented_code() {
        use ProblemKind as K;
        let table = [
            (K::MissingKey, 3),
            (K::InvalidKey, 3),
            (K::DuplicateKey, 3),
            (K::UnreadableBody, 3),
            (K::MissingPrincipal, 16),
            (K::BodyTooLarge, 8),
            (K::InFlight, 10),
            (K::Busy, 10),
            (K::Mismatch, 9),
            (K::StoreUnavailable, 14),
            (K::ResponseNotRetained, 6),
            (K::ResponseBodyFailed, 13),
        ];
        for (kind, code) in table {
            assert_eq!(grpc_code_for(kind), code, "{kind:?}");
        }
    }

    #[test]
    fn a_problem_becomes_a_trailers_only_status() {
        let problem = Problem::new(ProblemKind::Mismatch, StatusCode::CONFLICT, "key reused; 100%");
        let res = problem.clone().into_response::<http_body_util::Empty<Bytes>>();
        let res = problem_to_status(res, &problem);
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(res.headers()["content-type"], "application/grpc");
        assert_eq!(res.headers()["grpc-status"], "9");
        assert_eq!(res.headers()["grpc-message"], "key reused; 100%25");
        assert_eq!(res.headers()["idem-problem"], "urn:idem:problem:mismatch");
        assert!(http_body::Body::is_end_stream(res.body()), "no message: trailers-only");
    }

    /// A record that does not decode was answered `UNAVAILABLE`, which gRPC retry
    /// policies retry, while the HTTP answer says no retry can mend it.
    #[test]
    fn a_record_that_does_not_decode_is_data_loss() {
        let problem = Problem::new(ProblemKind::StoreUnavailable, StatusCode::SERVICE_UNAVAILABLE, "unreadable");
        let mut res = problem.clone().into_response::<http_body_util::Empty<Bytes>>();
        res.extensions_mut().insert(Unrecoverable);
        assert_eq!(problem_to_status(res, &problem).headers()["grpc-status"], "15");
        let res = problem.clone().into_response::<http_body_util::Empty<Bytes>>();
        assert_eq!(problem_to_status(res, &problem).headers()["grpc-status"], "14", "an outage stays UNAVAILABLE");
    }

    #[test]
    fn grpc_message_is_percent_encoded() {
        assert_eq!(percent_encode("retry in 1 s; 100% é"), "retry in 1 s; 100%25 %C3%A9");
    }
}
