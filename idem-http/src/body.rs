//! The response body the layer returns: the inner service's body untouched (safe methods,
//! keyless requests, fail-open, responses that are not stored), a buffered one (a keyed
//! response that ended within `max_stored_body`, and every replay), or a streamed one (a
//! keyed response longer than that, or endless: the part read while deciding, then the
//! rest straight from the handler; for gRPC, also the record's claim, written when the
//! stream ends, see [`crate::grpc`]).

use std::collections::VecDeque;
use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};

#[cfg(feature = "grpc")]
use crate::grpc::stream::StreamEnd;

/// Body of responses from [`crate::Idempotency`].
///
/// Its error type is the inner body's: a buffered body never fails; a streamed one fails
/// when the handler's body does, after the part the layer had read.
pub struct ResponseBody<B> {
    kind: Kind<B>,
}

enum Kind<B> {
    /// Passed through; boxed so the wrapper is `Unpin` whatever `B` is.
    Inner(Pin<Box<B>>),
    /// Buffered bytes, sent as one frame (`None` once sent), then the trailers, if any.
    Full { data: Option<Bytes>, trailers: Option<HeaderMap> },
    /// The frames read before the layer stopped buffering, then the rest of the inner body.
    Streamed { read: VecDeque<Bytes>, rest: Pin<Box<B>> },
    /// [`Kind::Streamed`] of a gRPC response: `end` holds the record's claim until its
    /// status is known.
    #[cfg(feature = "grpc")]
    UntilStatus { read: VecDeque<Bytes>, rest: Pin<Box<B>>, end: Box<StreamEnd> },
}

impl<B> ResponseBody<B> {
    pub(crate) fn inner(body: Pin<Box<B>>) -> Self {
        Self { kind: Kind::Inner(body) }
    }

    pub(crate) fn full(bytes: Bytes) -> Self {
        Self { kind: Kind::Full { data: Some(bytes), trailers: None } }
    }

    pub(crate) fn full_with_trailers(bytes: Bytes, trailers: Option<HeaderMap>) -> Self {
        Self { kind: Kind::Full { data: Some(bytes), trailers: trailers.filter(|t| !t.is_empty()) } }
    }

    pub(crate) fn streamed(read: Vec<Bytes>, rest: Pin<Box<B>>) -> Self {
        Self { kind: Kind::Streamed { read: read.into(), rest } }
    }

    /// [`Self::streamed`], whose end (its trailers, or none) completes or fails the record
    /// `end` holds the claim of before it reaches the client.
    #[cfg(feature = "grpc")]
    pub(crate) fn streamed_until_status(read: Vec<Bytes>, rest: Pin<Box<B>>, end: StreamEnd) -> Self {
        Self { kind: Kind::UntilStatus { read: read.into(), rest, end: Box::new(end) } }
    }
}

impl<B> fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            Kind::Inner(_) => f.write_str("ResponseBody::Inner(..)"),
            Kind::Full { data, trailers } => write!(
                f,
                "ResponseBody::Full({} bytes, {} trailers)",
                data.as_ref().map_or(0, Bytes::len),
                trailers.as_ref().map_or(0, HeaderMap::len)
            ),
            Kind::Streamed { read, .. } => write!(f, "ResponseBody::Streamed({} frames read, ..)", read.len()),
            #[cfg(feature = "grpc")]
            Kind::UntilStatus { read, .. } => write!(f, "ResponseBody::Streamed({} frames read, ..)", read.len()),
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
            Kind::Full { data, trailers } => {
                if let Some(bytes) = data.take().filter(|b| !b.is_empty()) {
                    return Poll::Ready(Some(Ok(Frame::data(bytes))));
                }
                Poll::Ready(trailers.take().map(|t| Ok(Frame::trailers(t))))
            }
            Kind::Streamed { read, rest } => match read.pop_front() {
                Some(bytes) => Poll::Ready(Some(Ok(Frame::data(bytes)))),
                None => rest.as_mut().poll_frame(cx),
            },
            #[cfg(feature = "grpc")]
            Kind::UntilStatus { read, rest, end } => match read.pop_front() {
                Some(bytes) => {
                    end.read_frame_sent();
                    Poll::Ready(Some(Ok(Frame::data(bytes))))
                }
                None => end.poll_frame(rest.as_mut(), cx),
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner(body) => body.is_end_stream(),
            Kind::Full { data, trailers } => data.as_ref().is_none_or(Bytes::is_empty) && trailers.is_none(),
            Kind::Streamed { read, rest } => read.is_empty() && rest.is_end_stream(),
            // A claimed gRPC stream ends only after its end was seen and the record
            // written: a body that said so earlier would never be polled for its end.
            #[cfg(feature = "grpc")]
            Kind::UntilStatus { read, end, .. } => read.is_empty() && end.is_done(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner(body) => body.size_hint(),
            Kind::Full { data, .. } => SizeHint::with_exact(data.as_ref().map_or(0, |b| b.len() as u64)),
            Kind::Streamed { read, rest } => streamed_hint(read, rest.size_hint()),
            #[cfg(feature = "grpc")]
            Kind::UntilStatus { read, rest, .. } => streamed_hint(read, rest.size_hint()),
        }
    }
}

/// The size of a streamed body: the frames read, then the rest.
fn streamed_hint(read: &VecDeque<Bytes>, rest: SizeHint) -> SizeHint {
    let read: u64 = read.iter().map(|b| b.len() as u64).sum();
    let mut hint = SizeHint::new();
    hint.set_lower(rest.lower().saturating_add(read));
    if let Some(upper) = rest.upper() {
        hint.set_upper(upper.saturating_add(read));
    }
    hint
}
