//! gRPC behind the layer (feature `grpc`): which handler outcomes are stored, and the
//! layer's own answers as gRPC statuses. Without the feature a gRPC request is plain HTTP
//! to the layer: stored by its HTTP status (200, whatever its `grpc-status`), answered
//! with problem bodies.
//!
//! What is stored (only a lasting `grpc-status`: `OK`, `INVALID_ARGUMENT`, `NOT_FOUND`,
//! `ALREADY_EXISTS`, `FAILED_PRECONDITION`, `OUT_OF_RANGE`), gRPC-Web, and how a streamed
//! response keeps its claim until its status, and why: `docs/contract.md#grpc`.
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
//! | store unavailable, deadline passed | `UNAVAILABLE` (14) |
//! | record does not decode | `DATA_LOSS` (15): retrying cannot mend it, and gRPC retry policies retry `UNAVAILABLE` |
//! | replay of a response that was not retained | `ALREADY_EXISTS` (6): the operation was done |
//! | the handler's body failed | `INTERNAL` (13) |
//!
//! The problem's `detail` becomes `grpc-message` (percent-encoded, as the gRPC HTTP/2
//! protocol requires), the problem's `type` URI the `idem-problem` metadata entry, and
//! `Retry-After`, `idempotency-key-expires` and the retry hints stay as metadata.
//!
//! # Layout
//! This module: what is gRPC, what is lasting; `status`: the layer's answers as statuses;
//! `stream`: the claim a streamed response holds until its status; `keeper`: that claim's
//! lease renewal and the watch for a client that stopped reading.

mod keeper;
pub(crate) mod status;
pub(crate) mod stream;

use http::{HeaderMap, HeaderValue};

use crate::headers::media_type;

use crate::problem::ProblemKind;

/// gRPC status codes the layer uses or reads (grpc/doc/statuscodes.md).
pub(crate) mod code {
    pub(crate) const OK: u32 = 0;
    pub(crate) const INVALID_ARGUMENT: u32 = 3;
    pub(crate) const NOT_FOUND: u32 = 5;
    pub(crate) const ALREADY_EXISTS: u32 = 6;
    pub(crate) const RESOURCE_EXHAUSTED: u32 = 8;
    pub(crate) const FAILED_PRECONDITION: u32 = 9;
    pub(crate) const ABORTED: u32 = 10;
    pub(crate) const OUT_OF_RANGE: u32 = 11;
    pub(crate) const INTERNAL: u32 = 13;
    pub(crate) const UNAVAILABLE: u32 = 14;
    pub(crate) const DATA_LOSS: u32 = 15;
    pub(crate) const UNAUTHENTICATED: u32 = 16;
}

/// Whether a request (or response) with `headers` is gRPC: `content-type` is
/// `application/grpc` or `application/grpc+<format>`.
pub(crate) fn is_grpc(headers: &HeaderMap) -> bool {
    media_type(headers).is_some_and(|media| is_media(media, b"application/grpc"))
}

/// Whether `media` is `base` or `base+<format>`, case-insensitively (RFC 9110 §8.3.1).
fn is_media(media: &[u8], base: &[u8]) -> bool {
    media.len() >= base.len()
        && media[..base.len()].eq_ignore_ascii_case(base)
        && (media.len() == base.len() || media[base.len()] == b'+')
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
        ProblemKind::StoreUnavailable | ProblemKind::DeadlinePassed => code::UNAVAILABLE,
        ProblemKind::ResponseNotRetained => code::ALREADY_EXISTS,
        _ => code::INTERNAL,
    }
}

/// Whether a response with `headers` is gRPC-Web: `content-type` is
/// `application/grpc-web`, `application/grpc-web-text`, or either with `+<format>`.
fn is_grpc_web(headers: &HeaderMap) -> bool {
    media_type(headers)
        .is_some_and(|media| is_media(media, b"application/grpc-web") || is_media(media, b"application/grpc-web-text"))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn map(fields: &[(&'static str, &'static str)]) -> HeaderMap {
        fields.iter().map(|&(n, v)| (http::HeaderName::from_static(n), HeaderValue::from_static(v))).collect()
    }

    #[test]
    fn grpc_content_types_are_recognised() {
        let ct = |v: &'static str| is_grpc(&map(&[("content-type", v)]));
        assert!(ct("application/grpc") && ct("application/grpc+proto") && ct("Application/GRPC; charset=x"));
        assert!(!ct("application/grpc-web") && !ct("application/json"));
        assert!(!is_grpc(&HeaderMap::new()));
    }

    /// A gRPC error answered with HTTP 200 was stored and replayed to every retry.
    #[test]
    fn only_lasting_grpc_statuses_are_stored() {
        let h = map(&[("content-type", "application/grpc")]);
        let with = |s: &'static str| is_lasting(&h, Some(&map(&[("grpc-status", s)])));
        for s in ["0", "3", "5", "6", "9", "11"] {
            assert!(with(s), "{s}");
        }
        for s in ["1", "2", "4", "7", "8", "10", "12", "13", "14", "15", "16", "x"] {
            assert!(!with(s), "{s}");
        }
        assert!(!is_lasting(&h, None), "no status at all is a broken response");
        let trailers_only = map(&[("content-type", "application/grpc"), ("grpc-status", "5")]);
        assert!(is_lasting(&trailers_only, None));
        assert!(is_lasting(&HeaderMap::new(), None), "not gRPC: the HTTP status decided");
    }

    /// A gRPC-Web error (HTTP 200, trailers-only, `grpc-status: 14` as a header) was
    /// stored as a lasting outcome and replayed to every retry: `is_lasting` knew only
    /// `application/grpc`.
    #[test]
    fn a_grpc_web_error_is_not_lasting() {
        for ct in ["application/grpc-web", "application/grpc-web+proto", "application/grpc-web-text"] {
            let mut h = map(&[("content-type", ct)]);
            assert!(is_lasting(&h, None), "{ct}: a message, its status in the body: stored");
            h.insert("grpc-status", HeaderValue::from_static("14"));
            assert!(!is_lasting(&h, None), "{ct}: UNAVAILABLE");
            h.insert("grpc-status", HeaderValue::from_static("5"));
            assert!(is_lasting(&h, None), "{ct}: NOT_FOUND");
        }
        let h = map(&[("content-type", "application/grpc-webby"), ("grpc-status", "14")]);
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
}
