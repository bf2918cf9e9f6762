//! Shared fixtures for the HTTP layer tests: a manual clock, a memory store, a store that
//! fails on demand, request builders and response readers. No sockets: every request goes
//! through `tower::ServiceExt::oneshot`.

#![allow(dead_code, unreachable_pub, reason = "each test binary uses a different subset of the fixtures")]

use idem_conformance::{Forward, Forwarding};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use axum::Router;
use axum::body::Body;
use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::BodyExt;
use idem_core::{
    ClaimOutcome, ClaimRequest, Endpoint, FencingToken, IdempotencyKey, JournalWrite, ManualClock, MemoryStore,
    ReclaimOutcome, ReclaimRequest, Record, RecordId, Scope, Store, StoreError, StoredResponse, SweepOutcome,
    UnixMillis,
};
use idem_http::BearerToken;
use tower::ServiceExt;

/// 2027-01-15T08:00:00Z: a fixed, plausible start for every test clock.
pub const T0: UnixMillis = UnixMillis(1_800_000_000_000);

/// A memory store on a manual clock, plus a switchboard of injected faults.
#[derive(Clone, Debug)]
pub struct Env {
    pub clock: ManualClock,
    pub store: Arc<Forwarding<FlakyStore>>,
}

impl Env {
    pub fn new() -> Self {
        let clock = ManualClock::new(T0);
        let memory = MemoryStore::with_clock(Arc::new(clock.clone()));
        Self { store: Arc::new(Forwarding(FlakyStore::new(memory, clock.clone()))), clock }
    }

    pub fn dyn_store(&self) -> Arc<dyn Store> {
        self.store.clone()
    }

    /// The record of `key` sent by bearer `token` to `endpoint` (e.g. `POST /v1/orders`).
    pub async fn record(&self, token: &str, endpoint: &str, key: &str) -> Option<Record> {
        let (method, route) = endpoint.split_once(' ').unwrap();
        let scope = Scope::new(BearerToken::principal_for(token.as_bytes()), Endpoint::new(method, route)).unwrap();
        let id: RecordId = scope.record_id(&IdempotencyKey::parse(key.as_bytes()).unwrap());
        self.store.inner.get(id).await.unwrap()
    }

    pub fn advance_ms(&self, ms: i64) {
        self.clock.advance_ms(ms);
    }

    pub fn advance(&self, d: Duration) {
        self.clock.advance(d);
    }
}

/// Makes the error a store refuses a call with.
pub type Refusal = fn(RecordId, FencingToken) -> StoreError;

/// Delegates to a [`MemoryStore`], failing the operations switched on.
#[derive(Debug)]
pub struct FlakyStore {
    pub inner: MemoryStore,
    clock: ManualClock,
    /// Every operation returns `Unavailable`.
    pub fail_all: AtomicBool,
    /// `complete` returns `Unavailable` (and writes nothing).
    pub fail_complete: AtomicBool,
    /// `reclaim` always loses the compare-and-set (as if another retry won every time).
    pub lose_reclaims: AtomicBool,
    /// The next this many `complete` calls return `Unavailable` and write nothing (a blip).
    pub complete_blips: AtomicUsize,
    /// The next this many `complete` calls write the response, then return `Unavailable`
    /// (the answer was lost on the way back: an ambiguous success).
    pub complete_answers_lost: AtomicUsize,
    /// The next this many `complete` calls are refused with an `Unavailable` the backend
    /// calls not retryable (SQLite's full disk, redb after a latched I/O failure).
    pub complete_outages: AtomicUsize,
    /// The same for `fail`.
    pub fail_outages: AtomicUsize,
    /// Every `complete` is refused with the error this makes (a final refusal).
    pub complete_refusal: std::sync::Mutex<Option<Refusal>>,
    /// `claim` never answers (a stalled server).
    pub stall_claims: AtomicBool,
    /// How many `complete` calls reached the store.
    pub completes: AtomicUsize,
    /// How many `fail` calls reached the store.
    pub fails: AtomicUsize,
    /// How many `reclaim` calls reached the store.
    pub reclaims: AtomicUsize,
    /// Delegate the journal (`journal_put`, `journal_get`) to the memory store. Off by
    /// default: the journal calls are then the trait's defaults (`Unsupported`).
    pub journal: AtomicBool,
    /// The next this many `journal_put` calls return `Unavailable` and write nothing,
    /// reported as not retryable (SQLite's full disk).
    pub journal_put_blips: AtomicUsize,
    /// How many `journal_put` calls reached the store.
    pub journal_puts: AtomicUsize,
}

impl FlakyStore {
    pub fn new(inner: MemoryStore, clock: ManualClock) -> Self {
        Self {
            inner,
            clock,
            fail_all: AtomicBool::new(false),
            fail_complete: AtomicBool::new(false),
            lose_reclaims: AtomicBool::new(false),
            complete_blips: AtomicUsize::new(0),
            complete_answers_lost: AtomicUsize::new(0),
            complete_outages: AtomicUsize::new(0),
            fail_outages: AtomicUsize::new(0),
            complete_refusal: std::sync::Mutex::new(None),
            stall_claims: AtomicBool::new(false),
            completes: AtomicUsize::new(0),
            fails: AtomicUsize::new(0),
            reclaims: AtomicUsize::new(0),
            journal: AtomicBool::new(false),
            journal_put_blips: AtomicUsize::new(0),
            journal_puts: AtomicUsize::new(0),
        }
    }

    fn inner_now(&self) -> UnixMillis {
        idem_core::Clock::now(&self.clock)
    }

    /// Takes one of the refusals `left` still counts, as a permanent outage.
    fn outage(left: &AtomicUsize, op: &'static str) -> Result<(), StoreError> {
        if left.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok() {
            return Err(StoreError::unavailable("flaky", op, false, std::io::Error::other("database or disk is full")));
        }
        Ok(())
    }

    fn down(&self, op: &'static str) -> Result<(), StoreError> {
        if self.fail_all.load(Ordering::SeqCst) {
            return Err(StoreError::unavailable("flaky", op, true, std::io::Error::other("injected outage")));
        }
        Ok(())
    }
}

#[async_trait]
impl Forward for FlakyStore {
    fn inner(&self) -> &dyn Store {
        &self.inner
    }
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        self.down("claim")?;
        if self.stall_claims.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        self.inner.claim(req).await
    }
    async fn reclaim(&self, req: ReclaimRequest) -> Result<ReclaimOutcome, StoreError> {
        self.down("reclaim")?;
        self.reclaims.fetch_add(1, Ordering::SeqCst);
        if self.lose_reclaims.load(Ordering::SeqCst) {
            let current = self.inner.get(req.id).await?;
            return Ok(ReclaimOutcome::Conflict { current, now: self.inner_now() });
        }
        self.inner.reclaim(req).await
    }
    async fn complete(
        &self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<idem_core::Receipt, StoreError> {
        self.completes.fetch_add(1, Ordering::SeqCst);
        self.down("complete")?;
        Self::outage(&self.complete_outages, "complete")?;
        if let Some(refusal) = *self.complete_refusal.lock().unwrap() {
            return Err(refusal(id, token));
        }
        let take = |n: &AtomicUsize| n.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| v.checked_sub(1)).is_ok();
        if take(&self.complete_blips) {
            return Err(StoreError::unavailable("flaky", "complete", true, std::io::Error::other("injected blip")));
        }
        if take(&self.complete_answers_lost) {
            self.inner.complete(id, token, response).await?;
            return Err(StoreError::unavailable("flaky", "complete", true, std::io::Error::other("answer lost")));
        }
        if self.fail_complete.load(Ordering::SeqCst) {
            return Err(StoreError::unavailable(
                "flaky",
                "complete",
                true,
                std::io::Error::other("injected write failure"),
            ));
        }
        self.inner.complete(id, token, response).await
    }
    async fn extend(
        &self,
        id: RecordId,
        token: FencingToken,
        lease_ttl: Duration,
    ) -> Result<idem_core::Receipt, StoreError> {
        self.down("extend")?;
        self.inner.extend(id, token, lease_ttl).await
    }

    async fn fail(&self, id: RecordId, token: FencingToken) -> Result<idem_core::Receipt, StoreError> {
        self.fails.fetch_add(1, Ordering::SeqCst);
        self.down("fail")?;
        Self::outage(&self.fail_outages, "fail")?;
        self.inner.fail(id, token).await
    }
    async fn get(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        self.down("get")?;
        self.inner.get(id).await
    }
    async fn sweep(&self, limit: usize) -> Result<SweepOutcome, StoreError> {
        self.down("sweep")?;
        self.inner.sweep(limit).await
    }
    async fn journal_put(
        &self,
        id: RecordId,
        token: FencingToken,
        name: &str,
        value: Vec<u8>,
        overwrite: bool,
    ) -> Result<JournalWrite, StoreError> {
        if !self.journal.load(Ordering::SeqCst) {
            return Err(StoreError::Unsupported { operation: "journal_put" });
        }
        self.journal_puts.fetch_add(1, Ordering::SeqCst);
        self.down("journal_put")?;
        if self.journal_put_blips.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| v.checked_sub(1)).is_ok() {
            return Err(StoreError::unavailable("flaky", "journal_put", false, std::io::Error::other("disk full")));
        }
        self.inner.journal_put(id, token, name, value, overwrite).await
    }
    async fn journal_get(&self, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        if !self.journal.load(Ordering::SeqCst) {
            return Err(StoreError::Unsupported { operation: "journal_get" });
        }
        self.down("journal_get")?;
        self.inner.journal_get(id, name).await
    }
}

/// A request builder with the usual headers.
#[derive(Clone, Debug)]
pub struct Req {
    method: http::Method,
    uri: String,
    token: Option<String>,
    keys: Vec<Vec<u8>>,
    body: Bytes,
    content_type: Option<String>,
}

pub fn post(uri: &str) -> Req {
    Req::new(http::Method::POST, uri)
}

pub fn put(uri: &str) -> Req {
    Req::new(http::Method::PUT, uri)
}

impl Req {
    pub fn new(method: http::Method, uri: &str) -> Self {
        Self {
            method,
            uri: uri.to_owned(),
            token: Some("tok-p".into()),
            keys: Vec::new(),
            body: Bytes::new(),
            content_type: Some("application/json".into()),
        }
    }

    pub fn token(mut self, token: &str) -> Self {
        self.token = Some(token.to_owned());
        self
    }

    pub fn anonymous(mut self) -> Self {
        self.token = None;
        self
    }

    pub fn key(mut self, key: &str) -> Self {
        self.keys.push(key.as_bytes().to_vec());
        self
    }

    pub fn key_bytes(mut self, key: &[u8]) -> Self {
        self.keys.push(key.to_vec());
        self
    }

    pub fn body(mut self, body: impl Into<Bytes>) -> Self {
        self.body = body.into();
        self
    }

    pub fn build(&self) -> Request<Body> {
        let mut b = Request::builder().method(self.method.clone()).uri(&self.uri);
        if let Some(t) = &self.token {
            b = b.header("authorization", format!("Bearer {t}"));
        }
        for k in &self.keys {
            b = b.header("idempotency-key", http::HeaderValue::from_bytes(k).unwrap());
        }
        if let Some(ct) = &self.content_type {
            b = b.header("content-type", ct);
        }
        b.body(Body::from(self.body.clone())).unwrap()
    }
}

/// A response read whole.
#[derive(Debug)]
pub struct Got {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Got {
    pub async fn read<B>(res: Response<B>) -> Self
    where
        B: http_body::Body<Data = Bytes>,
        B::Error: std::fmt::Debug,
    {
        let (parts, body) = res.into_parts();
        Self { status: parts.status, headers: parts.headers, body: body.collect().await.unwrap().to_bytes() }
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }

    pub fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    pub fn text(&self) -> &str {
        std::str::from_utf8(&self.body).unwrap()
    }

    /// Asserts an RFC 9457 body of `slug` with `status`, and returns it.
    #[track_caller]
    pub fn problem(&self, status: u16, slug: &str) -> serde_json::Value {
        assert_eq!(self.status.as_u16(), status, "status; body: {}", self.text());
        assert_eq!(self.header("content-type"), Some("application/problem+json"), "content-type");
        let v: serde_json::Value = serde_json::from_slice(&self.body).expect("problem body is JSON");
        assert_eq!(v["type"], format!("{}{slug}", idem_http::DEFAULT_TYPE_BASE), "type; body {v}");
        assert_eq!(v["status"], status, "status member");
        assert!(v["title"].as_str().is_some_and(|t| !t.is_empty()), "title");
        assert!(v["detail"].as_str().is_some_and(|t| !t.is_empty()), "detail");
        v
    }

    pub fn retry_after(&self) -> u64 {
        self.header("retry-after").expect("Retry-After").parse().unwrap()
    }
}

/// Sends one request through `app`.
pub async fn send(app: &Router, req: &Req) -> Got {
    Got::read(app.clone().oneshot(req.build()).await.unwrap()).await
}

/// Counts handler runs.
#[derive(Clone, Debug, Default)]
pub struct Counter(pub Arc<AtomicUsize>);

impl Counter {
    pub fn bump(&self) -> usize {
        self.0.fetch_add(1, Ordering::SeqCst) + 1
    }
    pub fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

/// Holds a handler until the test releases it; tells the test when the handler started.
#[derive(Clone, Debug)]
pub struct Gate {
    started: Arc<tokio::sync::Semaphore>,
    release: Arc<tokio::sync::Semaphore>,
}

impl Default for Gate {
    fn default() -> Self {
        Self { started: Arc::new(tokio::sync::Semaphore::new(0)), release: Arc::new(tokio::sync::Semaphore::new(0)) }
    }
}

impl Gate {
    /// Called by the handler: signal "started", then wait to be released.
    pub async fn hold(&self) {
        self.started.add_permits(1);
        self.release.acquire().await.unwrap().forget();
    }
    /// Called by the test: wait until a handler has started.
    pub async fn started(&self) {
        self.started.acquire().await.unwrap().forget();
    }
    /// Called by the test: let one held handler go on.
    pub fn release(&self) {
        self.release.add_permits(1);
    }
}

/// Starts `req` on `app` and polls it once, far enough to hold the claim (the handler must
/// then wait on something forever), then leaks the future: the process "died" mid-handler,
/// so neither complete nor fail ever runs and no drop guard fires. Under the default
/// `HandlerExecution::Detached` the handler's task is left blocked, as in a hung process.
pub async fn start_and_crash(app: &Router, req: &Req) {
    let mut fut = Box::pin(app.clone().oneshot(req.build()));
    assert!(futures::poll!(fut.as_mut()).is_pending(), "the handler should be blocked");
    std::mem::forget(fut);
    // A detached handler's task was only spawned by that poll: let it run up to its wait,
    // as the inline handler did inside the poll. Yields, never sleeps.
    for _ in 0..8 {
        tokio::task::yield_now().await;
    }
}

/// Yields to the runtime until `cond` holds (for work the layer spawns, such as the drop
/// guard's `fail`). Never sleeps; gives up after many turns.
pub async fn eventually<F, Fut>(mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    for _ in 0..10_000 {
        if cond().await {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("condition never held");
}

/// What the scripted handler does on one call (default: [`Step::Created`]).
#[derive(Clone, Debug)]
pub enum Step {
    /// 201 with `Location: <path>/<call>`, an `ETag`, JSON, a `Set-Cookie` and a request id.
    Created,
    /// This status with a small JSON body.
    Status(u16),
    /// Wait on the gate, then [`Step::Created`].
    Hold(Gate),
    /// Panic inside the handler.
    Panic,
    /// Wait on the gate, then panic.
    HoldThenPanic(Gate),
    /// 201 with a body of this many bytes (a repeating pattern).
    Big(usize),
    /// 201 with a streamed body of these chunks.
    Stream(Vec<&'static str>),
    /// 201 with a streamed body that fails after its first chunk.
    BrokenStream,
    /// This status, with a [`idem_http::ResponseCaching`] override.
    Override(u16, idem_http::ResponseCaching),
}

/// The queue of steps the handler follows, one per call.
#[derive(Clone, Debug, Default)]
pub struct Script(Arc<std::sync::Mutex<std::collections::VecDeque<Step>>>);

impl Script {
    pub fn then(&self, step: Step) -> &Self {
        self.0.lock().unwrap().push_back(step);
        self
    }
    fn next(&self) -> Step {
        self.0.lock().unwrap().pop_front().unwrap_or(Step::Created)
    }
}

/// `Policy::default()` with `change` applied: the record rules of one test.
pub fn policy(change: impl FnOnce(&mut idem_http::Policy)) -> idem_http::Policy {
    let mut policy = idem_http::Policy::default();
    change(&mut policy);
    policy
}

/// The test API: one scripted handler behind several routes, wrapped in `layer`.
pub fn app(layer: idem_http::IdempotencyLayer, counter: &Counter, script: &Script) -> Router {
    use axum::routing::{post, put};
    let (c, s) = (counter.clone(), script.clone());
    let handler = move |req: Request<Body>| {
        let (c, s) = (c.clone(), s.clone());
        async move { respond(&c, &s, req).await }
    };
    Router::new()
        .route("/v1/orders", post(handler.clone()).get(handler.clone()).fallback(handler.clone()))
        .route("/v1/projects", post(handler.clone()))
        .route("/v1/applications", post(handler.clone()))
        .route("/v1/workers/{id}/reboot", post(handler.clone()))
        .route("/tickets/{id}", put(handler))
        .layer(layer)
}

async fn respond(counter: &Counter, script: &Script, req: Request<Body>) -> Response<Body> {
    let call = counter.bump();
    let path = req.uri().path().to_owned();
    let token = req.extensions().get::<idem_http::IdempotencyContext>().map(|c| c.token().0);
    let created = |body: Body| {
        Response::builder()
            .status(201)
            .header("location", format!("{path}/{call}"))
            .header("etag", format!("\"v{call}\""))
            .header("content-type", "application/json")
            .header("set-cookie", format!("session={call}"))
            .header("date", "Thu, 01 Jan 2026 00:00:00 GMT")
            .header("x-request-id", format!("req-{call}"))
            .body(body)
            .unwrap()
    };
    let json = || Body::from(serde_json::json!({ "call": call, "path": path, "token": token }).to_string());
    match script.next() {
        Step::Created => created(json()),
        Step::Status(code) => Response::builder()
            .status(code)
            .header("content-type", "application/json")
            .header("retry-after", "2")
            .body(Body::from(serde_json::json!({ "call": call, "status": code }).to_string()))
            .unwrap(),
        Step::Hold(gate) => {
            gate.hold().await;
            created(json())
        }
        Step::Panic => panic!("handler panicked on purpose (call {call})"),
        Step::HoldThenPanic(gate) => {
            gate.hold().await;
            panic!("handler panicked on purpose after waiting (call {call})")
        }
        Step::Big(n) => {
            let body: Vec<u8> = (0..n).map(|i| b"0123456789abcdef"[(i + call) % 16]).collect();
            created(Body::from(body))
        }
        Step::Stream(chunks) => created(Body::from_stream(futures::stream::iter(
            chunks.into_iter().map(|c| Ok::<_, std::io::Error>(Bytes::from_static(c.as_bytes()))),
        ))),
        Step::Override(code, caching) => {
            let mut res = Response::builder()
                .status(code)
                .body(Body::from(serde_json::json!({ "call": call, "status": code }).to_string()))
                .unwrap();
            res.extensions_mut().insert(caching);
            res
        }
        Step::BrokenStream => created(Body::from_stream(futures::stream::iter(vec![
            Ok(Bytes::from_static(b"{\"partial\":")),
            Err(std::io::Error::other("upstream reset")),
        ]))),
    }
}
