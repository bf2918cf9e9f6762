//! When the layer stops buffering a response it may store, and streams it instead.
//!
//! The rules (the body passes `max_stored_body`, a streaming media type, the body still
//! open `buffer_for` after the head), what the record keeps, what a retry gets, and why a
//! gRPC response holds its claim instead: `docs/contract.md#bounded-buffering`.

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
