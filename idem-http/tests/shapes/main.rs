//! A streamed or endless response (SSE, chunked progress) held the client's head until the
//! body ended and left its record in flight, so a retry after the lease ran the handler a
//! second time; trailers were dropped; and FailOpen ran the handler again over a completed
//! record that did not decode. Every response shape, on every backend, with a clock the
//! test controls (the store's manual clock and tokio's paused clock, moved together).

#[path = "../lease/backends.rs"]
mod backends;
#[path = "../common/mod.rs"]
mod common;
#[allow(dead_code, reason = "the shapes reuse the lease scenarios' clock helpers only")]
#[path = "../lease/scenarios.rs"]
mod lease;
mod scenarios;

/// The scenarios of `scenarios.rs` as named tests on one backend factory.
macro_rules! shape_tests {
    ($backend:ident) => {
        mod $backend {
            use crate::backends::$backend as factory;
            use crate::scenarios;

            /// An endless SSE stream kept the client waiting for its head, or its retry ran twice.
            #[tokio::test(start_paused = true)]
            async fn an_endless_event_stream_is_not_retained_and_runs_once() {
                scenarios::endless_stream_runs_once(factory, "text/event-stream").await;
            }

            /// An endless chunked progress stream (no streaming content type) was buffered forever.
            #[tokio::test(start_paused = true)]
            async fn an_endless_chunked_stream_is_not_retained_and_runs_once() {
                scenarios::endless_stream_runs_once(factory, "text/plain").await;
            }

            /// A 5 MiB chunked body or a binary body replayed different bytes or content type.
            #[tokio::test(start_paused = true)]
            async fn large_chunked_and_binary_bodies_replay_byte_identical() {
                scenarios::large_and_binary_bodies_replay_byte_identical(factory).await;
            }

            /// A body over max_stored_body was buffered whole, or its retry ran the handler again.
            #[tokio::test(start_paused = true)]
            async fn a_body_over_the_limit_streams_and_is_not_retained() {
                scenarios::over_the_limit_streams_and_is_not_retained(factory).await;
            }

            /// Trailers were not stored, so a replay lost them (gRPC's status lives there).
            #[tokio::test(start_paused = true)]
            async fn trailers_are_stored_and_replayed() {
                scenarios::trailers_are_replayed(factory).await;
            }

            /// FailOpen ran the handler again over a completed record that does not decode.
            #[tokio::test(start_paused = true)]
            async fn fail_open_never_reruns_a_corrupt_completed_record() {
                scenarios::fail_open_never_reruns_a_corrupt_record(factory).await;
            }
        }
    };
}

shape_tests!(memory);
shape_tests!(redb);
shape_tests!(sqlite);
// The real servers (127.0.0.1:6379, 127.0.0.1:5432, or IDEM_REDIS_URL / IDEM_POSTGRES_URL);
// the tests fail, never skip, when a server is down.
shape_tests!(redis);
shape_tests!(postgres);

/// The endless-stream scenario cannot tell the streaming rules from luck: with them off
/// (no deadline, no streaming content type), the same stream must hold the head back.
#[tokio::test(start_paused = true)]
async fn without_the_streaming_rules_an_endless_stream_holds_the_head() {
    scenarios::endless_stream_without_rules_holds_the_head(backends::memory).await;
}
