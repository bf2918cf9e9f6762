//! What a request gets, typed until the last moment: the handler's response, the replay of
//! a stored one, or the layer's own refusal. The pipeline decides which; [`Answer::render`]
//! makes it a response once, at the edge: a refusal becomes an RFC 9457 problem body with
//! its `Retry-After`, `Idempotency-Key-Expires` and retry hints, or, for a gRPC request
//! (feature `grpc`), a trailers-only gRPC status with the same fields as metadata.

use std::borrow::Cow;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode, header};
use idem_core::{KeyError, Record, StoredBody, StoredResponse, UnixMillis};

use crate::body::ResponseBody;
use crate::headers::{IDEMPOTENCY_KEY_EXPIRES, IDEMPOTENT_REPLAYED, expires_value};
use crate::hints::{RetryHints, should_retry};
use crate::problem::{PROBLEM_JSON, Problem, ProblemKind};

/// `Retry-After` on 409 busy and on a 503 of the store, in seconds.
const RETRY_AFTER_BUSY_SECS: u64 = 1;

/// The answer to one request.
pub(crate) enum Answer<B> {
    /// The handler's response (or the inner service's, passed through): sent as it is.
    Handler(Response<ResponseBody<B>>),
    /// A completed record's response, replayed.
    Replay(Replay),
    /// The layer's own answer: a problem.
    Refusal(Refusal),
}

/// A stored response, read back: sent with the stored status, headers, body and trailers,
/// plus `Idempotent-Replayed: true` and `Idempotency-Key-Expires`.
pub(crate) struct Replay {
    status: StatusCode,
    /// The stored headers and trailers; its body moved into `body`.
    stored: StoredResponse,
    body: Bytes,
    expires_at: UnixMillis,
}

/// An answer the layer makes itself: what went wrong, and the fields that go with it.
#[derive(Debug)]
pub(crate) struct Refusal {
    problem: Problem,
    /// `Retry-After`, seconds.
    retry_after: Option<u64>,
    /// `WWW-Authenticate`, on a 401.
    challenge: Option<HeaderValue>,
    /// Set on the replay of a response whose body was not retained: the stored `Location`
    /// values it keeps (the rest of the stored headers described a body it does not have).
    not_retained: Option<Vec<HeaderValue>>,
    /// `Idempotency-Key-Expires`: the answer is about an existing record.
    expires_at: Option<UnixMillis>,
    /// The stored record does not decode: no retry can mend it, whatever its kind says.
    unrecoverable: bool,
}

impl<B> Answer<B> {
    /// The replay of `record`'s stored response; a body that was not retained becomes a
    /// `response-not-retained` problem under the original status, keeping `Location`. The
    /// record's body moves into the answer without a copy. `Err`: the completed record
    /// cannot be replayed (no response, an invalid status, a body that does not
    /// decompress).
    pub(crate) fn replay(record: Record) -> Result<Self, String> {
        let expires_at = record.expires_at;
        let Some(mut stored) = record.response else {
            return Err("completed record without a response".into());
        };
        let status =
            StatusCode::from_u16(stored.status).map_err(|e| format!("stored status {}: {e}", stored.status))?;
        match stored.take_body_bytes().map_err(|e| e.to_string())? {
            Some(body) => Ok(Answer::Replay(Replay { status, stored, body: Bytes::from(body), expires_at })),
            None => Ok(Answer::Refusal(Refusal::not_retained(status, &stored, expires_at))),
        }
    }

    /// The response, for a gRPC request when `grpc` (feature `grpc`; otherwise, and for a
    /// gRPC-Web request, every answer is plain HTTP).
    pub(crate) fn render(self, grpc: bool, hints: RetryHints) -> Response<ResponseBody<B>> {
        match self {
            Answer::Handler(res) => res,
            Answer::Replay(replay) => replay.render(),
            #[cfg(feature = "grpc")]
            Answer::Refusal(refusal) if grpc => crate::grpc::status::render(&refusal, hints),
            Answer::Refusal(refusal) => {
                let _ = grpc;
                refusal.render(hints)
            }
        }
    }
}

impl Replay {
    fn render<B>(self) -> Response<ResponseBody<B>> {
        let Replay { status, mut stored, body, expires_at } = self;
        let trailers = (!stored.trailers.is_empty()).then(|| {
            let mut map = HeaderMap::new();
            append_stored(&mut map, std::mem::take(&mut stored.trailers));
            map
        });
        let mut res = Response::new(ResponseBody::full_with_trailers(body, trailers));
        *res.status_mut() = status;
        let headers = res.headers_mut();
        append_stored(headers, stored.headers);
        headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
        headers.insert(IDEMPOTENCY_KEY_EXPIRES, expires_value(expires_at));
        res
    }
}

/// Appends stored fields (lower-case names, raw values, in stored order, repeats kept),
/// each value moved into its field rather than copied. A stored field that is no longer a
/// valid field is skipped and logged.
fn append_stored(out: &mut HeaderMap, stored: Vec<(String, Vec<u8>)>) {
    for (name, value) in stored {
        match (HeaderName::from_bytes(name.as_bytes()), HeaderValue::from_maybe_shared(Bytes::from(value))) {
            (Ok(name), Ok(value)) => {
                out.append(name, value);
            }
            _ => not_replayed(&name),
        }
    }
}

fn not_replayed(name: &str) {
    tracing::warn!(header = %name, "stored response header is not a valid header; not replayed");
}

impl Refusal {
    fn new(kind: ProblemKind, status: StatusCode, detail: impl Into<Cow<'static, str>>) -> Self {
        Self {
            problem: Problem::new(kind, status, detail),
            retry_after: None,
            challenge: None,
            not_retained: None,
            expires_at: None,
            unrecoverable: false,
        }
    }

    pub(crate) fn missing_key(source: &crate::KeySource) -> Self {
        let detail: Cow<'static, str> = match source.describe() {
            None => "this endpoint requires an Idempotency-Key header; generate one unique value per operation and \
                     send it on every retry"
                .into(),
            Some(place) => format!(
                "this endpoint requires {place}; generate one unique value per operation and send it on every retry"
            )
            .into(),
        };
        Self::new(ProblemKind::MissingKey, StatusCode::BAD_REQUEST, detail)
    }

    /// Two or more `Idempotency-Key` fields, equal or not: the field is a single sf-item
    /// (draft §2.1), and a client or proxy that repeats it is broken in a way the server
    /// should report, not guess around.
    pub(crate) fn duplicate_key() -> Self {
        Self::new(
            ProblemKind::DuplicateKey,
            StatusCode::BAD_REQUEST,
            "the request carries more than one Idempotency-Key field; send exactly one",
        )
    }

    pub(crate) fn invalid_key(error: &KeyError) -> Self {
        Self::key_refused(error.to_string())
    }

    /// 400: a key the application's rule refused (`with_key_rule`), with its detail.
    pub(crate) fn key_refused(detail: String) -> Self {
        Self::new(ProblemKind::InvalidKey, StatusCode::BAD_REQUEST, detail)
    }

    /// 401: no principal, under `MissingPrincipal::Reject`, or (`blank`) a blank one: a
    /// resolver bug or a client-supplied blank identity, never "anonymous", refused in
    /// every mode. `challenge` is the resolver's.
    pub(crate) fn missing_principal(challenge: Option<HeaderValue>, blank: bool) -> Self {
        let detail = if blank {
            "the request's principal is blank; an idempotency key needs a non-blank authenticated principal"
        } else {
            "an idempotency key is only meaningful for an authenticated principal; none was found"
        };
        Self { challenge, ..Self::new(ProblemKind::MissingPrincipal, StatusCode::UNAUTHORIZED, detail) }
    }

    pub(crate) fn headers_too_large(fields: usize, bytes: usize, max_fields: usize, max_bytes: usize) -> Self {
        Self::new(
            ProblemKind::HeadersTooLarge,
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            format!(
                "the request's fingerprinted header fields are {fields} fields, {bytes} bytes; the limits are \
                 {max_fields} fields and {max_bytes} bytes"
            ),
        )
    }

    pub(crate) fn body_too_large(limit: usize) -> Self {
        Self::new(
            ProblemKind::BodyTooLarge,
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the request body is larger than {limit} bytes, the most this endpoint buffers"),
        )
    }

    pub(crate) fn unreadable_body(error: &dyn std::fmt::Display) -> Self {
        Self::new(
            ProblemKind::UnreadableBody,
            StatusCode::BAD_REQUEST,
            format!("the request body could not be read: {error}"),
        )
    }

    /// 409 `in-flight`: another attempt holds a fresh lease on the record. `Retry-After`
    /// is `secs`, a short poll (the pipeline caps the remaining lease).
    pub(crate) fn in_flight(secs: u64, expires_at: UnixMillis) -> Self {
        Self {
            retry_after: Some(secs),
            expires_at: Some(expires_at),
            ..Self::new(
                ProblemKind::InFlight,
                StatusCode::CONFLICT,
                format!("another request with this idempotency key is still being processed; retry after {secs} s"),
            )
        }
    }

    pub(crate) fn busy() -> Self {
        Self {
            retry_after: Some(RETRY_AFTER_BUSY_SECS),
            ..Self::new(
                ProblemKind::Busy,
                StatusCode::CONFLICT,
                "the idempotency record for this key kept changing while this request was decided; retry",
            )
        }
    }

    /// Same key, different request: `status` is the layer's mismatch status.
    pub(crate) fn mismatch(status: StatusCode, expires_at: UnixMillis) -> Self {
        Self {
            expires_at: Some(expires_at),
            ..Self::new(
                ProblemKind::Mismatch,
                status,
                "this idempotency key was already used with a different request (method, path, query, fingerprinted \
                 headers or body); use a new key for a new operation",
            )
        }
    }

    /// 503: the store failed, and the layer fails closed.
    pub(crate) fn store_unavailable() -> Self {
        Self {
            retry_after: Some(RETRY_AFTER_BUSY_SECS),
            ..Self::new(
                ProblemKind::StoreUnavailable,
                StatusCode::SERVICE_UNAVAILABLE,
                "the idempotency store is unavailable; the request was not processed",
            )
        }
    }

    /// 503: the request's [`crate::LeaseDeadline`] left no time to claim and run. A retry
    /// (a new invocation, with its own deadline) may.
    pub(crate) fn deadline_passed() -> Self {
        Self {
            retry_after: Some(RETRY_AFTER_BUSY_SECS),
            ..Self::new(
                ProblemKind::DeadlinePassed,
                StatusCode::SERVICE_UNAVAILABLE,
                "the request's deadline left no time to process it; the request was not processed",
            )
        }
    }

    /// 503, never retried: the stored record does not decode or cannot be replayed. It may
    /// be a completed operation, so running its handler could repeat it; retrying cannot
    /// mend the record.
    pub(crate) fn unreadable() -> Self {
        Self {
            retry_after: Some(RETRY_AFTER_BUSY_SECS),
            unrecoverable: true,
            ..Self::new(
                ProblemKind::StoreUnavailable,
                StatusCode::SERVICE_UNAVAILABLE,
                "the stored record for this idempotency key cannot be read",
            )
        }
    }

    /// The replay of `stored`, whose body was over `max_stored_body` (or streamed): its
    /// original status and `Location`, and a problem for a body.
    fn not_retained(status: StatusCode, stored: &StoredResponse, expires_at: UnixMillis) -> Self {
        let len = match &stored.body {
            StoredBody::NotRetained { len: Some(len) } => format!(" ({len} bytes)"),
            _ => String::new(),
        };
        let detail = format!(
            "the operation completed with status {}, but its response body{len} was larger than the idempotency \
             store keeps, so it cannot be replayed",
            stored.status
        );
        let locations = (stored.headers.iter().filter(|(name, _)| name == "location"))
            .filter_map(|(name, value)| HeaderValue::from_bytes(value).inspect_err(|_| not_replayed(name)).ok())
            .collect();
        Self {
            not_retained: Some(locations),
            expires_at: Some(expires_at),
            ..Self::new(ProblemKind::ResponseNotRetained, status, detail)
        }
    }

    /// 500: the handler's response body failed, or its own completion did not commit;
    /// the record was marked failed, so a retry runs the handler again.
    pub(crate) fn response_failed(detail: &'static str) -> Self {
        Self::new(ProblemKind::ResponseBodyFailed, StatusCode::INTERNAL_SERVER_ERROR, detail)
    }

    #[cfg(feature = "grpc")]
    pub(crate) fn problem(&self) -> &Problem {
        &self.problem
    }

    /// Whether no retry can change this answer, whatever its kind says.
    #[cfg(feature = "grpc")]
    pub(crate) fn is_unrecoverable(&self) -> bool {
        self.unrecoverable
    }

    /// Whether a retry with the same key may get another answer: the retry hints.
    pub(crate) fn retries(&self) -> bool {
        !self.unrecoverable && should_retry(self.problem.kind())
    }

    /// The answer's own fields, in the order the layer sends them.
    pub(crate) fn add_fields(&self, headers: &mut HeaderMap) {
        if let Some(secs) = self.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if let Some(challenge) = &self.challenge {
            headers.insert(header::WWW_AUTHENTICATE, challenge.clone());
        }
        if let Some(locations) = &self.not_retained {
            for location in locations {
                headers.append(header::LOCATION, location.clone());
            }
            headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
        }
        if let Some(at) = self.expires_at {
            headers.insert(IDEMPOTENCY_KEY_EXPIRES, expires_value(at));
        }
    }

    /// The problem response: `application/problem+json`, the answer's fields, the hints.
    fn render<B>(self, hints: RetryHints) -> Response<ResponseBody<B>> {
        let mut res = Response::new(ResponseBody::full(Bytes::from(self.problem.to_json())));
        *res.status_mut() = self.problem.status();
        let headers = res.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        self.add_fields(headers);
        hints.add(headers, self.retries());
        res
    }
}
