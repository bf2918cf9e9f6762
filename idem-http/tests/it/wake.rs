//! Waking a waiting duplicate: under a bounded wait (`with_in_flight_wait`), a duplicate of
//! an in-flight request is woken when the first attempt completes, and answers with the
//! replay before any poll pause passes (tokio's paused clock: nothing advances it between
//! the completion and that answer). A store without wake-ups still gets the replay, at its
//! next poll.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::{Counter, Env, Gate, Script, Step, app, post, send};
use idem_conformance::{Forward, Forwarding};
use idem_core::{Settlements, Store};
use idem_http::IdempotencyLayer;
use tokio::time::Instant;

/// The first poll pause of a bounded wait: an answer sooner than this was not polled for.
const FIRST_PAUSE: Duration = Duration::from_millis(20);

/// The store without wake-ups: its waiters poll.
#[derive(Debug)]
struct Polling(Arc<dyn Store>);

#[async_trait::async_trait]
impl Forward for Polling {
    fn inner(&self) -> &dyn Store {
        &*self.0
    }
    fn settlements(&self) -> Option<&Settlements> {
        None
    }
}

/// Holds a first attempt on `store` until a duplicate has waited a second, completes it,
/// and returns how long after the completion began the duplicate had its replay.
async fn duplicate_answered_after(store: Arc<dyn Store>) -> Duration {
    let (n, s, gate) = (Counter::default(), Script::default(), Gate::default());
    s.then(Step::Hold(gate.clone()));
    let app = app(IdempotencyLayer::new(store).with_in_flight_wait(Some(Duration::from_secs(30))), &n, &s);
    let req = post("/v1/orders").key("k1").body("{}");
    let first = tokio::spawn({
        let (app, req) = (app.clone(), req.clone());
        async move { send(&app, &req).await }
    });
    gate.started().await;
    let duplicate = tokio::spawn(async move { (send(&app, &req).await, Instant::now()) });
    // Well into the wait, between two polls (20, 40, 80, ... 500 ms apart).
    tokio::time::sleep(Duration::from_millis(1_010)).await;
    let released = Instant::now();
    gate.release();
    let first = first.await.unwrap();
    let (got, at) = duplicate.await.unwrap();
    assert_eq!(first.status, 201);
    assert!(got.replayed() && got.body == first.body, "the duplicate gets the replay: {got:?}");
    assert_eq!(n.get(), 1, "the handler ran once");
    at - released
}

#[tokio::test(start_paused = true)]
async fn a_woken_duplicate_answers_with_the_replay_before_any_poll() {
    let env = Env::new();
    assert!(env.store.settlements().is_some(), "the memory store wakes its waiters");
    let took = duplicate_answered_after(env.dyn_store()).await;
    assert!(took < FIRST_PAUSE, "answered {took:?} after the completion: it waited for a poll");
}

#[tokio::test(start_paused = true)]
async fn without_wake_ups_the_duplicate_gets_the_replay_at_its_next_poll() {
    let env = Env::new();
    let took = duplicate_answered_after(Arc::new(Forwarding(Polling(env.dyn_store())))).await;
    assert!(took >= FIRST_PAUSE, "answered {took:?} after the completion, with no wake-up to hear");
}
