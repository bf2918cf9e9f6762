//! The wrapper that keeps a scenario's paused tokio clock still while a store works.
//!
//! Each timed scenario runs on a current-thread runtime with paused time: tokio's clock
//! moves only when the scenario advances it (together with the store's [`ManualClock`]),
//! so renewal timers fire at exactly the simulated moments. A paused runtime also moves
//! its clock on its own whenever it has nothing to do but wait for a timer
//! ("auto-advance"), which would let renewal timers run ahead of the store clock while a
//! store call waits for a disk or a socket. [`Frozen`] prevents that: every store call
//! runs inside `spawn_blocking` (tokio does not auto-advance while a blocking task runs),
//! on a separate real-time runtime where the store's own I/O, pools and timeouts live.
//!
//! [`ManualClock`]: idem_core::ManualClock

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use idem_core::{
    ClaimOutcome, ClaimRequest, FencingToken, JournalWrite, ListFilter, Listing, Receipt, ReclaimOutcome,
    ReclaimRequest, Record, RecordId, Store, StoreError, StoredResponse, SweepOutcome,
};

use crate::Forward;

/// The real-time runtime every store of the HTTP scenarios lives on, for the whole test
/// binary (never dropped: dropping a runtime inside a test's async context panics, and
/// pools opened on it must outlive every scenario that uses them).
fn io() -> &'static tokio::runtime::Runtime {
    static IO: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    IO.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .thread_name("idem-http-scenario-io")
            .build()
            .expect("io runtime")
    })
}

/// Runs `work` on the store runtime without letting the caller's paused clock move.
pub(crate) async fn on_io<T: Send + 'static>(work: impl Future<Output = T> + Send + 'static) -> T {
    tokio::task::spawn_blocking(move || io().block_on(work)).await.expect("store work panicked")
}

/// A store whose every call runs on a real-time runtime of its own inside
/// `spawn_blocking`, counting calls under way and `extend` calls, and failing renewals on
/// demand. Wrap it in [`crate::Forwarding`] to get a [`Store`].
pub struct Frozen {
    inner: Arc<dyn Store>,
    /// Store calls under way: a scenario waits for zero before it moves time again.
    pending: AtomicUsize,
    /// `extend` calls that reached the wrapper.
    extends: AtomicUsize,
    /// The next this many `extend` calls fail with an `Unavailable` (and write nothing).
    pub failing_extends: AtomicUsize,
    /// Whether the injected `extend` failures are non-retryable (a full disk) instead of
    /// retryable.
    pub failing_for_good: AtomicBool,
}

impl fmt::Debug for Frozen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Frozen").field("inner", &self.inner).finish_non_exhaustive()
    }
}

/// Decrements the pending count when a call ends, also when its future is dropped.
struct Pending<'a>(&'a AtomicUsize);

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Frozen {
    /// Wraps `inner`.
    #[must_use]
    pub fn new(inner: Arc<dyn Store>) -> Self {
        Self {
            inner,
            pending: AtomicUsize::new(0),
            extends: AtomicUsize::new(0),
            failing_extends: AtomicUsize::new(0),
            failing_for_good: AtomicBool::new(false),
        }
    }

    /// Store calls under way.
    #[must_use]
    pub fn pending(&self) -> usize {
        self.pending.load(Ordering::SeqCst)
    }

    /// `extend` calls so far (injected failures included).
    #[must_use]
    pub fn extends(&self) -> usize {
        self.extends.load(Ordering::SeqCst)
    }

    /// Reads a record (for a scenario's own checks); panics on a store error.
    pub async fn record(&self, id: RecordId) -> Option<Record> {
        Forward::get(self, id).await.expect("get")
    }

    async fn run<T, F>(&self, call: impl FnOnce(Arc<dyn Store>) -> F + Send + 'static) -> T
    where
        T: Send + 'static,
        F: Future<Output = T> + Send + 'static,
    {
        self.pending.fetch_add(1, Ordering::SeqCst);
        let _done = Pending(&self.pending);
        let inner = Arc::clone(&self.inner);
        on_io(async move { call(inner).await }).await
    }
}

#[async_trait]
impl Forward for Frozen {
    fn inner(&self) -> &dyn Store {
        &*self.inner
    }
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        self.run(|s| async move { s.claim(req).await }).await
    }
    async fn reclaim(&self, req: ReclaimRequest) -> Result<ReclaimOutcome, StoreError> {
        self.run(|s| async move { s.reclaim(req).await }).await
    }
    async fn complete(
        &self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Receipt, StoreError> {
        self.run(move |s| async move { s.complete(id, token, response).await }).await
    }
    async fn fail(&self, id: RecordId, token: FencingToken) -> Result<Receipt, StoreError> {
        self.run(move |s| async move { s.fail(id, token).await }).await
    }
    async fn extend(&self, id: RecordId, token: FencingToken, lease_ttl: Duration) -> Result<Receipt, StoreError> {
        self.extends.fetch_add(1, Ordering::SeqCst);
        let injected = self.failing_extends.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        if injected.is_ok() {
            let retryable = !self.failing_for_good.load(Ordering::SeqCst);
            return Err(StoreError::unavailable("frozen", "extend", retryable, std::io::Error::other("injected blip")));
        }
        self.run(move |s| async move { s.extend(id, token, lease_ttl).await }).await
    }
    async fn get(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        self.run(move |s| async move { s.get(id).await }).await
    }
    async fn sweep(&self, limit: usize) -> Result<SweepOutcome, StoreError> {
        self.run(move |s| async move { s.sweep(limit).await }).await
    }
    async fn journal_put(
        &self,
        id: RecordId,
        token: FencingToken,
        name: &str,
        value: Vec<u8>,
        overwrite: bool,
    ) -> Result<JournalWrite, StoreError> {
        let name = name.to_owned();
        self.run(move |s| async move { s.journal_put(id, token, &name, value, overwrite).await }).await
    }
    async fn journal_get(&self, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let name = name.to_owned();
        self.run(move |s| async move { s.journal_get(id, &name).await }).await
    }
    async fn list(&self, filter: ListFilter) -> Result<Listing, StoreError> {
        self.run(move |s| async move { s.list(filter).await }).await
    }
}
