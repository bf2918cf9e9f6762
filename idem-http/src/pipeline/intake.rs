//! Step 1, intake: what a non-safe request is, before anything is claimed. In order, the
//! first check that fails answers and nothing is claimed (`docs/decision-table.md`,
//! "Answers before the table"):
//!
//! 1. the `Idempotency-Key` field (or the [`crate::KeySource`]'s header): none (per
//!    [`crate::KeyRequirement`]), repeated, invalid, or refused by the application's key
//!    rule; a key in the body is read and checked the same way after step 3;
//! 2. the principal: none (per [`crate::MissingPrincipal`]), blank;
//! 3. the limits: the fingerprinted header fields (431), the body (413, or 400 when it
//!    cannot be read), buffered up to `max_request_body`;
//! 4. the fingerprint, and the claim request for the record of (principal, endpoint, key),
//!    its lease cut to the [`crate::LeaseDeadline`] if any (under 1 ms left: 503).

use std::pin::pin;

use bytes::{Buf, Bytes, BytesMut};
use http::request::Parts;
use http::{HeaderMap, Request, header};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use idem_core::{BoxError, ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, Principal, RequestParts, Scope};

use super::Pipeline;
use crate::answer::Refusal;
use crate::config::{KeyRequirement, MissingPrincipal};
use crate::lease::{LeaseDeadline, capped};

/// What intake makes of a request.
#[allow(
    clippy::large_enum_variant,
    reason = "made once per request and moved out at once; a box would allocate on every keyed request"
)]
pub(super) enum Intake<B> {
    /// Keyed, with a principal, within the limits: claim its record.
    Admitted(Admitted),
    /// No key where it is optional, or no principal under `SkipIdempotency`: the handler
    /// runs without idempotency, on the request as it came.
    Skipped(Request<B>),
    /// Answered before any claim.
    Refused(Refusal),
}

/// A request ready to claim its record.
pub(super) struct Admitted {
    pub(super) parts: Parts,
    /// The whole body, read: the handler gets it rebuilt from these bytes.
    pub(super) body: Bytes,
    pub(super) claim: ClaimRequest,
    /// The request's [`crate::LeaseDeadline`], on tokio's clock.
    pub(super) deadline: Option<tokio::time::Instant>,
}

/// Method plus axum's route template when the request went through an axum router (so
/// `/v1/workers/7/reboot` and `/v1/workers/8/reboot` share the endpoint
/// `POST /v1/workers/{id}/reboot`); otherwise method plus the concrete path, in which case
/// resolved path parameters are part of the scope. Either way the fingerprint covers the
/// raw path, so the same key on another resource is a mismatch, never a replay.
pub(super) fn endpoint<B>(req: &Request<B>) -> Endpoint {
    endpoint_of(req.method(), req.uri(), req.extensions())
}

pub(super) fn endpoint_of(method: &http::Method, uri: &http::Uri, extensions: &http::Extensions) -> Endpoint {
    #[cfg(feature = "axum")]
    if let Some(route) = extensions.get::<axum::extract::MatchedPath>() {
        return Endpoint::new(method.as_str(), route.as_str());
    }
    #[cfg(not(feature = "axum"))]
    let _ = extensions;
    Endpoint::new(method.as_str(), uri.path())
}

pub(super) async fn admit<B>(pipeline: &Pipeline, req: Request<B>, endpoint: Endpoint) -> Intake<B>
where
    B: Body + From<Bytes>,
    B::Error: Into<BoxError>,
{
    let settings = &pipeline.settings;
    let (parts, body) = req.into_parts();
    // A header key is checked before anything else; a body key once the body is read.
    let mut key = None;
    if let Some(name) = settings.key_source.header_name() {
        // One field: two or more are refused even when equal (`Refusal::duplicate_key`).
        let mut fields = parts.headers.get_all(name).iter();
        match (fields.next(), fields.next()) {
            (Some(field), None) => match parse_key(settings, field.as_bytes()) {
                Ok(parsed) => key = Some(parsed),
                Err(refusal) => return Intake::Refused(*refusal),
            },
            (Some(_), Some(_)) => return Intake::Refused(Refusal::duplicate_key()),
            (None, _) if settings.key_requirement == KeyRequirement::Optional => {
                return Intake::Skipped(Request::from_parts(parts, body));
            }
            (None, _) => return Intake::Refused(Refusal::missing_key(&settings.key_source)),
        }
    }
    // Resolved once per request: this one answer is the principal of the claim, the record
    // id, the handler's context and every later write, so a resolver that would answer
    // differently on a second call is never asked twice.
    let Some(resolved) = settings.resolver.resolve(&parts) else {
        if settings.missing_principal == MissingPrincipal::SkipIdempotency {
            return Intake::Skipped(Request::from_parts(parts, body));
        }
        return Intake::Refused(Refusal::missing_principal(settings.resolver.challenge(), false));
    };
    // Blank is a resolver bug (or a client-supplied blank identity), not "anonymous": it
    // never shares a bucket and never skips idempotency, whatever `MissingPrincipal` says.
    let Ok(principal) = Principal::new(resolved) else {
        return Intake::Refused(Refusal::missing_principal(settings.resolver.challenge(), true));
    };
    let (max_fields, max_bytes) = (settings.max_fingerprint_fields, settings.max_fingerprint_header_bytes);
    let fingerprinted = Fingerprinted::gather(pipeline, &parts.headers, max_fields);
    if let Some(refusal) = fingerprinted.over_limits(max_fields, max_bytes) {
        return Intake::Refused(refusal);
    }
    let body = match buffer(body, &parts.headers, settings.max_request_body).await {
        Ok(body) => body,
        Err(refusal) => return Intake::Refused(refusal),
    };
    let key = match key {
        Some(key) => key,
        None => match settings.key_source.read_body(&parts, &body) {
            Some(raw) => match parse_key(settings, &raw) {
                Ok(key) => key,
                Err(refusal) => return Intake::Refused(*refusal),
            },
            None if settings.key_requirement == KeyRequirement::Optional => {
                return Intake::Skipped(Request::from_parts(parts, B::from(body)));
            }
            None => return Intake::Refused(Refusal::missing_key(&settings.key_source)),
        },
    };
    let selected = settings.fingerprint_body.select(&parts, &body);
    let request = RequestParts {
        method: parts.method.as_str(),
        path: parts.uri.path(),
        query: parts.uri.query(),
        headers: fingerprinted.values(),
        body: selected.as_deref().unwrap_or(&body),
    };
    let fingerprint = Fingerprint::of_mode(&request, settings.fingerprint_mode);
    let scope = Scope { principal, endpoint };
    // Read after the body, whose reading took some of the time left.
    let deadline = match parts.extensions.get::<LeaseDeadline>().map(|deadline| deadline.instant()) {
        Some(None) => return Intake::Refused(Refusal::deadline_passed()),
        found => found.flatten(),
    };
    let lease_ttl = capped(settings.policy.lease_ttl, deadline);
    let claim = ClaimRequest::new(scope, key, fingerprint, lease_ttl, pipeline.retention);
    Intake::Admitted(Admitted { parts, body, claim, deadline })
}

/// The key in `raw` (the header's rules, then the application's key rule), or the 400.
fn parse_key(settings: &crate::config::Settings, raw: &[u8]) -> Result<IdempotencyKey, Box<Refusal>> {
    let key = IdempotencyKey::parse_with_limit(raw, settings.max_key_len).map_err(|e| Refusal::invalid_key(&e))?;
    match settings.key_rule.as_ref().map(|rule| (rule.0)(key.as_str())) {
        Some(Err(why)) => Err(Box::new(Refusal::key_refused(why))),
        _ => Ok(key),
    }
}

/// Reads the whole body, refusing one over `limit` bytes: a declared `Content-Length` over
/// it before any of it is read, a longer stream when it crosses it. A body of one frame is
/// kept as it came, without a copy.
async fn buffer<B>(body: B, headers: &HeaderMap, limit: usize) -> Result<Bytes, Refusal>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let declared = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(Refusal::body_too_large(limit));
    }
    let mut body = pin!(Limited::new(body, limit));
    let (mut first, mut joined) = (Bytes::new(), BytesMut::new());
    while let Some(frame) = body.frame().await {
        let frame = match frame {
            Ok(frame) => frame,
            Err(e) if e.is::<LengthLimitError>() => return Err(Refusal::body_too_large(limit)),
            Err(e) => return Err(Refusal::unreadable_body(&e)),
        };
        // Trailers of a request do not enter the fingerprint.
        let Ok(mut data) = frame.into_data() else { continue };
        let data = data.copy_to_bytes(data.remaining());
        if first.is_empty() && joined.is_empty() {
            first = data;
        } else {
            if !first.is_empty() {
                joined.extend_from_slice(&std::mem::take(&mut first));
            }
            joined.extend_from_slice(&data);
        }
    }
    Ok(if joined.is_empty() { first } else { joined.freeze() })
}

/// How many fingerprinted header values are gathered on the stack before a request needs
/// a heap list of them (the default fingerprints one header, `content-type`).
const INLINE_VALUES: usize = 8;

/// The request's fields that enter its fingerprint: every value of every configured name,
/// in configured order, then arrival order; looked up once for both the limits and the
/// hash.
struct Fingerprinted<'a> {
    inline: [(&'a str, &'a [u8]); INLINE_VALUES],
    /// How many fields there are, and their bytes (names plus values).
    len: usize,
    bytes: usize,
    /// All of them, once there are more than fit inline (never more than the limit).
    spilled: Vec<(&'a str, &'a [u8])>,
}

impl<'a> Fingerprinted<'a> {
    /// The fields of `headers`, each counted, none kept past `max_fields`: a request over
    /// the limit is refused, and a client cannot make the layer hold an unbounded set.
    fn gather(pipeline: &'a Pipeline, headers: &'a HeaderMap, max_fields: usize) -> Self {
        let mut gathered = Self { inline: [("", &b""[..]); INLINE_VALUES], len: 0, bytes: 0, spilled: Vec::new() };
        for name in &pipeline.fingerprint_headers {
            for value in headers.get_all(name) {
                let field = (name.as_str(), value.as_bytes());
                gathered.bytes = gathered.bytes.saturating_add(field.0.len() + field.1.len());
                if gathered.len < INLINE_VALUES {
                    gathered.inline[gathered.len] = field;
                } else if gathered.len < max_fields {
                    if gathered.spilled.is_empty() {
                        gathered.spilled.extend_from_slice(&gathered.inline);
                    }
                    gathered.spilled.push(field);
                }
                gathered.len += 1;
            }
        }
        gathered
    }

    fn values(&self) -> &[(&'a str, &'a [u8])] {
        if self.len <= INLINE_VALUES { &self.inline[..self.len] } else { &self.spilled }
    }

    /// The refusal of a request whose fingerprinted fields are more than `max_fields`, or
    /// more than `max_bytes` of names plus values: 431 `headers-too-large` (RFC 6585 §5),
    /// so a client cannot make the layer hash an unbounded header set.
    fn over_limits(&self, max_fields: usize, max_bytes: usize) -> Option<Refusal> {
        (self.len > max_fields || self.bytes > max_bytes)
            .then(|| Refusal::headers_too_large(self.len, self.bytes, max_fields, max_bytes))
    }
}
