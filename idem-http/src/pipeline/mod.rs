//! The walk of one non-safe request through the layer, one step per file, each read top
//! to bottom:
//!
//! 1. `intake`: the key (none: [`crate::KeyRequirement`]; invalid or repeated: 400), the
//!    principal (none: [`crate::MissingPrincipal`]), the header and body limits (431, 413),
//!    the fingerprint; the claim request it all makes;
//! 2. `acquire`: `claim` the record, decide ([`idem_core::decide`]), reclaim, or wait a
//!    bounded time for the first attempt's outcome (opt-in): this request holds the claim,
//!    or is answered (a replay, 409, a mismatch);
//! 3. `run`: the handler under the claim, its lease renewed while it runs
//!    ([`crate::LeaseRenewal`]), in work that outlives the response future under
//!    [`crate::HandlerExecution::Detached`];
//! 4. `capture`: a cacheable response's body read up to `max_stored_body + 1` bytes (or
//!    not at all for a streaming media type, or until the buffering deadline);
//! 5. `keep`: `complete` (with the body if it ended in time, not retained otherwise), or
//!    for any other status `fail`; only then is the response returned, its unread rest
//!    streaming straight from the handler;
//! 6. the answer ([`crate::answer::Answer`]): the handler's response, a replay or a
//!    refusal, made a response once, at the end of the walk.
//!
//! A [`Pipeline`] is prepared once per layer from its settings (`crate::layer`).

mod acquire;
mod capture;
mod intake;
mod keep;
mod run;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, Request, Response, StatusCode};
use http_body::Body;
use idem_core::BoxError;
use tower::Service;
use tracing::Instrument;

use crate::answer::{Answer, Refusal};
use crate::body::ResponseBody;
use crate::config::{Settings, StoreFailureMode};
use crate::observe::{DecisionKind, Observer};
use crate::store::LayerStore;

/// What one layer runs every request with: its settings, prepared once.
#[derive(Debug)]
pub(crate) struct Pipeline {
    pub(crate) settings: Settings,
    /// The layer's store: the given one behind deadlines, completion retries, sealing and
    /// metrics (`crate::store`).
    pub(crate) store: Arc<LayerStore>,
    /// `settings.fingerprint_headers` as header names (a configured name that is not a
    /// valid one can match no field, and is left out).
    fingerprint_headers: Vec<HeaderName>,
    /// The retention a claim asks for: never shorter than the lease.
    retention: Duration,
    /// The lease renewal interval; `None` when nothing renews.
    renewal_interval: Option<Duration>,
    mismatch_status: StatusCode,
}

impl Pipeline {
    pub(crate) fn prepare(settings: &Settings) -> Self {
        let policy = &settings.policy;
        Self {
            store: Arc::new(crate::store::compose(settings)),
            fingerprint_headers: (settings.fingerprint_headers.iter())
                .filter_map(|name| HeaderName::from_bytes(name.as_bytes()).ok())
                .collect(),
            retention: policy.effective_retention(),
            renewal_interval: settings.lease_renewal.interval(policy.lease_ttl),
            mismatch_status: StatusCode::from_u16(settings.mismatch_status.code()).unwrap_or(StatusCode::CONFLICT),
            settings: settings.clone(),
        }
    }

    /// Walks a non-safe request through the layer (module docs). One `idempotency` span
    /// per request: the handler's own spans nest under it, and it stays with the work if
    /// that moves to a task of its own.
    pub(crate) async fn walk<S, ReqBody, ResBody>(
        self: Arc<Self>,
        inner: S,
        req: Request<ReqBody>,
    ) -> Result<Response<ResponseBody<ResBody>>, S::Error>
    where
        S: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
        S::Future: Send,
        S::Error: Send + 'static,
        ReqBody: Body + From<Bytes> + Send + 'static,
        ReqBody::Error: Into<BoxError>,
        ResBody: Body<Data = Bytes> + Send + 'static,
        ResBody::Error: Into<BoxError>,
    {
        let grpc = crate::headers::is_grpc(req.headers());
        let endpoint = intake::endpoint(&req);
        let span = crate::observe::request_span(&endpoint);
        let mut obs = Observer::new(span.clone(), self.settings.events.as_ref().map(|e| &e.0), &endpoint);
        obs.endpoint(&endpoint);
        let answer = async {
            let admitted = match intake::admit(&self, req, endpoint).await {
                intake::Intake::Admitted(admitted) => admitted,
                intake::Intake::Skipped(req) => {
                    obs.decision(DecisionKind::Skipped);
                    return pass_through(inner, req).await.map(Answer::Handler);
                }
                intake::Intake::Refused(refusal) => {
                    obs.decision(DecisionKind::Rejected);
                    return Ok(Answer::Refusal(refusal));
                }
            };
            let intake::Admitted { parts, body, claim, deadline } = admitted;
            let id = claim.id();
            obs.record(id);
            match acquire::acquire(&self, claim, deadline).await {
                acquire::Acquired::Claimed { record, sent, decision } => {
                    obs.claimed(decision, record.token);
                    run::run(&self, inner, parts, body, record, (sent, deadline), &obs).await
                }
                acquire::Acquired::Answered(answer, decision) => {
                    obs.decision(decision);
                    Ok(answer)
                }
                acquire::Acquired::StoreFailed(error) => {
                    let endpoint = intake::endpoint_of(&parts.method, &parts.uri, &parts.extensions);
                    match self.settings.store_failure_mode {
                        StoreFailureMode::FailOpen => {
                            obs.decision(DecisionKind::FailOpen);
                            tracing::warn!(
                                record = %id, endpoint = %endpoint.as_str(), error = %error,
                                "idempotency store failed; running the handler WITHOUT idempotency protection (fail-open)"
                            );
                            pass_through(inner, Request::from_parts(parts, ReqBody::from(body))).await.map(Answer::Handler)
                        }
                        StoreFailureMode::FailClosed => {
                            obs.decision(DecisionKind::StoreUnavailable);
                            tracing::error!(
                                record = %id, endpoint = %endpoint.as_str(), error = %error,
                                "idempotency store failed; answering 503 without running the handler (fail-closed)"
                            );
                            Ok(Answer::Refusal(Refusal::store_unavailable()))
                        }
                    }
                }
                acquire::Acquired::Unreadable(why) => {
                    // In both failure modes: the record may be a completed operation, and
                    // running its handler again (fail-open) could repeat it.
                    obs.decision(DecisionKind::Unreadable);
                    tracing::error!(record = %id, why, "stored idempotency record cannot be read or replayed");
                    Ok(Answer::Refusal(Refusal::unreadable()))
                }
            }
        }
        .instrument(span)
        .await?;
        let replayed = matches!(answer, Answer::Replay(_));
        let res = answer.render(grpc, self.settings.retry_hints);
        Ok(match &self.settings.replay_edit {
            Some(edit) if replayed => {
                let (mut head, body) = res.into_parts();
                (edit.0)(&mut head);
                Response::from_parts(head, body)
            }
            _ => res,
        })
    }
}

/// The inner service's answer, untouched: safe methods, keyless and skipped requests,
/// fail-open.
pub(crate) async fn pass_through<S, ReqBody, ResBody>(
    mut inner: S,
    req: Request<ReqBody>,
) -> Result<Response<ResponseBody<ResBody>>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    inner.call(req).await.map(|res| res.map(|body| ResponseBody::inner(Box::pin(body))))
}
