//! Step 4, capture: the handler's response, its body read as far as the record needs
//! (`docs/contract.md#what-is-stored-and-when`).
//!
//! What is read of which response, and when reading stops: `docs/contract.md#bounded-buffering`.
//! What the record keeps of it is decided and written next (`keep`).

use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::task::{Poll, ready};

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, Response};
use http_body::Body;
use idem_core::BoxError;
use tokio::time::{Instant, Sleep};

use super::Pipeline;
use crate::context::ResponseCaching;
use crate::streaming::Streaming;

/// The handler's response, its body read as far as the record needs.
pub(super) struct Captured<B> {
    pub(super) head: http::response::Parts,
    pub(super) caching: Option<ResponseCaching>,
    pub(super) read: Read<B>,
}

/// What the layer read of a response body.
pub(super) enum Read<B> {
    /// Not read: the response is not stored, so it streams through.
    Untouched(Pin<Box<B>>),
    /// The whole body ended within `max_stored_body` bytes, with its trailers.
    Whole(Bytes, Option<HeaderMap>),
    /// The layer stopped buffering: `read` is what it had read, `rest` the body from there.
    Streamed {
        read: Vec<Bytes>,
        /// The body's full length, when its size hint said it exactly.
        len: Option<u64>,
        rest: Pin<Box<B>>,
        why: &'static str,
    },
    /// The body failed while it was read.
    Failed(BoxError),
}

/// Reads `res`'s body as far as the record needs (module docs).
pub(super) async fn read<B>(pipeline: &Pipeline, res: Response<B>) -> Captured<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let (mut head, body) = res.into_parts();
    let caching = head.extensions.remove::<ResponseCaching>();
    let policy = &pipeline.settings.policy;
    let cacheable = match caching {
        // Completed in the handler's own transaction: nothing more to store.
        Some(ResponseCaching::CompletedByHandler | ResponseCaching::DoNotStore) => false,
        Some(ResponseCaching::StoreServerError) => true,
        Some(ResponseCaching::Store) if !head.status.is_server_error() => true,
        _ => policy.is_cacheable(head.status.as_u16()),
    };
    let body = Box::pin(body);
    let read = if cacheable {
        read_bounded(body, &head, policy.max_stored_body, &pipeline.settings.streaming).await
    } else {
        Read::Untouched(body)
    };
    Captured { head, caching, read }
}

/// Reads `body` until it ends, or it has given more than `limit` bytes, or it is a stream
/// (a streaming media type, a declared length over `limit`), or it has not ended within
/// the buffering deadline after the head. The deadline's timer is set only if the body
/// makes the layer wait; without a tokio runtime the layer reads by size alone.
async fn read_bounded<B>(
    mut body: Pin<Box<B>>,
    head: &http::response::Parts,
    limit: usize,
    streaming: &Streaming,
) -> Read<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let exact = body.size_hint().exact();
    if exact.is_some_and(|len| len > limit as u64) {
        return Read::Streamed {
            read: Vec::new(),
            len: exact,
            rest: body,
            why: "declared length over max_stored_body",
        };
    }
    if streaming.is_stream(&head.headers) {
        return Read::Streamed { read: Vec::new(), len: None, rest: body, why: "streaming content type" };
    }
    let deadline = streaming.buffer_for.map(|d| Instant::now() + d);
    let mut timer: Option<Pin<Box<Sleep>>> = None;
    let mut read = Coalesced::new(limit);
    let mut trailers: Option<HeaderMap> = None;
    loop {
        // `None`: the deadline passed first.
        let next = poll_fn(|cx| {
            if let Poll::Ready(frame) = body.as_mut().poll_frame(cx) {
                return Poll::Ready(Some(frame));
            }
            let timer = match (&mut timer, deadline) {
                (Some(timer), _) => timer,
                (None, Some(at)) if tokio::runtime::Handle::try_current().is_ok() => {
                    timer.insert(Box::pin(tokio::time::sleep_until(at)))
                }
                _ => return Poll::Pending,
            };
            ready!(timer.as_mut().poll(cx));
            Poll::Ready(None)
        });
        let Some(next) = next.await else {
            let why = "body still open at the buffering deadline";
            return Read::Streamed { read: read.into_frames(), len: None, rest: body, why };
        };
        match next {
            None => break,
            Some(Err(e)) => return Read::Failed(e.into()),
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => {
                    read.push(data);
                    if read.total > limit {
                        // The size hint (if any) said at most `limit` bytes, and the body
                        // sent more: the hint was wrong, so the full length is unknown.
                        let why = "body over max_stored_body";
                        return Read::Streamed { read: read.into_frames(), len: None, rest: body, why };
                    }
                }
                Err(frame) => {
                    if let Ok(t) = frame.into_trailers() {
                        trailers.get_or_insert_with(HeaderMap::new).extend(t);
                    }
                }
            },
        }
    }
    Read::Whole(read.into_bytes(), trailers)
}

/// The bytes of a body read so far, in one buffer: kept frame by frame, a body of tiny
/// frames would cost a `Bytes` handle and an allocation per frame (~64 bytes of heap per
/// one-byte frame), far over `limit`. A body of one frame is kept as it came (no copy);
/// from the second frame on, they are copied into one buffer that never grows past
/// `limit` plus the frame that crossed it.
struct Coalesced {
    limit: usize,
    first: Option<Bytes>,
    joined: BytesMut,
    total: usize,
}

impl Coalesced {
    fn new(limit: usize) -> Self {
        Self { limit, first: None, joined: BytesMut::new(), total: 0 }
    }

    fn push(&mut self, data: Bytes) {
        if data.is_empty() {
            return;
        }
        self.total = self.total.saturating_add(data.len());
        if self.first.is_none() && self.joined.is_empty() {
            self.first = Some(data);
            return;
        }
        if let Some(first) = self.first.take() {
            self.append(&first);
        }
        self.append(&data);
    }

    fn append(&mut self, data: &[u8]) {
        let len = self.joined.len();
        if self.joined.capacity() - len < data.len() {
            // Double, as `BytesMut` would, but never past `limit + 1` bytes, plus this frame.
            let doubled = len.max(data.len()).min(self.limit.saturating_add(1).saturating_sub(len));
            self.joined.reserve(doubled.max(data.len()));
        }
        self.joined.extend_from_slice(data);
    }

    fn into_bytes(self) -> Bytes {
        self.first.unwrap_or_else(|| self.joined.freeze())
    }

    fn into_frames(self) -> Vec<Bytes> {
        let bytes = self.into_bytes();
        if bytes.is_empty() { Vec::new() } else { vec![bytes] }
    }
}
