//! Sub-keys, steps and intents on the memory store (the conformance suite runs the
//! journal contract on every backend).

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use idem_core::*;

fn setup() -> (Arc<dyn Store>, ManualClock, ClaimRequest) {
    let clock = ManualClock::new(UnixMillis(1_000_000));
    let store: Arc<dyn Store> = Arc::new(MemoryStore::with_clock(Arc::new(clock.clone())));
    let scope = Scope::new("p", Endpoint::new("POST", "/v1/workers")).unwrap();
    let req = ClaimRequest::new(
        scope,
        IdempotencyKey::parse(b"k").unwrap(),
        Fingerprint::of_bytes(b"b"),
        Duration::from_secs(5),
        Duration::from_secs(60),
    );
    (store, clock, req)
}

async fn claimed(store: &Arc<dyn Store>, req: &ClaimRequest) -> Record {
    match store.claim(req.clone()).await.unwrap() {
        ClaimOutcome::Claimed(r) => r,
        other => panic!("{other:?}"),
    }
}

/// Reclaims `first` (failed, or past its lease) with the same fingerprint and expects to win.
async fn reclaimed(store: &Arc<dyn Store>, first: &Record) -> Record {
    let req = ReclaimRequest {
        id: first.id,
        expected: first.token,
        fingerprint: first.fingerprint,
        lease_ttl: Duration::from_secs(5),
        retention: Duration::from_secs(60),
    };
    match store.reclaim(req).await.unwrap() {
        ReclaimOutcome::Reclaimed(r) => r,
        other => panic!("expected Reclaimed, got {other:?}"),
    }
}

#[test]
fn subkeys_are_stable_distinct_and_short() {
    // Derived only from (principal, endpoint, key, generation, name), never from the attempt.
    let a = RecordId::derive("p", "POST /x", "k");
    let t = UnixMillis(1_800_000_000_000);
    assert_eq!(SubKey::derive(a, t, "charge"), SubKey::derive(a, t, "charge"));
    assert_ne!(SubKey::derive(a, t, "charge"), SubKey::derive(a, t, "refund"));
    assert_ne!(SubKey::derive(a, t, "charge"), SubKey::derive(RecordId::derive("q", "POST /x", "k"), t, "charge"));
    assert_ne!(SubKey::derive(a, t, "charge"), SubKey::derive(RecordId::derive("p", "POST /y", "k"), t, "charge"));
    assert_ne!(SubKey::derive(a, t, "charge"), SubKey::derive(RecordId::derive("p", "POST /x", "k2"), t, "charge"));
    assert_ne!(SubKey::derive(a, t, "charge"), SubKey::derive(a, UnixMillis(t.0 + 1), "charge"), "another generation");
    let s = SubKey::derive(a, t, "charge");
    assert_eq!(s.as_str().len(), 53);
    assert!(s.as_str().starts_with("idem-") && s.as_str()[5..].bytes().all(|b| b.is_ascii_hexdigit()));
}

#[tokio::test]
async fn subkeys_stay_across_a_reclaim_and_change_with_a_new_generation() {
    //! A retry of the same operation must send the same downstream key; the same
    //! idempotency key reused after retention is a new operation and must not.
    let (store, clock, req) = setup();
    let first = claimed(&store, &req).await;
    let handle = |r: &Record| Resumable::new(Arc::clone(&store), r.id, r.token, r.created_at);
    let charge = handle(&first).subkey("charge");
    clock.advance(Duration::from_secs(6));
    let retry = reclaimed(&store, &first).await;
    assert_eq!(retry.created_at, first.created_at, "a reclaim keeps the generation");
    assert_eq!(handle(&retry).subkey("charge"), charge, "the same operation keeps its sub-key");
    store.fail(retry.id, retry.token).await.unwrap();
    let again = reclaimed(&store, &retry).await;
    assert_eq!(handle(&again).subkey("charge"), charge, "a failed attempt's retry too");
    // Retention ends: the same key now names a new operation.
    clock.set(again.expires_at);
    let next = claimed(&store, &req).await;
    assert_eq!(next.id, first.id);
    assert_ne!(next.created_at, first.created_at);
    let new_charge = handle(&next).subkey("charge");
    assert_ne!(new_charge, charge, "a new generation gets new sub-keys");
    assert_eq!(new_charge, SubKey::derive(next.id, next.created_at, "charge"));
    // A step of the new generation runs: nothing of the old one is read back.
    let got = handle(&next).step("charge", |sk| async move { Ok::<_, std::io::Error>(sk.to_string()) }).await.unwrap();
    assert_eq!(got, new_charge.to_string());
}

#[tokio::test]
async fn a_step_runs_once_per_record_across_a_reclaim() {
    let (store, clock, req) = setup();
    let first = claimed(&store, &req).await;
    let runs = AtomicU32::new(0);
    let runs = &runs;
    let r1 = Resumable::new(Arc::clone(&store), first.id, first.token, first.created_at);
    let node: String = r1
        .step("allocate", |sk| async move {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, std::io::Error>(format!("node-for-{sk}"))
        })
        .await
        .unwrap();
    // The attempt dies; after the lease the retry reclaims and resumes.
    clock.advance(Duration::from_secs(6));
    let second = reclaimed(&store, &first).await;
    let r2 = Resumable::new(Arc::clone(&store), second.id, second.token, second.created_at);
    let again: String = r2
        .step("allocate", |_| async move {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, std::io::Error>("another node".into())
        })
        .await
        .unwrap();
    assert_eq!(again, node);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    // The stale owner's new step is fenced off.
    let stale = r1.step("lease", |_| async { Ok::<_, std::io::Error>(1u32) }).await.unwrap_err();
    assert!(stale.is_lease_lost(), "{stale:?}");
}

#[tokio::test]
async fn a_failed_step_is_not_journalled() {
    let (store, _clock, req) = setup();
    let r = claimed(&store, &req).await;
    let h = Resumable::new(Arc::clone(&store), r.id, r.token, r.created_at);
    let e = h.step::<u32, _, _, _>("x", |_| async { Err("boom") }).await.unwrap_err();
    assert!(matches!(e, StepError::Failed { .. }));
    assert_eq!(h.step("x", |_| async { Ok::<u32, &str>(7) }).await.unwrap(), 7);
}

#[tokio::test]
async fn intent_reconciles_a_pending_call_before_issuing_again() {
    let (store, clock, req) = setup();
    let first = claimed(&store, &req).await;
    let booted = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let h1 = Resumable::new(Arc::clone(&store), first.id, first.token, first.created_at);
    // Attempt 1 issues the boot (tagged with the sub-key) but "dies" before journalling done.
    let b = Arc::clone(&booted);
    let e = h1
        .intent(
            "boot",
            |tag| async move {
                b.lock().unwrap().push(tag.to_string());
                Err::<String, &str>("process killed after the call")
            },
            |_| async { Ok(Reconciled::NotFound) },
        )
        .await
        .unwrap_err();
    assert!(matches!(e, StepError::Failed { .. }));
    store.fail(first.id, first.token).await.unwrap();
    clock.advance(Duration::from_millis(1));
    let second = reclaimed(&store, &first).await;
    let h2 = Resumable::new(Arc::clone(&store), second.id, second.token, second.created_at);
    let (b_issue, b_find) = (Arc::clone(&booted), Arc::clone(&booted));
    let vm = h2
        .intent(
            "boot",
            |tag| async move {
                b_issue.lock().unwrap().push(tag.to_string());
                Ok::<_, &str>("never".to_string())
            },
            |tag| async move {
                let found = b_find.lock().unwrap().iter().any(|t| *t == tag.to_string());
                Ok(if found { Reconciled::Found(format!("vm-{tag}")) } else { Reconciled::NotFound })
            },
        )
        .await
        .unwrap();
    assert!(vm.starts_with("vm-idem-"));
    assert_eq!(booted.lock().unwrap().len(), 1, "the boot was adopted, not issued again");
    // Done is final: a third look returns the same id without calling anything.
    let again = h2
        .intent("boot", |_| async { Err::<String, &str>("must not issue") }, |_| async { Err("must not reconcile") })
        .await
        .unwrap();
    assert_eq!(again, vm);
    // Unknown fails the request as ambiguous.
    let h3 = Resumable::new(Arc::clone(&store), second.id, second.token, second.created_at);
    h3.intent("flash", |_| async { Err::<String, &str>("lost") }, |_| async { Ok(Reconciled::NotFound) })
        .await
        .unwrap_err();
    let e = h3
        .intent("flash", |_| async { Ok::<_, &str>("x".into()) }, |_| async { Ok(Reconciled::Unknown) })
        .await
        .unwrap_err();
    assert!(matches!(e, StepError::Ambiguous { .. }));
}

#[tokio::test]
async fn journal_dies_with_its_record() {
    let (store, clock, req) = setup();
    let r = claimed(&store, &req).await;
    store.journal_put(r.id, r.token, "s:a", b"v".to_vec(), false).await.unwrap();
    assert_eq!(store.journal_get(r.id, "s:a").await.unwrap(), Some(b"v".to_vec()));
    clock.advance(Duration::from_secs(60));
    assert_eq!(store.journal_get(r.id, "s:a").await.unwrap(), None);
    // A new claim of the same id after expiry starts with an empty journal.
    let again = claimed(&store, &req).await;
    assert!(again.token > r.token);
    assert_eq!(store.journal_get(r.id, "s:a").await.unwrap(), None);
}

/// What a lease watch reports: lost once `lost` is set.
#[derive(Debug, Default)]
struct Watch {
    lost: std::sync::atomic::AtomicBool,
}

impl LeaseWatch for Watch {
    fn is_lease_lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }
}

/// A step or intent started its side effect after the attempt's lease was known lost
/// (the store would only refuse the journal write after the call was made).
#[tokio::test]
async fn a_lost_lease_stops_steps_and_intents_before_their_call() {
    let (store, _clock, req) = setup();
    let rec = claimed(&store, &req).await;
    let watch = Arc::new(Watch::default());
    let run = Resumable::new(Arc::clone(&store), rec.id, rec.token, rec.created_at).with_lease_watch(watch.clone());
    let calls = Arc::new(AtomicU32::new(0));
    let call =
        |calls: Arc<AtomicU32>| async move { Ok::<_, std::convert::Infallible>(calls.fetch_add(1, Ordering::SeqCst)) };

    assert_eq!(run.step("before", |_| call(calls.clone())).await.unwrap(), 0, "a held lease runs the step");
    watch.lost.store(true, Ordering::SeqCst);
    let step = run.step("after", |_| call(calls.clone())).await.unwrap_err();
    assert!(matches!(&step, StepError::LeaseLost { name } if name == "after") && step.is_lease_lost(), "{step:?}");
    let intent = run
        .intent(
            "boot",
            |_| async { Ok::<_, std::convert::Infallible>("vm-1".to_owned()) },
            |_| async { Ok(Reconciled::NotFound) },
        )
        .await
        .unwrap_err();
    assert!(matches!(&intent, StepError::LeaseLost { name } if name == "boot"), "{intent:?}");
    assert_eq!(calls.load(Ordering::SeqCst), 1, "nothing was called after the loss");
    assert_eq!(store.journal_get(rec.id, "s:after").await.unwrap(), None, "nothing journalled");
    assert_eq!(store.journal_get(rec.id, "i:boot").await.unwrap(), None, "no pending intent either");
}
