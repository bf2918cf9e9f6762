//! A firmware flash that outlives its lease ran twice: a retry arriving after the lease
//! reclaimed the record while the first flash still ran. Lease renewal, in-flight answers
//! and the bounded wait, with a clock the test controls (the store's manual clock and
//! tokio's paused clock, moved together): a 30-minute flash under a 10 s lease runs once
//! while a retry arrives every 3 s; a killed holder is reclaimed within one lease plus one
//! renewal interval; a holder stalled past its lease is fenced when it resumes; renewal
//! rides out store outages and stops with the handler.
//!
//! Time: the store's [`idem_core::ManualClock`] and tokio's paused clock move together,
//! only through `advance`, in steps of `STEP` (100 ms); after each step every task that came due
//! runs and every store call it made finishes (`settle`) before time moves again.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Router};
use futures::task::AtomicWaker;
use http::StatusCode;
use idem_core::{Endpoint, IdempotencyKey, Record, RecordId, RecordState, Scope};
use idem_http::{BearerToken, HandlerExecution, IdempotencyContext, IdempotencyLayer, LeaseRenewal, Problem};
use tokio::task::JoinHandle;

use super::HttpEnv;
use super::fixtures::{Got, Req, policy, post as post_req, send};

/// The lease every scenario runs under.
pub(crate) const LEASE: Duration = Duration::from_secs(10);
/// The default renewal interval for [`LEASE`] (lease / 3), ms.
pub(crate) const INTERVAL_MS: i64 = 3_333;
/// How far time moves at once: renewal timers fire within one step of their deadline.
pub(crate) const STEP: Duration = Duration::from_millis(100);

const ROUTE: &str = "/v1/workers/{id}/firmware";
const PATH: &str = "/v1/workers/7/firmware";
const BEARER: &str = "ops";
const KEY: &str = "flash-7-fw-2.4.1";

/// The one firmware flash the scenarios retry.
pub(crate) fn flash_req() -> Req {
    flash_req_with_key(KEY)
}

/// The flash under another idempotency key (another operation).
pub(crate) fn flash_req_with_key(key: &str) -> Req {
    post_req(PATH).token(BEARER).key(key).body(r#"{"image":"fw-2.4.1"}"#)
}

/// The record of [`flash_req`].
pub(crate) fn flash_record_id() -> RecordId {
    let scope = Scope::new(BearerToken::principal_for(BEARER.as_bytes()), Endpoint::new("POST", ROUTE)).unwrap();
    scope.record_id(&IdempotencyKey::parse(KEY.as_bytes()).unwrap())
}

/// The layer every scenario starts from: the backend's store, a 10 s lease.
pub(crate) fn layer(b: &HttpEnv) -> IdempotencyLayer {
    IdempotencyLayer::new(b.dyn_store()).with_policy(policy(|p| p.lease_ttl = LEASE))
}

/// Moves the store clock and tokio's clock forward by `d` together, one [`STEP`] at a
/// time; the store clock first, so a renewal the step's timers fire reads the new time.
pub(crate) async fn advance(b: &HttpEnv, d: Duration) {
    let mut left = d;
    while !left.is_zero() {
        let step = left.min(STEP);
        b.clock.advance(step);
        tokio::time::advance(step).await;
        settle(b).await;
        left -= step;
    }
}

/// Lets every task that is ready run, and every store call they started finish, until
/// nothing is left to do at this instant. Yields, never sleeps (paused time stays put:
/// tokio does not auto-advance while the store's blocking calls run).
pub(crate) async fn settle(b: &HttpEnv) {
    let started = std::time::Instant::now();
    let mut quiet = 0;
    while quiet < 16 {
        tokio::task::yield_now().await;
        if b.store.pending() == 0 {
            quiet += 1;
        } else {
            quiet = 0;
            assert!(started.elapsed() < Duration::from_secs(60), "{}: a store call never finished", b.name);
        }
    }
}

/// The store clock, ms.
pub(crate) fn now_ms(b: &HttpEnv) -> i64 {
    b.clock.now_ms()
}

/// Starts `req` on `app` as a task of its own (a client's attempt).
pub(crate) fn start(app: &Router, req: &Req) -> JoinHandle<Got> {
    let (app, req) = (app.clone(), req.clone());
    tokio::spawn(async move { send(&app, &req).await })
}

/// The answer of a finished attempt.
pub(crate) async fn answer(attempt: JoinHandle<Got>) -> Got {
    assert!(attempt.is_finished(), "the attempt is still running");
    attempt.await.expect("attempt task")
}

/// What one handler run does.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Run {
    /// Flashes for this long (a timer), then 201.
    Flash(Duration),
    /// Works for this long, then answers this status without flashing.
    FailAfter(Duration, u16),
    /// Works for this long, then panics.
    PanicAfter(Duration),
    /// Works for up to this long, stopping early once the lease is lost, then flashes in a
    /// resumable step (which refuses to start after a lost lease).
    Careful(Duration),
}

/// A BMC whose firmware flash must never run twice, behind the layer.
#[derive(Clone, Debug, Default)]
pub(crate) struct Firmware {
    runs: Arc<AtomicUsize>,
    flashes: Arc<AtomicUsize>,
    plan: Arc<Mutex<VecDeque<Run>>>,
}

impl Firmware {
    /// A BMC whose handler runs follow `plan`, then flash for 1 s.
    pub(crate) fn with_plan(plan: impl IntoIterator<Item = Run>) -> Self {
        Self { plan: Arc::new(Mutex::new(plan.into_iter().collect())), ..Self::default() }
    }

    /// Handler runs so far.
    pub(crate) fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }

    /// Flashes that finished.
    pub(crate) fn flashes(&self) -> usize {
        self.flashes.load(Ordering::SeqCst)
    }

    pub(crate) fn app(&self, layer: IdempotencyLayer) -> Router {
        let fw = self.clone();
        Router::new()
            .route(
                ROUTE,
                post(move |Extension(ctx): Extension<IdempotencyContext>| {
                    let fw = fw.clone();
                    async move { fw.handle(ctx).await }
                }),
            )
            .layer(layer)
    }

    async fn handle(&self, ctx: IdempotencyContext) -> Response {
        let run = self.runs.fetch_add(1, Ordering::SeqCst) + 1;
        let plan = self.plan.lock().unwrap().pop_front().unwrap_or(Run::Flash(Duration::from_secs(1)));
        let body = serde_json::json!({ "run": run, "token": ctx.token().0 }).to_string();
        match plan {
            Run::Flash(d) => {
                tokio::time::sleep(d).await;
                self.flashes.fetch_add(1, Ordering::SeqCst);
                (StatusCode::CREATED, body).into_response()
            }
            Run::FailAfter(d, status) => {
                tokio::time::sleep(d).await;
                (StatusCode::from_u16(status).unwrap(), body).into_response()
            }
            Run::PanicAfter(d) => {
                tokio::time::sleep(d).await;
                panic!("the flash tool crashed (run {run})")
            }
            Run::Careful(d) => {
                tokio::select! {
                    () = tokio::time::sleep(d) => {}
                    () = ctx.lease_lost() => assert!(ctx.is_lease_lost()),
                }
                let flashes = Arc::clone(&self.flashes);
                let flashed = ctx
                    .resumable()
                    .step("flash", |_| async move {
                        flashes.fetch_add(1, Ordering::SeqCst);
                        Ok::<_, std::convert::Infallible>(run)
                    })
                    .await;
                match flashed {
                    Ok(_) => (StatusCode::CREATED, body).into_response(),
                    Err(e) => Problem::from_step_error(&e).expect("a store-side step error").into_response(),
                }
            }
        }
    }
}

/// Stops and kills a task's future as a process would be: `pause` stops polling it (a
/// stopped or stalled process), `resume` polls it again, `kill` stops it for good and makes
/// its drop run no destructor at all (no drop guard, no detach, no renewal: SIGKILL).
#[derive(Clone, Debug, Default)]
pub(crate) struct Process {
    paused: Arc<AtomicBool>,
    killed: Arc<AtomicBool>,
    waker: Arc<AtomicWaker>,
}

impl Process {
    /// Runs `fut` as a task under this control.
    pub(crate) fn spawn<F>(&self, fut: F) -> JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        tokio::spawn(Controlled { inner: Some(Box::pin(fut)), ctl: self.clone() })
    }

    pub(crate) fn pause(&self) {
        self.paused.store(true, Ordering::SeqCst);
    }

    pub(crate) fn resume(&self) {
        self.paused.store(false, Ordering::SeqCst);
        self.waker.wake();
    }

    /// Kills the process running `task`: it is never polled again, and aborting its task
    /// drops nothing of its state.
    pub(crate) fn kill<T>(&self, task: &JoinHandle<T>) {
        self.killed.store(true, Ordering::SeqCst);
        self.pause();
        task.abort();
    }
}

struct Controlled<F> {
    inner: Option<Pin<Box<F>>>,
    ctl: Process,
}

impl<F: Future> Future for Controlled<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        self.ctl.waker.register(cx.waker());
        if self.ctl.paused.load(Ordering::SeqCst) {
            return Poll::Pending;
        }
        match self.inner.as_mut() {
            Some(inner) => inner.as_mut().poll(cx),
            None => Poll::Pending,
        }
    }
}

impl<F> Drop for Controlled<F> {
    fn drop(&mut self) {
        if self.ctl.killed.load(Ordering::SeqCst) {
            // A killed process runs no destructor: its memory just goes away.
            std::mem::forget(self.inner.take());
        }
    }
}

/// What the retries of one long flash got.
#[derive(Debug)]
pub(crate) struct Storm {
    /// Retries answered 409 `in-flight`, and each answer's `Retry-After`.
    pub(crate) in_flight: Vec<u64>,
    /// Retries that ran the handler (they claimed or reclaimed the record).
    pub(crate) ran: usize,
    /// Retries answered anything else: (status, body).
    pub(crate) other: Vec<(u16, String)>,
    /// The first attempt's answer.
    pub(crate) holder: Got,
    /// A retry after the first attempt finished.
    pub(crate) last: Got,
    /// The record after that retry.
    pub(crate) record: Record,
}

/// A 30-minute flash under a 10 s lease, retried every 3 s until it finished.
pub(crate) async fn thirty_minute_flash(b: &HttpEnv, layer: IdempotencyLayer) -> (Storm, Firmware) {
    let fw = Firmware::with_plan([Run::Flash(Duration::from_secs(30 * 60))]);
    let app = fw.app(layer);
    let req = flash_req();
    let holder = start(&app, &req);
    settle(b).await;
    assert_eq!(fw.runs(), 1, "{}: the first attempt runs the flash", b.name);
    let (mut in_flight, mut other, mut running) = (Vec::new(), Vec::new(), Vec::new());
    while !holder.is_finished() {
        advance(b, Duration::from_secs(3)).await;
        if holder.is_finished() {
            break;
        }
        let retry = start(&app, &req);
        settle(b).await;
        if !retry.is_finished() {
            // Still running after every store call settled: it holds a claim and flashes.
            running.push(retry);
            continue;
        }
        let got = answer(retry).await;
        if got.status == 409 && got.header("content-type") == Some("application/problem+json") {
            got.problem(409, "in-flight");
            in_flight.push(got.retry_after());
        } else {
            other.push((got.status.as_u16(), got.text().to_owned()));
        }
    }
    let holder = answer(holder).await;
    let last = send(&app, &req).await;
    let record = b.store.record(flash_record_id()).await.expect("the record lives");
    let ran = running.len();
    for r in running {
        r.abort();
    }
    (Storm { in_flight, ran, other, holder, last, record }, fw)
}

/// Renewal on: the flash runs once; every retry during the 30 minutes gets 409 `in-flight`
/// with the 2 s poll interval, then the replay; renewal stops with the handler.
pub async fn long_flash_runs_once(b: HttpEnv, execution: HandlerExecution) {
    let (storm, fw) = thirty_minute_flash(&b, layer(&b).with_handler_execution(execution)).await;
    let name = b.name;
    assert_eq!((fw.runs(), fw.flashes(), storm.ran), (1, 1, 0), "{name}: one flash, no retry ran it: {storm:?}");
    assert!(storm.other.is_empty(), "{name}: every retry during the flash was in-flight: {:?}", storm.other);
    // 30 minutes, a retry every 3 s, the last one due as the flash ends.
    assert_eq!(storm.in_flight.len(), 599, "{name}");
    assert!(storm.in_flight.iter().all(|&s| s == 2), "{name}: Retry-After is the 2 s cap: {:?}", storm.in_flight);
    assert_eq!(storm.holder.status, 201, "{name}");
    assert!(storm.last.replayed(), "{name}");
    assert_eq!(storm.last.body, storm.holder.body, "{name}: the replay is the flash's own answer");
    assert_eq!(storm.record.state, RecordState::Completed, "{name}");
    // About one renewal per lease / 3 (timers fire on 100 ms steps: every 3.4 s).
    let renewals = b.store.extends();
    assert!(
        (1_800_000 / 3_400 - 1..=1_800_000 / INTERVAL_MS as usize).contains(&renewals),
        "{name}: {renewals} renewals"
    );
    advance(&b, Duration::from_secs(30)).await;
    assert_eq!(b.store.extends(), renewals, "{name}: renewal stopped when the handler ended");
}

/// Renewal off: the same storm runs the flash again once the lease has passed, so the
/// test above fails without renewal.
pub async fn long_flash_runs_twice_without_renewal(b: HttpEnv) {
    let (storm, fw) = thirty_minute_flash(&b, layer(&b).with_lease_renewal(LeaseRenewal::Off)).await;
    assert!(storm.ran >= 1 && fw.runs() >= 2, "{}: a retry after the lease ran the flash again: {storm:?}", b.name);
    // Retries 1 to 3 (3 s to 9 s) found the lease fresh; the fourth (12 s) reclaimed.
    assert_eq!(&storm.in_flight[..3], &[2, 2, 1][..], "{}", b.name);
    assert_eq!(b.store.extends(), 0, "{}: nothing renews", b.name);
}

/// The holder is killed mid-flash: renewal dies with it, and a retry reclaims the record
/// once the lease it last renewed runs out: within one lease plus one renewal interval of
/// the kill, never before the lease's end.
pub async fn killed_holder_is_reclaimed_within_one_lease(b: HttpEnv) {
    let fw = Firmware::with_plan([Run::Flash(Duration::from_secs(30 * 60)), Run::Flash(Duration::from_secs(5))]);
    let app = fw.app(layer(&b));
    let req = flash_req();
    let process = Process::default();
    let holder = process.spawn({
        let (app, req) = (app.clone(), req.clone());
        async move { send(&app, &req).await }
    });
    settle(&b).await;
    advance(&b, Duration::from_secs(61)).await;
    let name = b.name;
    assert!(b.store.extends() >= 17, "{name}: renewed while alive: {}", b.store.extends());
    let before = b.store.record(flash_record_id()).await.unwrap();
    let killed_at = now_ms(&b);
    process.kill(&holder);
    settle(&b).await;

    let mut reclaimed_at = None;
    for _ in 0..30 {
        advance(&b, Duration::from_secs(1)).await;
        let retry = start(&app, &req);
        settle(&b).await;
        if !retry.is_finished() {
            reclaimed_at = Some((now_ms(&b), retry));
            break;
        }
        let got = answer(retry).await;
        got.problem(409, "in-flight");
    }
    let (at, retry) = reclaimed_at.unwrap_or_else(|| panic!("{name}: no retry reclaimed within 30 s of the kill"));
    assert!(
        at >= before.lease_expires_at.0,
        "{name}: reclaimed at {at}, before the lease's end {}",
        before.lease_expires_at
    );
    assert!(
        at - killed_at <= LEASE.as_millis() as i64 + INTERVAL_MS,
        "{name}: reclaimed {} ms after the kill",
        at - killed_at
    );
    assert_eq!(fw.runs(), 2, "{name}");
    let record = b.store.record(flash_record_id()).await.unwrap();
    assert_eq!((record.state, record.token), (RecordState::InFlight, before.token.next()), "{name}");
    advance(&b, Duration::from_secs(6)).await;
    let got = answer(retry).await;
    assert_eq!((got.status.as_u16(), got.replayed()), (201, false), "{name}");
    let replay = send(&app, &req).await;
    assert!(replay.replayed() && replay.body == got.body, "{name}");
}

/// Renewal off: a holder stalled past its lease loses the record to a retry; when it
/// resumes, its late `complete` is fenced and the record keeps the retry's outcome. (Two
/// flashes: without renewal a stall is a double execution; the fence only keeps the
/// record straight.)
pub async fn stalled_holder_without_renewal_is_fenced(b: HttpEnv) {
    let fw = Firmware::with_plan([Run::Flash(Duration::from_secs(20)), Run::Flash(Duration::from_secs(1))]);
    let app = fw.app(layer(&b).with_lease_renewal(LeaseRenewal::Off));
    let req = flash_req();
    let process = Process::default();
    let holder = process.spawn({
        let (app, req) = (app.clone(), req.clone());
        async move { send(&app, &req).await }
    });
    settle(&b).await;
    let name = b.name;
    let first = b.store.record(flash_record_id()).await.unwrap();
    advance(&b, Duration::from_secs(2)).await;
    process.pause();
    advance(&b, Duration::from_secs(10)).await;

    let retry = start(&app, &req);
    settle(&b).await;
    assert_eq!(fw.runs(), 2, "{name}: the lease passed, a retry reclaimed and flashes");
    advance(&b, Duration::from_secs(2)).await;
    let retried = answer(retry).await;
    assert_eq!((retried.status.as_u16(), retried.replayed()), (201, false), "{name}");
    let done = b.store.record(flash_record_id()).await.unwrap();
    assert_eq!((done.state, done.token), (RecordState::Completed, first.token.next()), "{name}");

    process.resume();
    advance(&b, Duration::from_secs(10)).await;
    let late = holder.await.expect("holder task");
    assert_eq!(late.status, 201, "{name}: the stalled attempt still answers its own client");
    assert_ne!(late.body, retried.body, "{name}");
    let after = b.store.record(flash_record_id()).await.unwrap();
    assert_eq!(
        (after.state, after.token, after.response.as_ref().map(|r| r.body_bytes().unwrap().unwrap().into_owned())),
        (RecordState::Completed, done.token, Some(retried.body.to_vec())),
        "{name}: the late complete changed nothing"
    );
    let replay = send(&app, &req).await;
    assert!(replay.replayed() && replay.body == retried.body, "{name}");
    assert_eq!(fw.flashes(), 2, "{name}");
}

/// Renewal on: a holder stalled past its lease (its renewal stalls with it) learns on
/// resuming that the lease is lost: `lease_lost` resolves, its resumable step refuses to
/// start, and nothing it writes lands. One flash in all.
pub async fn stalled_holder_with_renewal_learns_its_lease_is_lost(b: HttpEnv) {
    let fw = Firmware::with_plan([Run::Careful(Duration::from_secs(60)), Run::Careful(Duration::from_secs(5))]);
    let app = fw.app(layer(&b));
    let req = flash_req();
    let process = Process::default();
    let holder = process.spawn({
        let (app, req) = (app.clone(), req.clone());
        async move { send(&app, &req).await }
    });
    settle(&b).await;
    advance(&b, Duration::from_secs(5)).await;
    let name = b.name;
    assert_eq!(b.store.extends(), 1, "{name}: renewed once in 5 s");
    let first = b.store.record(flash_record_id()).await.unwrap();
    process.pause();
    advance(&b, Duration::from_secs(20)).await;

    let retry = start(&app, &req);
    settle(&b).await;
    assert_eq!(fw.runs(), 2, "{name}: the stalled holder's lease passed; a retry reclaimed");
    advance(&b, Duration::from_secs(6)).await;
    let retried = answer(retry).await;
    assert_eq!((retried.status.as_u16(), retried.replayed()), (201, false), "{name}");
    let done = b.store.record(flash_record_id()).await.unwrap();
    assert_eq!((done.state, done.token), (RecordState::Completed, first.token.next()), "{name}");

    process.resume();
    settle(&b).await;
    let late = holder.await.expect("holder task");
    let problem = late.problem(409, "in-flight");
    assert!(problem["detail"].as_str().unwrap().contains("lost its lease"), "{name}: {problem}");
    assert_eq!(fw.flashes(), 1, "{name}: the stalled holder did not flash");
    let after = b.store.record(flash_record_id()).await.unwrap();
    assert_eq!((after.state, after.token, after.response), (done.state, done.token, done.response), "{name}");
}

/// Bounded wait, first outcome: the first attempt completes while the duplicate waits,
/// and the duplicate gets the replay as soon as a read sees it.
pub async fn bounded_wait_replays_a_completion(b: HttpEnv) {
    let fw = Firmware::with_plan([Run::Flash(Duration::from_secs(3))]);
    let app = fw.app(layer(&b).with_in_flight_wait(Some(Duration::from_secs(10))));
    let req = flash_req();
    let holder = start(&app, &req);
    settle(&b).await;
    advance(&b, Duration::from_secs(1)).await;
    let started = now_ms(&b);
    let (waiter, at) = run_until_finished(&b, start(&app, &req)).await;
    let name = b.name;
    let (first, got) = (answer(holder).await, answer(waiter).await);
    assert!(got.replayed() && got.body == first.body && got.status == 201, "{name}: {got:?}");
    assert_eq!(fw.runs(), 1, "{name}");
    // The flash ended 2 s into the wait; the reads are at most 500 ms apart.
    assert!((2_000..=2_600).contains(&(at - started)), "{name}: answered after {} ms", at - started);
}

/// Bounded wait, second outcome: the first attempt fails while the duplicate waits; the
/// duplicate reclaims and runs the handler, as any retry of a failed record would.
pub async fn bounded_wait_reclaims_a_failure(b: HttpEnv) {
    let fw = Firmware::with_plan([Run::FailAfter(Duration::from_secs(3), 503), Run::Flash(Duration::from_secs(1))]);
    let app = fw.app(layer(&b).with_in_flight_wait(Some(Duration::from_secs(10))));
    let req = flash_req();
    let holder = start(&app, &req);
    settle(&b).await;
    advance(&b, Duration::from_secs(1)).await;
    let (waiter, _) = run_until_finished(&b, start(&app, &req)).await;
    let name = b.name;
    assert_eq!(answer(holder).await.status, 503, "{name}");
    let got = answer(waiter).await;
    assert_eq!((got.status.as_u16(), got.replayed()), (201, false), "{name}: {}", got.text());
    assert_eq!((fw.runs(), fw.flashes()), (2, 1), "{name}");
    let record = b.store.record(flash_record_id()).await.unwrap();
    assert_eq!(record.state, RecordState::Completed, "{name}");
}

/// Bounded wait, third outcome: the first attempt outlasts the wait; the duplicate gets the
/// usual 409 once the wait is over, not before.
pub async fn bounded_wait_times_out_with_409(b: HttpEnv) {
    let fw = Firmware::with_plan([Run::Flash(Duration::from_secs(30))]);
    let app = fw.app(layer(&b).with_in_flight_wait(Some(Duration::from_secs(5))));
    let req = flash_req();
    let _holder = start(&app, &req);
    settle(&b).await;
    advance(&b, Duration::from_secs(1)).await;
    let started = now_ms(&b);
    let (waiter, at) = run_until_finished(&b, start(&app, &req)).await;
    let name = b.name;
    let got = answer(waiter).await;
    got.problem(409, "in-flight");
    assert_eq!(got.retry_after(), 2, "{name}");
    assert_eq!(at - started, 5_000, "{name}: answered when the 5 s wait was over");
    assert_eq!(fw.runs(), 1, "{name}");
}

/// Advances time step by step until `attempt` finished (at most 60 s); returns it with the
/// store time it finished at.
pub(crate) async fn run_until_finished(b: &HttpEnv, attempt: JoinHandle<Got>) -> (JoinHandle<Got>, i64) {
    settle(b).await;
    for _ in 0..600 {
        if attempt.is_finished() {
            return (attempt, now_ms(b));
        }
        advance(b, STEP).await;
    }
    panic!("{}: the attempt did not finish within 60 s", b.name);
}

/// A renewal that failed transiently waited for the next interval instead of retrying
/// within the lease, so three failures in a row let a retry reclaim a live flash.
pub async fn transient_renewal_failures_are_retried(b: HttpEnv) {
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
pub async fn renewal_failing_for_good_keeps_renewing(b: HttpEnv) {
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
pub async fn renewal_outlasts_a_long_outage(b: HttpEnv) {
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
pub async fn panicking_handler_stops_renewing(b: HttpEnv) {
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
pub async fn cancelled_inline_handler_stops_renewing(b: HttpEnv) {
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
pub async fn renewal_spawns_no_task_and_short_handlers_cost_no_write(b: HttpEnv) {
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
