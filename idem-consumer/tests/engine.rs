//! The engine's decisions on the in-process store: no broker, no server.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem_consumer::{Acked, Config, Consumer, DeadLetter, Delivery, Redeliver, Settle};
use idem_core::{
    Endpoint, IdempotencyKey, MemoryStore, ReclaimRequest, Reconciled, RecordId, Resumable, Scope, StepError, Store,
};

fn consumer(lease: Duration) -> Consumer {
    Consumer::new(
        Arc::new(MemoryStore::new()),
        Config::default().with_lease_ttl(lease).with_retry_after(Duration::from_millis(5)),
    )
}

async fn nothing() {}

/// Runs `c` on `d` with a handler that counts its runs and holds `hold` before `Ok`.
async fn run(c: &Consumer, d: Delivery<'_>, runs: &Arc<AtomicUsize>, hold: Duration) -> Settle {
    c.process(d, nothing, |_| async move {
        runs.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(hold).await;
        Ok::<(), String>(())
    })
    .await
}

fn record_id(source: &str, principal: &str, key: &[u8]) -> RecordId {
    let scope = Scope::new(principal, Endpoint::new(idem_consumer::METHOD, source)).unwrap();
    scope.record_id(&IdempotencyKey::parse(key).unwrap())
}

#[tokio::test]
async fn a_redelivered_message_is_acked_without_running_again() {
    let c = consumer(Duration::from_secs(5));
    let runs = Arc::new(AtomicUsize::new(0));
    let d = Delivery::new("jobs", "tenant-a", Some(b"job-1"), b"{\"create\":1}");
    assert_eq!(run(&c, d, &runs, Duration::ZERO).await, Settle::Ack(Acked::Ran));
    assert_eq!(run(&c, d.with_attempt(2), &runs, Duration::ZERO).await, Settle::Ack(Acked::AlreadyDone));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn keys_are_scoped_by_source_and_principal() {
    let c = consumer(Duration::from_secs(5));
    let runs = Arc::new(AtomicUsize::new(0));
    for (source, principal) in [("jobs", "a"), ("jobs", "b"), ("other", "a")] {
        let d = Delivery::new(source, principal, Some(b"k"), b"p");
        assert_eq!(run(&c, d, &runs, Duration::ZERO).await, Settle::Ack(Acked::Ran));
    }
    assert_eq!(runs.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn a_key_in_flight_is_redelivered_and_never_run_twice() {
    let c = consumer(Duration::from_secs(5));
    let runs = Arc::new(AtomicUsize::new(0));
    let d = Delivery::new("jobs", "a", Some(b"slow"), b"p");
    let first = run(&c, d, &runs, Duration::from_millis(300));
    let second = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        run(&c, d, &runs, Duration::ZERO).await
    };
    let (first, second) = tokio::join!(first, second);
    assert_eq!(first, Settle::Ack(Acked::Ran));
    let Settle::Redeliver { after, why: Redeliver::InFlight } = second else { panic!("{second:?}") };
    assert!(after > Duration::ZERO && after <= Duration::from_secs(5), "{after:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn another_payload_under_a_spent_key_is_dead_lettered_as_a_mismatch() {
    let c = consumer(Duration::from_secs(5));
    let runs = Arc::new(AtomicUsize::new(0));
    run(&c, Delivery::new("jobs", "a", Some(b"k"), b"one"), &runs, Duration::ZERO).await;
    let other = run(&c, Delivery::new("jobs", "a", Some(b"k"), b"two"), &runs, Duration::ZERO).await;
    assert_eq!(other, Settle::DeadLetter(DeadLetter::Mismatch));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn no_key_or_a_bad_key_or_no_principal_is_dead_lettered_without_a_run() {
    let c = consumer(Duration::from_secs(5));
    let runs = Arc::new(AtomicUsize::new(0));
    let cases = [
        (Delivery::new("jobs", "a", None, b"p"), "missing-key"),
        (Delivery::new("jobs", "a", Some(b"bad key"), b"p"), "invalid-key"),
        (Delivery::new("jobs", "a", Some(b""), b"p"), "invalid-key"),
        (Delivery::new("jobs", " ", Some(b"k"), b"p"), "invalid-scope"),
    ];
    for (d, code) in cases {
        let Settle::DeadLetter(reason) = run(&c, d, &runs, Duration::ZERO).await else { panic!("{d:?}") };
        assert_eq!(reason.code(), code, "{reason}");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_failed_handler_is_redelivered_run_again_and_dead_lettered_at_the_limit() {
    let c = Consumer::new(Arc::new(MemoryStore::new()), Config::default().with_max_failures(3));
    let runs = Arc::new(AtomicUsize::new(0));
    let failing = || {
        let runs = Arc::clone(&runs);
        let d = Delivery::new("jobs", "a", Some(b"k"), b"p");
        let c = c.clone();
        async move {
            c.process(d, nothing, |_| async move {
                runs.fetch_add(1, Ordering::SeqCst);
                Err::<(), _>("provider said 500")
            })
            .await
        }
    };
    for _ in 1..=2 {
        let s = failing().await;
        assert!(matches!(s, Settle::Redeliver { why: Redeliver::HandlerFailed, .. }), "{s:?}");
    }
    let Settle::DeadLetter(DeadLetter::HandlerFailed { failures: 3, error }) = failing().await else { panic!() };
    assert_eq!(error, "provider said 500");
    assert_eq!(runs.load(Ordering::SeqCst), 3);
    // A later delivery of the key is dead-lettered without running.
    let d = Delivery::new("jobs", "a", Some(b"k"), b"p");
    let Settle::DeadLetter(DeadLetter::HandlerFailed { failures: 3, .. }) = run(&c, d, &runs, Duration::ZERO).await
    else {
        panic!()
    };
    assert_eq!(runs.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn the_same_key_on_another_subject_is_a_mismatch() {
    let c = consumer(Duration::from_secs(5));
    let runs = Arc::new(AtomicUsize::new(0));
    let d = Delivery::new("jobs", "a", Some(b"k"), b"{\"id\":42}");
    assert_eq!(run(&c, d.with_subject("jobs.create"), &runs, Duration::ZERO).await, Settle::Ack(Acked::Ran));
    let other = run(&c, d.with_subject("jobs.delete"), &runs, Duration::ZERO).await;
    assert_eq!(other, Settle::DeadLetter(DeadLetter::Mismatch));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn the_lease_is_renewed_and_the_broker_kept_alive_while_a_long_handler_runs() {
    // Without renewal a duplicate arriving after the lease would take the key over and
    // run the handler a second time while the first still runs.
    let c = consumer(Duration::from_millis(150));
    let runs = Arc::new(AtomicUsize::new(0));
    let alive = Arc::new(AtomicUsize::new(0));
    let d = Delivery::new("jobs", "a", Some(b"long"), b"p");
    let keep_alive = || {
        alive.fetch_add(1, Ordering::SeqCst);
        nothing()
    };
    let first = c.process(d, keep_alive, |_| async {
        runs.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(700)).await;
        Ok::<(), String>(())
    });
    let duplicates = async {
        let mut settles = Vec::new();
        for _ in 0..5 {
            tokio::time::sleep(Duration::from_millis(120)).await;
            settles.push(run(&c, d, &runs, Duration::ZERO).await);
        }
        settles
    };
    let (first, duplicates) = tokio::join!(first, duplicates);
    assert_eq!(first, Settle::Ack(Acked::Ran));
    assert!(
        duplicates.iter().all(|s| matches!(s, Settle::Redeliver { why: Redeliver::InFlight, .. })),
        "{duplicates:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert!(alive.load(Ordering::SeqCst) >= 3, "keep-alive called {} times", alive.load(Ordering::SeqCst));
}

#[tokio::test]
async fn a_handler_that_lost_its_lease_is_stopped_and_its_message_redelivered() {
    let store = Arc::new(MemoryStore::new());
    let c = Consumer::new(store.clone(), Config::default().with_lease_ttl(Duration::from_millis(90)));
    let d = Delivery::new("jobs", "a", Some(b"k"), b"p");
    let effects = Arc::new(AtomicUsize::new(0));
    let settle = c
        .process(d, nothing, |_| {
            let effects = Arc::clone(&effects);
            let store = store.clone();
            async move {
                // Someone takes the record over: fail it with our token, then reclaim it as
                // a second delivery would, so our renewal is refused.
                let rec = store.get(record_id("jobs", "a", b"k")).await.unwrap().unwrap();
                store.fail(rec.id, rec.token).await.unwrap();
                let req = ReclaimRequest {
                    id: rec.id,
                    expected: rec.token,
                    fingerprint: rec.fingerprint,
                    lease_ttl: Duration::from_secs(60),
                    retention: Duration::from_secs(60),
                };
                store.reclaim(req).await.unwrap();
                tokio::time::sleep(Duration::from_millis(500)).await;
                effects.fetch_add(1, Ordering::SeqCst);
                Ok::<(), String>(())
            }
        })
        .await;
    assert!(matches!(settle, Settle::Redeliver { why: Redeliver::LeaseLost, .. }), "{settle:?}");
    assert_eq!(effects.load(Ordering::SeqCst), 0, "the handler ran on after its lease was lost");
}

#[tokio::test]
async fn intents_converge_when_a_delivery_takes_over_a_dead_consumers_key() {
    // A consumer that died after its cloud call and before completing: the next delivery
    // reconciles by the sub-key instead of creating a second worker.
    let store = Arc::new(MemoryStore::new());
    let c = Consumer::new(store, Config::default().with_lease_ttl(Duration::from_millis(60)));
    let created = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let d = Delivery::new("jobs", "a", Some(b"k"), b"p");
    let create = |r: Resumable, die: bool| {
        let created = Arc::clone(&created);
        async move {
            let tag = r.subkey("create").to_string();
            let found = created.lock().unwrap().contains(&tag);
            r.intent(
                "create",
                |sk| {
                    let created = Arc::clone(&created);
                    async move {
                        created.lock().unwrap().push(sk.to_string());
                        Ok::<_, String>(sk.to_string())
                    }
                },
                |_| async move { Ok(if found { Reconciled::Found(tag) } else { Reconciled::NotFound }) },
            )
            .await
            .map_err(|e: StepError<String>| e.to_string())?;
            if die {
                std::future::pending::<()>().await;
            }
            Ok::<(), String>(())
        }
    };
    // The first consumer "dies" after its effect: its processing is abandoned mid-handler.
    let _ = tokio::time::timeout(Duration::from_millis(30), c.process(d, nothing, |r| create(r, true))).await;
    tokio::time::sleep(Duration::from_millis(80)).await;
    assert_eq!(c.process(d, nothing, |r| create(r, false)).await, Settle::Ack(Acked::Ran));
    assert_eq!(created.lock().unwrap().len(), 1, "{:?}", created.lock().unwrap());
}
