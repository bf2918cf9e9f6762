//! The HTTP scenarios (feature `http`): idem-http's [`IdempotencyLayer`] in front of the
//! backend's store, driven the way clients drive it, on every backend that writes
//!
//! ```ignore
//! idem_conformance::http_tests!(MyBackend::new());
//! ```
//!
//! beside its [`store_tests!`](crate::store_tests). The macro expands into one named
//! `#[tokio::test]` per scenario, grouped in modules:
//!
//! | module | what must hold |
//! |---|---|
//! | [`lease`] | a 30-minute handler under a 10 s lease runs once (renewal); a killed holder is reclaimed within one lease and one renewal interval; a stalled holder is fenced; the bounded in-flight wait; renewal through store outages, panics and cancellations |
//! | [`isolation`] | two tenants sending the same key never see each other's record, in every row of the decision table |
//! | [`shapes`] | endless streams, large, binary and over-the-limit bodies, trailers; `FailOpen` never reruns a completed record that does not decode |
//! | [`sealed`] | a sealed response replays; moved or flipped sealed bytes answer 503 without a second run; the stored bytes never hold the plaintext; key rotation; unsealed records |
//!
//! Time: the timed scenarios run on a current-thread runtime with paused time (the
//! expanded tests are `#[tokio::test(start_paused = true)]`, so the crate running them
//! needs tokio's `test-util` feature, which this feature turns on), and every store call
//! goes through [`Frozen`], which keeps that clock still while the store works. A store
//! is opened with [`Backend::open`] on a real-time runtime of its own, so stores with
//! connection pools work unchanged.
//!
//! Raw access: some scenarios write behind the store's back (garbage in a completed
//! record, a sealed response moved onto another record). They use
//! [`Backend::read_stored`], [`Backend::overwrite_stored`] and
//! [`Backend::corrupt_stored`]; a backend that leaves them at their defaults runs the
//! rest of the scenario and reports the part it skipped with a `variant:` line
//! ([`HttpEnv::report`]), never a silent pass.
//!
//! [`IdempotencyLayer`]: idem_http::IdempotencyLayer

use std::sync::Arc;

use idem_core::{ManualClock, RecordId, Store};

use crate::{Backend, Forwarding};

mod fixtures;
mod frozen;
pub mod isolation;
pub mod lease;
pub mod sealed;
pub mod shapes;

pub use frozen::Frozen;
use frozen::on_io;

#[doc(hidden)]
pub use idem_http as __idem_http;

/// What an HTTP scenario runs against: the backend's store behind [`Frozen`], its clock,
/// and the backend (for raw access).
pub struct HttpEnv {
    /// The scenario's name (in messages and [`HttpEnv::report`] lines).
    pub name: &'static str,
    /// The store's clock; timed scenarios move it together with tokio's paused clock.
    pub clock: ManualClock,
    /// The store under test, every call through [`Frozen`].
    pub store: Arc<Forwarding<Frozen>>,
    /// The store [`Backend::open`] returned, for the backend's raw access.
    raw: Arc<dyn Store>,
    backend: Arc<dyn Backend>,
}

impl std::fmt::Debug for HttpEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpEnv").field("name", &self.name).field("store", &self.store).finish_non_exhaustive()
    }
}

impl HttpEnv {
    /// Opens a fresh store of `backend` (on the store runtime) with a manual clock started
    /// at the current wall time, for the scenario called `name`.
    pub async fn open(backend: Arc<dyn Backend>, name: &'static str) -> Self {
        let clock = ManualClock::starting_now();
        let (b, c) = (Arc::clone(&backend), clock.clone());
        let raw = on_io(async move { b.open(c).await }).await;
        let store = Arc::new(Forwarding(Frozen::new(Arc::clone(&raw))));
        Self { name, clock, store, raw, backend }
    }

    /// The store under test as a trait object (for the layer).
    #[must_use]
    pub fn dyn_store(&self) -> Arc<dyn Store> {
        self.store.clone()
    }

    /// Says which variant of a scenario ran, on stderr:
    /// `idem-conformance <scenario>: variant: <what>`.
    pub fn report(&self, variant: &str) {
        eprintln!("idem-conformance {}: variant: {variant}", self.name);
    }

    /// [`Backend::read_stored`] on this scenario's store.
    pub async fn read_stored(&self, id: RecordId) -> Option<Vec<u8>> {
        let (backend, raw) = (Arc::clone(&self.backend), Arc::clone(&self.raw));
        on_io(async move { backend.read_stored(&raw, id).await }).await
    }

    /// [`Backend::overwrite_stored`] on this scenario's store.
    pub async fn overwrite_stored(&self, id: RecordId, bytes: Vec<u8>) -> bool {
        let (backend, raw) = (Arc::clone(&self.backend), Arc::clone(&self.raw));
        on_io(async move { backend.overwrite_stored(&raw, id, bytes).await }).await
    }

    /// [`Backend::corrupt_stored`] on this scenario's store.
    pub async fn corrupt_stored(&self, id: RecordId) -> bool {
        let (backend, raw) = (Arc::clone(&self.backend), Arc::clone(&self.raw));
        on_io(async move { backend.corrupt_stored(&raw, id).await }).await
    }
}

/// The stored record `bytes` of record `id` decoded, if the backend keeps the record as
/// one value ([`idem_core::codec::encode`]) rather than its response apart.
pub(crate) fn whole_record(bytes: &[u8], id: RecordId) -> Option<idem_core::Record> {
    idem_core::codec::decode(bytes).ok().filter(|r| r.id == id)
}

/// Expands into one `#[tokio::test]` per HTTP scenario for the backend built by
/// `$backend` (an expression evaluated once per test), in modules `lease`,
/// `isolation`, `shapes` and `sealed` (see [`http`](crate::http)).
#[macro_export]
macro_rules! http_tests {
    ($backend:expr) => {
        mod lease {
            #[allow(unused_imports)]
            use super::*;

            $crate::__http_test!($backend, paused,
                /// A 30-minute flash under a 10 s lease ran twice, or a retry got anything but
                /// 409 in-flight (with the 2 s poll cap) until the replay.
                a_thirty_minute_flash_under_a_ten_second_lease_runs_once
                => lease::long_flash_runs_once($crate::http::__idem_http::HandlerExecution::Detached));
            $crate::__http_test!($backend, paused,
                /// Inline execution did not renew (the renewal only lived in detached work).
                a_thirty_minute_inline_flash_runs_once
                => lease::long_flash_runs_once($crate::http::__idem_http::HandlerExecution::Inline));
            $crate::__http_test!($backend, paused,
                /// The storm above cannot tell renewal from luck: without renewal it must flash twice.
                without_renewal_the_same_storm_flashes_twice
                => lease::long_flash_runs_twice_without_renewal());
            $crate::__http_test!($backend, paused,
                /// A killed holder kept its key blocked past one lease plus one renewal interval.
                a_killed_holder_is_reclaimed_within_one_lease_and_one_interval
                => lease::killed_holder_is_reclaimed_within_one_lease());
            $crate::__http_test!($backend, paused,
                /// A holder stalled past its lease (renewal off) completed over the newer attempt.
                a_stalled_holder_without_renewal_is_fenced_when_it_resumes
                => lease::stalled_holder_without_renewal_is_fenced());
            $crate::__http_test!($backend, paused,
                /// A holder stalled past its lease (renewal on) flashed after resuming, or never heard.
                a_stalled_holder_with_renewal_stops_before_its_next_step
                => lease::stalled_holder_with_renewal_learns_its_lease_is_lost());
            $crate::__http_test!($backend, paused,
                /// A waiting duplicate missed the completion, or ran the handler.
                a_bounded_wait_replays_the_completion
                => lease::bounded_wait_replays_a_completion());
            $crate::__http_test!($backend, paused,
                /// A waiting duplicate answered a failed first attempt instead of running again.
                a_bounded_wait_reclaims_a_failed_record
                => lease::bounded_wait_reclaims_a_failure());
            $crate::__http_test!($backend, paused,
                /// A waiting duplicate answered before its wait was over, or never.
                a_bounded_wait_ends_with_409_in_flight
                => lease::bounded_wait_times_out_with_409());
            $crate::__http_test!($backend, paused,
                /// A renewal that failed transiently waited for the next interval instead of retrying
                /// within the lease, so three failures in a row let a retry reclaim a live flash.
                transient_renewal_failures_are_retried_within_the_lease
                => lease::transient_renewal_failures_are_retried());
            $crate::__http_test!($backend, paused,
                /// A renewal refused with a non-retryable `Unavailable` (SQLite's full disk) stopped
                /// renewing for good: the lease ran out while the flash still ran, and a retry flashed
                /// again once the disk was freed (the chaos run's double flashes on a full disk).
                a_renewal_failing_for_good_keeps_renewing_once_the_store_recovers
                => lease::renewal_failing_for_good_keeps_renewing());
            $crate::__http_test!($backend, paused,
                /// Renewal gave up for good when an outage outlasted the lease, although nobody had
                /// reclaimed the record and the store would still extend it.
                renewal_outlasts_an_outage_longer_than_the_lease
                => lease::renewal_outlasts_a_long_outage());
            $crate::__http_test!($backend, paused,
                /// Renewal went on after the handler panicked.
                a_panicking_handler_stops_renewing
                => lease::panicking_handler_stops_renewing());
            $crate::__http_test!($backend, paused,
                /// Under inline execution, a cancelled request (client gone) kept renewing a claim nobody
                /// would finish.
                a_cancelled_inline_handler_stops_renewing
                => lease::cancelled_inline_handler_stops_renewing());
            $crate::__http_test!($backend, paused,
                /// Renewal spawned a task per request, or renewed with renewal off, or renewed a handler
                /// that ended within one interval.
                renewal_spawns_no_task_and_short_or_unrenewed_handlers_cost_no_write
                => lease::renewal_spawns_no_task_and_short_handlers_cost_no_write());
        }

        mod isolation {
            #[allow(unused_imports)]
            use super::*;

            $crate::__http_test!($backend, paused,
                /// B got A's 409/Retry-After while A's record was in flight, or B's handler did not run.
                in_flight_record_of_one_tenant_never_blocks_the_other
                => isolation::in_flight());
            $crate::__http_test!($backend, paused,
                /// B got A's stored response replayed (status, headers, body) for the same key.
                completed_record_of_one_tenant_is_never_replayed_to_the_other
                => isolation::completed());
            $crate::__http_test!($backend, paused,
                /// B's request reclaimed or saw A's failed record.
                failed_record_of_one_tenant_is_never_reclaimed_by_the_other
                => isolation::failed());
            $crate::__http_test!($backend, paused,
                /// B got a mismatch because A had used the key with another body first.
                one_tenants_fingerprint_never_makes_a_mismatch_for_the_other
                => isolation::mismatch());
            $crate::__http_test!($backend, paused,
                /// B reclaimed A's record after its lease expired, or A's retry did not.
                expired_lease_of_one_tenant_is_reclaimed_only_by_that_tenant
                => isolation::reclaimed());
            $crate::__http_test!($backend, paused,
                /// After A's record passed its retention window, B's record and A's new one stayed apart.
                expired_records_never_cross_tenants
                => isolation::expired());
        }

        mod shapes {
            #[allow(unused_imports)]
            use super::*;

            $crate::__http_test!($backend, paused,
                /// An endless SSE stream kept the client waiting for its head, or its retry ran twice.
                an_endless_event_stream_is_not_retained_and_runs_once
                => shapes::endless_stream_runs_once("text/event-stream"));
            $crate::__http_test!($backend, paused,
                /// An endless chunked progress stream (no streaming content type) was buffered forever.
                an_endless_chunked_stream_is_not_retained_and_runs_once
                => shapes::endless_stream_runs_once("text/plain"));
            $crate::__http_test!($backend, paused,
                /// A 5 MiB chunked body or a binary body replayed different bytes or content type.
                large_chunked_and_binary_bodies_replay_byte_identical
                => shapes::large_and_binary_bodies_replay_byte_identical());
            $crate::__http_test!($backend, paused,
                /// A body over max_stored_body was buffered whole, or its retry ran the handler again.
                a_body_over_the_limit_streams_and_is_not_retained
                => shapes::over_the_limit_streams_and_is_not_retained());
            $crate::__http_test!($backend, paused,
                /// Trailers were not stored, so a replay lost them (gRPC's status lives there).
                trailers_are_stored_and_replayed
                => shapes::trailers_are_replayed());
            $crate::__http_test!($backend, paused,
                /// FailOpen ran the handler again over a completed record that does not decode.
                fail_open_never_reruns_a_corrupt_completed_record
                => shapes::fail_open_never_reruns_a_corrupt_record());
            $crate::__http_test!($backend, paused,
                /// A 5xx was stored without an opt-in, or replayed without its record when opted in;
                /// an allowlist stored a header it does not name.
                server_errors_are_stored_only_on_purpose
                => shapes::server_errors_are_stored_only_on_purpose());
            $crate::__http_test!($backend, paused,
                /// A key in the body was not read, a volatile field left out of the fingerprint
                /// still made a mismatch, or the application missed a step or could not edit a replay.
                keys_and_fingerprints_from_the_body
                => shapes::keys_and_fingerprints_from_the_body());
            $crate::__http_test!($backend, paused,
                /// The endless-stream scenario cannot tell the streaming rules from luck: with them off
                /// (no deadline, no streaming content type), the same stream must hold the head back.
                without_the_streaming_rules_an_endless_stream_holds_the_head
                => shapes::endless_stream_without_rules_holds_the_head());
        }

        mod sealed {
            #[allow(unused_imports)]
            use super::*;

            $crate::__http_test!($backend, threaded,
                /// A sealed response did not replay, held the plaintext in the stored bytes, or opened
                /// (or ran the handler again) once moved onto another record or flipped by one byte.
                sealed_round_trip_move_and_flip
                => sealed::round_trip_move_and_flip());
            $crate::__http_test!($backend, threaded,
                /// After a key rotation the old key no longer opened, the newest key did not seal, or a
                /// record sealed by a removed key ran the handler again.
                rotation
                => sealed::rotation());
            $crate::__http_test!($backend, threaded,
                /// An unsealed record was replayed once sealing was on (without `accept_unsealed`), or
                /// refused during a migration that accepts it.
                unsealed_records_are_refused_unless_accepted
                => sealed::unsealed_records_are_refused_unless_accepted());
        }
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __http_test {
    ($backend:expr, paused, $(#[$doc:meta])* $name:ident => $group:ident :: $scenario:ident ($($arg:expr),*)) => {
        $(#[$doc])*
        #[::tokio::test(start_paused = true)]
        async fn $name() {
            let backend: ::std::sync::Arc<dyn $crate::Backend> = ::std::sync::Arc::new($backend);
            let env = $crate::http::HttpEnv::open(backend, ::std::stringify!($name)).await;
            $crate::http::$group::$scenario(env $(, $arg)*).await;
        }
    };
    ($backend:expr, threaded, $(#[$doc:meta])* $name:ident => $group:ident :: $scenario:ident ($($arg:expr),*)) => {
        $(#[$doc])*
        #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            let backend: ::std::sync::Arc<dyn $crate::Backend> = ::std::sync::Arc::new($backend);
            let env = $crate::http::HttpEnv::open(backend, ::std::stringify!($name)).await;
            $crate::http::$group::$scenario(env $(, $arg)*).await;
        }
    };
}
