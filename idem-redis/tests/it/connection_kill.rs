//! A connection killed in the middle of a claim or a completion leaves the record either
//! committed or untouched, never half-written, and the store's reconnecting connection
//! serves the next call.
//!
//! Redis runs a script atomically, so the only cuts that can happen are "before the script
//! ran" and "after it ran, before the reply arrived". Both are forced deterministically on
//! a private server: a busy script on another connection holds the server's event loop
//! while the claim and a `CLIENT KILL` for the store's connection queue up in their
//! sockets, in the order the test chooses; when the loop resumes it serves them in arrival
//! order. A third test kills the connection at random points while a large completion is
//! being sent.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use idem_core::{
    ClaimOutcome, ClaimRequest, Endpoint, FencingToken, Fingerprint, IdempotencyKey, ManualClock, Receipt, Record,
    RecordState, Scope, Store, StoreError, StoredResponse,
};
use idem_redis::RedisStore;
use redis::AsyncCommands;

/// How long the busy script holds the server. Below Redis' 5 s busy threshold, so other
/// clients are simply not served (no `BUSY` replies) until it ends.
const HOLD_MS: u64 = 800;

fn req(key: &str) -> ClaimRequest {
    let scope = Scope::new("p", Endpoint::new("POST", "/v1/workers")).expect("scope");
    ClaimRequest::new(
        scope,
        IdempotencyKey::parse(key.as_bytes()).expect("key"),
        Fingerprint::of_bytes(b"body"),
        Duration::from_secs(5),
        Duration::from_secs(60),
    )
}

async fn conn(url: &str) -> redis::aio::MultiplexedConnection {
    let client = redis::Client::open(url).expect("url");
    let config = redis::AsyncConnectionConfig::new().set_response_timeout(Some(Duration::from_secs(10)));
    client.get_multiplexed_async_connection_with_config(&config).await.expect("connection")
}

async fn store_on(server: &common::PrivateRedis, clock: &ManualClock) -> RedisStore {
    let config = common::test_config("idem:", Arc::new(clock.clone())).with_response_timeout(Duration::from_secs(10));
    RedisStore::connect(&server.url, config).await.expect("connect")
}

async fn client_id(store: &RedisStore) -> i64 {
    let mut c = store.connection();
    redis::cmd("CLIENT").arg("ID").query_async(&mut c).await.expect("CLIENT ID")
}

/// Holds the server's event loop for [`HOLD_MS`] with a script that only reads `TIME`.
fn hold_server(mut c: redis::aio::MultiplexedConnection) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let script = "local t = redis.call('TIME') local s = t[1] * 1000000 + t[2] \
                      repeat local n = redis.call('TIME') until n[1] * 1000000 + n[2] - s > tonumber(ARGV[1]) \
                      return 1";
        let _: i64 =
            redis::cmd("EVAL").arg(script).arg(0).arg(HOLD_MS * 1_000).query_async(&mut c).await.expect("hold");
    })
}

fn kill(mut c: redis::aio::MultiplexedConnection, id: i64) -> tokio::task::JoinHandle<i64> {
    tokio::spawn(
        async move { redis::cmd("CLIENT").arg("KILL").arg("ID").arg(id).query_async(&mut c).await.expect("kill") },
    )
}

/// Lets already-sent bytes reach the server's socket while it is held: orders events on
/// the wire, it does not move the store's clock.
async fn settle() {
    tokio::time::sleep(Duration::from_millis(100)).await;
}

/// The next call after a killed connection: `get` is read-only, so the store sends it once
/// more after an I/O error, on the connection the manager opens in the meantime.
async fn get_after_reconnect(store: &RedisStore, id: idem_core::RecordId) -> Option<Record> {
    store.get(id).await.expect("the reconnected store serves the next call")
}

fn assert_whole_claim(r: &Record, req: &ClaimRequest, clock: &ManualClock) {
    assert_eq!(r.id, req.id());
    assert_eq!(r.scope, req.scope().clone());
    assert_eq!(r.key, req.key().clone());
    assert_eq!(r.fingerprint, req.fingerprint());
    assert_eq!(r.state, RecordState::InFlight);
    assert_eq!(r.token, FencingToken::first_at(idem_core::UnixMillis(clock.now_ms())));
    assert_eq!(r.response, None);
    assert_eq!((r.created_at.0, r.started_at.0), (clock.now_ms(), clock.now_ms()));
    assert_eq!(r.lease_expires_at.0, clock.now_ms() + 5_000);
    assert_eq!(r.expires_at.0, clock.now_ms() + 60_000);
}

/// Killed before the claim script ran: nothing is written; the caller gets a retryable
/// error, and a retry claims normally.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_before_the_claim_runs_commits_nothing() {
    let server = common::PrivateRedis::start(&[]).await;
    let clock = ManualClock::starting_now();
    let store = store_on(&server, &clock).await;
    let id = client_id(&store).await;
    let r = req("k");

    // Both helper connections exist before the hold: a connection opened during it would
    // only be accepted after it, behind everything else.
    let (holder, killer) = (conn(&server.url).await, conn(&server.url).await);
    let hold = hold_server(holder);
    settle().await;
    let killed = kill(killer, id);
    settle().await;
    let claim = {
        let store = store.clone();
        let r = r.clone();
        tokio::spawn(async move { store.claim(r).await })
    };
    hold.await.expect("hold task");
    assert_eq!(killed.await.expect("kill task"), 1, "the store's connection was killed");
    let outcome = claim.await.expect("claim task");
    let e = outcome.expect_err("the claim's connection was killed before it ran");
    assert!(matches!(e, StoreError::Unavailable { retryable: true, .. }), "{e:?}");

    let mut admin = server.admin().await;
    let exists: bool = admin.exists(store.record_key(r.id())).await.expect("EXISTS");
    assert!(!exists, "a claim that never ran left no record");
    assert_eq!(get_after_reconnect(&store, r.id()).await, None);
    match store.claim(r.clone()).await.expect("claim after reconnect") {
        ClaimOutcome::Claimed(c) => assert_whole_claim(&c, &r, &clock),
        other => panic!("expected Claimed, got {other:?}"),
    }
    assert_ne!(client_id(&store).await, id, "the connection manager reconnected");
}

/// Killed after the claim script ran, before its reply was read: the claim is committed
/// whole, the caller gets a retryable error, and a retry sees the in-flight record (409
/// until its lease ends), never a second claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_after_the_claim_ran_keeps_a_whole_record() {
    let server = common::PrivateRedis::start(&[]).await;
    let clock = ManualClock::starting_now();
    let store = store_on(&server, &clock).await;
    let id = client_id(&store).await;
    let r = req("k");

    let (holder, killer) = (conn(&server.url).await, conn(&server.url).await);
    let hold = hold_server(holder);
    settle().await;
    let claim = {
        let store = store.clone();
        let r = r.clone();
        tokio::spawn(async move { store.claim(r).await })
    };
    settle().await;
    let killed = kill(killer, id);
    hold.await.expect("hold task");
    assert_eq!(killed.await.expect("kill task"), 1, "the store's connection was killed");
    let e = claim.await.expect("claim task").expect_err("the reply was lost with the connection");
    assert!(matches!(e, StoreError::Unavailable { retryable: true, .. }), "{e:?}");

    let stored = get_after_reconnect(&store, r.id()).await.expect("the claim ran, so the record exists");
    assert_whole_claim(&stored, &r, &clock);
    match store.claim(r.clone()).await.expect("claim after reconnect") {
        ClaimOutcome::Existing { record, .. } => assert_eq!(record, stored),
        other => panic!("a retry must see the committed claim, got {other:?}"),
    }
}

/// Kills at random points while 2 MiB completions are being sent: each record ends either
/// still in flight with no response (the command never arrived whole) or completed with
/// every byte of it, and the store keeps working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kills_during_large_completions_never_leave_half_a_record() {
    let server = common::PrivateRedis::start(&[]).await;
    let clock = ManualClock::starting_now();
    let store = store_on(&server, &clock).await;
    let body: Vec<u8> = (0..2u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8).collect();
    let response = StoredResponse::new(201, vec![("location".into(), b"/v1/workers/42".to_vec())], body);
    let mut admin = conn(&server.url).await;
    // How long one completion takes here (encoding and upload dominate), so the kills can
    // be spread over it.
    let probe = claim_fresh(&store, &req("probe")).await;
    let started = std::time::Instant::now();
    store.complete(probe.id, probe.token, response.clone()).await.expect("uncut completion");
    let span = started.elapsed();
    let (mut committed, mut not_committed) = (0, 0);
    for i in 0..24u64 {
        let r = req(&format!("k{i}"));
        let claimed = claim_fresh(&store, &r).await;
        let id = client_id(&store).await;
        let complete = {
            let store = store.clone();
            let response = response.clone();
            tokio::spawn(async move { store.complete(claimed.id, claimed.token, response).await })
        };
        // Spread the kill from at once to 1.4 times the uncut completion's duration.
        tokio::time::sleep(span * u32::try_from(i % 8).expect("small") / 5).await;
        let _: i64 = redis::cmd("CLIENT").arg("KILL").arg("ID").arg(id).query_async(&mut admin).await.expect("kill");
        let result = complete.await.expect("complete task");
        let stored = get_after_reconnect(&store, r.id()).await.expect("the claim is still there");
        match stored.state {
            RecordState::Completed => {
                committed += 1;
                assert_eq!(stored.response.as_ref(), Some(&response), "key {i}: a stored response is whole");
                if let Ok(done) = result {
                    assert_eq!(done, Receipt::of(&stored), "key {i}: the receipt reports the record as written");
                }
            }
            RecordState::InFlight => {
                not_committed += 1;
                assert!(result.is_err(), "key {i}: complete reported success but nothing was stored");
                assert_eq!(stored, claimed, "key {i}: an uncommitted completion changed nothing");
            }
            RecordState::Failed => panic!("key {i}: nobody failed this record"),
        }
    }
    eprintln!("one completion takes {span:?}");
    eprintln!("kills during completion: {committed} committed, {not_committed} not committed, 0 half");
    assert_eq!(committed + not_committed, 24);
}

/// Claims a fresh key, retrying the retryable error a killed connection leaves behind.
async fn claim_fresh(store: &RedisStore, r: &ClaimRequest) -> Record {
    loop {
        match store.claim(r.clone()).await {
            Ok(ClaimOutcome::Claimed(c)) => return c,
            Ok(other) => panic!("fresh key {}: {other:?}", r.key().clone()),
            Err(e) if e.is_retryable() => continue,
            Err(e) => panic!("claim {}: {e:?}", r.key().clone()),
        }
    }
}

/// A connection killed while idle (a server restart, an idle timeout) is only noticed by
/// the next command. A read is resent and succeeds; a write fails retryably without having
/// run (its bytes never reached a live connection), and the call after it works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_while_idle_reads_recover_and_writes_fail_cleanly() {
    let server = common::PrivateRedis::start(&[]).await;
    let clock = ManualClock::starting_now();
    let store = store_on(&server, &clock).await;
    let mut admin = conn(&server.url).await;
    let r1 = claim_fresh(&store, &req("k1")).await;

    let id = client_id(&store).await;
    let _: i64 = redis::cmd("CLIENT").arg("KILL").arg("ID").arg(id).query_async(&mut admin).await.expect("kill");
    assert_eq!(store.get(r1.id).await.expect("get is resent after the idle kill"), Some(r1.clone()));

    let id = client_id(&store).await;
    let _: i64 = redis::cmd("CLIENT").arg("KILL").arg("ID").arg(id).query_async(&mut admin).await.expect("kill");
    let r2 = req("k2");
    match store.claim(r2.clone()).await {
        Err(e) => {
            assert!(e.is_retryable(), "{e:?}");
            let exists: bool = admin.exists(store.record_key(r2.id())).await.expect("EXISTS");
            assert!(!exists, "a write that failed on a dead connection did not run");
            match store.claim(r2.clone()).await.expect("the next call works") {
                ClaimOutcome::Claimed(c) => assert_whole_claim(&c, &r2, &clock),
                other => panic!("expected Claimed, got {other:?}"),
            }
        }
        // The manager may already have replaced the connection.
        Ok(ClaimOutcome::Claimed(c)) => assert_whole_claim(&c, &r2, &clock),
        Ok(other) => panic!("fresh key: {other:?}"),
    }
    let receipt = store.fail(r1.id, r1.token).await.expect("fail");
    let f = store.get(r1.id).await.expect("get").expect("the failed record is live");
    assert_eq!(receipt, Receipt::of(&f), "the receipt reports the record as written");
    assert_eq!(f.state, RecordState::Failed);
}
