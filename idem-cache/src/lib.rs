//! # idem-cache
//!
//! [`CachedStore`] keeps completed records in process memory in front of any
//! [`Store`], so a replay is answered without a round trip to a remote store (Redis,
//! PostgreSQL, MySQL, DynamoDB) until the record's retention ends.
//!
//! ```
//! use std::sync::Arc;
//! use idem_cache::CachedStore;
//! use idem_core::{MemoryStore, Store};
//!
//! // 64 MiB of completed records in front of the shared store.
//! let store: Arc<dyn Store> = Arc::new(CachedStore::new(MemoryStore::new(), 64 << 20));
//! ```
//!
//! # Why it is safe
//! A completed record never changes until its retention ends (`docs/state-machine.md`):
//! no transition leaves `completed`, so no other process can make a cached copy stale.
//! The cache keeps nothing else: an in-flight or failed record changes under other
//! processes' claims, reclaims and renewals, and always goes to the store.
//!
//! A cached record is answered only while the store's clock is before its `expires_at`:
//! the store's `now` from the answer that brought the record in, plus the time the
//! cache's clock says passed since. Once retention ends, the call goes to the store,
//! which finds the record gone (a new claim) exactly as without the cache.
//!
//! # What it answers
//! - `claim` of a cached record: `ClaimOutcome::Existing` with the cached record, so the
//!   layer replays it (or answers a mismatch, for another fingerprint) without a store
//!   call.
//! - `get` of a cached record (the bounded wait's reads).
//! - Every other call goes to the store unchanged. A record enters the cache when a
//!   `claim` returns it completed (with the store's clock, which a `get` does not carry):
//!   the first replay of an operation in a process reads the store, later ones do not.
//!
//! # What it costs and what it does not protect against
//! - Memory: at most `max_bytes` of records (status, headers, body, scope and key, plus
//!   a fixed overhead per record, [`CachedStore::weight`]); the least useful go first
//!   (S3-FIFO, `quick_cache`).
//! - A record changed behind the store's back (an operator editing the database, a
//!   restore from an older backup) is not seen while it is cached.
//! - Clock rate: the cache measures elapsed time with its clock; if that clock and the
//!   store's disagree on how much time passed (a wall clock stepped back), a replay may
//!   be answered that long past its retention. It is never answered by a record that
//!   was not completed.
//! - Sealed responses are cached sealed, as the store keeps them; the layer opens them.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idem_core::{
    Capabilities, ClaimOutcome, ClaimRequest, Clock, FencingToken, JournalWrite, ListFilter, Listing, Receipt,
    ReclaimOutcome, ReclaimRequest, Record, RecordId, RecordState, Store, StoreError, StoredBody, StoredResponse,
    SweepOutcome, SystemClock, UnixMillis,
};
use quick_cache::Weighter;
use quick_cache::sync::Cache;

/// Bytes counted for a record beyond its variable parts: the record's fields, the
/// cache's entry and its bookkeeping.
const RECORD_OVERHEAD: u64 = 512;

/// A completed record and where it stood on the store's clock when it was read.
#[derive(Debug)]
struct Cached {
    record: Record,
    /// The store's clock when it returned the record.
    store_now: UnixMillis,
    /// The cache's clock at the same moment.
    read_at: UnixMillis,
}

#[derive(Clone, Copy, Debug)]
struct ByBytes;

impl Weighter<RecordId, Arc<Cached>> for ByBytes {
    fn weight(&self, _id: &RecordId, cached: &Arc<Cached>) -> u64 {
        CachedStore::<()>::weight(&cached.record)
    }
}

/// A [`Store`] that answers `claim` and `get` of completed records from process memory
/// (see the [crate documentation](crate)).
pub struct CachedStore<S> {
    inner: S,
    cache: Cache<RecordId, Arc<Cached>, ByBytes>,
    clock: Arc<dyn Clock>,
}

impl<S> std::fmt::Debug for CachedStore<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CachedStore")
            .field("records", &self.cache.len())
            .field("bytes", &self.cache.weight())
            .field("max_bytes", &self.cache.capacity())
            .finish_non_exhaustive()
    }
}

impl<S> CachedStore<S> {
    /// `inner` with at most `max_bytes` of completed records kept in memory (as
    /// [`CachedStore::weight`] counts them). Elapsed time is measured with the system
    /// clock.
    #[must_use]
    pub fn new(inner: S, max_bytes: u64) -> Self {
        // quick_cache sizes its tables from an estimate of the entry count: 2 KiB records.
        let estimated = usize::try_from(max_bytes / 2048).unwrap_or(usize::MAX).max(16);
        let cache = Cache::with_weighter(estimated, max_bytes, ByBytes);
        Self { inner, cache, clock: Arc::new(SystemClock) }
    }

    /// Measures elapsed time with `clock`: the clock `inner` was given, for a store whose
    /// clock is injected (the conformance suite's `ManualClock`).
    #[must_use]
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Records and bytes held now.
    #[must_use]
    pub fn usage(&self) -> (usize, u64) {
        (self.cache.len(), self.cache.weight())
    }

    /// The bytes `record` counts for: scope, key, stored status line, header names and
    /// values, trailers and body as stored (compressed bodies by their compressed size),
    /// plus a fixed overhead.
    #[must_use]
    pub fn weight(record: &Record) -> u64 {
        let fields = |f: &[(String, Vec<u8>)]| f.iter().map(|(n, v)| n.len() + v.len() + 16).sum::<usize>();
        let response = record.response.as_ref().map_or(0, |r: &StoredResponse| {
            let body = match &r.body {
                StoredBody::Identity(b) => b.len(),
                StoredBody::Lz4 { data, .. } => data.len(),
                StoredBody::NotRetained { .. } => 0,
            };
            fields(&r.headers) + fields(&r.trailers) + body
        });
        let scope = record.scope.principal.as_str().len() + record.scope.endpoint.as_str().len();
        RECORD_OVERHEAD + (scope + record.key.as_str().len() + response) as u64
    }

    /// The cached record `id` with the store's clock now, while its retention lasts.
    fn lookup(&self, id: RecordId) -> Option<(Record, UnixMillis)> {
        let cached = self.cache.get(&id)?;
        let elapsed = cached.read_at.millis_until(self.clock.now());
        let now = cached.store_now.saturating_add(Duration::from_millis(elapsed));
        if cached.record.is_expired(now) {
            self.cache.remove(&id);
            return None;
        }
        Some((cached.record.clone(), now))
    }

    /// Keeps `record` if it is completed and live at the store's `now`.
    fn keep(&self, record: &Record, now: UnixMillis) {
        if record.state == RecordState::Completed && !record.is_expired(now) {
            let cached = Cached { record: record.clone(), store_now: now, read_at: self.clock.now() };
            self.cache.insert(record.id, Arc::new(cached));
        }
    }
}

#[async_trait]
impl<S: Store> Store for CachedStore<S> {
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        if let Some((record, now)) = self.lookup(req.id()) {
            return Ok(ClaimOutcome::Existing { record, now });
        }
        let outcome = self.inner.claim(req).await?;
        if let ClaimOutcome::Existing { record, now } = &outcome {
            self.keep(record, *now);
        }
        Ok(outcome)
    }

    async fn reclaim(&self, req: ReclaimRequest) -> Result<ReclaimOutcome, StoreError> {
        self.inner.reclaim(req).await
    }

    async fn complete(
        &self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Receipt, StoreError> {
        self.inner.complete(id, token, response).await
    }

    async fn fail(&self, id: RecordId, token: FencingToken) -> Result<Receipt, StoreError> {
        self.inner.fail(id, token).await
    }

    async fn extend(&self, id: RecordId, token: FencingToken, lease_ttl: Duration) -> Result<Receipt, StoreError> {
        self.inner.extend(id, token, lease_ttl).await
    }

    async fn get(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        if let Some((record, _)) = self.lookup(id) {
            return Ok(Some(record));
        }
        // A `get` carries no reading of the store's clock, so what it returns is not kept.
        self.inner.get(id).await
    }

    async fn sweep(&self, limit: usize) -> Result<SweepOutcome, StoreError> {
        self.inner.sweep(limit).await
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn journal_put(
        &self,
        id: RecordId,
        token: FencingToken,
        name: &str,
        value: Vec<u8>,
        overwrite: bool,
    ) -> Result<JournalWrite, StoreError> {
        self.inner.journal_put(id, token, name, value, overwrite).await
    }

    async fn journal_get(&self, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.inner.journal_get(id, name).await
    }

    async fn list(&self, filter: ListFilter) -> Result<Listing, StoreError> {
        self.inner.list(filter).await
    }

    /// The inner store's: a record in flight is never cached, so a waiter's read after a
    /// wake-up reaches the inner store.
    fn settlements(&self) -> Option<&idem_core::Settlements> {
        self.inner.settlements()
    }
}
