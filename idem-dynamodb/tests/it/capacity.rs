//! What a call costs in DynamoDB requests and capacity units, with the store used as the
//! HTTP layer uses it (`IdempotencyLayer` in front of a handler): a first-time call is at
//! most two writes and no read, a replay one request, an in-flight retry one request. A
//! store that reads the record again after a refused claim (a `GetItem` on top of the
//! `PutItem` whose refusal already returned the item) fails here.
//!
//! Requests are counted by an SDK interceptor on the store's client, by operation, resends
//! included. Capacity units are computed from the record item's size by DynamoDB's
//! documented rules (a write 1 WCU per KB of the larger of the item before and after,
//! rounded up, a refused conditional write included; a strongly consistent read 1 RCU per
//! 4 KB): moto reports a flat figure per operation (1 for `PutItem`, 0.5 for
//! `UpdateItem` and `GetItem`) whatever the size and consistency, and nothing for a
//! refused write, so its figure is only printed beside ours. `cargo test -p idem-dynamodb --features live-tests --test it capacity --
//! --nocapture` prints the table BENCHMARKS.md shows.

use crate::common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use idem_dynamodb::aws_sdk_dynamodb::Client;
use idem_dynamodb::aws_sdk_dynamodb::config::interceptors::{
    AfterDeserializationInterceptorContextRef, BeforeSerializationInterceptorContextMut,
    BeforeTransmitInterceptorContextRef,
};
use idem_dynamodb::aws_sdk_dynamodb::config::{ConfigBag, Intercept, RuntimeComponents};
use idem_dynamodb::aws_sdk_dynamodb::error::BoxError;
use idem_dynamodb::aws_sdk_dynamodb::operation::delete_item::{DeleteItemInput, DeleteItemOutput};
use idem_dynamodb::aws_sdk_dynamodb::operation::get_item::{GetItemInput, GetItemOutput};
use idem_dynamodb::aws_sdk_dynamodb::operation::put_item::{PutItemInput, PutItemOutput};
use idem_dynamodb::aws_sdk_dynamodb::operation::transact_write_items::{
    TransactWriteItemsInput, TransactWriteItemsOutput,
};
use idem_dynamodb::aws_sdk_dynamodb::operation::update_item::{UpdateItemInput, UpdateItemOutput};
use idem_dynamodb::aws_sdk_dynamodb::types::{AttributeValue, ConsumedCapacity, ReturnConsumedCapacity};
use idem_dynamodb::{Config, DynamoStore};
use idem_http::IdempotencyLayer;
use tokio::sync::Notify;
use tower::ServiceExt;

/// One request the store sent: its operation (`PutItem`, ...), whether DynamoDB refused it
/// (a failed condition: HTTP 400), and the capacity the emulator reported.
#[derive(Clone, Debug)]
struct Call {
    op: String,
    refused: bool,
    reported: Option<f64>,
}

/// Counts every request of the client it is registered on, and asks each for its
/// `ConsumedCapacity` (`TOTAL`).
#[derive(Debug, Default)]
struct Meter {
    calls: Mutex<Vec<Call>>,
}

impl Meter {
    fn take(&self) -> Vec<Call> {
        std::mem::take(&mut *self.calls.lock().expect("meter lock"))
    }
}

fn reported(c: Option<&ConsumedCapacity>) -> Option<f64> {
    c.and_then(ConsumedCapacity::capacity_units)
}

/// The interceptor, shared with the test that reads it.
#[derive(Debug)]
struct SharedMeter(Arc<Meter>);

impl Intercept for SharedMeter {
    fn name(&self) -> &'static str {
        "Meter"
    }

    fn modify_before_serialization(
        &self,
        context: &mut BeforeSerializationInterceptorContextMut<'_>,
        _: &RuntimeComponents,
        _: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        let total = Some(ReturnConsumedCapacity::Total);
        let input = context.input_mut();
        if let Some(i) = input.downcast_mut::<PutItemInput>() {
            i.return_consumed_capacity = total;
        } else if let Some(i) = input.downcast_mut::<UpdateItemInput>() {
            i.return_consumed_capacity = total;
        } else if let Some(i) = input.downcast_mut::<GetItemInput>() {
            i.return_consumed_capacity = total;
        } else if let Some(i) = input.downcast_mut::<DeleteItemInput>() {
            i.return_consumed_capacity = total;
        } else if let Some(i) = input.downcast_mut::<TransactWriteItemsInput>() {
            i.return_consumed_capacity = total;
        }
        Ok(())
    }

    fn read_before_transmit(
        &self,
        context: &BeforeTransmitInterceptorContextRef<'_>,
        _: &RuntimeComponents,
        _: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        let target = context.request().headers().get("x-amz-target").unwrap_or_default();
        let op = target.rsplit('.').next().unwrap_or(target).to_owned();
        self.0.calls.lock().map_err(|_| "meter lock poisoned")?.push(Call { op, refused: false, reported: None });
        Ok(())
    }

    fn read_after_deserialization(
        &self,
        context: &AfterDeserializationInterceptorContextRef<'_>,
        _: &RuntimeComponents,
        _: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        let mut calls = self.0.calls.lock().map_err(|_| "meter lock poisoned")?;
        let Some(call) = calls.last_mut() else { return Ok(()) };
        call.refused = context.response().status().as_u16() == 400;
        if let Ok(out) = context.output_or_error() {
            call.reported = reported(
                out.downcast_ref::<PutItemOutput>()
                    .and_then(|o| o.consumed_capacity.as_ref())
                    .or_else(|| out.downcast_ref::<UpdateItemOutput>().and_then(|o| o.consumed_capacity.as_ref()))
                    .or_else(|| out.downcast_ref::<GetItemOutput>().and_then(|o| o.consumed_capacity.as_ref()))
                    .or_else(|| out.downcast_ref::<DeleteItemOutput>().and_then(|o| o.consumed_capacity.as_ref()))
                    .or_else(|| {
                        out.downcast_ref::<TransactWriteItemsOutput>()
                            .and_then(|o| o.consumed_capacity.as_deref()?.first())
                    }),
            );
        }
        Ok(())
    }
}

/// An item's size as DynamoDB counts it: each attribute's name plus its value (a string's
/// or binary's bytes, a number's significant digits two per byte plus one).
fn item_size(item: &HashMap<String, AttributeValue>) -> usize {
    item.iter()
        .map(|(name, value)| {
            name.len()
                + match value {
                    AttributeValue::S(s) => s.len(),
                    AttributeValue::B(b) => b.as_ref().len(),
                    AttributeValue::N(n) => {
                        let digits = n.trim_start_matches('-').replace('.', "");
                        digits.trim_start_matches('0').trim_end_matches('0').len().div_ceil(2) + 1
                    }
                    AttributeValue::Bool(_) | AttributeValue::Null(_) => 1,
                    other => panic!("the store writes only S, N and B attributes, not {other:?}"),
                }
        })
        .sum()
}

/// The record item's size now (read with a client the meter does not see; the table
/// holds one record).
async fn record_size(table: &str) -> usize {
    let out = common::client().scan().table_name(table).consistent_read(true).send().await.expect("Scan");
    let records: Vec<_> = out.items().iter().filter(|i| i.get("sk") == Some(&AttributeValue::S("r".into()))).collect();
    assert_eq!(records.len(), 1, "one record item");
    item_size(records[0])
}

/// What one step of a call cost.
#[derive(Debug)]
struct Step {
    name: &'static str,
    calls: Vec<Call>,
    wcu: usize,
    rcu: usize,
}

impl Step {
    /// Capacity by DynamoDB's rules, with the record item `before` and `after` the step
    /// (bytes) and `claim` the size of the item a claim puts: a write is charged on the
    /// larger of the item it finds and the one it leaves (a refused one too, at least 1
    /// WCU), a strongly consistent read on the item it reads.
    fn new(name: &'static str, calls: Vec<Call>, before: usize, after: usize, claim: usize) -> Self {
        let (mut wcu, mut rcu) = (0, 0);
        for c in &calls {
            match c.op.as_str() {
                "PutItem" => wcu += before.max(after).max(claim).div_ceil(1024).max(1),
                "UpdateItem" | "DeleteItem" => wcu += before.max(after).div_ceil(1024).max(1),
                "GetItem" => rcu += before.div_ceil(4096).max(1),
                other => panic!("{name}: a {other} the measurement does not price"),
            }
        }
        Self { name, calls, wcu, rcu }
    }

    fn count(&self, op: &str) -> usize {
        self.calls.iter().filter(|c| c.op == op).count()
    }

    fn reads(&self) -> usize {
        self.calls.iter().filter(|c| matches!(c.op.as_str(), "GetItem" | "Query" | "Scan" | "BatchGetItem")).count()
    }

    fn row(&self) -> String {
        let requests: Vec<String> =
            self.calls.iter().map(|c| format!("{}{}", c.op, if c.refused { " (refused)" } else { "" })).collect();
        let moto: Vec<String> =
            self.calls.iter().map(|c| c.reported.map_or("none".to_owned(), |u| format!("{u}"))).collect();
        format!(
            "| {} | {} | {} | {} | {} | {} |",
            self.name,
            self.calls.len(),
            requests.join(" + "),
            self.wcu,
            self.rcu,
            moto.join(" + ")
        )
    }
}

/// The handler behind the layer: counts its runs, and holds the first run until released
/// so that a second caller finds the claim in flight.
#[derive(Default)]
struct Handler {
    runs: AtomicUsize,
    started: Notify,
    release: Notify,
}

fn request(body_len: usize) -> Request<Body> {
    Request::post("/v1/workers")
        .header("authorization", "Bearer capacity")
        .header("idempotency-key", "capacity-k1")
        .header("content-type", "application/json")
        .body(Body::from(format!(r#"{{"image":"worker-base","pad":"{}"}}"#, "x".repeat(body_len))))
        .expect("request")
}

/// One first-time call with an in-flight retry during it, then a replay, for a response
/// body of `body_len` bytes: the steps and the record item's sizes.
async fn measure(body_len: usize) -> (Vec<Step>, usize, usize) {
    let meter = Arc::new(Meter::default());
    let conf = common::client().config().to_builder().interceptor(SharedMeter(Arc::clone(&meter))).build();
    let table = common::fresh_table();
    let store = DynamoStore::from_client(Client::from_conf(conf), Config::default().with_table(&table))
        .await
        .unwrap_or_else(|e| panic!("DynamoDB at {} (run scripts/services): {e}", common::url()));
    meter.take(); // Creating the table is not a call's.

    let handler = Arc::new(Handler::default());
    let h = Arc::clone(&handler);
    let app = Router::new()
        .route(
            "/v1/workers",
            post(move || {
                let h = Arc::clone(&h);
                async move {
                    if h.runs.fetch_add(1, Ordering::SeqCst) == 0 {
                        h.started.notify_one();
                        h.release.notified().await;
                    }
                    let body = format!(r#"{{"id":"w-1","image":"worker-base","pad":"{}"}}"#, "y".repeat(body_len));
                    (StatusCode::CREATED, [("content-type", "application/json")], body)
                }
            }),
        )
        .layer(IdempotencyLayer::new(Arc::new(store)));

    let first = tokio::spawn(app.clone().oneshot(request(body_len)));
    handler.started.notified().await;
    let claimed = record_size(&table).await;
    let claim = Step::new("first-time call: claim", meter.take(), 0, claimed, claimed);

    let retry = app.clone().oneshot(request(body_len)).await.expect("in-flight retry");
    assert_eq!(retry.status(), StatusCode::CONFLICT, "a retry while the first call runs is told it is in flight");
    let in_flight = Step::new("in-flight retry", meter.take(), claimed, claimed, claimed);

    handler.release.notify_one();
    let answered = first.await.expect("first call task").expect("first call");
    assert_eq!(answered.status(), StatusCode::CREATED);
    let done = record_size(&table).await;
    let complete = Step::new("first-time call: completion", meter.take(), claimed, done, claimed);

    let replay = app.oneshot(request(body_len)).await.expect("replay");
    assert_eq!(replay.status(), StatusCode::CREATED);
    assert_eq!(replay.headers().get("idempotent-replayed").map(|v| v.as_bytes()), Some(&b"true"[..]));
    let replayed = Step::new("replay", meter.take(), done, done, claimed);
    assert_eq!(handler.runs.load(Ordering::SeqCst), 1, "the handler ran once");
    (vec![claim, complete, in_flight, replayed], claimed, done)
}

/// A first-time call is at most two writes and no read; a replay and an in-flight retry
/// are one request each, the claim's refused `PutItem` (its refusal returns the record, so
/// no `GetItem` follows).
#[tokio::test]
async fn a_first_call_is_two_writes_a_replay_and_an_in_flight_retry_one_request() {
    let mut table = vec![
        "| step | requests | by operation | WCU | RCU | moto's ConsumedCapacity |".to_owned(),
        "|---|---:|---|---:|---:|---|".to_owned(),
    ];
    for body_len in [200, 3_000] {
        let (steps, claimed, done) = measure(body_len).await;
        let [claim, complete, in_flight, replay] = &steps[..] else { unreachable!() };
        let first: Vec<&Call> = claim.calls.iter().chain(&complete.calls).collect();
        assert!(first.len() <= 2, "a first-time call: {first:?}");
        assert_eq!(claim.reads() + complete.reads(), 0, "a first-time call reads nothing: {first:?}");
        assert_eq!((claim.count("PutItem"), complete.count("UpdateItem")), (1, 1), "{first:?}");
        assert_eq!(replay.calls.len(), 1, "a replay is one request: {:?}", replay.calls);
        assert_eq!((replay.count("PutItem"), replay.reads()), (1, 0), "{:?}", replay.calls);
        assert_eq!(in_flight.calls.len(), 1, "an in-flight retry is one request: {:?}", in_flight.calls);
        assert_eq!((in_flight.count("PutItem"), in_flight.reads()), (1, 0), "{:?}", in_flight.calls);
        assert!(replay.calls[0].refused && in_flight.calls[0].refused);
        table.push(format!(
            "| *response body {body_len} B: record item {claimed} B in flight, {done} B completed* ||||||"
        ));
        table.extend(steps.iter().map(Step::row));
        table.push(format!(
            "| first-time call, in all | {} | | {} | {} | |",
            first.len(),
            claim.wcu + complete.wcu,
            claim.rcu + complete.rcu
        ));
    }
    println!("{}", table.join("\n"));
}
