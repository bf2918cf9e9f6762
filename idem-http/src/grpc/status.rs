//! The layer's own answers to a gRPC request: trailers-only responses (HTTP 200,
//! `grpc-status`, `grpc-message`), never a problem body a gRPC client cannot read. The
//! codes are the table in the module docs of `crate::grpc`.

use bytes::Bytes;
use http::{HeaderValue, Response, header};

use super::code;
use crate::answer::Refusal;
use crate::body::ResponseBody;
use crate::hints::RetryHints;

/// `refusal` as a trailers-only gRPC status: the same fields as its problem response
/// (`Retry-After`, `WWW-Authenticate`, `Idempotency-Key-Expires`, ...) as metadata, its
/// detail as `grpc-message`, its `type` URI as `idem-problem`, and the retry hints.
pub(crate) fn render<B>(refusal: &Refusal, hints: RetryHints) -> Response<ResponseBody<B>> {
    let problem = refusal.problem();
    let mut res = Response::new(ResponseBody::full(Bytes::new()));
    let headers = res.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    refusal.add_fields(headers);
    // A record that does not decode answers `DATA_LOSS`, which gRPC retry policies do not
    // retry, rather than its kind's `UNAVAILABLE`; its `false` hint belongs to that
    // answer, with its own fields. Every other hint follows the status it is read with.
    let code = if refusal.is_unrecoverable() {
        hints.add(headers, false);
        code::DATA_LOSS
    } else {
        super::grpc_code_for(problem.kind())
    };
    headers.insert("grpc-status", HeaderValue::from(code));
    if let Ok(message) = HeaderValue::from_str(&percent_encode(problem.detail())) {
        headers.insert("grpc-message", message);
    }
    if let Ok(kind) = HeaderValue::from_str(&problem.kind().type_uri()) {
        headers.insert("idem-problem", kind);
    }
    if !refusal.is_unrecoverable() {
        hints.add(headers, refusal.retries());
    }
    res
}

/// `grpc-message` encoding: bytes outside printable ASCII, and `%`, as `%XX` (UTF-8).
fn percent_encode(text: &str) -> String {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(char::from(b));
        } else {
            out.extend(['%', char::from(HEX[usize::from(b >> 4)]), char::from(HEX[usize::from(b & 0xf)])]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use http::StatusCode;
    use idem_core::UnixMillis;

    use super::*;

    fn render(refusal: &Refusal) -> Response<ResponseBody<http_body_util::Empty<Bytes>>> {
        super::render(refusal, RetryHints::default())
    }

    #[test]
    fn a_refusal_becomes_a_trailers_only_status() {
        let res = render(&Refusal::mismatch(StatusCode::CONFLICT, UnixMillis(0)));
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(res.headers()["content-type"], "application/grpc");
        assert_eq!(res.headers()["grpc-status"], "9");
        assert!(res.headers()["grpc-message"].to_str().unwrap().starts_with("this idempotency key was already used"));
        assert_eq!(res.headers()["idem-problem"], crate::ProblemKind::Mismatch.type_uri());
        assert_eq!(res.headers()["idempotency-key-expires"], "Thu, 01 Jan 1970 00:00:00 GMT");
        assert_eq!(res.headers()["x-should-retry"], "false");
        assert!(http_body::Body::is_end_stream(res.body()), "no message: trailers-only");
    }

    /// A record that does not decode was answered `UNAVAILABLE`, which gRPC retry
    /// policies retry, while the HTTP answer says no retry can mend it.
    #[test]
    fn a_record_that_does_not_decode_is_data_loss() {
        let res = render(&Refusal::unreadable());
        assert_eq!(res.headers()["grpc-status"], "15");
        assert_eq!(res.headers()["x-should-retry"], "false");
        let res = render(&Refusal::store_unavailable());
        assert_eq!(res.headers()["grpc-status"], "14", "an outage stays UNAVAILABLE");
        assert_eq!(res.headers()["x-should-retry"], "true");
    }

    #[test]
    fn grpc_message_is_percent_encoded() {
        assert_eq!(percent_encode("retry in 1 s; 100% é"), "retry in 1 s; 100%25 %C3%A9");
    }
}
