//! What the cache answers and what it leaves to the store, counted at the store behind it.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use idem_cache::CachedStore;
use idem_conformance::{Forward, Forwarding};
use idem_core::{
    ClaimOutcome, ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, ManualClock, MemoryStore, Record, RecordState,
    Scope, Store, StoreError, StoredResponse,
};

/// The memory store behind the cache, counting the claims and reads that reach it.
#[derive(Debug)]
struct Counting {
    inner: MemoryStore,
    claims: AtomicUsize,
}

#[async_trait]
impl Forward for Counting {
    fn inner(&self) -> &dyn Store {
        &self.inner
    }
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        self.claims.fetch_add(1, Ordering::SeqCst);
        self.inner.claim(req).await
    }
}

struct Rig {
    clock: ManualClock,
    backend: Arc<Forwarding<Counting>>,
    cache: CachedStore<Arc<Forwarding<Counting>>>,
}

fn rig(max_bytes: u64) -> Rig {
    let clock = ManualClock::starting_now();
    let inner = MemoryStore::with_clock(Arc::new(clock.clone()));
    let backend = Arc::new(Forwarding(Counting { inner, claims: AtomicUsize::new(0) }));
    let cache = CachedStore::new(backend.clone(), max_bytes).with_clock(Arc::new(clock.clone()));
    Rig { clock, backend, cache }
}

const RETENTION: Duration = Duration::from_secs(3600);

fn request(key: &str, body: &[u8]) -> ClaimRequest {
    let scope = Scope::new("acct_42", Endpoint::new("POST", "/v1/workers")).expect("scope");
    ClaimRequest::new(
        scope,
        IdempotencyKey::parse(key.as_bytes()).expect("key"),
        Fingerprint::of_bytes(body),
        Duration::from_secs(30),
        RETENTION,
    )
}

impl Rig {
    fn claims(&self) -> usize {
        self.backend.claims.load(Ordering::SeqCst)
    }

    /// Claims `key` and completes it with `body` as the response.
    async fn completed(&self, key: &str, body: Vec<u8>) -> Record {
        let ClaimOutcome::Claimed(record) = self.cache.claim(request(key, b"req")).await.expect("claim") else {
            panic!("a fresh key is claimed");
        };
        let response = StoredResponse::new(201, vec![("location".into(), b"/v1/workers/w-1".to_vec())], body);
        self.cache.complete(record.id, record.token, response).await.expect("complete");
        record
    }

    async fn existing(&self, key: &str) -> Record {
        match self.cache.claim(request(key, b"req")).await.expect("claim") {
            ClaimOutcome::Existing { record, .. } => record,
            ClaimOutcome::Claimed(_) => panic!("{key} was claimed anew"),
        }
    }
}

#[tokio::test]
async fn replays_after_the_first_are_answered_without_the_store() {
    let rig = rig(1 << 20);
    rig.completed("k1", b"{\"id\":\"w-1\"}".to_vec()).await;
    let first = rig.existing("k1").await;
    assert_eq!(rig.claims(), 2, "the claim and the first replay reach the store");
    for _ in 0..10 {
        let again = rig.existing("k1").await;
        assert_eq!(again, first, "the cached record is the stored one");
    }
    assert_eq!(rig.claims(), 2, "later replays are answered from the cache");
    assert_eq!(first.state, RecordState::Completed);
    // Another request with the key gets the record to decide a mismatch on, from the cache.
    let ClaimOutcome::Existing { record, now } = rig.cache.claim(request("k1", b"other")).await.expect("claim") else {
        panic!("existing");
    };
    assert_eq!(
        idem_core::decide(Some(&record), &request("k1", b"other").fingerprint(), now),
        idem_core::Decision::Mismatch
    );
    assert_eq!(rig.claims(), 2);
    assert_eq!(rig.cache.get(first.id).await.expect("get"), Some(first), "get is answered from the cache too");
}

#[tokio::test]
async fn an_in_flight_or_failed_record_is_never_cached() {
    let rig = rig(1 << 20);
    let ClaimOutcome::Claimed(claimed) = rig.cache.claim(request("k2", b"req")).await.expect("claim") else {
        panic!("claimed");
    };
    for n in 2..5 {
        assert_eq!(rig.existing("k2").await.state, RecordState::InFlight);
        assert_eq!(rig.claims(), n, "an in-flight record is read from the store every time");
    }
    rig.cache.fail(claimed.id, claimed.token).await.expect("fail");
    assert_eq!(rig.existing("k2").await.state, RecordState::Failed);
    assert_eq!(rig.existing("k2").await.state, RecordState::Failed);
    assert_eq!(rig.claims(), 6, "a failed record is read from the store every time");
    assert_eq!(rig.cache.usage().0, 0);
}

/// A cached replay outlived its retention: once the store's clock passed `expires_at`, the
/// key must be claimed anew (the record is gone), not answered from memory.
#[tokio::test]
async fn a_cached_record_is_gone_when_its_retention_ends() {
    let rig = rig(1 << 20);
    let record = rig.completed("k3", b"{}".to_vec()).await;
    rig.existing("k3").await;
    assert_eq!(rig.cache.usage().0, 1);
    let left = record.created_at.millis_until(record.expires_at);
    rig.clock.advance(Duration::from_millis(left - 1));
    rig.existing("k3").await;
    assert_eq!(rig.claims(), 2, "1 ms before the end: still from the cache");
    rig.clock.advance(Duration::from_millis(1));
    let ClaimOutcome::Claimed(again) = rig.cache.claim(request("k3", b"req")).await.expect("claim") else {
        panic!("at expires_at the key is claimed anew");
    };
    assert_ne!(again.token, record.token);
    assert_eq!(rig.claims(), 3);
}

#[tokio::test]
async fn memory_stays_within_its_bound_under_key_churn() {
    const BOUND: u64 = 1 << 20;
    let rig = rig(BOUND);
    let body = vec![b'x'; 4096];
    let mut peak = 0;
    for n in 0..2_000 {
        let key = format!("churn-{n}");
        rig.completed(&key, body.clone()).await;
        rig.existing(&key).await;
        let (records, bytes) = rig.cache.usage();
        peak = peak.max(bytes);
        assert!(bytes <= BOUND, "{bytes} bytes in the cache after {n} keys ({records} records)");
    }
    let (records, _) = rig.cache.usage();
    let per_record = CachedStore::<()>::weight(&rig.existing("churn-1999").await);
    assert!(per_record > 4096, "the body is counted: {per_record}");
    assert!(records as u64 <= BOUND / per_record, "{records} records of {per_record} bytes in {BOUND}");
    assert!(peak > BOUND / 2, "the cache is used up to its bound: peak {peak}");
}
