//! SDK retries are safe: a conditional write whose first send landed but whose answer was
//! lost is sent again by the SDK; the resend is refused, and the store must read the item
//! it gets back (carrying this call's own nonce) as its own success, never as someone
//! else's claim or a lost lease. The answer is "lost" by an interceptor that turns the
//! first answer of one operation into an HTTP 500, which the SDK retries.

use crate::common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::{
    ClaimOutcome, ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, ManualClock, RecordState, Scope, Store,
    StoredResponse,
};
use idem_dynamodb::aws_sdk_dynamodb::Client;
use idem_dynamodb::aws_sdk_dynamodb::config::interceptors::{
    BeforeDeserializationInterceptorContextMut, BeforeTransmitInterceptorContextRef,
};
use idem_dynamodb::aws_sdk_dynamodb::config::{ConfigBag, Intercept, RuntimeComponents};
use idem_dynamodb::aws_sdk_dynamodb::error::BoxError;
use idem_dynamodb::{Config, DynamoStore};

/// Answers the first `target` call (`DynamoDB_20120810.PutItem`, ...) it is armed for
/// with HTTP 500 after DynamoDB applied it.
#[derive(Debug, Default)]
struct LoseAnswer {
    target: Mutex<Option<&'static str>>,
    current: Mutex<String>,
    lost: AtomicUsize,
    armed: AtomicBool,
}

impl LoseAnswer {
    fn arm(&self, target: &'static str) {
        *self.target.lock().expect("lock") = Some(target);
        self.armed.store(true, Ordering::SeqCst);
    }
}

impl Intercept for LoseAnswer {
    fn name(&self) -> &'static str {
        "LoseAnswer"
    }

    fn read_before_transmit(
        &self,
        context: &BeforeTransmitInterceptorContextRef<'_>,
        _: &RuntimeComponents,
        _: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        let target = context.request().headers().get("x-amz-target").unwrap_or_default().to_owned();
        *self.current.lock().map_err(|_| "lock poisoned")? = target;
        Ok(())
    }

    fn modify_before_deserialization(
        &self,
        context: &mut BeforeDeserializationInterceptorContextMut<'_>,
        _: &RuntimeComponents,
        _: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        let target = *self.target.lock().map_err(|_| "lock poisoned")?;
        let current = self.current.lock().map_err(|_| "lock poisoned")?.clone();
        if target.is_some_and(|t| t == current) && self.armed.swap(false, Ordering::SeqCst) {
            assert!(context.response().status().is_success(), "the first send landed");
            *context.response_mut().status_mut() = 500u16.try_into()?;
            self.lost.fetch_add(1, Ordering::SeqCst);
        }
        Ok(())
    }
}

fn claim_req() -> ClaimRequest {
    let scope = Scope::new(format!("resend-{}", uuid::Uuid::new_v4().simple()), Endpoint::new("POST", "/t"))
        .expect("principal");
    ClaimRequest::new(
        scope,
        IdempotencyKey::parse(b"k").expect("key"),
        Fingerprint::of_bytes(b"body"),
        Duration::from_secs(10),
        Duration::from_secs(60),
    )
}

async fn store_with(interceptor: Arc<LoseAnswer>) -> DynamoStore {
    let conf = common::client().config().to_builder().interceptor(SharedLose(interceptor)).build();
    let client = Client::from_conf(conf);
    let config = Config::default().with_table(common::fresh_table()).with_clock(Arc::new(ManualClock::starting_now()));
    DynamoStore::from_client(client, config)
        .await
        .unwrap_or_else(|e| panic!("DynamoDB at {} (run scripts/services): {e}", common::url()))
}

/// The interceptor, shared with the test that arms it.
#[derive(Debug)]
struct SharedLose(Arc<LoseAnswer>);

impl Intercept for SharedLose {
    fn name(&self) -> &'static str {
        "SharedLose"
    }
    fn read_before_transmit(
        &self,
        context: &BeforeTransmitInterceptorContextRef<'_>,
        rc: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        self.0.read_before_transmit(context, rc, cfg)
    }
    fn modify_before_deserialization(
        &self,
        context: &mut BeforeDeserializationInterceptorContextMut<'_>,
        rc: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        self.0.modify_before_deserialization(context, rc, cfg)
    }
}

/// A claim whose answer was lost is still this caller's claim after the SDK resends it;
/// a completion whose answer was lost is still this caller's completion.
#[tokio::test]
async fn a_resent_claim_or_completion_reads_as_the_callers_own() {
    let lose = Arc::new(LoseAnswer::default());
    let store = store_with(Arc::clone(&lose)).await;
    let req = claim_req();

    lose.arm("DynamoDB_20120810.PutItem");
    let claimed = store.claim(req.clone()).await.expect("claim");
    assert_eq!(lose.lost.load(Ordering::SeqCst), 1, "the first answer was lost and the SDK sent the put again");
    let ClaimOutcome::Claimed(r) = claimed else { panic!("a resent claim read as someone else's: {claimed:?}") };

    lose.arm("DynamoDB_20120810.UpdateItem");
    let receipt = store.complete(r.id, r.token, StoredResponse::new(201, vec![], b"made".to_vec())).await;
    assert_eq!(lose.lost.load(Ordering::SeqCst), 2);
    let receipt = receipt.expect("a resent completion is the caller's own, not LeaseLost");
    assert_eq!(receipt.token, r.token);
    let got = store.get(r.id).await.expect("get").expect("present");
    assert_eq!(got.state, RecordState::Completed);
    assert_eq!(got.response.expect("response").status, 201);
}
