//! Resumable handlers through the layer: a retry keeps the downstream key and a failed
//! attempt's charge is not repeated (a downstream payment API that deduplicates on the
//! sub-key; `docs/failures.md#retry-makes-a-new-downstream-key`,
//! `docs/failures.md#partial-side-effect-repeated-after-a-failure`), sub-key stability
//! across layer instances, and a store without a journal answering a clear problem instead
//! of panicking.

use crate::common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Extension;
use axum::Router;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing;
use common::{Env, Got, Req, T0, post, send, start_and_crash};
use idem_core::{ManualClock, MemoryStore, Store};
use idem_http::{IdempotencyContext, IdempotencyLayer, Problem};
use proptest::prelude::*;

/// A payment API that deduplicates on the caller's idempotency key: the same key charges
/// once and answers the first charge again.
#[derive(Clone, Debug, Default)]
struct PaymentApi {
    charges: Arc<Mutex<HashMap<String, String>>>,
    /// Every request it received, keys in arrival order.
    seen: Arc<Mutex<Vec<String>>>,
}

impl PaymentApi {
    fn charge(&self, key: &str) -> String {
        self.seen.lock().unwrap().push(key.to_string());
        let mut c = self.charges.lock().unwrap();
        let n = c.len() + 1;
        c.entry(key.to_string()).or_insert_with(|| format!("ch_{n:04}")).clone()
    }
    fn charges(&self) -> usize {
        self.charges.lock().unwrap().len()
    }
    fn seen(&self) -> Vec<String> {
        self.seen.lock().unwrap().clone()
    }
}

/// What the handler does after charging, per attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum After {
    /// Answers 201 with the charge id.
    Answer,
    /// Hangs forever: the process died before completing.
    Die,
    /// Fails while sending the receipt: 502.
    Error,
    /// Panics while sending the receipt.
    Panic,
}

#[derive(Clone, Debug)]
struct Shop {
    api: PaymentApi,
    plan: Arc<Mutex<Vec<After>>>,
}

async fn pay(Extension(ctx): Extension<IdempotencyContext>, Extension(shop): Extension<Shop>) -> Response {
    let charge = shop.api.charge(ctx.subkey("charge").as_str());
    let next = {
        let mut p = shop.plan.lock().unwrap();
        if p.is_empty() { After::Answer } else { p.remove(0) }
    };
    match next {
        After::Answer => (StatusCode::CREATED, charge).into_response(),
        After::Die => std::future::pending().await,
        After::Error => (StatusCode::BAD_GATEWAY, "receipt mailer down").into_response(),
        After::Panic => panic!("receipt mailer panicked"),
    }
}

fn shop_app(store: Arc<dyn Store>, shop: &Shop) -> Router {
    Router::new()
        .route("/v1/payments", routing::post(pay))
        .route("/v1/refunds", routing::post(pay))
        .layer(IdempotencyLayer::new(store))
        .layer(Extension(shop.clone()))
}

fn shop(plan: &[After]) -> Shop {
    Shop { api: PaymentApi::default(), plan: Arc::new(Mutex::new(plan.to_vec())) }
}

fn memory() -> (ManualClock, Arc<dyn Store>) {
    let clock = ManualClock::new(T0);
    (clock.clone(), Arc::new(MemoryStore::with_clock(Arc::new(clock))))
}

#[tokio::test]
async fn a_retry_in_another_instance_after_a_crash_charges_once() {
    //! Retries must not make a new downstream key; the crashed attempt's charge is the only one.
    let (clock, store) = memory();
    let s = shop(&[After::Die]);
    let req = post("/v1/payments").key("order-17").body("{}");
    // Attempt 1 charges, then its process dies before completing.
    start_and_crash(&shop_app(Arc::clone(&store), &s), &req).await;
    assert_eq!(s.api.charges(), 1);
    // After the in-flight lease, the client retries against another instance.
    clock.advance(Duration::from_secs(5 * 60 + 1)); // the default lease
    let other_instance = shop_app(Arc::clone(&store), &s);
    let got = send(&other_instance, &req).await;
    assert_eq!(got.status, StatusCode::CREATED, "{}", got.text());
    let seen = s.api.seen();
    assert_eq!(seen.len(), 2, "both attempts reached the payment API");
    assert_eq!(seen[0], seen[1], "with the same sub-key");
    assert_eq!(s.api.charges(), 1, "one charge");
    assert_eq!(got.text(), "ch_0001");
    let replay = send(&other_instance, &req).await;
    assert!(replay.replayed());
    assert_eq!(replay.text(), "ch_0001");
}

#[tokio::test]
async fn a_key_reused_after_retention_charges_again_under_a_new_sub_key() {
    //! The same idempotency key after its record's retention is a new operation: a sub-key
    //! that repeated the old one would get the old charge back from the payment API.
    let (clock, store) = memory();
    let s = shop(&[]);
    let app = shop_app(store, &s);
    let req = post("/v1/payments").key("order-19").body("{}");
    assert_eq!(send(&app, &req).await.text(), "ch_0001");
    clock.advance(Duration::from_secs(24 * 3_600)); // the default retention
    let again = send(&app, &req).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert!(!again.replayed(), "the retention ended: a new operation");
    let seen = s.api.seen();
    assert_eq!(seen.len(), 2);
    assert_ne!(seen[0], seen[1], "a new operation sends a new sub-key");
    assert_eq!(again.text(), "ch_0002", "and the payment API charges it");
}

#[tokio::test]
async fn a_failed_attempt_after_the_charge_is_retried_without_a_second_charge() {
    //! The record is marked failed after a partial side effect; the retry runs, the charge is not repeated.
    for after in [After::Error, After::Panic] {
        let (_clock, store) = memory();
        let s = shop(&[after]);
        let app = shop_app(store, &s);
        let req = post("/v1/payments").key("order-18").body("{}");
        if after == After::Panic {
            let joined = tokio::spawn({
                let (app, req) = (app.clone(), req.clone());
                async move { send(&app, &req).await }
            })
            .await;
            assert!(joined.is_err(), "the panic is re-raised to the caller");
        } else {
            assert_eq!(send(&app, &req).await.status, StatusCode::BAD_GATEWAY);
        }
        // The failed state is retryable: the handler runs again at once.
        let got = send(&app, &req).await;
        assert_eq!(got.status, StatusCode::CREATED, "{after:?}: {}", got.text());
        assert!(!got.replayed());
        assert_eq!(s.api.seen().len(), 2, "{after:?}");
        assert_eq!(s.api.charges(), 1, "{after:?}: one charge");
        assert_eq!(got.text(), "ch_0001", "{after:?}: the response reflects the single charge");
    }
}

/// The sub-key a handler saw for (token, route, key, label), through a fresh layer
/// instance on a fresh store each time (a restart).
async fn observed_subkey(token: &str, route: &str, key: &str, label: &str) -> String {
    let (_clock, store) = memory();
    let label = label.to_string();
    let app = Router::new()
        .route(
            route,
            routing::post(move |Extension(ctx): Extension<IdempotencyContext>| {
                let label = label.clone();
                async move { ctx.subkey(&label).to_string() }
            }),
        )
        .layer(IdempotencyLayer::new(store));
    let got: Got = send(&app, &post(route).token(token).key(key)).await;
    assert_eq!(got.status, StatusCode::OK);
    got.text().to_string()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, .. ProptestConfig::default() })]

    /// Property: the sub-key depends on (principal, endpoint, key, label) and the record's
    /// generation only; every instance here claims a fresh record at the same time (T0).
    #[test]
    fn subkeys_are_stable_across_restarts_and_change_with_each_input(
        token in "[a-z0-9]{1,12}",
        key in "[A-Za-z0-9-]{1,40}",
        label in "[a-z]{1,10}",
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let base = observed_subkey(&token, "/v1/payments", &key, &label).await;
            prop_assert_eq!(&base, &observed_subkey(&token, "/v1/payments", &key, &label).await);
            prop_assert_eq!(base.len(), 53);
            prop_assert!(base.starts_with("idem-") && base[5..].bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')));
            prop_assert_ne!(&base, &observed_subkey(&format!("{token}x"), "/v1/payments", &key, &label).await);
            prop_assert_ne!(&base, &observed_subkey(&token, "/v1/refunds", &key, &label).await);
            prop_assert_ne!(&base, &observed_subkey(&token, "/v1/payments", &format!("{key}x"), &label).await);
            prop_assert_ne!(&base, &observed_subkey(&token, "/v1/payments", &key, &format!("{label}x")).await);
            Ok(())
        })?;
    }
}

#[tokio::test]
async fn a_store_without_a_journal_answers_journal_unsupported_and_does_not_store_it() {
    //! A resumable handler on a store that lacks the journal must answer a clear 500, never panic.
    let env = Env::new(); // FlakyStore delegates records only: journal_put/get are the trait defaults.
    let app = Router::new()
        .route(
            "/v1/workers",
            routing::post(|Extension(ctx): Extension<IdempotencyContext>| async move {
                match ctx
                    .resumable()
                    .step("allocate", |sk| async move { Ok::<_, std::io::Error>(sk.to_string()) })
                    .await
                {
                    Ok(node) => (StatusCode::CREATED, node).into_response(),
                    Err(e) => Problem::from_step_error(&e).expect("a store error").into_response(),
                }
            }),
        )
        .layer(IdempotencyLayer::new(env.dyn_store()));
    let req: Req = post("/v1/workers").key("k");
    let got = send(&app, &req).await;
    let v = got.problem(500, "journal-unsupported");
    assert!(v["detail"].as_str().unwrap().contains("journal_get"), "{v}");
    // A 5xx is never stored: the record is failed and the retry runs again (and fails the same way).
    let again = send(&app, &req).await;
    assert!(!again.replayed());
    again.problem(500, "journal-unsupported");
}

#[test]
fn step_errors_map_to_problems() {
    use idem_core::{StepError, StoreError};
    let lost: StepError<std::io::Error> = StepError::Store {
        name: "a".into(),
        source: StoreError::LeaseLost {
            id: idem_core::RecordId::from_bytes([0; 32]),
            presented: idem_core::FencingToken(1),
            current: None,
        },
    };
    let p = Problem::from_step_error(&lost).unwrap();
    assert_eq!((p.kind(), p.status()), (idem_http::ProblemKind::InFlight, StatusCode::CONFLICT));
    assert_eq!(p.to_response().headers()["retry-after"], "1");
    let amb: StepError<std::io::Error> = StepError::Ambiguous { name: "boot".into() };
    let p = Problem::from_step_error(&amb).unwrap();
    assert_eq!(
        (p.kind(), p.status()),
        (idem_http::ProblemKind::AmbiguousSideEffect, StatusCode::INTERNAL_SERVER_ERROR)
    );
    let own: StepError<std::io::Error> = StepError::Failed { name: "x".into(), source: std::io::Error::other("e") };
    assert!(Problem::from_step_error(&own).is_none());
}
