//! RFC 9457 problem details: the `application/problem+json` bodies the layer answers with.
//!
//! Every response the layer produces itself (400, 401, 409, 413, 503, and the replay of a
//! response whose body was not retained) carries a body of this shape:
//!
//! ```json
//! {"type":"https://docs.rs/idem-http/latest/idem_http/problem/enum.ProblemKind.html#in-flight",
//!  "title":"Request in flight","status":409,
//!  "detail":"another request with this idempotency key is still being processed; retry after 12 s"}
//! ```
//!
//! `type` (RFC 9457 §3.1.1) is a URI that names the kind of problem; clients should match on
//! it (or on [`ProblemKind::from_type_uri`]) rather than on `title` or `detail`, which are
//! for humans. It is `{base}{slug}`, the base [`DEFAULT_TYPE_BASE`] (this enum's docs) or
//! the application's ([`set_type_base`]). Two kinds share status 409: an
//! [`ProblemKind::InFlight`] request may be retried after `Retry-After`, a
//! [`ProblemKind::Mismatch`] never (draft-ietf-httpapi-idempotency-key-header §2.7).

use std::borrow::Cow;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use idem_core::{StepError, StoreError};

/// The media type of problem bodies (RFC 9457 §3).
pub const PROBLEM_JSON: &str = "application/problem+json";

/// Declares [`ProblemKind`] from one table: each kind, its `type` URI and its `title`.
macro_rules! problem_kinds {
    ($($(#[$doc:meta])* $kind:ident => $uri:literal, $title:literal;)*) => {
        /// The kinds of problem the layer reports. Each has a stable `type` URI.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum ProblemKind {
            $($(#[$doc])* $kind,)*
        }

        impl ProblemKind {
            const ALL: &[ProblemKind] = &[$(ProblemKind::$kind),*];

            /// The last part of the `type` URI (`in-flight`), after the base.
            pub(crate) const fn slug(self) -> &'static str {
                match self {
                    $(ProblemKind::$kind => $uri,)*
                }
            }

            /// The `title` member: a short summary that does not change between occurrences
            /// (RFC 9457 §3.1.3).
            fn title(self) -> &'static str {
                match self {
                    $(ProblemKind::$kind => $title,)*
                }
            }
        }
    };
}

problem_kinds! {
    /// 400: the endpoint requires an `Idempotency-Key` and the request has none.
    MissingKey => "missing-idempotency-key", "Idempotency-Key required";
    /// 400: the `Idempotency-Key` value is empty, blank, too long, not visible ASCII, or a
    /// malformed structured-field string.
    InvalidKey => "invalid-idempotency-key", "Invalid Idempotency-Key";
    /// 400: the request carries more than one `Idempotency-Key` field.
    DuplicateKey => "duplicate-idempotency-key", "More than one Idempotency-Key";
    /// 401: no principal could be resolved, and the layer rejects anonymous keyed requests.
    MissingPrincipal => "missing-principal", "Principal required";
    /// 400: the request body could not be read.
    UnreadableBody => "unreadable-body", "Unreadable request body";
    /// 413: the request body is larger than the layer's `max_request_body`.
    BodyTooLarge => "body-too-large", "Request body too large";
    /// 431 (RFC 6585 §5): the request headers that enter the fingerprint are more fields
    /// or more bytes than the layer's limits (`with_max_fingerprint_headers`).
    HeadersTooLarge => "headers-too-large", "Request header fields too large";
    /// 409 + `Retry-After`: another attempt with this key holds a fresh lease.
    InFlight => "in-flight", "Request in flight";
    /// 409 + `Retry-After`: the record changed under this request several times in a row
    /// (heavy contention on one key); retry.
    Busy => "busy", "Idempotency record busy";
    /// 409 (or the layer's mismatch status): the key was first used with a different
    /// request. Never retry with this key.
    Mismatch => "mismatch", "Idempotency-Key reused with a different request";
    /// 503 + `Retry-After`: the idempotency store is unavailable; the handler did not run.
    StoreUnavailable => "store-unavailable", "Idempotency store unavailable";
    /// 503 + `Retry-After`: the request's [`crate::LeaseDeadline`] left no time; nothing
    /// was claimed and the handler did not run.
    DeadlinePassed => "deadline-passed", "Request deadline passed";
    /// The original status: the response completed but its body was larger than the
    /// policy's `max_stored_body`, so the replay cannot repeat it.
    ResponseNotRetained => "response-not-retained", "Response not retained";
    /// 500: the handler's response body failed while being read; the record was marked
    /// failed, so a retry runs the handler again.
    ResponseBodyFailed => "response-body-failed", "Response body failed";
    /// 500: a resumable handler needs the step journal and the store has none
    /// ([`idem_core::Capabilities::journal`] false, [`idem_core::StoreError::Unsupported`]).
    /// Retrying does not help until the store is changed.
    JournalUnsupported => "journal-unsupported", "Step journal unsupported by the store";
    /// 500: an intent was found pending and its reconcile could not tell whether the earlier
    /// call happened ([`idem_core::StepError::Ambiguous`]); the handler refused to risk a
    /// second call. Needs an operator (or a later reconcile that can tell).
    AmbiguousSideEffect => "ambiguous-side-effect", "Side effect ambiguous";
    /// 500: a journalled step value no longer decodes, or a step name is invalid (a code
    /// change between attempts, or a bug).
    ResumeFailed => "resume-failed", "Resume failed";
}

/// The `type` URIs' base unless [`set_type_base`] chose one: [`ProblemKind`]'s docs.
pub const DEFAULT_TYPE_BASE: &str = "https://docs.rs/idem-http/latest/idem_http/problem/enum.ProblemKind.html#";

/// The types' old base, an unregistered URN namespace (RFC 8141); still read.
const OLD_BASE: &str = "urn:idem:problem:";

static TYPE_BASE: std::sync::OnceLock<Box<str>> = std::sync::OnceLock::new();

/// Sets the base of every problem `type` URI (`{base}{slug}`, RFC 9457 §3.1.1): where the
/// application documents the kinds. Once per process, before the first problem is answered.
/// ```standalone_crate
/// use idem_http::{ProblemKind as K, set_type_base};
/// assert_eq!(K::from_type_uri("urn:idem:problem:busy"), Some(K::Busy)); // a read fixes nothing
/// set_type_base("https://api.example.com/problems/").unwrap();
/// assert_eq!(K::InFlight.type_uri(), "https://api.example.com/problems/in-flight");
/// assert_eq!(K::from_type_uri("https://api.example.com/problems/mismatch"), Some(K::Mismatch));
/// assert_eq!(set_type_base("https://elsewhere/"), Err("https://api.example.com/problems/"));
/// ```
///
/// # Errors
/// The base already in use (set before, or [`DEFAULT_TYPE_BASE`] once an answer used it).
pub fn set_type_base(base: impl Into<String>) -> Result<(), &'static str> {
    let mut base = Some(base.into().into_boxed_str());
    let used = TYPE_BASE.get_or_init(|| base.take().unwrap_or_default());
    if base.is_some() { Err(used) } else { Ok(()) }
}

fn type_base() -> &'static str {
    TYPE_BASE.get_or_init(|| DEFAULT_TYPE_BASE.into())
}

impl ProblemKind {
    /// The `type` member: `{base}{slug}` ([`set_type_base`]).
    #[must_use]
    pub fn type_uri(self) -> String {
        format!("{}{}", type_base(), self.slug())
    }

    /// The kind named by a `type` member, if it is one of ours (under this process's base,
    /// or the old `urn:idem:problem:` one).
    #[must_use]
    pub fn from_type_uri(uri: &str) -> Option<Self> {
        // Reading a type never fixes the base: `set_type_base` may still come after.
        let base = TYPE_BASE.get().map_or(DEFAULT_TYPE_BASE, |b| b);
        let slug = uri.strip_prefix(base).or_else(|| uri.strip_prefix(OLD_BASE))?;
        Self::ALL.iter().copied().find(|k| k.slug() == slug)
    }
}

/// One problem details object (RFC 9457 §3): `type`, `title`, `status`, `detail`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    kind: ProblemKind,
    status: StatusCode,
    /// Most details are fixed sentences; only some name a number or an error.
    detail: Cow<'static, str>,
}

/// The JSON body. The members are in the order the layer has always sent them, sorted by
/// name: clients parse them, and a reordering would change bytes a proxy may have cached.
#[derive(serde::Serialize)]
struct Json<'a> {
    detail: &'a str,
    status: u16,
    title: &'static str,
    r#type: &'a str,
}

impl Problem {
    /// A problem of `kind` answered with `status`; `detail` explains this occurrence.
    pub(crate) fn new(kind: ProblemKind, status: StatusCode, detail: impl Into<Cow<'static, str>>) -> Self {
        Self { kind, status, detail: detail.into() }
    }

    /// The kind.
    #[must_use]
    pub fn kind(&self) -> ProblemKind {
        self.kind
    }

    /// The HTTP status.
    #[must_use]
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The human-readable explanation of this occurrence.
    #[cfg_attr(not(feature = "grpc"), allow(dead_code, reason = "the gRPC message"))]
    pub(crate) fn detail(&self) -> &str {
        &self.detail
    }

    /// The JSON body.
    pub(crate) fn to_json(&self) -> Vec<u8> {
        let json = Json {
            detail: &self.detail,
            status: self.status.as_u16(),
            title: self.kind.title(),
            r#type: &self.kind.type_uri(),
        };
        // Serialising strings and an integer cannot fail.
        serde_json::to_vec(&json).unwrap_or_default()
    }

    /// The problem a resumable handler answers when a step or intent did not produce a
    /// value for a reason other than its own future's error; `None` for
    /// [`StepError::Failed`] (the handler decides what its own failure means).
    ///
    /// | error | problem |
    /// |---|---|
    /// | store `Unsupported` (no journal) | 500 `journal-unsupported` |
    /// | store `LeaseLost` (a retry reclaimed the record), or `LeaseLost` (a renewal was refused, so the step did not start) | 409 `in-flight` + `Retry-After: 1`: the newer attempt owns the outcome |
    /// | any other store error | 503 `store-unavailable` + `Retry-After: 1` |
    /// | `Ambiguous` | 500 `ambiguous-side-effect` |
    /// | `Decode`, `BadName` | 500 `resume-failed` |
    ///
    /// Every one of them is a response the layer does not store (5xx, or a 409), so the
    /// record is marked failed (or is already someone else's) and a retry resumes from the
    /// journal.
    #[must_use]
    pub fn from_step_error<E>(e: &StepError<E>) -> Option<Self> {
        let p = match e {
            StepError::Failed { .. } => return None,
            StepError::Store { name, source: StoreError::Unsupported { operation } } => Problem::new(
                ProblemKind::JournalUnsupported,
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("step {name}: the idempotency store does not implement {operation}"),
            ),
            StepError::Store { name, source } if source.is_lease_lost() => Problem::new(
                ProblemKind::InFlight,
                StatusCode::CONFLICT,
                format!("step {name}: a newer attempt with this idempotency key owns the record; retry after 1 s"),
            ),
            StepError::Store { name, source } => Problem::new(
                ProblemKind::StoreUnavailable,
                StatusCode::SERVICE_UNAVAILABLE,
                format!("step {name}: the idempotency store failed ({source}); retry"),
            ),
            StepError::LeaseLost { name } => Problem::new(
                ProblemKind::InFlight,
                StatusCode::CONFLICT,
                format!(
                    "step {name}: this attempt lost its lease, so the step did not start; a newer attempt with this \
                     idempotency key may own the record; retry after 1 s"
                ),
            ),
            StepError::Ambiguous { name } => Problem::new(
                ProblemKind::AmbiguousSideEffect,
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("intent {name}: an earlier attempt may have made the call and it cannot be found or ruled out"),
            ),
            StepError::Decode { name, .. } => Problem::new(
                ProblemKind::ResumeFailed,
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("step {name}: the journalled value does not decode"),
            ),
            StepError::BadName(name) => Problem::new(
                ProblemKind::ResumeFailed,
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("step name {name:?} must be 1-250 bytes"),
            ),
            _ => Problem::new(ProblemKind::ResumeFailed, StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        };
        Some(p)
    }

    /// The response as plain bytes, for a handler to return: this status,
    /// `Content-Type: application/problem+json`, `Retry-After: 1` (seconds) for
    /// `in-flight`, `busy` and `store-unavailable`, and the JSON body.
    #[must_use]
    pub fn to_response(&self) -> Response<Bytes> {
        let mut res = Response::new(Bytes::from(self.to_json()));
        *res.status_mut() = self.status;
        res.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if matches!(self.kind, ProblemKind::InFlight | ProblemKind::Busy | ProblemKind::StoreUnavailable) {
            res.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(1u32));
        }
        res
    }
}

#[cfg(feature = "axum")]
impl axum::response::IntoResponse for Problem {
    fn into_response(self) -> axum::response::Response {
        self.to_response().map(axum::body::Body::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_uris_round_trip() {
        for &k in ProblemKind::ALL {
            assert_eq!(ProblemKind::from_type_uri(&k.type_uri()), Some(k));
        }
        assert_eq!(ProblemKind::from_type_uri("about:blank"), None);
        assert_eq!(ProblemKind::from_type_uri("urn:idem:problem:mismatch"), Some(ProblemKind::Mismatch));
    }

    #[test]
    fn body_has_the_four_members() {
        let p = Problem::new(ProblemKind::Mismatch, StatusCode::CONFLICT, "d");
        let v: serde_json::Value = serde_json::from_slice(&p.to_json()).unwrap();
        assert_eq!(v["type"], format!("{DEFAULT_TYPE_BASE}mismatch"));
        assert_eq!(v["status"], 409);
        assert_eq!(v["detail"], "d");
        assert!(v["title"].is_string());
    }

    /// The body's bytes changed: the members' order, or the escaping of a detail that
    /// quotes a client's error text.
    #[test]
    fn the_body_bytes_are_pinned() {
        let p = Problem::new(ProblemKind::UnreadableBody, StatusCode::BAD_REQUEST, "read: \"x\"\\\u{1}\n é");
        assert_eq!(
            String::from_utf8(p.to_json()).unwrap(),
            r#"{"detail":"read: \"x\"\\\u0001\n é","status":400,"title":"Unreadable request body","type":"https://docs.rs/idem-http/latest/idem_http/problem/enum.ProblemKind.html#unreadable-body"}"#
        );
    }
}
