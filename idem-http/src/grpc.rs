//! gRPC behind the layer: which handler outcomes are stored, and the layer's own answers
//! as gRPC statuses.
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
//! retry gets `ABORTED` (in flight), however long the stream lasts. Why hold the claim
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

use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use futures::future::BoxFuture;
use http::{HeaderMap, HeaderValue, Response, StatusCode, header};
use http_body::{Body, Frame};
use idem_core::{FencingToken, Policy, RecordId, Store, StoredBody, StoredResponse};

use crate::body::ResponseBody;
use crate::future::FailGuard;
use crate::lease::{LeaseState, Renewal, Renewing};
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
#[must_use]
pub fn is_grpc(headers: &HeaderMap) -> bool {
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
/// docs, "Streamed responses"): held by the response body, which writes the record when
/// the stream ends and only then passes the trailers on.
pub(crate) struct StreamEnd {
    /// Keeps the lease fresh while the stream flows: a stream may outlast any lease.
    /// Declared first, so a dropped stream stops renewing before its guard fails the
    /// record.
    renewing: Renewing,
    state: EndState,
}

enum EndState {
    /// The stream flows; the claim is held and renewed.
    Open(Box<OpenClaim>),
    /// The stream ended: the record is being written; `trailers` go out after it.
    Writing {
        /// In a mutex only so that the body stays `Sync`: polled through `get_mut`, never
        /// locked.
        write: Mutex<BoxFuture<'static, ()>>,
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
        // On a task of its own, not polled with the body: a client that reads slowly
        // would otherwise let the lease run out under a live stream.
        let renewing = Renewing::start(renewal);
        Self { state: EndState::Open(Box::new(claim)), renewing }
    }

    /// Whether the body has ended: the record is written and nothing is held back.
    pub(crate) fn is_done(&self) -> bool {
        matches!(self.state, EndState::Done)
    }

    /// The next frame of `rest`, the body after the part the layer read. Data passes
    /// through; the end (trailers, or none) waits for the record to be written.
    pub(crate) fn poll_frame<B>(
        &mut self,
        mut rest: Pin<&mut B>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>>
    where
        B: Body<Data = Bytes>,
    {
        loop {
            match &mut self.state {
                EndState::Done => return Poll::Ready(None),
                EndState::Writing { write, trailers } => {
                    ready!(write.get_mut().unwrap_or_else(PoisonError::into_inner).as_mut().poll(cx));
                    let trailers = trailers.take();
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
                            Ok(trailers) => self.end(Some(trailers)),
                            // Neither data nor trailers: not ours to judge.
                            Err(frame) => return Poll::Ready(Some(Ok(frame))),
                        },
                    },
                    None => self.end(None),
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

    /// The stream ended with `trailers`: starts writing the record.
    fn end(&mut self, trailers: Option<HeaderMap>) {
        let EndState::Open(claim) = std::mem::replace(&mut self.state, EndState::Done) else { return };
        let OpenClaim { store, id, token, mut guard, status, headers, head_status, policy, len, lease, obs } = *claim;
        let renewal = std::mem::take(&mut self.renewing);
        let status_field = trailers.as_ref().and_then(|t| t.get("grpc-status")).or(head_status.as_ref());
        let stored = lasting_code(status_field).then(|| {
            let kept = trailers.as_ref().map_or_else(Vec::new, |t| crate::service::kept_fields(&policy, t));
            StoredResponse { status, headers, body: StoredBody::NotRetained { len: Some(len) } }.with_trailers(kept)
        });
        let write = async move {
            renewal.stop().await;
            let outcome = match stored {
                Some(stored) => match store.complete(id, token, stored).await {
                    Ok(_) => Outcome::NotRetained,
                    Err(e) if e.is_lease_lost() => {
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
                            "could not store the gRPC stream's status; the record stays in flight until its lease \
                             ends, after which a retry reclaims it and runs the handler again"
                        );
                        Outcome::NotStored
                    }
                },
                None => {
                    guard.fail_now("gRPC stream ended without a lasting status").await;
                    Outcome::Failed
                }
            };
            guard.disarm();
            let outcome = if lease.is_lost() { Outcome::LeaseLost } else { outcome };
            obs.outcome(outcome, lease.renewals());
        };
        self.state = EndState::Writing { write: Mutex::new(Box::pin(write)), trailers };
    }

    /// The stream failed: the claim's guard marks the record failed (on the runtime, in
    /// the background), and the renewal stops with it.
    fn abandon(&mut self) {
        self.renewing = Renewing::default();
        if let EndState::Open(claim) = std::mem::replace(&mut self.state, EndState::Done) {
            claim.observe_failed();
        }
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
