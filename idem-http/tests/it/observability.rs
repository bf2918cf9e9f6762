//! The `idempotency` span and the metrics (docs/observability.md), row by row of the
//! decision table (`decision_table.rs` beside this module drives the same rows for the responses): a
//! capturing `tracing` layer reads every span's fields, and `metrics-util`'s
//! `DebuggingRecorder` every counter. Both are installed for the current thread only, and
//! each test runs on a current-thread runtime, so tests running in parallel never see each
//! other's spans or metrics.

use crate::common;

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use common::{Counter, Env, Gate, Script, Step, T0, app, post, send, start_and_crash};
use http::Request;
use idem_core::FencingToken;
use idem_http::{IdempotencyLayer, KeyRequirement, StoreFailureMode};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Instrument, Subscriber};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

const ORDERS: &str = "POST /v1/orders";
const LEASE_MS: i64 = 300_000;

/// One span as the capturing layer saw it: its name, its parent's index, and every field
/// recorded so far (formatted).
#[derive(Clone, Debug)]
struct SpanRec {
    name: &'static str,
    parent: Option<usize>,
    fields: BTreeMap<String, String>,
}

impl SpanRec {
    fn get(&self, field: &str) -> Option<&str> {
        self.fields.get(field).map(String::as_str)
    }
}

/// Every span created on this thread, in creation order.
#[derive(Clone, Debug, Default)]
struct Spans(Arc<Mutex<Vec<SpanRec>>>);

/// A span's index in [`Spans`], kept in the registry's span extensions.
struct Idx(usize);

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().to_owned(), value.to_string());
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> tracing_subscriber::Layer<S> for Spans {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let span = ctx.span(id).expect("a new span is in the registry");
        let parent = span.parent().and_then(|p| p.extensions().get::<Idx>().map(|i| i.0));
        let mut fields = BTreeMap::new();
        attrs.record(&mut Fields(&mut fields));
        let mut all = self.0.lock().unwrap();
        all.push(SpanRec { name: attrs.metadata().name(), parent, fields });
        span.extensions_mut().insert(Idx(all.len() - 1));
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let span = ctx.span(id).expect("a recorded span is in the registry");
        if let Some(Idx(i)) = span.extensions().get::<Idx>() {
            values.record(&mut Fields(&mut self.0.lock().unwrap()[*i].fields));
        }
    }
}

/// One metric as the recorder held it: name, labels, value.
type Metric = (String, Vec<(String, String)>, DebugValue);

/// What one test run produced.
struct Seen {
    spans: Vec<SpanRec>,
    metrics: Vec<Metric>,
}

impl Seen {
    /// The `idempotency` spans, in creation order.
    fn requests(&self) -> Vec<&SpanRec> {
        self.spans.iter().filter(|s| s.name == "idempotency").collect()
    }

    /// (decision, outcome) of every `idempotency` span; "-" for a field never recorded.
    fn rows(&self) -> Vec<(String, String)> {
        self.requests()
            .iter()
            .map(|s| (s.get("decision").unwrap_or("-").to_owned(), s.get("outcome").unwrap_or("-").to_owned()))
            .collect()
    }

    /// The sum of counter `name` over every label set that includes `labels`.
    fn counter(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        self.matching(name, labels)
            .map(|v| match v {
                DebugValue::Counter(n) => *n,
                other => panic!("{name} is not a counter: {other:?}"),
            })
            .sum()
    }

    /// How many values histogram `name` holds over every label set that includes `labels`.
    fn histogram_len(&self, name: &str, labels: &[(&str, &str)]) -> usize {
        self.matching(name, labels)
            .map(|v| match v {
                DebugValue::Histogram(values) => values.len(),
                other => panic!("{name} is not a histogram: {other:?}"),
            })
            .sum()
    }

    fn matching<'a>(&'a self, name: &'a str, labels: &'a [(&str, &str)]) -> impl Iterator<Item = &'a DebugValue> {
        self.metrics
            .iter()
            .filter(move |(n, l, _)| {
                n == name && labels.iter().all(|(k, v)| l.iter().any(|(lk, lv)| lk == k && lv == v))
            })
            .map(|(_, _, v)| v)
    }

    /// Every decision and outcome counter equals the number of spans that carry it: the
    /// two views of one request always agree.
    #[track_caller]
    fn assert_counters_match_spans(&self) {
        for field in ["decision", "outcome"] {
            let mut by_value: BTreeMap<&str, u64> = BTreeMap::new();
            for s in self.requests() {
                if let Some(v) = s.get(field) {
                    *by_value.entry(v).or_default() += 1;
                }
            }
            let metric = format!("idem_{field}s_total");
            let total: u64 = by_value.values().sum();
            assert_eq!(self.counter(&metric, &[]), total, "{metric} overall; spans {:?}", self.rows());
            for (value, n) in by_value {
                assert_eq!(self.counter(&metric, &[(field, value)]), n, "{metric}{{{field}={value}}}");
            }
        }
    }
}

/// Runs `test` on a current-thread runtime (time paused when `paused`) with the capturing
/// layer and a debugging recorder installed for this thread, and returns what they saw.
fn observe<F, Fut>(paused: bool, test: F) -> Seen
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = ()>,
{
    let mut builder = tokio::runtime::Builder::new_current_thread();
    builder.enable_all();
    if paused {
        builder.start_paused(true);
    }
    let rt = builder.build().unwrap();
    let spans = Spans::default();
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let subscriber = tracing_subscriber::registry().with(spans.clone());
    tracing::subscriber::with_default(subscriber, || metrics::with_local_recorder(&recorder, || rt.block_on(test())));
    let metrics = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(key, _, _, value)| {
            let key = key.key();
            let labels = key.labels().map(|l| (l.key().to_owned(), l.value().to_owned())).collect();
            (key.name().to_owned(), labels, value)
        })
        .collect();
    let spans = spans.0.lock().unwrap().clone();
    Seen { spans, metrics }
}

fn layer(env: &Env) -> IdempotencyLayer {
    IdempotencyLayer::new(env.dyn_store())
}

fn pair(decision: &str, outcome: &str) -> (String, String) {
    (decision.to_owned(), outcome.to_owned())
}

/// The first 8 bytes of the record id in hex, as the span's `record` field shows it.
async fn short_id(env: &Env, key: &str) -> String {
    let id = env.record("tok-p", ORDERS, key).await.expect("record").id;
    id.as_bytes()[..8].iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn row_none_claims_and_the_span_names_endpoint_record_token_and_outcome() {
    let env = Env::new();
    let (n, s) = (Counter::default(), Script::default());
    let short = Arc::new(Mutex::new(String::new()));
    let seen = observe(false, || {
        let (env, short) = (env.clone(), Arc::clone(&short));
        async move {
            let app = app(layer(&env), &n, &s);
            assert_eq!(send(&app, &post("/v1/orders").key("k1").body("{}")).await.status, 201);
            *short.lock().unwrap() = short_id(&env, "k1").await;
        }
    });
    assert_eq!(seen.rows(), vec![pair("claimed", "completed")]);
    let span = seen.requests()[0];
    assert_eq!(span.get("endpoint"), Some(ORDERS));
    assert_eq!(span.get("record"), Some(short.lock().unwrap().as_str()));
    assert_eq!(span.get("record").unwrap().len(), 16);
    assert_eq!(span.get("token"), Some(FencingToken::first_at(T0).0.to_string().as_str()));
    assert_eq!(span.get("renewals"), Some("0"));
    seen.assert_counters_match_spans();
    assert_eq!(seen.counter("idem_decisions_total", &[("decision", "claimed"), ("endpoint", ORDERS)]), 1);
    for op in ["claim", "complete"] {
        assert_eq!(
            seen.histogram_len("idem_store_call_seconds", &[("operation", op), ("backend", "memory")]),
            1,
            "{op} timed once"
        );
    }
    assert_eq!(seen.counter("idem_store_errors_total", &[]), 0);
}

#[test]
fn row_in_flight_fresh_same_request_is_in_flight() {
    let env = Env::new();
    let seen = observe(false, || async move {
        let (n, s, gate) = (Counter::default(), Script::default(), Gate::default());
        s.then(Step::Hold(gate.clone()));
        let app = app(layer(&env), &n, &s);
        let req = post("/v1/orders").key("k1").body("{}");
        let first = tokio::spawn({
            let (app, req) = (app.clone(), req.clone());
            async move { send(&app, &req).await }
        });
        gate.started().await;
        send(&app, &req).await.problem(409, "in-flight");
        gate.release();
        assert_eq!(first.await.unwrap().status, 201);
    });
    assert_eq!(seen.rows(), vec![pair("claimed", "completed"), pair("in_flight", "-")]);
    seen.assert_counters_match_spans();
}

#[test]
fn row_in_flight_fresh_different_request_is_a_mismatch() {
    let env = Env::new();
    let seen = observe(false, || async move {
        let (n, s, gate) = (Counter::default(), Script::default(), Gate::default());
        s.then(Step::Hold(gate.clone()));
        let app = app(layer(&env), &n, &s);
        let first = tokio::spawn({
            let app = app.clone();
            async move { send(&app, &post("/v1/orders").key("k1").body("{\"a\":1}")).await }
        });
        gate.started().await;
        send(&app, &post("/v1/orders").key("k1").body("{\"a\":2}")).await.problem(409, "mismatch");
        gate.release();
        first.await.unwrap();
    });
    assert_eq!(seen.rows(), vec![pair("claimed", "completed"), pair("mismatch", "-")]);
    seen.assert_counters_match_spans();
}

#[test]
fn row_in_flight_expired_same_request_is_reclaimed() {
    let env = Env::new();
    let seen = observe(false, || async move {
        let (n, s) = (Counter::default(), Script::default());
        s.then(Step::Hold(Gate::default()));
        let app = app(layer(&env), &n, &s);
        let req = post("/v1/orders").key("k1").body("{}");
        start_and_crash(&app, &req).await;
        env.advance_ms(LEASE_MS);
        assert_eq!(send(&app, &req).await.status, 201);
    });
    assert_eq!(seen.rows(), vec![pair("claimed", "-"), pair("reclaimed", "completed")]);
    let spans = seen.requests();
    let (crashed, reclaimed): (u64, u64) =
        (spans[0].get("token").unwrap().parse().unwrap(), spans[1].get("token").unwrap().parse().unwrap());
    assert_eq!(reclaimed, crashed + 1, "the reclaim's span carries the new token");
    seen.assert_counters_match_spans();
}

#[test]
fn row_in_flight_expired_different_request_is_a_mismatch() {
    let env = Env::new();
    let seen = observe(false, || async move {
        let (n, s) = (Counter::default(), Script::default());
        s.then(Step::Hold(Gate::default()));
        let app = app(layer(&env), &n, &s);
        start_and_crash(&app, &post("/v1/orders").key("k1").body("{\"a\":1}")).await;
        env.advance_ms(LEASE_MS + 1);
        send(&app, &post("/v1/orders").key("k1").body("{\"a\":2}")).await.problem(409, "mismatch");
    });
    assert_eq!(seen.rows(), vec![pair("claimed", "-"), pair("mismatch", "-")]);
    seen.assert_counters_match_spans();
}

#[test]
fn row_completed_same_request_is_replayed() {
    let env = Env::new();
    let seen = observe(false, || async move {
        let (n, s) = (Counter::default(), Script::default());
        let app = app(layer(&env), &n, &s);
        let req = post("/v1/orders").key("k1").body("{}");
        send(&app, &req).await;
        assert!(send(&app, &req).await.replayed());
        assert!(send(&app, &req).await.replayed());
    });
    assert_eq!(seen.rows(), vec![pair("claimed", "completed"), pair("replayed", "-"), pair("replayed", "-")]);
    seen.assert_counters_match_spans();
    assert_eq!(seen.counter("idem_decisions_total", &[("decision", "replayed"), ("endpoint", ORDERS)]), 2);
}

#[test]
fn row_completed_different_request_is_a_mismatch() {
    let env = Env::new();
    let seen = observe(false, || async move {
        let (n, s) = (Counter::default(), Script::default());
        let app = app(layer(&env), &n, &s);
        send(&app, &post("/v1/orders").key("k1").body("{\"a\":1}")).await;
        send(&app, &post("/v1/orders").key("k1").body("{\"a\":2}")).await.problem(409, "mismatch");
    });
    assert_eq!(seen.rows(), vec![pair("claimed", "completed"), pair("mismatch", "-")]);
    seen.assert_counters_match_spans();
}

#[test]
fn row_failed_same_request_is_reclaimed_after_a_failed_outcome() {
    let env = Env::new();
    let seen = observe(false, || async move {
        let (n, s) = (Counter::default(), Script::default());
        s.then(Step::Status(500));
        let app = app(layer(&env), &n, &s);
        let req = post("/v1/orders").key("k1").body("{}");
        assert_eq!(send(&app, &req).await.status, 500);
        assert_eq!(send(&app, &req).await.status, 201);
    });
    assert_eq!(seen.rows(), vec![pair("claimed", "failed"), pair("reclaimed", "completed")]);
    seen.assert_counters_match_spans();
}

#[test]
fn row_failed_different_request_is_a_mismatch() {
    let env = Env::new();
    let seen = observe(false, || async move {
        let (n, s) = (Counter::default(), Script::default());
        s.then(Step::Status(500));
        let app = app(layer(&env), &n, &s);
        send(&app, &post("/v1/orders").key("k1").body("{\"a\":1}")).await;
        send(&app, &post("/v1/orders").key("k1").body("{\"a\":2}")).await.problem(409, "mismatch");
    });
    assert_eq!(seen.rows(), vec![pair("claimed", "failed"), pair("mismatch", "-")]);
    seen.assert_counters_match_spans();
}

#[test]
fn a_record_that_keeps_changing_is_busy() {
    let env = Env::new();
    let seen = observe(false, || async move {
        let (n, s) = (Counter::default(), Script::default());
        s.then(Step::Status(500));
        let app = app(layer(&env), &n, &s);
        let req = post("/v1/orders").key("k1").body("{}");
        send(&app, &req).await;
        env.store.lose_reclaims.store(true, Ordering::SeqCst);
        send(&app, &req).await.problem(409, "busy");
    });
    assert_eq!(seen.rows(), vec![pair("claimed", "failed"), pair("busy", "-")]);
    seen.assert_counters_match_spans();
}

#[test]
fn a_store_outage_is_store_unavailable_when_closed_and_fail_open_when_open() {
    let env = Env::new();
    let seen = observe(false, || async move {
        let (n, s) = (Counter::default(), Script::default());
        env.store.fail_all.store(true, Ordering::SeqCst);
        let closed = app(layer(&env), &n, &s);
        let open = app(layer(&env).with_store_failure_mode(StoreFailureMode::FailOpen), &n, &s);
        send(&closed, &post("/v1/orders").key("k1").body("{}")).await.problem(503, "store-unavailable");
        assert_eq!(send(&open, &post("/v1/orders").key("k1").body("{}")).await.status, 201);
        assert_eq!(n.get(), 1, "only the fail-open request ran the handler");
    });
    assert_eq!(seen.rows(), vec![pair("store_unavailable", "-"), pair("fail_open", "-")]);
    seen.assert_counters_match_spans();
    assert_eq!(seen.counter("idem_fail_open_total", &[("endpoint", ORDERS)]), 1);
    assert_eq!(
        seen.counter(
            "idem_store_errors_total",
            &[("backend", "memory"), ("operation", "claim"), ("retryable", "true")]
        ),
        2,
        "each request's failed claim"
    );
}

/// A sealed response that does not open (here: sealed under another key) counted as no
/// store error once the layer's deadline store opened records outside its timed call; it
/// must count like a record that does not decode.
#[test]
fn a_sealed_response_that_does_not_open_is_unreadable_and_a_store_error() {
    let env = Env::new();
    let seen = observe(false, || async move {
        let (n, s) = (Counter::default(), Script::default());
        let sealing = |key| idem_http::Sealing::new(idem_http::SealingKeys::new(1, key));
        let sealed = app(layer(&env).with_sealing(sealing([1; 32])), &n, &s);
        let other_key = app(layer(&env).with_sealing(sealing([2; 32])), &n, &s);
        let req = post("/v1/orders").key("k1").body("{}");
        assert_eq!(send(&sealed, &req).await.status, 201);
        assert_eq!(send(&other_key, &req).await.status, 503);
        assert_eq!(n.get(), 1, "the handler never ran for the record that did not open");
    });
    assert_eq!(seen.rows(), vec![pair("claimed", "completed"), pair("unreadable", "-")]);
    assert_eq!(
        seen.counter(
            "idem_store_errors_total",
            &[("backend", "memory"), ("operation", "claim"), ("retryable", "false")]
        ),
        1
    );
}

#[test]
fn requests_without_a_key_are_skipped_or_rejected_and_safe_methods_get_no_span() {
    let env = Env::new();
    let seen = observe(false, || async move {
        let (n, s) = (Counter::default(), Script::default());
        let required = app(layer(&env), &n, &s);
        let optional = app(layer(&env).with_key_requirement(KeyRequirement::Optional), &n, &s);
        send(&required, &post("/v1/orders").body("{}")).await.problem(400, "missing-idempotency-key");
        assert_eq!(send(&optional, &post("/v1/orders").body("{}")).await.status, 201);
        send(&required, &post("/v1/orders").key("bad key").body("{}")).await.problem(400, "invalid-idempotency-key");
        send(&required, &post("/v1/orders").key("k1").anonymous().body("{}")).await.problem(401, "missing-principal");
        send(&required, &common::Req::new(http::Method::GET, "/v1/orders")).await;
    });
    assert_eq!(
        seen.rows(),
        vec![pair("rejected", "-"), pair("skipped", "-"), pair("rejected", "-"), pair("rejected", "-")],
        "four non-safe requests, four spans; the GET has none"
    );
    seen.assert_counters_match_spans();
}

#[test]
fn a_body_over_the_stored_limit_is_not_retained() {
    let env = Env::new();
    let seen = observe(false, || async move {
        let (n, s) = (Counter::default(), Script::default());
        s.then(Step::Big(1_000));
        let app = app(layer(&env).with_policy(common::policy(|p| p.max_stored_body = 999)), &n, &s);
        send(&app, &post("/v1/orders").key("k1").body("{}")).await;
    });
    assert_eq!(seen.rows(), vec![pair("claimed", "not_retained")]);
    seen.assert_counters_match_spans();
    assert_eq!(seen.counter("idem_bodies_not_retained_total", &[("endpoint", ORDERS)]), 1);
}

#[test]
fn a_completion_after_a_reclaim_is_lease_lost() {
    let env = Env::new();
    let seen = observe(false, || async move {
        let (n, s, gate) = (Counter::default(), Script::default(), Gate::default());
        s.then(Step::Hold(gate.clone()));
        let app = app(layer(&env), &n, &s);
        let req = post("/v1/orders").key("k1").body("{}");
        let slow = tokio::spawn({
            let (app, req) = (app.clone(), req.clone());
            async move { send(&app, &req).await }
        });
        gate.started().await;
        env.advance_ms(LEASE_MS);
        assert_eq!(send(&app, &req).await.status, 201, "the retry reclaims and completes");
        gate.release();
        assert_eq!(slow.await.unwrap().status, 201, "the slow attempt's response is still returned");
    });
    assert_eq!(seen.rows(), vec![pair("claimed", "lease_lost"), pair("reclaimed", "completed")]);
    seen.assert_counters_match_spans();
    assert_eq!(seen.counter("idem_lease_lost_total", &[("endpoint", ORDERS)]), 1);
}

/// A handler that sleeps (tokio time) inside a span of its own.
fn slow_app(env: &Env, sleep: Duration) -> Router {
    let handler = move |_req: Request<Body>| {
        async move {
            tracing::info!("handler started");
            tokio::time::sleep(sleep).await;
            (http::StatusCode::CREATED, "{}")
        }
        .instrument(tracing::info_span!("handler"))
    };
    Router::new().route("/v1/orders", axum::routing::post(handler)).layer(layer(env))
}

#[test]
fn renewals_are_counted_and_the_handler_span_nests_under_the_request_span() {
    let env = Env::new();
    let seen = observe(true, || async move {
        // Lease 300 s, renewed every 100 s: a 250 s handler renews twice.
        let app = slow_app(&env, Duration::from_secs(250));
        assert_eq!(send(&app, &post("/v1/orders").key("k1").body("{}")).await.status, 201);
    });
    assert_eq!(seen.rows(), vec![pair("claimed", "completed")]);
    let request = seen.spans.iter().position(|s| s.name == "idempotency").unwrap();
    assert_eq!(seen.spans[request].get("renewals"), Some("2"));
    let handler = seen.spans.iter().find(|s| s.name == "handler").expect("the handler's span");
    assert_eq!(handler.parent, Some(request), "the handler's span is a child of the idempotency span");
    seen.assert_counters_match_spans();
    assert_eq!(seen.counter("idem_lease_renewals_total", &[("endpoint", ORDERS)]), 2);
    assert_eq!(seen.histogram_len("idem_store_call_seconds", &[("operation", "extend"), ("backend", "memory")]), 2);
}

#[test]
fn a_detached_handler_keeps_its_parent_span_after_the_client_left() {
    let env = Env::new();
    let seen = observe(true, || async move {
        let app = slow_app(&env, Duration::from_secs(5));
        // The client gives up after 1 s; the handler goes on in a task of its own.
        let req = post("/v1/orders").key("k1").body("{}");
        let gone = tokio::time::timeout(Duration::from_secs(1), send(&app, &req)).await;
        assert!(gone.is_err(), "the client left before the handler finished");
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert!(send(&app, &req).await.replayed(), "the detached handler finished and stored its response");
    });
    assert_eq!(seen.rows(), vec![pair("claimed", "completed"), pair("replayed", "-")]);
    let request = seen.spans.iter().position(|s| s.name == "idempotency").unwrap();
    let handler = seen.spans.iter().find(|s| s.name == "handler").expect("the handler's span");
    assert_eq!(handler.parent, Some(request));
    seen.assert_counters_match_spans();
}

#[test]
fn the_sweeper_counts_its_sweeps_and_the_records_it_removed() {
    let env = Env::new();
    let seen = observe(true, || async move {
        let (n, s) = (Counter::default(), Script::default());
        let app = app(layer(&env), &n, &s);
        send(&app, &post("/v1/orders").key("k1").body("{}")).await;
        env.advance_ms(24 * 3_600_000 + 1);
        let sweeper = idem_core::sweeper::Sweeper::start(
            env.store.clone(),
            idem_core::sweeper::SweepConfig::default().with_period(Duration::from_secs(60)),
        );
        // The first sweep runs at once; let the paused clock reach the second.
        tokio::time::sleep(Duration::from_secs(61)).await;
        sweeper.stop().await;
        assert!(env.record("tok-p", ORDERS, "k1").await.is_none(), "swept");
    });
    assert!(seen.counter("idem_sweeps_total", &[("backend", "memory"), ("status", "ok")]) >= 2);
    assert_eq!(seen.counter("idem_swept_records_total", &[("backend", "memory")]), 1);
}
