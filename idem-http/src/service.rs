//! [`Idempotency`]: the middleware service, and the request flow it runs.
//!
//! The flow for a non-safe request, in order:
//! 1. read `Idempotency-Key` (none: [`crate::KeyRequirement`]; invalid or repeated: 400);
//! 2. resolve the principal (none: [`crate::MissingPrincipal`]);
//! 3. buffer the body up to the layer's `max_request_body` (over: 413, nothing claimed);
//! 4. fingerprint, and `claim` the record in the store;
//! 5. decide ([`idem_core::decide`]): run the handler under the claim, replay, 409 (or,
//!    opt-in, wait a bounded time for the first attempt's outcome), mismatch;
//! 6. while the handler runs, renew its lease ([`crate::LeaseRenewal`]);
//! 7. after the handler: for a cacheable status, read the body up to `max_stored_body + 1`
//!    bytes (or not at all for a streaming media type, or until the buffering deadline),
//!    then `complete` (with the body if it ended in time, not retained otherwise); for any
//!    other status `fail` without reading; only then return the response, whose unread
//!    rest streams straight from the handler.
//!
//! Steps 5 (running the handler), 6 and 7 happen in work that outlives the response future
//! under [`crate::HandlerExecution::Detached`] (default: polled in place, moved to a task of
//! its own if the response future is dropped), and in the response future itself under
//! [`crate::HandlerExecution::Inline`].

use std::panic::AssertUnwindSafe;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures::FutureExt;
use http::request::Parts;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode, header};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use idem_core::{
    BoxError, ClaimOutcome, ClaimRequest, Decision, Endpoint, FencingToken, Fingerprint, IdempotencyKey, Policy,
    Principal, ReclaimOutcome, ReclaimRequest, Record, RecordId, RecordState, RequestParts, Scope, StoreError,
    StoredBody, StoredResponse, UnixMillis, decide,
};
use tokio::time::Instant;
use tower::Service;
use tracing::Instrument;

use crate::body::ResponseBody;
use crate::config::{Config, HandlerExecution, KeyRequirement, MissingPrincipal, StoreFailureMode};
use crate::context::{IdempotencyContext, ResponseCaching};
use crate::future::{FailGuard, ResponseFuture, detach_on_drop};
use crate::headers::{IDEMPOTENCY_KEY, IDEMPOTENCY_KEY_EXPIRES, IDEMPOTENT_REPLAYED, expires_value};
use crate::lease::{LeaseState, Renewal, while_renewing};
use crate::observe::{DecisionKind, Observer, Outcome};
use crate::problem::{Problem, ProblemKind};
use crate::streaming::Streaming;

/// How many times one request re-reads a record that changed under it (a lost reclaim, a
/// record that expired between two reads) before it answers 409 busy. Each round follows
/// an actual change by another request, so three is plenty outside pathological
/// contention, and it bounds the store calls one request can make.
const MAX_ROUNDS: usize = 3;

/// `Retry-After` on a 503 from an unavailable store, and on 409 busy, in seconds.
const RETRY_AFTER_BUSY_SECS: u64 = 1;

/// First pause of a bounded wait for an in-flight record (`with_in_flight_wait`) before it
/// reads the record again; each pause doubles, up to [`WAIT_POLL_MAX`]. Short first, so a
/// duplicate that arrives as the first attempt finishes gets the replay within
/// milliseconds; longer later, so a long wait costs a few reads per second.
const WAIT_POLL_FIRST: Duration = Duration::from_millis(20);
/// Longest pause between two reads of a bounded wait.
const WAIT_POLL_MAX: Duration = Duration::from_millis(500);

/// The middleware made by [`crate::IdempotencyLayer`].
///
/// Generic over the request body `ReqBody` (rebuilt from the buffered bytes with
/// `From<Bytes>`, as axum's `Body` and `http_body_util::Full` allow) and the response body
/// `ResBody` (any `http_body::Body<Data = Bytes>`). Responses come back as
/// [`ResponseBody<ResBody>`]. The error type is the inner service's: a handler error is
/// returned as is, after the record was marked failed.
///
/// The wrapped service must be `Clone + Send + 'static` with a `Send` future, error and
/// body (axum's routers and handlers are): under [`crate::HandlerExecution::Detached`] a
/// claimed request's handler moves to a task of its own if the client goes away before it
/// finished.
#[derive(Clone, Debug)]
pub struct Idempotency<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> Idempotency<S> {
    pub(crate) fn new(inner: S, config: Arc<Config>) -> Self {
        Self { inner, config }
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body + From<Bytes> + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        // The instance that was driven to readiness serves this request; a fresh clone
        // stays behind for the next one (the usual tower pattern for async middleware).
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        ResponseFuture::new(Box::pin(handle(Arc::clone(&self.config), inner, req)))
    }
}

type Res<B> = Response<ResponseBody<B>>;

async fn handle<S, ReqBody, ResBody>(
    cfg: Arc<Config>,
    inner: S,
    req: Request<ReqBody>,
) -> Result<Res<ResBody>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    ReqBody: Body + From<Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    // RFC 9110 §9.2.1: safe methods change nothing, so there is nothing to protect.
    if req.method().is_safe() {
        return pass_through(inner, req).await;
    }
    let grpc = is_grpc(req.headers());
    // One span per non-safe request: the handler's own spans nest under it, and it stays
    // with the work if that moves to a task of its own (`detach_on_drop` takes the
    // current span).
    let endpoint = endpoint_of(req.method(), req.uri(), req.extensions());
    let span = crate::observe::request_span(&endpoint);
    let mut obs = Observer::new(span.clone());
    let res = handle_keyed(&cfg, inner, req, endpoint, &mut obs).instrument(span).await?;
    // The layer's own answers (they carry their `ProblemKind`) get the retry hints, and
    // become gRPC statuses for a gRPC request; handler responses and replays of them pass
    // unchanged.
    Ok(crate::hints::dress(res, &cfg.retry_hints, grpc))
}

async fn handle_keyed<S, ReqBody, ResBody>(
    cfg: &Config,
    inner: S,
    req: Request<ReqBody>,
    endpoint: Endpoint,
    obs: &mut Observer,
) -> Result<Res<ResBody>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    ReqBody: Body + From<Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let (parts, body) = req.into_parts();
    obs.endpoint(&endpoint);
    let key = match read_key(&parts.headers, cfg.max_key_len) {
        Ok(Some(key)) => key,
        Ok(None) => {
            return match cfg.key_requirement {
                KeyRequirement::Optional => {
                    obs.decision(DecisionKind::Skipped);
                    pass_through(inner, Request::from_parts(parts, body)).await
                }
                KeyRequirement::Required => Ok(obs.rejected(Problem::new(
                    ProblemKind::MissingKey,
                    StatusCode::BAD_REQUEST,
                    "this endpoint requires an Idempotency-Key header; generate one unique value per operation and \
                     send it on every retry",
                ))),
            };
        }
        Err(problem) => return Ok(obs.rejected(problem)),
    };
    // Resolved once per request: this one answer is the principal of the claim, the record
    // id, the handler's context and every later write, so a resolver that would answer
    // differently on a second call is never asked twice.
    let Some(resolved) = cfg.resolver.resolve(&parts) else {
        return match cfg.missing_principal {
            MissingPrincipal::SkipIdempotency => {
                obs.decision(DecisionKind::Skipped);
                pass_through(inner, Request::from_parts(parts, body)).await
            }
            MissingPrincipal::Reject => {
                obs.decision(DecisionKind::Rejected);
                let mut res = Problem::new(
                    ProblemKind::MissingPrincipal,
                    StatusCode::UNAUTHORIZED,
                    "an idempotency key is only meaningful for an authenticated principal; none was found",
                )
                .into_response();
                if let Some(challenge) = cfg.resolver.challenge() {
                    res.headers_mut().insert(header::WWW_AUTHENTICATE, challenge);
                }
                Ok(res)
            }
        };
    };
    // Blank is a resolver bug (or a client-supplied blank identity), not "anonymous": it
    // never shares a bucket and never skips idempotency, whatever MissingPrincipal says.
    let Ok(principal) = Principal::new(resolved) else {
        return Ok(obs.rejected(crate::principal::blank_principal()));
    };
    if let Err(problem) = crate::headers::check_fingerprint_headers(
        &parts.headers,
        &cfg.fingerprint_headers,
        cfg.max_fingerprint_fields,
        cfg.max_fingerprint_header_bytes,
    ) {
        return Ok(obs.rejected(problem));
    }
    let bytes = match buffer(body, &parts.headers, cfg.max_request_body).await {
        Ok(bytes) => bytes,
        Err(problem) => return Ok(obs.rejected(problem)),
    };
    let fingerprint = fingerprint(&parts, &bytes, cfg);
    let claim = ClaimRequest::new(
        Scope { principal, endpoint },
        key,
        fingerprint,
        cfg.policy.lease_ttl,
        cfg.policy.effective_retention(),
    );
    let id = claim.id();
    obs.record(id);
    let (acquired, decision) = acquire(cfg, claim).await;
    match (&acquired, decision) {
        (Acquired::Run(record, _), Some(decision)) => obs.claimed(decision, record.token),
        (_, Some(decision)) => obs.decision(decision),
        (_, None) => {}
    }
    match acquired {
        Acquired::Run(record, claimed_at) => match cfg.handler_execution {
            HandlerExecution::Inline => run_claimed(cfg, inner, parts, bytes, record, claimed_at, obs).await,
            HandlerExecution::Detached => run_detached(cfg, inner, parts, bytes, record, claimed_at, obs).await,
        },
        Acquired::Answer(res) => Ok(res),
        Acquired::StoreFailed(error) => match cfg.store_failure_mode {
            StoreFailureMode::FailOpen => {
                obs.decision(DecisionKind::FailOpen);
                tracing::warn!(
                    record = %id, endpoint = %endpoint_of(&parts.method, &parts.uri, &parts.extensions).as_str(), error = %error,
                    "idempotency store failed; running the handler WITHOUT idempotency protection (fail-open)"
                );
                pass_through(inner, Request::from_parts(parts, ReqBody::from(bytes))).await
            }
            StoreFailureMode::FailClosed => {
                obs.decision(DecisionKind::StoreUnavailable);
                tracing::error!(
                    record = %id, endpoint = %endpoint_of(&parts.method, &parts.uri, &parts.extensions).as_str(), error = %error,
                    "idempotency store failed; answering 503 without running the handler (fail-closed)"
                );
                Ok(store_unavailable("the idempotency store is unavailable; the request was not processed"))
            }
        },
        Acquired::Unreadable(why) => {
            // In both failure modes: the record may be a completed operation, and running
            // its handler again (fail-open) could repeat it. Retrying cannot fix the
            // record, so SDK retry loops are told not to.
            obs.decision(DecisionKind::Unreadable);
            tracing::error!(record = %id, why, "stored idempotency record cannot be read or replayed");
            let mut res = store_unavailable("the stored record for this idempotency key cannot be read");
            crate::hints::never_retry(res.headers_mut(), &cfg.retry_hints);
            #[cfg(feature = "grpc")]
            res.extensions_mut().insert(crate::grpc::Unrecoverable);
            Ok(res)
        }
    }
}

async fn pass_through<S, ReqBody, ResBody>(mut inner: S, req: Request<ReqBody>) -> Result<Res<ResBody>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    inner.call(req).await.map(|res| res.map(|body| ResponseBody::inner(Box::pin(body))))
}

/// One `Idempotency-Key` field, parsed. Two or more fields are a 400 even when their
/// values are equal: the field is a single sf-item (draft §2.1), and a client or proxy
/// that repeats it is broken in a way the server should report, not guess around.
fn read_key(headers: &HeaderMap, max_len: usize) -> Result<Option<IdempotencyKey>, Problem> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else { return Ok(None) };
    if values.next().is_some() {
        return Err(Problem::new(
            ProblemKind::DuplicateKey,
            StatusCode::BAD_REQUEST,
            "the request carries more than one Idempotency-Key field; send exactly one",
        ));
    }
    IdempotencyKey::parse_with_limit(value.as_bytes(), max_len)
        .map(Some)
        .map_err(|e| Problem::new(ProblemKind::InvalidKey, StatusCode::BAD_REQUEST, e.to_string()))
}

/// Method plus axum's route template when the request went through an axum router (so
/// `/v1/workers/7/reboot` and `/v1/workers/8/reboot` share the endpoint
/// `POST /v1/workers/{id}/reboot`); otherwise method plus the concrete path, in which case
/// resolved path parameters are part of the scope. Either way the fingerprint covers the
/// raw path, so the same key on another resource is a mismatch, never a replay.
fn endpoint_of(method: &http::Method, uri: &http::Uri, extensions: &http::Extensions) -> Endpoint {
    #[cfg(feature = "axum")]
    if let Some(route) = extensions.get::<axum::extract::MatchedPath>() {
        return Endpoint::new(method.as_str(), route.as_str());
    }
    #[cfg(not(feature = "axum"))]
    let _ = extensions;
    Endpoint::new(method.as_str(), uri.path())
}

async fn buffer<B>(body: B, headers: &HeaderMap, limit: usize) -> Result<Bytes, Problem>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let too_large = || {
        Problem::new(
            ProblemKind::BodyTooLarge,
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the request body is larger than {limit} bytes, the most this endpoint buffers"),
        )
    };
    // Refuse a declared oversize body before reading any of it.
    let declared = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(too_large());
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.is::<LengthLimitError>() => Err(too_large()),
        Err(e) => Err(Problem::new(
            ProblemKind::UnreadableBody,
            StatusCode::BAD_REQUEST,
            format!("the request body could not be read: {e}"),
        )),
    }
}

fn fingerprint(parts: &Parts, body: &[u8], cfg: &Config) -> Fingerprint {
    let headers: Vec<(&str, &[u8])> = cfg
        .fingerprint_headers
        .iter()
        .flat_map(|name| parts.headers.get_all(name.as_str()).iter().map(move |v| (name.as_str(), v.as_bytes())))
        .collect();
    Fingerprint::of_mode(
        &RequestParts {
            method: parts.method.as_str(),
            path: parts.uri.path(),
            query: parts.uri.query(),
            headers: &headers,
            body,
        },
        cfg.fingerprint_mode,
    )
}

enum Acquired<B> {
    /// This request holds the claim (first claim or reclaim): run the handler. The instant
    /// is when the winning call was sent: the lease started no earlier.
    Run(Record, Instant),
    /// Answer without running the handler: replay, 409, mismatch.
    Answer(Res<B>),
    /// The store failed: fail closed or open, per the layer's store failure mode.
    StoreFailed(StoreError),
    /// A record that does not decode ([`StoreError::Corrupt`]), or a completed record
    /// whose response cannot be rebuilt.
    Unreadable(String),
}

/// Claims `claim`'s record and decides what to do with what the store found.
///
/// The claim request goes to the store by value; the common cases (a first claim, a
/// replay, a 409) need nothing of it afterwards. A request that must claim anew (its record
/// expired or vanished between two reads) rebuilds it from a record it saw, which has the
/// same scope and key: the record id is their hash.
///
/// With a bounded wait (`with_in_flight_wait`), a record found in flight is read again
/// with `get` after short pauses until it is no longer in flight with a fresh lease, or
/// the wait is over; each read goes through the same decision as the claim's answer.
/// Nothing is held between two reads: no connection, no lock, no claim.
///
/// Returns the decision for the request's span and metrics with it; `None` for a store
/// failure and an unreadable record, which the caller names (it knows the failure mode).
async fn acquire<B>(cfg: &Config, claim: ClaimRequest) -> (Acquired<B>, Option<DecisionKind>) {
    let store = &cfg.store;
    let (id, fingerprint) = (claim.id(), claim.fingerprint());
    let (lease_ttl, retention) = (cfg.policy.lease_ttl, cfg.policy.effective_retention());
    let again = |scope: Scope, key: IdempotencyKey| ClaimRequest::new(scope, key, fingerprint, lease_ttl, retention);
    let sent = Instant::now();
    let (mut current, mut now) = match store.claim(claim).await {
        Ok(ClaimOutcome::Claimed(record)) => return (Acquired::Run(record, sent), Some(DecisionKind::Claimed)),
        Ok(ClaimOutcome::Existing { record, now }) => (Some(record), now),
        // A record that does not decode is no outage: it may be a completed operation.
        Err(e) if e.is_corrupt() => return (Acquired::Unreadable(e.to_string()), None),
        Err(e) => return (Acquired::StoreFailed(e), None),
    };
    // When the store's `now` was last read, for the estimate a `get` (which reports no
    // `now`) is decided with.
    let mut read_at = Instant::now();
    // Scope and key of the last record seen, for a claim after a reclaim found none.
    let mut seen: Option<(Scope, IdempotencyKey)> = None;
    let mut wait = cfg.in_flight_wait.map(BoundedWait::new);
    let mut rounds = 0;
    while rounds < MAX_ROUNDS {
        let next = match (decide(current.as_ref(), &fingerprint, now), current.as_ref()) {
            // No live record (it expired or vanished since the claim read it): claim anew.
            (Decision::Claim, _) | (_, None) => {
                let Some((scope, key)) = current.take().map(|r| (r.scope, r.key)).or_else(|| seen.take()) else {
                    // Unreachable: every round starts from a record or follows a reclaim,
                    // which remembered one. Answered like a record that kept changing.
                    break;
                };
                seen = Some((scope.clone(), key.clone()));
                let sent = Instant::now();
                match store.claim(again(scope, key)).await {
                    Ok(ClaimOutcome::Claimed(record)) => {
                        return (Acquired::Run(record, sent), Some(DecisionKind::Claimed));
                    }
                    Ok(ClaimOutcome::Existing { record, now: n }) => (Some(record), n),
                    Err(e) if e.is_corrupt() => return (Acquired::Unreadable(e.to_string()), None),
                    Err(e) => return (Acquired::StoreFailed(e), None),
                }
            }
            (Decision::Replay, Some(_)) => {
                let Some(record) = current.take() else { break };
                return match replay(record) {
                    Ok(res) => (Acquired::Answer(res), Some(DecisionKind::Replayed)),
                    Err(why) => (Acquired::Unreadable(why), None),
                };
            }
            (Decision::InFlight { retry_after_secs }, Some(record)) => {
                if let Some(pause) = wait.as_mut().and_then(BoundedWait::next_pause) {
                    seen = Some((record.scope.clone(), record.key.clone()));
                    tokio::time::sleep(pause).await;
                    match store.get(id).await {
                        Ok(found) => {
                            // The store's clock moved on by (at least) the time that passed here.
                            now = now.saturating_add(read_at.elapsed());
                            read_at = Instant::now();
                            current = found;
                            // A read while waiting is not a round: nothing raced this request.
                            continue;
                        }
                        // A record that stopped opening (or decoding) while this request
                        // waited is answered like at the claim: 503, never retry.
                        Err(e) if e.is_corrupt() => return (Acquired::Unreadable(e.to_string()), None),
                        // The record was in flight at the last read; say so rather than
                        // guess (failing open here could run the handler a second time).
                        Err(e) => tracing::warn!(
                            record = %id, error = %e,
                            "idempotency store failed during a bounded wait; answering in-flight"
                        ),
                    }
                }
                return (Acquired::Answer(in_flight(cfg, retry_after_secs, record)), Some(DecisionKind::InFlight));
            }
            (Decision::Mismatch, Some(record)) => {
                let status = StatusCode::from_u16(cfg.mismatch_status.code()).unwrap_or(StatusCode::CONFLICT);
                let detail = "this idempotency key was already used with a different request (method, path, query, \
                              fingerprinted headers or body); use a new key for a new operation";
                let mut res = Problem::new(ProblemKind::Mismatch, status, detail).into_response();
                set_expires(res.headers_mut(), record.expires_at);
                return (Acquired::Answer(res), Some(DecisionKind::Mismatch));
            }
            (Decision::Reclaim { expected }, Some(record)) => {
                seen = Some((record.scope.clone(), record.key.clone()));
                let req = ReclaimRequest { id, expected, fingerprint, lease_ttl, retention };
                let sent = Instant::now();
                match store.reclaim(req).await {
                    Ok(ReclaimOutcome::Reclaimed(record)) => {
                        return (Acquired::Run(record, sent), Some(DecisionKind::Reclaimed));
                    }
                    // Another retry won the compare-and-set, or the record moved on: look again.
                    Ok(ReclaimOutcome::Conflict { current, now: n }) => (current, n),
                    Err(e) if e.is_corrupt() => return (Acquired::Unreadable(e.to_string()), None),
                    Err(e) => return (Acquired::StoreFailed(e), None),
                }
            }
        };
        (current, now) = next;
        read_at = Instant::now();
        rounds += 1;
    }
    let mut res = Problem::new(
        ProblemKind::Busy,
        StatusCode::CONFLICT,
        "the idempotency record for this key kept changing while this request was decided; retry",
    )
    .into_response();
    set_retry_after(res.headers_mut(), RETRY_AFTER_BUSY_SECS);
    (Acquired::Answer(res), Some(DecisionKind::Busy))
}

/// 409 `in-flight`: another attempt holds a fresh lease on `record`. `Retry-After` is the
/// remaining lease (whole seconds, rounded up, at least 1) capped by the layer's
/// `in_flight_retry_after`: a short poll, because renewal keeps a live attempt's lease
/// fresh however long it runs, so the lease end says nothing about when the outcome lands.
fn in_flight<B>(cfg: &Config, remaining_lease_secs: u64, record: &Record) -> Res<B> {
    let secs = in_flight_retry_after_secs(remaining_lease_secs, cfg.in_flight_retry_after);
    let detail = format!("another request with this idempotency key is still being processed; retry after {secs} s");
    let mut res = Problem::new(ProblemKind::InFlight, StatusCode::CONFLICT, detail).into_response();
    set_retry_after(res.headers_mut(), secs);
    set_expires(res.headers_mut(), record.expires_at);
    res
}

/// clamp(remaining lease, 1 s, cap): `Retry-After` is whole delay-seconds (RFC 9110
/// §10.2.3), so the cap counts in whole seconds too (rounded down, at least 1).
fn in_flight_retry_after_secs(remaining_lease_secs: u64, cap: Duration) -> u64 {
    remaining_lease_secs.clamp(1, cap.as_secs().max(1))
}

/// The clock of one bounded wait: when it ends, and the next pause.
struct BoundedWait {
    deadline: Instant,
    pause: Duration,
}

impl BoundedWait {
    fn new(limit: Duration) -> Self {
        Self { deadline: Instant::now() + limit, pause: WAIT_POLL_FIRST }
    }

    /// How long to pause before the next read, never past the deadline; `None` once the
    /// wait is over.
    fn next_pause(&mut self) -> Option<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return None;
        }
        let pause = self.pause.min(left);
        self.pause = (self.pause * 2).min(WAIT_POLL_MAX);
        Some(pause)
    }
}

/// The replay of `record`'s stored response: status, headers and body, plus
/// `Idempotent-Replayed: true`. A body that was not retained becomes a problem body under
/// the original status, keeping `Location`. Takes the record: its body moves into the
/// response without a copy.
fn replay<B>(record: Record) -> Result<Res<B>, String> {
    let expires_at = record.expires_at;
    let Some(mut stored) = record.response else {
        return Err("completed record without a response".into());
    };
    let status = StatusCode::from_u16(stored.status).map_err(|e| format!("stored status {}: {e}", stored.status))?;
    let mut res = match stored.take_body_bytes().map_err(|e| e.to_string())? {
        Some(body) => {
            let trailers = stored_trailers(stored.trailers());
            let mut res = Response::new(ResponseBody::full_with_trailers(Bytes::from(body), trailers));
            *res.status_mut() = status;
            append_stored_headers(res.headers_mut(), &stored.headers, |_| true);
            res
        }
        None => {
            let len = match stored.plain_body() {
                StoredBody::NotRetained { len: Some(len) } => format!(" ({len} bytes)"),
                _ => String::new(),
            };
            let detail = format!(
                "the operation completed with status {}, but its response body{len} was larger than the \
                 idempotency store keeps, so it cannot be replayed",
                stored.status
            );
            let mut res = Problem::new(ProblemKind::ResponseNotRetained, status, detail).into_response();
            append_stored_headers(res.headers_mut(), &stored.headers, |name| name == "location");
            res
        }
    };
    res.headers_mut().insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    set_expires(res.headers_mut(), expires_at);
    Ok(res)
}

/// The stored trailers as a field map; `None` when there are none.
fn stored_trailers(stored: &[(String, Vec<u8>)]) -> Option<HeaderMap> {
    if stored.is_empty() {
        return None;
    }
    let mut map = HeaderMap::new();
    append_stored_headers(&mut map, stored, |_| true);
    Some(map)
}

fn append_stored_headers(out: &mut HeaderMap, stored: &[(String, Vec<u8>)], keep: impl Fn(&str) -> bool) {
    for (name, value) in stored.iter().filter(|(name, _)| keep(name)) {
        match (HeaderName::from_bytes(name.as_bytes()), HeaderValue::from_bytes(value)) {
            (Ok(name), Ok(value)) => {
                out.append(name, value);
            }
            _ => tracing::warn!(header = %name, "stored response header is not a valid header; not replayed"),
        }
    }
}

/// [`run_claimed`], detached from the response future: dropping the response future (a
/// client disconnect) does not cancel the handler half-way. The work is polled in place
/// while the response future lives and moves to a task of its own only when it is dropped
/// (see [`ResponseFuture`]); it finishes and stores its outcome, and the client's retry
/// finds it in flight, then replays it. A panic marks the record failed inside the work,
/// then goes on from here, as it would have inline.
async fn run_detached<S, ReqBody, ResBody>(
    cfg: &Config,
    inner: S,
    parts: Parts,
    bytes: Bytes,
    record: Record,
    claimed_at: Instant,
    obs: &Observer,
) -> Result<Res<ResBody>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ReqBody: From<Bytes>,
    ResBody: Body<Data = Bytes>,
    ResBody::Error: Into<BoxError>,
{
    // No runtime to hand the work to (an executor other than tokio): inline is all there is.
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        detach_on_drop(runtime);
    }
    run_claimed(cfg, inner, parts, bytes, record, claimed_at, obs).await
}

/// Runs the handler under the claim in `record` (claimed by a call sent at `claimed_at`),
/// renewing its lease while it runs, then completes or fails the record before the
/// response is returned.
async fn run_claimed<S, ReqBody, ResBody>(
    cfg: &Config,
    mut inner: S,
    mut parts: Parts,
    bytes: Bytes,
    record: Record,
    claimed_at: Instant,
    obs: &Observer,
) -> Result<Res<ResBody>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ReqBody: From<Bytes>,
    ResBody: Body<Data = Bytes>,
    ResBody::Error: Into<BoxError>,
{
    let store = Arc::clone(&cfg.store);
    // The record's scope and key move into the handler's context: nothing after the
    // handler reads them.
    let Record { id, token, scope, key, created_at, expires_at: claimed_expires_at, .. } = record;
    let mut guard = FailGuard::new(Arc::clone(&store), id, token);
    let lease = LeaseState::new();
    // The lease is renewed from the claim until the record is written, polled together
    // with the handler and then with the completion (never on a task of its own: a request
    // that stops being polled, or is dropped, stops renewing): the completion may be resent
    // for a whole lease while the store is out (`crate::deadline`), and a lease that ran
    // out meanwhile would let a retry reclaim the record and run the handler again.
    let mut renewing = pin!(renewal(cfg, id, token, claimed_at, &lease).map(Renewal::run));
    // The outcome, with the renewals so far; a lost lease wins over what the write said.
    let watch = lease.clone();
    // A gRPC stream's outcome is recorded when it ends, after this request's observer is
    // gone: its endpoint is kept for the metrics of that outcome.
    #[cfg(feature = "grpc")]
    let grpc_endpoint = is_grpc(&parts.headers).then(|| scope.endpoint.clone());
    let done = |outcome: Outcome| {
        let outcome = if watch.is_lost() { Outcome::LeaseLost } else { outcome };
        obs.outcome(outcome, watch.renewals());
    };
    // A write with this attempt's token landed, so the lease was still ours: a renewal
    // refused because the record had just been written does not make it lost.
    let written = |outcome: Outcome| obs.outcome(outcome, watch.renewals());
    parts.extensions.insert(IdempotencyContext {
        record_id: id,
        token,
        scope,
        key,
        lease,
        created_at,
        store: Arc::clone(&store),
        #[cfg(feature = "seal")]
        sealing: cfg.sealing.clone(),
    });
    let req = Request::from_parts(parts, ReqBody::from(bytes));
    let policy = &cfg.policy;
    let streaming = &cfg.streaming;
    // The handler's own future and the bounded reading of its body both run inside
    // catch_unwind: a streamed body that panics half-way is a handler panic too.
    let work = AssertUnwindSafe(async move {
        let res = inner.call(req).await?;
        let (mut head, body) = res.into_parts();
        let caching = head.extensions.remove::<ResponseCaching>();
        let cacheable = match caching {
            _ if head.status.is_server_error() => false,
            // Completed in the handler's own transaction: nothing more to store.
            Some(ResponseCaching::CompletedByHandler) => false,
            Some(ResponseCaching::Store) => true,
            Some(ResponseCaching::DoNotStore) => false,
            None => policy.is_cacheable(head.status.as_u16()),
        };
        let body = Box::pin(body);
        // A response that is not stored is not read here at all: it streams through as
        // it comes, after the record is marked failed.
        let read = if cacheable {
            read_bounded(body, &head, policy.max_stored_body, streaming).await
        } else {
            Read::Untouched(body)
        };
        Ok((head, caching, read))
    })
    .catch_unwind();
    let outcome = while_renewing(renewing.as_mut(), work).await;
    let (mut head, caching, read) = match outcome {
        Err(panic) => {
            // Mark failed first, deterministically, then let the panic continue to whatever
            // catches panics above this layer (a layer must not turn a panic into a response).
            while_renewing(renewing.as_mut(), guard.fail_now("handler panicked")).await;
            done(Outcome::Failed);
            std::panic::resume_unwind(panic);
        }
        Ok(Err(error)) => {
            while_renewing(renewing.as_mut(), guard.fail_now("handler returned an error")).await;
            done(Outcome::Failed);
            return Err(error);
        }
        Ok(Ok(parts)) => parts,
    };
    let mut expires_at = claimed_expires_at;
    if caching == Some(ResponseCaching::CompletedByHandler) {
        // The handler completed the record in its own transaction, together with its
        // writes; a completion does not move the retention end the claim set. Its body is
        // not read here (nothing is stored), so it streams through.
        //
        // Trust, but check once: a handler that set the marker and whose transaction then
        // rolled back (or that never completed) would otherwise leave the record in flight
        // with nobody running it, every retry answered "in flight" until the lease ran out,
        // and the client told it succeeded. Still in flight under this claim's token means
        // the completion did not commit: fail the record, so a retry runs cleanly.
        let check = store.get(id).await;
        if let Err(e) = &check
            && e.is_corrupt()
        {
            // The handler's completion committed (its writes with it), so its answer
            // stands; but the stored response does not open or decode (under sealing: it
            // was stored plain, not `IdempotencyContext::stored_form`), so every retry
            // gets 503, and a plain response sits in the store unsealed.
            tracing::error!(
                record = %id, token = %token, error = %e,
                "handler returned ResponseCaching::CompletedByHandler but the response it stored cannot be read back \
                 (stored unsealed while sealing is on?); retries of this key will be answered 503"
            );
        }
        if let Ok(Some(current)) = check
            && current.token == token
            && current.state == RecordState::InFlight
        {
            guard.fail_now("handler said it completed its record, but the record is still in flight").await;
            done(Outcome::Failed);
            tracing::error!(
                record = %id, token = %token,
                "handler returned ResponseCaching::CompletedByHandler but its completion did not commit; record marked failed"
            );
            return Ok(Problem::new(
                ProblemKind::ResponseBodyFailed,
                StatusCode::INTERNAL_SERVER_ERROR,
                "the handler's completion of this request did not commit; the request may be retried with the same key",
            )
            .into_response());
        }
        guard.disarm();
        done(Outcome::Completed);
        set_expires(&mut head.headers, claimed_expires_at);
        let body = match read {
            Read::Untouched(body) => ResponseBody::inner(body),
            Read::Whole(bytes, trailers) => ResponseBody::full_with_trailers(bytes, trailers),
            Read::Streamed { read, rest, .. } => ResponseBody::streamed(read, rest),
            Read::Failed(error) => {
                tracing::error!(record = %id, error = %error, "handler response body failed after the handler completed its record");
                return Ok(Problem::new(
                    ProblemKind::ResponseBodyFailed,
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "the response failed while it was being produced",
                )
                .into_response());
            }
        };
        return Ok(Response::from_parts(head, body));
    }
    let status = head.status.as_u16();
    let (stored, body) = match read {
        Read::Failed(error) => {
            while_renewing(renewing.as_mut(), guard.fail_now("response body failed")).await;
            done(Outcome::Failed);
            tracing::error!(record = %id, error = %error, "handler response body failed; record marked failed");
            return Ok(Problem::new(
                ProblemKind::ResponseBodyFailed,
                StatusCode::INTERNAL_SERVER_ERROR,
                "the response failed while it was being produced; the request may be retried with the same key",
            )
            .into_response());
        }
        Read::Untouched(body) => (None, ResponseBody::inner(body)),
        Read::Whole(bytes, trailers) => {
            // gRPC answers its errors with HTTP 200 and the real outcome in `grpc-status`;
            // only a lasting one is stored (see `crate::grpc`), unless the handler said.
            #[cfg(feature = "grpc")]
            let lasting = caching.is_some() || crate::grpc::is_lasting(&head.headers, trailers.as_ref());
            #[cfg(not(feature = "grpc"))]
            let lasting = true;
            let stored = lasting.then(|| {
                stored_response(policy, status, &head.headers, &bytes)
                    .with_trailers(trailers.as_ref().map_or_else(Vec::new, |t| kept_fields(policy, t)))
            });
            (stored, ResponseBody::full_with_trailers(bytes, trailers))
        }
        #[cfg(feature = "grpc")]
        Read::Streamed { read, rest, why, .. } if caching.is_none() && is_grpc(&head.headers) => {
            // Its `grpc-status` comes after the body: the claim stays held (and renewed)
            // until the body ends, which completes or fails the record (`crate::grpc`).
            tracing::debug!(record = %id, status, why, "gRPC response streamed: the record waits for its status");
            let mut stream_obs = Observer::new(obs.span.clone());
            if let Some(endpoint) = &grpc_endpoint {
                stream_obs.endpoint(endpoint);
            }
            let claim = crate::grpc::OpenClaim {
                store,
                id,
                token,
                guard,
                status,
                headers: kept_fields(policy, &head.headers),
                head_status: head.headers.get("grpc-status").cloned(),
                policy: policy.clone(),
                len: read.iter().map(|b| b.len() as u64).sum(),
                lease: watch.clone(),
                obs: stream_obs,
            };
            // The stream renews its own lease from here on.
            let end = crate::grpc::StreamEnd::new(claim, self::renewal(cfg, id, token, claimed_at, &watch));
            set_expires(&mut head.headers, claimed_expires_at);
            return Ok(Response::from_parts(head, ResponseBody::streamed_until_status(read, rest, end)));
        }
        Read::Streamed { read, len, rest, why } => {
            tracing::debug!(record = %id, status, why, "response streamed: the record completes without its body");
            let headers = kept_fields(policy, &head.headers);
            let stored = StoredResponse { status, headers, body: StoredBody::NotRetained { len } };
            (Some(stored), ResponseBody::streamed(read, rest))
        }
    };
    if let Some(stored) = stored {
        let retained = !matches!(stored.body, StoredBody::NotRetained { .. });
        match while_renewing(renewing.as_mut(), store.complete(id, token, stored)).await {
            Ok(record) => {
                expires_at = record.expires_at;
                written(if retained { Outcome::Completed } else { Outcome::NotRetained });
            }
            Err(e) if e.is_lease_lost() => {
                done(Outcome::LeaseLost);
                not_stored(&mut head.headers);
                tracing::warn!(
                    record = %id, token = %token, error = %e,
                    "lease lost before completion: another attempt owns the record now; this response is still \
                     returned but not stored"
                );
            }
            Err(e) => {
                done(Outcome::NotStored);
                not_stored(&mut head.headers);
                tracing::error!(
                    record = %id, token = %token, error = %e,
                    "could not store the response; it is returned anyway, and the record stays in flight until \
                     its lease ends, after which a retry reclaims it and runs the handler again"
                );
            }
        }
        guard.disarm();
    } else {
        // 5xx, 1xx, 3xx other than 303, the uncacheable 4xx, a gRPC status that is not
        // lasting, and what the handler marked `DoNotStore`: never stored, so a retry runs
        // again.
        while_renewing(renewing.as_mut(), guard.fail_now("response status is not cacheable")).await;
        done(Outcome::Failed);
    }
    set_expires(&mut head.headers, expires_at);
    Ok(Response::from_parts(head, body))
}

/// Whether a request or response is gRPC (`crate::grpc`). Without the `grpc` feature
/// never: a gRPC request is handled as plain HTTP.
fn is_grpc(headers: &HeaderMap) -> bool {
    #[cfg(feature = "grpc")]
    return crate::grpc::is_grpc(headers);
    #[cfg(not(feature = "grpc"))]
    {
        let _ = headers;
        false
    }
}

/// Marks a response the layer could not store (`Idempotent-Stored: false`), so that its
/// client knows a retry of the key will not replay it.
fn not_stored(headers: &mut HeaderMap) {
    headers.insert(crate::headers::IDEMPOTENT_STORED, HeaderValue::from_static("false"));
}

/// What the layer read of a response body it may store.
enum Read<B> {
    /// Not read: the response is not stored, so it streams through.
    Untouched(Pin<Box<B>>),
    /// The whole body ended within `max_stored_body` bytes, with its trailers.
    Whole(Bytes, Option<HeaderMap>),
    /// The layer stopped buffering: `read` is what it had read, `rest` the body from there.
    Streamed {
        read: Vec<Bytes>,
        /// The body's full length, when its size hint said it exactly.
        len: Option<u64>,
        rest: Pin<Box<B>>,
        why: &'static str,
    },
    /// The body failed while it was read.
    Failed(BoxError),
}

/// Reads `body` until it ends, or it has given more than `limit` bytes, or it is a stream
/// (`text/event-stream`, a declared length over `limit`), or it has not ended within the
/// layer's buffering deadline after the head. Holds at most `limit` bytes plus the one
/// frame that crossed the limit: memory per request is bounded whatever the response size.
async fn read_bounded<B>(
    mut body: Pin<Box<B>>,
    head: &http::response::Parts,
    limit: usize,
    streaming: &Streaming,
) -> Read<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let exact = body.size_hint().exact();
    if exact.is_some_and(|len| len > limit as u64) {
        return Read::Streamed {
            read: Vec::new(),
            len: exact,
            rest: body,
            why: "declared length over max_stored_body",
        };
    }
    if streaming.is_stream(&head.headers) {
        return Read::Streamed { read: Vec::new(), len: None, rest: body, why: "streaming content type" };
    }
    // The deadline needs tokio's timer; without a runtime the layer reads by size alone.
    let deadline =
        streaming.buffer_for.filter(|_| tokio::runtime::Handle::try_current().is_ok()).map(|d| Instant::now() + d);
    let mut read = Coalesced::new(limit);
    let mut trailers: Option<HeaderMap> = None;
    loop {
        let next = match deadline {
            Some(at) => match tokio::time::timeout_at(at, body.frame()).await {
                Ok(next) => next,
                Err(_) => {
                    return Read::Streamed {
                        read: read.into_frames(),
                        len: None,
                        rest: body,
                        why: "body still open at the buffering deadline",
                    };
                }
            },
            None => body.frame().await,
        };
        match next {
            None => break,
            Some(Err(e)) => return Read::Failed(e.into()),
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => {
                    read.push(data);
                    if read.total > limit {
                        // The size hint (if any) said at most `limit` bytes, and the body
                        // sent more: the hint was wrong, so the full length is unknown.
                        return Read::Streamed {
                            read: read.into_frames(),
                            len: None,
                            rest: body,
                            why: "body over max_stored_body",
                        };
                    }
                }
                Err(frame) => {
                    if let Ok(t) = frame.into_trailers() {
                        trailers.get_or_insert_with(HeaderMap::new).extend(t);
                    }
                }
            },
        }
    }
    Read::Whole(read.into_bytes(), trailers)
}

/// The bytes of a body read so far, in one buffer: kept frame by frame, a body of tiny
/// frames would cost a `Bytes` handle and an allocation per frame (~64 bytes of heap per
/// one-byte frame), far over `limit`. A body of one frame is kept as it came (no copy);
/// from the second frame on, they are copied into one buffer that never grows past
/// `limit` plus the frame that crossed it.
struct Coalesced {
    limit: usize,
    first: Option<Bytes>,
    joined: bytes::BytesMut,
    total: usize,
}

impl Coalesced {
    fn new(limit: usize) -> Self {
        Self { limit, first: None, joined: bytes::BytesMut::new(), total: 0 }
    }

    fn push(&mut self, data: Bytes) {
        if data.is_empty() {
            return;
        }
        self.total = self.total.saturating_add(data.len());
        if self.first.is_none() && self.joined.is_empty() {
            self.first = Some(data);
            return;
        }
        if let Some(first) = self.first.take() {
            self.append(&first);
        }
        self.append(&data);
    }

    fn append(&mut self, data: &[u8]) {
        let len = self.joined.len();
        if self.joined.capacity() - len < data.len() {
            // Double, as `BytesMut` would, but never past `limit + 1` bytes, plus this frame.
            let doubled = len.max(data.len()).min(self.limit.saturating_add(1).saturating_sub(len));
            self.joined.reserve(doubled.max(data.len()));
        }
        self.joined.extend_from_slice(data);
    }

    fn into_bytes(self) -> Bytes {
        self.first.unwrap_or_else(|| self.joined.freeze())
    }

    fn into_frames(self) -> Vec<Bytes> {
        let bytes = self.into_bytes();
        if bytes.is_empty() { Vec::new() } else { vec![bytes] }
    }
}

/// The renewal duty of a claimed attempt, or `None` when the layer does not renew: renewal
/// off, a zero lease, or no tokio runtime to time it (an executor other than tokio).
fn renewal(
    cfg: &Config,
    id: RecordId,
    token: FencingToken,
    claimed_at: Instant,
    lease: &LeaseState,
) -> Option<Renewal> {
    let lease_ttl = cfg.policy.lease_ttl;
    let interval = cfg.lease_renewal.interval(lease_ttl)?;
    if tokio::runtime::Handle::try_current().is_err() {
        tracing::debug!(record = %id, "no tokio runtime: the lease is not renewed");
        return None;
    }
    Some(Renewal { store: Arc::clone(&cfg.store), id, token, lease_ttl, interval, claimed_at, state: lease.clone() })
}

fn stored_response(policy: &Policy, status: u16, headers: &HeaderMap, body: &Bytes) -> StoredResponse {
    let headers = kept_fields(policy, headers);
    if body.len() > policy.max_stored_body {
        StoredResponse { status, headers, body: StoredBody::NotRetained { len: Some(body.len() as u64) } }
    } else {
        StoredResponse::compressed_over(status, headers, body.to_vec(), policy.compress_over)
    }
}

/// The fields of `fields` (headers or trailers) a record keeps: not hop-by-hop, not on the
/// deny list, and not named by the message's own `Connection` field (RFC 9110 §7.6.1: a
/// sender lists there the fields meant for the next hop only).
pub(crate) fn kept_fields(policy: &Policy, fields: &HeaderMap) -> Vec<(String, Vec<u8>)> {
    let per_hop: Vec<String> = fields
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|name| name.trim().to_ascii_lowercase())
        .filter(|name| !name.is_empty())
        .collect();
    fields
        .iter()
        .filter(|(name, _)| policy.stores_header(name.as_str()) && !per_hop.iter().any(|p| p == name.as_str()))
        .map(|(name, value)| (name.as_str().to_owned(), value.as_bytes().to_vec()))
        .collect()
}

fn set_retry_after(headers: &mut HeaderMap, secs: u64) {
    headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
}

fn set_expires(headers: &mut HeaderMap, at: UnixMillis) {
    headers.insert(IDEMPOTENCY_KEY_EXPIRES, expires_value(at));
}

fn store_unavailable<B>(detail: &str) -> Res<B> {
    let mut res = Problem::new(ProblemKind::StoreUnavailable, StatusCode::SERVICE_UNAVAILABLE, detail).into_response();
    set_retry_after(res.headers_mut(), RETRY_AFTER_BUSY_SECS);
    res
}
