//! A firmware flash that outlives its lease ran twice: a retry arriving after the lease
//! reclaimed the record while the first flash still ran. Lease renewal, in-flight answers
//! and the bounded wait, on every backend, with a clock the test controls (the store's
//! manual clock and tokio's paused clock, moved together): a 30-minute flash under a 10 s
//! lease runs once while a retry arrives every 3 s; a killed holder is reclaimed within one
//! lease plus one renewal interval; a holder stalled past its lease is fenced when it
//! resumes.

#[path = "../common/mod.rs"]
mod common;

mod backends;
mod scenarios;

use std::sync::atomic::Ordering;
use std::time::Duration;

use idem_core::RecordState;
use idem_http::{HandlerExecution, LeaseRenewal};

use crate::backends::memory;
use crate::scenarios::{
    Firmware, Run, advance, answer, flash_record_id, flash_req, flash_req_with_key, layer, now_ms, settle, start,
};

/// The scenarios of `scenarios.rs` as named tests on one backend factory of `backends.rs`.
macro_rules! lease_tests {
    ($backend:ident) => {
        mod $backend {
            use idem_http::HandlerExecution;

            use crate::backends::$backend as factory;
            use crate::scenarios;

            /// A 30-minute flash under a 10 s lease ran twice, or a retry got anything but
            /// 409 in-flight (with the 2 s poll cap) until the replay.
            #[tokio::test(start_paused = true)]
            async fn a_thirty_minute_flash_under_a_ten_second_lease_runs_once() {
                scenarios::long_flash_runs_once(factory, HandlerExecution::Detached).await;
            }

            /// Inline execution did not renew (the renewal only lived in detached work).
            #[tokio::test(start_paused = true)]
            async fn a_thirty_minute_inline_flash_runs_once() {
                scenarios::long_flash_runs_once(factory, HandlerExecution::Inline).await;
            }

            /// The storm above cannot tell renewal from luck: without renewal it must flash twice.
            #[tokio::test(start_paused = true)]
            async fn without_renewal_the_same_storm_flashes_twice() {
                scenarios::long_flash_runs_twice_without_renewal(factory).await;
            }

            /// A killed holder kept its key blocked past one lease plus one renewal interval.
            #[tokio::test(start_paused = true)]
            async fn a_killed_holder_is_reclaimed_within_one_lease_and_one_interval() {
                scenarios::killed_holder_is_reclaimed_within_one_lease(factory).await;
            }

            /// A holder stalled past its lease (renewal off) completed over the newer attempt.
            #[tokio::test(start_paused = true)]
            async fn a_stalled_holder_without_renewal_is_fenced_when_it_resumes() {
                scenarios::stalled_holder_without_renewal_is_fenced(factory).await;
            }

            /// A holder stalled past its lease (renewal on) flashed after resuming, or never heard.
            #[tokio::test(start_paused = true)]
            async fn a_stalled_holder_with_renewal_stops_before_its_next_step() {
                scenarios::stalled_holder_with_renewal_learns_its_lease_is_lost(factory).await;
            }

            /// A waiting duplicate missed the completion, or ran the handler.
            #[tokio::test(start_paused = true)]
            async fn a_bounded_wait_replays_the_completion() {
                scenarios::bounded_wait_replays_a_completion(factory).await;
            }

            /// A waiting duplicate answered a failed first attempt instead of running again.
            #[tokio::test(start_paused = true)]
            async fn a_bounded_wait_reclaims_a_failed_record() {
                scenarios::bounded_wait_reclaims_a_failure(factory).await;
            }

            /// A waiting duplicate answered before its wait was over, or never.
            #[tokio::test(start_paused = true)]
            async fn a_bounded_wait_ends_with_409_in_flight() {
                scenarios::bounded_wait_times_out_with_409(factory).await;
            }
        }
    };
}

lease_tests!(memory);
lease_tests!(redb);
lease_tests!(sqlite);
// The real servers (127.0.0.1:6379, 127.0.0.1:5432, or IDEM_REDIS_URL / IDEM_POSTGRES_URL);
// the tests fail, never skip, when a server is down.
lease_tests!(redis);
lease_tests!(postgres);

/// A renewal that failed transiently waited for the next interval instead of retrying
/// within the lease, so three failures in a row let a retry reclaim a live flash.
#[tokio::test(start_paused = true)]
async fn transient_renewal_failures_are_retried_within_the_lease() {
    let b = memory().await;
    let fw = Firmware::with_plan([Run::Flash(Duration::from_secs(60))]);
    let app = fw.app(layer(&b));
    let req = flash_req();
    b.store.failing_extends.store(3, Ordering::SeqCst);
    let holder = start(&app, &req);
    settle(&b).await;
    for _ in 0..59 {
        advance(&b, Duration::from_secs(1)).await;
        let retry = start(&app, &req);
        settle(&b).await;
        answer(retry).await.problem(409, "in-flight");
    }
    advance(&b, Duration::from_secs(1)).await;
    assert_eq!(answer(holder).await.status, 201);
    assert_eq!((fw.runs(), b.store.failing_extends.load(Ordering::SeqCst)), (1, 0));
}

/// A renewal refused with a non-retryable `Unavailable` (SQLite's full disk) stopped
/// renewing for good: the lease ran out while the flash still ran, and a retry flashed
/// again once the disk was freed (the chaos run's double flashes on a full disk).
#[tokio::test(start_paused = true)]
async fn a_renewal_failing_for_good_keeps_renewing_once_the_store_recovers() {
    let b = memory().await;
    let fw = Firmware::with_plan([Run::Flash(Duration::from_secs(60))]);
    let app = fw.app(layer(&b));
    let req = flash_req();
    b.store.failing_for_good.store(true, Ordering::SeqCst);
    b.store.failing_extends.store(3, Ordering::SeqCst);
    let holder = start(&app, &req);
    settle(&b).await;
    for _ in 0..59 {
        advance(&b, Duration::from_secs(1)).await;
        let retry = start(&app, &req);
        settle(&b).await;
        answer(retry).await.problem(409, "in-flight");
    }
    advance(&b, Duration::from_secs(1)).await;
    assert_eq!(answer(holder).await.status, 201);
    assert_eq!((fw.runs(), b.store.failing_extends.load(Ordering::SeqCst)), (1, 0));
}

/// Renewal gave up for good when an outage outlasted the lease, although nobody had
/// reclaimed the record and the store would still extend it.
#[tokio::test(start_paused = true)]
async fn renewal_outlasts_an_outage_longer_than_the_lease() {
    let b = memory().await;
    let fw = Firmware::with_plan([Run::Flash(Duration::from_secs(60))]);
    let app = fw.app(layer(&b));
    let req = flash_req();
    // The renewals fail from 3.4 s to 12.5 s: eleven tries within the first lease (3.4 s,
    // then backing off from 25 ms to 1 s until 9.1 s), then the one try at the next
    // interval (12.5 s); the next interval's (15.9 s) succeeds.
    b.store.failing_extends.store(12, Ordering::SeqCst);
    let holder = start(&app, &req);
    settle(&b).await;
    advance(&b, Duration::from_secs(13)).await;
    let lapsed = b.store.record(flash_record_id()).await.unwrap();
    assert!(lapsed.lease_expires_at.0 <= now_ms(&b), "the lease ran out during the outage");
    assert_eq!(b.store.failing_extends.load(Ordering::SeqCst), 0, "the outage is over");
    advance(&b, Duration::from_secs(4)).await;
    let renewed = b.store.record(flash_record_id()).await.unwrap();
    assert!(renewed.lease_expires_at.0 > now_ms(&b), "renewed again once the store answered");
    let retry = start(&app, &req);
    settle(&b).await;
    answer(retry).await.problem(409, "in-flight");
    drop(holder);
}

/// Renewal went on after the handler panicked.
#[tokio::test(start_paused = true)]
async fn a_panicking_handler_stops_renewing() {
    let b = memory().await;
    let fw = Firmware::with_plan([Run::PanicAfter(Duration::from_secs(5))]);
    let app = fw.app(layer(&b));
    let holder = start(&app, &flash_req());
    settle(&b).await;
    advance(&b, Duration::from_secs(6)).await;
    assert!(holder.await.unwrap_err().is_panic(), "the panic goes on up");
    let renewals = b.store.extends();
    assert_eq!(renewals, 1);
    assert_eq!(b.store.record(flash_record_id()).await.unwrap().state, RecordState::Failed);
    advance(&b, Duration::from_secs(30)).await;
    assert_eq!(b.store.extends(), renewals);
}

/// Under inline execution, a cancelled request (client gone) kept renewing a claim nobody
/// would finish.
#[tokio::test(start_paused = true)]
async fn a_cancelled_inline_handler_stops_renewing() {
    let b = memory().await;
    let fw = Firmware::with_plan([Run::Flash(Duration::from_secs(60))]);
    let app = fw.app(layer(&b).with_handler_execution(HandlerExecution::Inline));
    let holder = start(&app, &flash_req());
    settle(&b).await;
    advance(&b, Duration::from_secs(5)).await;
    assert_eq!(b.store.extends(), 1);
    holder.abort();
    settle(&b).await;
    assert_eq!(b.store.record(flash_record_id()).await.unwrap().state, RecordState::Failed, "the drop guard failed it");
    advance(&b, Duration::from_secs(30)).await;
    assert_eq!(b.store.extends(), 1);
}

/// Renewal spawned a task per request, or renewed with renewal off, or renewed a handler
/// that ended within one interval.
#[tokio::test(start_paused = true)]
async fn renewal_spawns_no_task_and_short_or_unrenewed_handlers_cost_no_write() {
    let b = memory().await;
    for renewal in [LeaseRenewal::default(), LeaseRenewal::Off] {
        let fw = Firmware::with_plan([Run::Flash(Duration::from_secs(30))]);
        let app = fw.app(layer(&b).with_lease_renewal(renewal));
        let before = b.store.extends();
        let holder = start(&app, &flash_req_with_key(&format!("{renewal:?}")));
        settle(&b).await;
        advance(&b, Duration::from_secs(15)).await;
        // The holder's task alone (the test body is not a task): its renewal runs inside it.
        assert_eq!(tokio::runtime::Handle::current().metrics().num_alive_tasks(), 1, "{renewal:?}");
        advance(&b, Duration::from_secs(15)).await;
        assert_eq!(answer(holder).await.status, 201);
        let renewals = b.store.extends() - before;
        match renewal {
            LeaseRenewal::Off => assert_eq!(renewals, 0),
            _ => assert_eq!(renewals, 8, "every 3.4 s for 30 s"),
        }
    }
    let fw = Firmware::with_plan([Run::Flash(Duration::from_secs(3))]);
    let app = fw.app(layer(&b));
    let before = b.store.extends();
    let holder = start(&app, &flash_req_with_key("short"));
    settle(&b).await;
    advance(&b, Duration::from_secs(4)).await;
    assert_eq!(answer(holder).await.status, 201);
    assert_eq!(b.store.extends(), before, "a 3 s flash ends before the first renewal at 3.3 s");
}
