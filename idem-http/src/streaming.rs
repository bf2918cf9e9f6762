//! When the layer stops buffering a response it may store, and streams it instead.
//!
//! The layer reads a cacheable response's body before it returns the head, so that the
//! record completes (with the body) before anybody can see the response. It stops reading
//! and streams the rest through, completing the record as not retained first, when:
//! - the body passes `max_stored_body` bytes (a large export, an image);
//! - the response is a stream by its `content-type` (default `text/event-stream`): it
//!   streams at once, without waiting for any of its body;
//! - the body is still open `buffer_for` after the head (default 500 ms): chunked progress
//!   or a long poll that would otherwise keep the client waiting for its first byte.
//!
//! A retry of a streamed operation gets the `response-not-retained` problem with the
//! original status and `Location`, never a second run.
//!
//! A gRPC response is the exception: its `grpc-status` comes after the body, so the
//! record keeps its claim while the body streams and is written when the stream ends
//! (`crate::grpc`, "Streamed responses").

use std::time::Duration;

use http::HeaderMap;

/// The default buffering deadline: long enough for any handler that builds its body in
/// memory and returns it, short enough that a streamed response's first bytes reach the
/// client within a second.
pub(crate) const DEFAULT_BUFFER_FOR: Duration = Duration::from_millis(500);

/// The streaming rules of one layer.
#[derive(Clone, Debug)]
pub(crate) struct Streaming {
    /// Media types (lower-case, no parameters) streamed at once.
    pub(crate) content_types: Vec<String>,
    /// How long the layer waits for a body to end after the head; `None`: no deadline.
    pub(crate) buffer_for: Option<Duration>,
}

impl Default for Streaming {
    fn default() -> Self {
        Self { content_types: vec!["text/event-stream".into()], buffer_for: Some(DEFAULT_BUFFER_FOR) }
    }
}

impl Streaming {
    /// Whether a response with `headers` is a stream by its media type.
    pub(crate) fn is_stream(&self, headers: &HeaderMap) -> bool {
        crate::headers::media_type(headers)
            .is_some_and(|media| self.content_types.iter().any(|t| t.as_bytes().eq_ignore_ascii_case(media)))
    }
}
