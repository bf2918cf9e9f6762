//! [`Idempotency`]: the middleware service. A safe method passes through untouched; every
//! other request walks the layer's pipeline (`crate::pipeline`).

use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use idem_core::BoxError;
use tower::Service;

use crate::body::ResponseBody;
use crate::future::ResponseFuture;
use crate::pipeline::{Pipeline, pass_through};

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
    pipeline: Arc<Pipeline>,
}

impl<S> Idempotency<S> {
    pub(crate) fn new(inner: S, pipeline: Arc<Pipeline>) -> Self {
        Self { inner, pipeline }
    }

    #[cfg(test)]
    pub(crate) fn pipeline(&self) -> &Arc<Pipeline> {
        &self.pipeline
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
        // RFC 9110 §9.2.1 (and RFC 10008 for QUERY, which `http` counts as safe): safe
        // methods change nothing, so there is nothing to protect.
        if req.method().is_safe() {
            return ResponseFuture::new(Box::pin(pass_through(inner, req)));
        }
        // The allocation comes first and the walk is written into it: built on the stack and
        // then boxed, its several kilobytes of state would be copied on every request.
        let work = Box::write(Box::new_uninit(), Arc::clone(&self.pipeline).walk(inner, req));
        ResponseFuture::new(Box::into_pin(work))
    }
}
