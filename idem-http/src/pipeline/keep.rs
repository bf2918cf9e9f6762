//! Step 5, keep: what the record keeps of the handler's response, written (`complete` or
//! `fail`) while the lease is still renewed, before the response is returned
//! (`docs/contract.md#what-is-stored-and-when`).
//!
//! A gRPC response that streams keeps its claim until its status is known instead
//! (`crate::grpc`); a handler that completed its record in its own transaction has it
//! checked once.

use std::pin::{Pin, pin};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Response};
use http_body::Body;
use idem_core::{BoxError, RecordState, StoredBody, StoredResponse, UnixMillis};

use super::Pipeline;
use super::capture::{Captured, Read};
use super::run::Attempt;
use crate::answer::{Answer, Refusal};
use crate::body::ResponseBody;
use crate::context::ResponseCaching;
use crate::headers::{IDEMPOTENCY_KEY_EXPIRES, IDEMPOTENT_STORED, expires_value, kept_fields};
use crate::lease::Renewal;
use crate::observe::Outcome;

/// A response the record keeps.
enum Kept<B> {
    /// The whole response.
    Whole(Bytes, Option<HeaderMap>),
    /// Status and headers, the body not retained; `read` then `rest` go to the client.
    Streamed { read: Vec<Bytes>, len: Option<u64>, rest: Pin<Box<B>> },
}

/// A response the record does not keep: the record is marked failed.
enum Dropped<B> {
    /// Not stored: the response goes out as it is.
    Uncacheable(ResponseBody<B>),
    /// The body failed while it was read: the client gets a 500.
    Failed(BoxError),
}

/// Completes or fails the attempt's record with what it keeps of `captured`, while the
/// lease is still renewed, and returns the handler's response with its
/// `Idempotency-Key-Expires` (and `Idempotent-Stored: false` if the record could not take
/// it).
pub(super) async fn keep<B>(
    pipeline: &Pipeline,
    captured: Captured<B>,
    mut attempt: Attempt<'_>,
    mut renewal: Renewal<'_>,
) -> Answer<B>
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let Captured { mut head, caching, read } = captured;
    if caching == Some(ResponseCaching::CompletedByHandler) {
        // The handler's own completion is checked, rarely: its state stays out of this one.
        return Box::pin(completed_by_handler(pipeline, head, read, attempt)).await;
    }
    let (id, policy, status) = (attempt.id, &pipeline.settings.policy, head.status.as_u16());
    let kept = match read {
        Read::Failed(error) => Err(Dropped::Failed(error)),
        Read::Untouched(body) => Err(Dropped::Uncacheable(ResponseBody::inner(body))),
        Read::Whole(bytes, trailers) => {
            // gRPC answers its errors with HTTP 200 and the real outcome in `grpc-status`;
            // only a lasting one is stored (see `crate::grpc`), unless the handler said.
            #[cfg(feature = "grpc")]
            let lasting = caching.is_some() || crate::grpc::is_lasting(&head.headers, trailers.as_ref());
            #[cfg(not(feature = "grpc"))]
            let lasting = true;
            if lasting {
                Ok(Kept::Whole(bytes, trailers))
            } else {
                Err(Dropped::Uncacheable(ResponseBody::full_with_trailers(bytes, trailers)))
            }
        }
        #[cfg(feature = "grpc")]
        Read::Streamed { read, rest, why, .. } if caching.is_none() && crate::grpc::is_grpc(&head.headers) => {
            // Its `grpc-status` comes after the body: the claim stays held (and renewed)
            // until the body ends, which completes or fails the record.
            tracing::debug!(record = %id, status, why, "gRPC response streamed: the record waits for its status");
            let expires_at = attempt.expires_at;
            let end = hold_until_status(pipeline, &head, &read, attempt);
            set_expires(&mut head.headers, expires_at);
            return Answer::Handler(Response::from_parts(head, ResponseBody::streamed_until_status(read, rest, end)));
        }
        Read::Streamed { read, len, rest, why } => {
            tracing::debug!(record = %id, status, why, "response streamed: the record completes without its body");
            Ok(Kept::Streamed { read, len, rest })
        }
    };
    let kept = match kept {
        Ok(kept) => kept,
        Err(dropped) => {
            let why = match dropped {
                Dropped::Failed(_) => "response body failed",
                // 5xx, 1xx, 3xx other than 303, the uncacheable 4xx, a gRPC status that is
                // not lasting, and what the handler marked `DoNotStore`: a retry runs again.
                Dropped::Uncacheable(_) => "response status is not cacheable",
            };
            renewal.during(pin!(attempt.guard.fail_now(why))).await;
            attempt.done(Outcome::Failed);
            return match dropped {
                Dropped::Failed(error) => {
                    tracing::error!(record = %id, error = %error, "handler response body failed; record marked failed");
                    let detail =
                        "the response failed while it was being produced; the request may be retried with the same key";
                    Answer::Refusal(Refusal::response_failed(detail))
                }
                Dropped::Uncacheable(body) => {
                    set_expires(&mut head.headers, attempt.expires_at);
                    Answer::Handler(Response::from_parts(head, body))
                }
            };
        }
    };
    // Each attempt builds what it sends from the response the client gets: nothing is kept
    // aside for a resend that almost never comes.
    let stored = match &kept {
        Kept::Whole(bytes, trailers) => Stored::Whole(bytes, trailers.as_ref()),
        Kept::Streamed { len, .. } => Stored::NotRetained(*len),
    };
    let response = || stored.response(pipeline, status, &head.headers);
    let written = renewal.during(pin!(pipeline.store.complete(id, attempt.token, response))).await;
    let (outcome, body) = match kept {
        Kept::Whole(bytes, trailers) => {
            let outcome = if bytes.len() <= policy.max_stored_body { Outcome::Completed } else { Outcome::NotRetained };
            (outcome, ResponseBody::full_with_trailers(bytes, trailers))
        }
        Kept::Streamed { read, rest, .. } => (Outcome::NotRetained, ResponseBody::streamed(read, rest)),
    };
    let mut expires_at = attempt.expires_at;
    match written {
        Ok(receipt) => {
            expires_at = receipt.expires_at;
            attempt.written(outcome);
        }
        Err(e) if e.is_lease_lost() => {
            attempt.done(Outcome::LeaseLost);
            not_stored(&mut head.headers);
            tracing::warn!(
                record = %id, token = %attempt.token, error = %e,
                "lease lost before completion: another attempt owns the record now; this response is still returned \
                 but not stored"
            );
        }
        Err(e) => {
            attempt.done(Outcome::NotStored);
            not_stored(&mut head.headers);
            tracing::error!(
                record = %id, token = %attempt.token, error = %e,
                "could not store the response; it is returned anyway, and the record stays in flight until its lease \
                 ends, after which a retry reclaims it and runs the handler again"
            );
        }
    }
    attempt.guard.disarm();
    set_expires(&mut head.headers, expires_at);
    Answer::Handler(Response::from_parts(head, body))
}

/// The handler completed the record in its own transaction, together with its writes
/// ([`ResponseCaching::CompletedByHandler`]); a completion does not move the retention end
/// the claim set. Its body is not read here (nothing is stored), so it streams through.
///
/// Trust, but check once: a handler that set the marker and whose transaction then rolled
/// back (or that never completed) would otherwise leave the record in flight with nobody
/// running it, every retry answered "in flight" until the lease ran out, and the client
/// told it succeeded. Still in flight under this claim's token means the completion did
/// not commit: fail the record, so a retry runs cleanly.
async fn completed_by_handler<B>(
    pipeline: &Pipeline,
    mut head: http::response::Parts,
    read: Read<B>,
    mut attempt: Attempt<'_>,
) -> Answer<B> {
    let (id, token) = (attempt.id, attempt.token);
    let check = pipeline.store.get(id).await;
    if let Err(e) = &check
        && e.is_corrupt()
    {
        // The handler's completion committed (its writes with it), so its answer stands;
        // but the stored response does not open or decode (under sealing: it was stored
        // plain, not `IdempotencyContext::stored_form`), so every retry gets 503, and a
        // plain response sits in the store unsealed.
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
        attempt.guard.fail_now("handler said it completed its record, but the record is still in flight").await;
        attempt.done(Outcome::Failed);
        tracing::error!(
            record = %id, token = %token,
            "handler returned ResponseCaching::CompletedByHandler but its completion did not commit; record marked failed"
        );
        return Answer::Refusal(Refusal::response_failed(
            "the handler's completion of this request did not commit; the request may be retried with the same key",
        ));
    }
    attempt.guard.disarm();
    attempt.done(Outcome::Completed);
    set_expires(&mut head.headers, attempt.expires_at);
    let body = match read {
        Read::Untouched(body) => ResponseBody::inner(body),
        Read::Whole(bytes, trailers) => ResponseBody::full_with_trailers(bytes, trailers),
        Read::Streamed { read, rest, .. } => ResponseBody::streamed(read, rest),
        Read::Failed(error) => {
            tracing::error!(record = %id, error = %error, "handler response body failed after the handler completed its record");
            return Answer::Refusal(Refusal::response_failed("the response failed while it was being produced"));
        }
    };
    Answer::Handler(Response::from_parts(head, body))
}

/// The claim of a gRPC response that streams, handed to its body: the record is written
/// when the stream ends, with the status it ends with (`docs/contract.md#grpc`,
/// "Streamed"). The stream renews its own lease from here on.
#[cfg(feature = "grpc")]
fn hold_until_status(
    pipeline: &Pipeline,
    head: &http::response::Parts,
    read: &[Bytes],
    attempt: Attempt<'_>,
) -> crate::grpc::stream::StreamEnd {
    let Attempt { id, token, guard, lease, terms, obs, grpc_endpoint, .. } = attempt;
    // Its outcome is counted after this request's observer is gone.
    let mut stream_obs = obs.clone();
    if let Some(endpoint) = &grpc_endpoint {
        stream_obs.endpoint(endpoint);
    }
    let claim = crate::grpc::stream::OpenClaim {
        store: std::sync::Arc::clone(&pipeline.store),
        id,
        token,
        guard: guard.into_owned(),
        status: head.status.as_u16(),
        headers: kept_fields(&pipeline.settings.policy, &head.headers),
        head_status: head.headers.get("grpc-status").cloned(),
        policy: pipeline.settings.policy.clone(),
        len: read.iter().map(|b| b.len() as u64).sum(),
        lease,
        obs: stream_obs,
    };
    crate::grpc::stream::StreamEnd::new(claim, terms)
}

/// What a completion stores besides the status and the kept headers: the parts of a
/// [`Kept`] response that the record takes, not the body the client still reads.
#[derive(Clone, Copy)]
enum Stored<'a> {
    /// The whole body, and its trailers.
    Whole(&'a Bytes, Option<&'a HeaderMap>),
    /// No body; its length, when it is known.
    NotRetained(Option<u64>),
}

impl Stored<'_> {
    /// The stored form of the response: its kept headers (and trailers), its body
    /// compressed past the policy's threshold, or marked not retained.
    fn response(self, pipeline: &Pipeline, status: u16, headers: &HeaderMap) -> StoredResponse {
        let policy = &pipeline.settings.policy;
        let headers = kept_fields(policy, headers);
        let (body, trailers) = match self {
            Stored::Whole(body, trailers) => {
                let trailers = trailers.map_or_else(Vec::new, |t| kept_fields(policy, t));
                if body.len() <= policy.max_stored_body {
                    let stored = StoredResponse::compressed_over(status, headers, body.to_vec(), policy.compress_over);
                    return stored.with_trailers(trailers);
                }
                (StoredBody::NotRetained { len: Some(body.len() as u64) }, trailers)
            }
            Stored::NotRetained(len) => (StoredBody::NotRetained { len }, Vec::new()),
        };
        StoredResponse { status, headers, body, trailers }
    }
}

/// Marks a response the layer could not store (`Idempotent-Stored: false`), so that its
/// client knows a retry of the key will not replay it.
fn not_stored(headers: &mut HeaderMap) {
    headers.insert(IDEMPOTENT_STORED, HeaderValue::from_static("false"));
}

fn set_expires(headers: &mut HeaderMap, at: UnixMillis) {
    headers.insert(IDEMPOTENCY_KEY_EXPIRES, expires_value(at));
}
