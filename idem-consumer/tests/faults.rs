//! The engine under faults: panics, store outages and hangs, long handlers, failure
//! limits and keys that must not fold together. In-process store; no broker.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use idem_conformance::{Forward, Forwarding};
use idem_consumer::{Acked, Config, Consumer, DeadLetter, Delivery, Redeliver, Settle};
use idem_core::{
    ClaimOutcome, ClaimRequest, Endpoint, FencingToken, IdempotencyKey, MemoryStore, Receipt, RecordId, RecordState,
    Scope, Store, StoreError, StoredResponse,
};

async fn nothing() {}

fn record_id(source: &str, principal: &str, key: &[u8]) -> RecordId {
    let scope = Scope::new(principal, Endpoint::new(idem_consumer::METHOD, source)).unwrap();
    scope.record_id(&IdempotencyKey::parse(key).unwrap())
}

fn transient(what: &str) -> StoreError {
    StoreError::unavailable("flaky", what.to_owned(), true, std::io::Error::other(what.to_owned()))
}

/// A MemoryStore whose `complete` fails `fail_completes` times and whose `extend` fails while
/// `extend_down` is set (transient errors, as a dropped connection gives).
#[derive(Debug, Default)]
struct Flaky {
    inner: MemoryStore,
    fail_completes: AtomicUsize,
    extend_down: AtomicBool,
    claim_hangs: AtomicBool,
}

#[async_trait]
impl Forward for Flaky {
    fn inner(&self) -> &dyn Store {
        &self.inner
    }
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        if self.claim_hangs.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        self.inner.claim(req).await
    }
    async fn complete(&self, id: RecordId, token: FencingToken, r: StoredResponse) -> Result<Receipt, StoreError> {
        if self.fail_completes.load(Ordering::SeqCst) > 0 {
            self.fail_completes.fetch_sub(1, Ordering::SeqCst);
            return Err(transient("complete: connection reset"));
        }
        self.inner.complete(id, token, r).await
    }
    async fn extend(&self, id: RecordId, token: FencingToken, ttl: Duration) -> Result<Receipt, StoreError> {
        if self.extend_down.load(Ordering::SeqCst) {
            return Err(transient("extend: connection reset"));
        }
        self.inner.extend(id, token, ttl).await
    }
}

/// A panicking handler left its record in flight for the whole lease and unwound through
/// `process`, so the glue never settled the message (and a worker crashed on every
/// redelivery). The panic now marks the record failed and the message is redelivered.
#[tokio::test]
async fn a_panicking_handler_marks_the_record_failed() {
    let store = Arc::new(MemoryStore::new());
    let c = Consumer::new(store.clone(), Config::default().with_lease_ttl(Duration::from_secs(30)));
    let runs = Arc::new(AtomicUsize::new(0));
    let c2 = c.clone();
    let r = Arc::clone(&runs);
    let joined = tokio::spawn(async move {
        let d = Delivery::new("jobs", "a", Some(b"poison"), b"p");
        c2.process(d, nothing, |_| async move {
            r.fetch_add(1, Ordering::SeqCst);
            if true {
                panic!("handler bug");
            }
            Ok::<(), String>(())
        })
        .await
    })
    .await;
    let settle = joined.expect("the panic stays inside process");
    assert!(matches!(settle, Settle::Redeliver { why: Redeliver::HandlerFailed, .. }), "{settle:?}");
    let rec = store.get(record_id("jobs", "a", b"poison")).await.unwrap().unwrap();
    // The next delivery (JetStream redelivers after ack_wait) should run the handler again at
    // once, as after an Err; instead it waits out the 30 s lease.
    let d = Delivery::new("jobs", "a", Some(b"poison"), b"p").with_attempt(2);
    let s = c.process(d, nothing, |_| async { Ok::<(), String>(()) }).await;
    assert_eq!(rec.state, RecordState::Failed, "record left {:?} after a panic; next delivery: {s:?}", rec.state);
    assert_eq!(s, Settle::Ack(Acked::Ran));
}

/// After a handler longer than one lease, one transient `complete` error was not retried
/// (the lease was measured from the claim, not the last renewal): the message was
/// redelivered and the handler ran a second time.
#[tokio::test]
async fn a_transient_complete_error_after_a_long_handler_is_retried() {
    let store = Arc::new(Forwarding(Flaky::default()));
    let c = Consumer::new(
        store.clone(),
        Config::default().with_lease_ttl(Duration::from_millis(90)).with_retry_after(Duration::from_millis(5)),
    );
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = |hold: u64| {
        let runs = Arc::clone(&runs);
        move |_| async move {
            runs.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(hold)).await;
            Ok::<(), String>(())
        }
    };
    store.fail_completes.store(1, Ordering::SeqCst);
    let d = Delivery::new("jobs", "a", Some(b"long"), b"p");
    let first = c.process(d, nothing, handler(300)).await;
    // Follow the redelivery to its end.
    let mut s = first.clone();
    for attempt in 2..20 {
        if matches!(s, Settle::Ack(_)) {
            break;
        }
        if let Settle::Redeliver { after, .. } = s {
            tokio::time::sleep(after.min(Duration::from_millis(200))).await;
        }
        s = c.process(d.with_attempt(attempt), nothing, handler(0)).await;
    }
    assert_eq!(
        (first.clone(), runs.load(Ordering::SeqCst)),
        (Settle::Ack(Acked::Ran), 1),
        "first delivery: {first:?}; the handler ran {} times",
        runs.load(Ordering::SeqCst)
    );
}

/// During a store outage the renewals failed, the lease ran out, a redelivery reclaimed
/// the key, and the first handler (stopped only on a refused renewal) ran its step after
/// another delivery owned the record: the effect happened twice even through `step`.
#[tokio::test]
async fn a_handler_whose_lease_ran_out_unrenewed_is_stopped_before_its_next_step() {
    let store = Arc::new(Forwarding(Flaky::default()));
    let c = Consumer::new(store.clone(), Config::default().with_lease_ttl(Duration::from_millis(90)));
    let charges = Arc::new(AtomicUsize::new(0));
    let handler = || {
        let charges = Arc::clone(&charges);
        move |r: idem_core::Resumable| async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            r.step("charge", |_| async {
                charges.fetch_add(1, Ordering::SeqCst);
                Ok::<u32, String>(1)
            })
            .await
            .map_err(|e| e.to_string())?;
            Ok::<(), String>(())
        }
    };
    store.extend_down.store(true, Ordering::SeqCst);
    let d = Delivery::new("jobs", "a", Some(b"k"), b"p");
    let first = c.process(d, nothing, handler());
    let second = async {
        tokio::time::sleep(Duration::from_millis(150)).await;
        c.process(d.with_attempt(2), nothing, handler()).await
    };
    let (first, second) = tokio::join!(first, second);
    assert!(matches!(first, Settle::Redeliver { why: Redeliver::LeaseLost, .. }), "{first:?}");
    assert!(charges.load(Ordering::SeqCst) <= 1, "the effect ran twice; first {first:?}, second {second:?}");
    // Once the store is back, a delivery finishes the job, and the step ran once in all.
    store.extend_down.store(false, Ordering::SeqCst);
    let mut last = second;
    for _ in 0..20 {
        if matches!(last, Settle::Ack(_)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        last = c.process(d, nothing, handler()).await;
    }
    assert_eq!(last, Settle::Ack(Acked::Ran));
    assert_eq!(charges.load(Ordering::SeqCst), 1);
}

/// The broker's delivery count, which also counts redeliveries for a key in flight or a
/// store outage, dead-lettered a message on its first handler failure.
#[tokio::test]
async fn only_handler_failures_count_towards_max_failures() {
    let c = Consumer::new(Arc::new(MemoryStore::new()), Config::default());
    let d = Delivery::new("jobs", "a", Some(b"k"), b"p").with_attempt(5);
    let s = c.process(d, nothing, |_| async { Err::<(), _>("transient 503 from the provider") }).await;
    assert!(matches!(s, Settle::Redeliver { why: Redeliver::HandlerFailed, .. }), "first failure: {s:?}");
}

/// A delivery after the failure limit (the dead-letter publish failed, or JetStream
/// redelivered before `+TERM`) reclaimed the failed record and ran the handler again.
#[tokio::test]
async fn a_message_past_max_failures_does_not_run_again() {
    let c = Consumer::new(Arc::new(MemoryStore::new()), Config::default().with_max_failures(2));
    let runs = Arc::new(AtomicUsize::new(0));
    for attempt in 1..=4 {
        let runs = Arc::clone(&runs);
        let d = Delivery::new("jobs", "a", Some(b"k"), b"p").with_attempt(attempt);
        let s = c
            .process(d, nothing, |_| async move {
                runs.fetch_add(1, Ordering::SeqCst);
                Err::<(), _>("boom")
            })
            .await;
        if attempt >= 2 {
            assert!(matches!(s, Settle::DeadLetter(DeadLetter::HandlerFailed { .. })), "{s:?}");
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2, "the handler ran past max_failures");
}

/// Parsed as an HTTP header, AMQP message ids `job-1`, ` job-1 ` and `"job-1"` (distinct
/// ids at the broker) shared one record: the second and third were acked without running.
/// They are refused as invalid keys instead.
#[tokio::test]
async fn distinct_message_ids_never_share_a_record() {
    let c = Consumer::new(Arc::new(MemoryStore::new()), Config::default());
    let runs = Arc::new(AtomicUsize::new(0));
    let mut settles = Vec::new();
    for key in [&b"job-1"[..], b" job-1\t", b"\"job-1\""] {
        let runs = Arc::clone(&runs);
        let d = Delivery::new("jobs", "a", Some(key), b"p");
        settles.push(
            c.process(d, nothing, |_| async move {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<(), String>(())
            })
            .await,
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1, "{settles:?}");
    assert!(
        settles[1..].iter().all(|s| matches!(s, Settle::DeadLetter(r) if r.code() == "invalid-key")),
        "{settles:?}"
    );
}

/// A store that stopped answering (half-open TCP, an exhausted pool) parked every
/// delivery on its claim forever instead of redelivering it.
#[tokio::test]
async fn a_hung_store_claim_redelivers_instead_of_blocking() {
    let store = Arc::new(Forwarding(Flaky::default()));
    store.claim_hangs.store(true, Ordering::SeqCst);
    let c = Consumer::new(store, Config::default().with_store_timeout(Duration::from_millis(200)));
    let d = Delivery::new("jobs", "a", Some(b"k"), b"p");
    let s =
        tokio::time::timeout(Duration::from_secs(5), c.process(d, nothing, |_| async { Ok::<(), String>(()) })).await;
    assert!(matches!(s, Ok(Settle::Redeliver { why: Redeliver::StoreUnavailable, .. })), "{s:?}");
}

/// journal_get fails once, on the `fail_on`-th call.
#[derive(Debug, Default)]
struct BlipJournal {
    inner: MemoryStore,
    calls: AtomicUsize,
    fail_on: usize,
}

#[async_trait]
impl Forward for BlipJournal {
    fn inner(&self) -> &dyn Store {
        &self.inner
    }
    async fn journal_get(&self, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        if n == self.fail_on {
            return Err(StoreError::unavailable("blip", "journal_get: reset", true, std::io::Error::other("reset")));
        }
        self.inner.journal_get(id, name).await
    }
}

/// One transient journal_get error while counting a failure rewrote the count as 1: the
/// third failure (max_failures 3) was redelivered instead of dead-lettered. Now the
/// broker's count stands in for that one decision and nothing overwrites the count.
#[tokio::test]
async fn a_journal_read_blip_does_not_reset_the_failure_count() {
    // journal_get calls: d1 failed()=#1; d2 pre-check=#2, failed()=#3; d3 pre-check=#4, failed()=#5.
    let store = Arc::new(Forwarding(BlipJournal { fail_on: 5, ..Default::default() }));
    let c = Consumer::new(store, Config::default().with_max_failures(3).with_retry_after(Duration::ZERO));
    let runs = Arc::new(AtomicUsize::new(0));
    let mut settles = Vec::new();
    for attempt in 1..=6 {
        let runs = Arc::clone(&runs);
        let d = Delivery::new("jobs", "a", Some(b"k"), b"p").with_attempt(attempt);
        settles.push(
            c.process(d, nothing, |_| async move {
                runs.fetch_add(1, Ordering::SeqCst);
                Err::<(), _>("boom")
            })
            .await,
        );
    }
    assert!(matches!(settles[2], Settle::DeadLetter(DeadLetter::HandlerFailed { failures: 3, .. })), "{settles:#?}");
    // The count that could not be read stayed at 2, so one later delivery ran once more
    // (a dead-lettered message is not delivered again; a re-publish would be).
    assert_eq!(runs.load(Ordering::SeqCst), 4, "{settles:#?}");
    assert!(settles[4..].iter().all(|s| matches!(s, Settle::DeadLetter(_))), "{settles:#?}");
}

/// claim answers 100 ms late; extend is down.
#[derive(Debug, Default)]
struct SlowClaim {
    inner: MemoryStore,
    slow: std::sync::atomic::AtomicBool,
}

#[async_trait]
impl Forward for SlowClaim {
    fn inner(&self) -> &dyn Store {
        &self.inner
    }
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let out = self.inner.claim(req).await;
        if self.slow.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        out
    }
    async fn extend(&self, _: RecordId, _: FencingToken, _: Duration) -> Result<Receipt, StoreError> {
        Err(StoreError::unavailable("slow", "extend: reset", true, std::io::Error::other("reset")))
    }
}

/// With the lease measured from when the claim returned, the first handler ran on for the
/// claim's latency after the store's lease ended and a redelivery took the key over; its
/// step was refused, and that error was counted as a handler failure: at the limit one
/// message both ran (the new owner) and was dead-lettered.
#[tokio::test]
async fn a_handler_stopped_by_a_lost_lease_is_not_counted_as_a_failure() {
    let store = Arc::new(Forwarding(SlowClaim::default()));
    store.slow.store(true, Ordering::SeqCst);
    let c =
        Consumer::new(store.clone(), Config::default().with_lease_ttl(Duration::from_millis(300)).with_max_failures(1));
    let d = Delivery::new("jobs", "a", Some(b"k"), b"p");
    let first = c.process(d, nothing, |r: idem_core::Resumable| async move {
        // claim returned at T0+100; step at T0+360 (store lease ended at T0+300).
        tokio::time::sleep(Duration::from_millis(260)).await;
        r.step("effect", |_| async { Ok::<u32, String>(1) }).await.map_err(|e| e.to_string())?;
        Ok::<(), String>(())
    });
    let second = async {
        tokio::time::sleep(Duration::from_millis(330)).await;
        store.slow.store(false, Ordering::SeqCst);
        c.process(d.with_attempt(2), nothing, |_| async { Ok::<(), String>(()) }).await
    };
    let (first, second) = tokio::join!(first, second);
    assert!(
        !matches!(first, Settle::DeadLetter(_)),
        "first: {first:?} (dead-lettered), second: {second:?}: the one message both ran and was dead-lettered"
    );
}
