//! The response body the layer returns: the inner service's body untouched (safe methods,
//! keyless requests, fail-open), or a buffered one (every keyed response, whose body had
//! to be read whole so that it could be stored before the response leaves).

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

/// Body of responses from [`crate::Idempotency`].
///
/// Its error type is the inner body's: a buffered body never fails.
pub struct ResponseBody<B> {
    kind: Kind<B>,
}

enum Kind<B> {
    /// Passed through; boxed so the wrapper is `Unpin` whatever `B` is.
    Inner(Pin<Box<B>>),
    /// Buffered bytes, sent as one frame; `None` once sent.
    Full(Option<Bytes>),
}

impl<B> ResponseBody<B> {
    pub(crate) fn inner(body: B) -> Self {
        Self { kind: Kind::Inner(Box::pin(body)) }
    }

    pub(crate) fn full(bytes: Bytes) -> Self {
        Self { kind: Kind::Full(Some(bytes)) }
    }
}

impl<B> fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            Kind::Inner(_) => f.write_str("ResponseBody::Inner(..)"),
            Kind::Full(b) => write!(f, "ResponseBody::Full({} bytes)", b.as_ref().map_or(0, Bytes::len)),
        }
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match &mut self.get_mut().kind {
            Kind::Inner(body) => body.as_mut().poll_frame(cx),
            Kind::Full(bytes) => Poll::Ready(bytes.take().filter(|b| !b.is_empty()).map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner(body) => body.is_end_stream(),
            Kind::Full(bytes) => bytes.as_ref().is_none_or(Bytes::is_empty),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner(body) => body.size_hint(),
            Kind::Full(bytes) => SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64)),
        }
    }
}
