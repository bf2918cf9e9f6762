//! Redis-specific behaviour the generic suite cannot see: the key layout and its native
//! expiry, exact 64-bit arithmetic inside the scripts, byte-exact responses, corrupt and
//! foreign values, script reloading, the `maxmemory-policy` and persistence checks, `WAIT`
//! with a real replica (and a paused one), `READONLY`, and a differential run against
//! `idem_conformance::Spec`.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use idem_conformance::{Oracle, Spec};
use idem_core::{
    ClaimOutcome, ClaimRequest, Clock, Endpoint, FencingToken, Fingerprint, IdempotencyKey, JournalWrite, ManualClock,
    Receipt, ReclaimOutcome, ReclaimRequest, Record, RecordId, RecordState, Scope, Store, StoreError, StoredBody,
    StoredResponse, SystemClock, UnixMillis,
};
use idem_redis::{Config, Error, EvictionCheck, PersistenceCheck, RedisStore, ReplicaAck};
use redis::AsyncCommands;

const LEASE: Duration = Duration::from_secs(5);
const RETENTION: Duration = Duration::from_secs(60);

fn req(principal: &str, key: &str, body: &[u8]) -> ClaimRequest {
    let scope = Scope::new(principal, Endpoint::new("POST", "/v1/workers")).expect("scope");
    ClaimRequest::new(
        scope,
        IdempotencyKey::parse(key.as_bytes()).expect("key"),
        Fingerprint::of_bytes(body),
        LEASE,
        RETENTION,
    )
}

async fn test_store() -> (RedisStore, ManualClock) {
    let clock = ManualClock::starting_now();
    let store = common::connect(common::test_config(&common::fresh_prefix(), Arc::new(clock.clone()))).await;
    (store, clock)
}

/// A reclaim of `record` (its current token and fingerprint), with `retention` from now.
fn reclaim_of(record: &Record, retention: Duration) -> ReclaimRequest {
    ReclaimRequest {
        id: record.id,
        expected: record.token,
        fingerprint: record.fingerprint,
        lease_ttl: LEASE,
        retention,
    }
}

async fn claim(store: &RedisStore, r: ClaimRequest) -> Record {
    match store.claim(r).await.expect("claim") {
        ClaimOutcome::Claimed(r) => r,
        other => panic!("expected Claimed, got {other:?}"),
    }
}

/// The record a fenced write just wrote, read back; its receipt must report it.
async fn written(store: &RedisStore, id: RecordId, receipt: Receipt) -> Record {
    let record = store.get(id).await.expect("get after a write").expect("the record just written is live");
    assert_eq!(Receipt::of(&record), receipt, "the receipt reports the record as written");
    record
}

async fn pexpiretime(conn: &mut redis::aio::MultiplexedConnection, key: &str) -> i64 {
    redis::cmd("PEXPIRETIME").arg(key).query_async(conn).await.expect("PEXPIRETIME")
}

/// Pins: seconds and milliseconds are never mixed in expiry; the key expires at exactly
/// `expires_at` in ms (plus the configured grace). Also: the record lives at
/// `<prefix>{<id hex>}`, and retention is native, no sweeper.
#[tokio::test]
async fn key_layout_and_native_expiry_on_the_server_clock() {
    let prefix = common::fresh_prefix();
    let store = common::connect(Config::default().with_prefix(&prefix)).await;
    let mut admin = common::admin().await;
    let before = SystemClock.now().0;
    let r = claim(&store, req("p", "k", b"b")).await;
    let after = SystemClock.now().0;
    let key = store.record_key(r.id);
    assert_eq!(key, format!("{prefix}{{{}}}", r.id.to_hex()));
    // Time came from the server (same host here, so it is within the call's window).
    assert!(r.created_at.0 >= before - 1_000 && r.created_at.0 <= after + 1_000, "created_at {}", r.created_at);
    assert_eq!(r.token, FencingToken::first_at(r.created_at), "the first token comes from the server's TIME");
    assert_eq!(r.expires_at.0 - r.created_at.0, 60_000);
    assert_eq!(pexpiretime(&mut admin, &key).await, r.expires_at.0);
    // Completing keeps the key's expiry.
    store.complete(r.id, r.token, StoredResponse::new(200, vec![], b"ok".to_vec())).await.expect("complete");
    assert_eq!(pexpiretime(&mut admin, &key).await, r.expires_at.0);
    assert_eq!(store.sweep(100).await.expect("sweep").removed, 0);

    let graced = common::connect(
        Config::default().with_prefix(common::fresh_prefix()).with_expiry_grace(Duration::from_millis(1_500)),
    )
    .await;
    let g = claim(&graced, req("p", "k", b"b")).await;
    assert_eq!(pexpiretime(&mut admin, &graced.record_key(g.id)).await, g.expires_at.0 + 1_500);
    let _: () = admin.del(&[key, graced.record_key(g.id)]).await.expect("clean up own keys");
}

/// A reclaim that extends retention moves the key's expiry with it; a failed attempt
/// leaves it.
#[tokio::test]
async fn reclaim_moves_native_expiry_forward() {
    let prefix = common::fresh_prefix();
    let store = common::connect(Config::default().with_prefix(&prefix)).await;
    let mut admin = common::admin().await;
    let r = claim(&store, req("p", "k", b"b")).await;
    let f = store.fail(r.id, r.token).await.expect("fail");
    let f = written(&store, r.id, f).await;
    assert_eq!(pexpiretime(&mut admin, &store.record_key(r.id)).await, r.expires_at.0);
    let ReclaimOutcome::Reclaimed(n) = store.reclaim(reclaim_of(&f, Duration::from_secs(120))).await.expect("reclaim")
    else {
        panic!("failed record should be reclaimable")
    };
    assert!(n.expires_at > r.expires_at);
    assert_eq!(pexpiretime(&mut admin, &store.record_key(r.id)).await, n.expires_at.0);
}

/// Under a test clock the key keeps the record's remaining time on that clock plus the
/// grace, so a clock moved a day into the past does not make Redis drop live records.
#[tokio::test]
async fn test_clock_in_the_past_keeps_keys() {
    let clock = ManualClock::starting_now();
    clock.advance_ms(-86_400_000);
    let store = common::connect(
        Config::default()
            .with_prefix(common::fresh_prefix())
            .with_clock(Arc::new(clock.clone()))
            .with_expiry_grace(Duration::from_secs(30)),
    )
    .await;
    let r = claim(&store, req("p", "k", b"b")).await;
    assert_eq!(r.created_at.0, clock.now_ms());
    let mut admin = common::admin().await;
    let pttl: i64 = admin.pttl(store.record_key(r.id)).await.expect("PTTL");
    assert!(pttl > 85_000 && pttl <= 90_000, "60 s remaining + 30 s grace, got {pttl} ms");
    assert_eq!(store.get(r.id).await.expect("get"), Some(r));
}

/// Timestamps and tokens are 64-bit and saturate like the model, with no rounding through
/// Lua doubles: a retention of `u64::MAX` seconds ends at `i64::MAX` ms, and tokens past
/// 2^53 count exactly.
#[tokio::test]
async fn scripts_do_exact_64_bit_arithmetic() {
    let (store, clock) = test_store().await;
    let r = req("p", "forever", b"b");
    let forever = Duration::from_secs(u64::MAX);
    let r = ClaimRequest::new(r.scope().clone(), r.key().clone(), r.fingerprint(), forever, forever);
    let c = claim(&store, r.clone()).await;
    let mut model = Spec::new();
    let ClaimOutcome::Claimed(m) = model.claim(&r, clock.now()) else { panic!("model claims") };
    assert_eq!(c, m);
    assert_eq!((c.lease_expires_at.0, c.expires_at.0), (i64::MAX, i64::MAX));
    assert_eq!(store.get(c.id).await.expect("get"), Some(c.clone()));

    // A record whose token is past 2^53, written as a previous version of the store would.
    let mut admin = common::admin().await;
    let big = (1u64 << 53) + 1;
    let r = req("p", "big-token", b"b");
    let key = store.record_key(r.id());
    let now = clock.now_ms();
    write_raw(&mut admin, &key, &r, IN_FLIGHT, big, now).await;
    let done = store.complete(r.id(), FencingToken(big), StoredResponse::new(200, vec![], vec![])).await;
    let done = done.expect("the exact token completes");
    assert_eq!(done.token, FencingToken(big));
    let stale = store.complete(r.id(), FencingToken(big - 1), StoredResponse::new(200, vec![], vec![])).await;
    assert!(matches!(stale, Err(StoreError::LeaseLost { current: Some(FencingToken(t)), .. }) if t == big));

    let r2 = req("p", "max-token", b"b");
    let key2 = store.record_key(r2.id());
    write_raw(&mut admin, &key2, &r2, FAILED, u64::MAX, now).await;
    let rr = ReclaimRequest {
        id: r2.id(),
        expected: FencingToken(u64::MAX),
        fingerprint: r2.fingerprint(),
        lease_ttl: LEASE,
        retention: RETENTION,
    };
    let ReclaimOutcome::Reclaimed(n) = store.reclaim(rr).await.expect("reclaim") else { panic!("reclaimable") };
    assert_eq!(n.token, FencingToken(u64::MAX), "the token saturates like FencingToken::next");
}

/// State bytes of the header (`common.lua`).
const IN_FLIGHT: u8 = 1;
const FAILED: u8 = 3;

/// Hash field `h` as the store lays it out (format 2, see `common.lua`): the header, then
/// the scope.
fn raw_header(r: &ClaimRequest, state: u8, token: u64, now: i64) -> Vec<u8> {
    let mut h = vec![2, state];
    h.extend_from_slice(&token.to_be_bytes());
    for t in [now, now, now, now + 60_000] {
        h.extend_from_slice(&t.to_be_bytes());
    }
    h.extend_from_slice(r.fingerprint().as_bytes());
    h.extend_from_slice(&raw_scope(r));
    h
}

/// The scope as the store encodes it: format byte 1, then postcard.
fn raw_scope(r: &ClaimRequest) -> Vec<u8> {
    let parts = (r.scope().principal.as_str(), r.scope().endpoint.as_str(), r.key().as_str());
    postcard::to_extend(&parts, vec![1]).expect("encode")
}

/// Writes a record hash directly (as the scripts lay it out).
async fn write_raw(
    admin: &mut redis::aio::MultiplexedConnection,
    key: &str,
    r: &ClaimRequest,
    state: u8,
    token: u64,
    now: i64,
) {
    let _: () = redis::cmd("HSET")
        .arg(key)
        .arg("h")
        .arg(raw_header(r, state, token, now))
        .query_async(admin)
        .await
        .expect("HSET");
    let _: () = admin.pexpire(key, 600_000).await.expect("PEXPIRE");
}

/// The `lease_expires_at` of the record header at `key` (bytes 26..34, big-endian).
async fn lease_end(admin: &mut redis::aio::MultiplexedConnection, key: &str) -> Option<i64> {
    let h: Option<Vec<u8>> = admin.hget(key, "h").await.expect("HGET");
    h.map(|h| i64::from_be_bytes(h[26..34].try_into().expect("8 bytes")))
}

/// The state byte of the record header at `key`.
async fn state_byte(admin: &mut redis::aio::MultiplexedConnection, key: &str) -> Option<u8> {
    let h: Option<Vec<u8>> = admin.hget(key, "h").await.expect("HGET");
    h.map(|h| h[1])
}

/// Status, header values and bodies come back byte for byte, whatever the bytes, for every
/// body encoding, including a 4 MiB body.
#[tokio::test]
async fn responses_round_trip_byte_exact() {
    let (store, _clock) = test_store().await;
    let all_bytes: Vec<u8> = (0..=255u8).collect();
    let big: Vec<u8> = (0..4 << 20).map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    let responses = [
        StoredResponse::new(201, vec![("etag".into(), all_bytes.clone()), ("x-empty".into(), vec![])], all_bytes),
        StoredResponse::new(204, vec![], vec![]),
        StoredResponse::new(200, vec![("content-type".into(), b"application/octet-stream".to_vec())], big),
        StoredResponse::compressed_over(200, vec![], vec![b'a'; 10_000], 100),
        StoredResponse {
            status: 201,
            headers: vec![],
            body: StoredBody::NotRetained { len: Some(1 << 40) },
            trailers: vec![],
        },
    ];
    for (i, response) in responses.into_iter().enumerate() {
        let r = claim(&store, req("p", &format!("k{i}"), b"b")).await;
        let done = store.complete(r.id, r.token, response.clone()).await.expect("complete");
        let got = store.get(r.id).await.expect("get").expect("present");
        assert_eq!(Receipt::of(&got), done, "response {i}: the receipt reports the record as written");
        let done = got;
        assert_eq!(done.response.as_ref(), Some(&response), "response {i} round-trips");
        let ClaimOutcome::Existing { record, .. } = store.claim(req("p", &format!("k{i}"), b"b")).await.expect("claim")
        else {
            panic!("completed record exists")
        };
        assert_eq!(record, done);
    }
}

/// Scope, key and binary-looking principals survive: a key that starts with a quote, a
/// principal with spaces and UTF-8.
#[tokio::test]
async fn scope_and_key_round_trip() {
    let (store, _clock) = test_store().await;
    let scope = Scope::new("tenant 7 / Ünïcode ✓", Endpoint::new("POST", "/v1/{id}/reboot")).expect("scope");
    let key = IdempotencyKey::parse(br#""\"quoted\\key""#).expect("key");
    let r = ClaimRequest::new(scope, key, Fingerprint::of_bytes(b"b"), LEASE, RETENTION);
    let c = claim(&store, r).await;
    assert_eq!(store.get(c.id).await.expect("get"), Some(c));
}

/// Two prefixes are two namespaces: the same record id under another prefix is another key.
#[tokio::test]
async fn prefixes_isolate_stores() {
    let (a, clock) = test_store().await;
    let b = common::connect(common::test_config(&common::fresh_prefix(), Arc::new(clock))).await;
    let ra = claim(&a, req("p", "k", b"a")).await;
    let rb = claim(&b, req("p", "k", b"b")).await;
    assert_eq!(ra.id, rb.id);
    assert_ne!(a.record_key(ra.id), b.record_key(rb.id));
    assert_eq!(a.get(ra.id).await.expect("get").map(|r| r.fingerprint), Some(ra.fingerprint));
    assert_eq!(b.get(rb.id).await.expect("get").map(|r| r.fingerprint), Some(rb.fingerprint));
}

/// Damages field `h` of a raw record.
type Corruption<'a> = dyn Fn(&mut Vec<u8>) + 'a;

/// A record that does not decode is `Corrupt`, and a claim never overwrites it.
#[tokio::test]
async fn corrupt_records_are_reported_not_overwritten() {
    let (store, clock) = test_store().await;
    let mut admin = common::admin().await;
    let now = clock.now_ms();
    let other = req("p", "another-key", b"b");
    let cases: [(&str, &Corruption<'_>); 6] = [
        ("state", &|h| h[1] = 9),
        ("version", &|h| h[0] = 3),
        ("short-header", &|h| h.truncate(40)),
        ("timestamp", &|h| h[26] = 0xff),
        ("key", &|h| {
            h.truncate(74);
            h.extend_from_slice(&raw_scope(&other));
        }),
        ("scope", &|h| {
            h.truncate(74);
            h.extend_from_slice(b"\x01\xff");
        }),
    ];
    for (name, corrupt) in cases {
        let r = req("p", name, b"b");
        let key = store.record_key(r.id());
        let mut h = raw_header(&r, IN_FLIGHT, 3, now);
        corrupt(&mut h);
        let _: () = admin.hset(&key, "h", h).await.expect("HSET");
        let _: () = admin.pexpire(&key, 600_000).await.expect("PEXPIRE");
        let before: Vec<(Vec<u8>, Vec<u8>)> = admin.hgetall(&key).await.expect("HGETALL");
        let got = store.get(r.id()).await;
        assert!(matches!(got, Err(StoreError::Corrupt { id: Some(id), .. }) if id == r.id()), "{name}: {got:?}");
        let claimed = store.claim(r.clone()).await;
        assert!(matches!(claimed, Err(StoreError::Corrupt { .. })), "{name}: claim gave {claimed:?}");
        let after: Vec<(Vec<u8>, Vec<u8>)> = admin.hgetall(&key).await.expect("HGETALL");
        assert_eq!(before, after, "{name}: the corrupt record was changed");
    }
    // A completed record whose response bytes are garbage.
    let r = claim(&store, req("p", "bad-response", b"b")).await;
    store.complete(r.id, r.token, StoredResponse::new(200, vec![], vec![])).await.expect("complete");
    let _: () = admin.hset(store.record_key(r.id), "r", &b"\x01\xff\xff\xff"[..]).await.expect("HSET");
    assert!(matches!(store.get(r.id).await, Err(StoreError::Corrupt { .. })));
}

/// A foreign value of another type at a record key is a permanent (non-retryable) error.
#[tokio::test]
async fn foreign_value_at_a_record_key_is_not_retryable() {
    let (store, _clock) = test_store().await;
    let r = req("p", "k", b"b");
    let mut admin = common::admin().await;
    let _: () = admin.set_ex(store.record_key(r.id()), "not a hash", 600).await.expect("SET");
    let e = store.claim(r).await.expect_err("WRONGTYPE");
    assert!(matches!(e, StoreError::Unavailable { retryable: false, .. }), "{e:?}");
}

/// Nothing listening: connecting fails fast with a retryable error that keeps the driver's
/// error as its source.
#[tokio::test]
async fn unreachable_server_is_retryable() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").expect("port").local_addr().expect("addr").port();
    let e = RedisStore::connect(&format!("redis://127.0.0.1:{port}"), Config::default()).await.expect_err("refused");
    assert!(e.is_retryable(), "{e:?}");
    assert!(matches!(e, Error::Command { .. }));
    let bad = RedisStore::connect("http://nope", Config::default()).await.expect_err("bad url");
    assert!(matches!(bad, Error::Url(_)) && !bad.is_retryable());
    let brace = RedisStore::connect(&common::url(), Config::default().with_prefix("a{b}")).await.expect_err("prefix");
    assert!(matches!(brace, Error::Config(_)));
}

/// The scripts run by SHA and come back after the server forgot them (`NOSCRIPT`, as after a
/// restart or failover). Uses a private server: flushing the script cache of the shared one
/// would be rude.
#[tokio::test]
async fn scripts_are_reloaded_after_noscript() {
    let server = common::PrivateRedis::start(&[]).await;
    let clock = ManualClock::starting_now();
    let store =
        RedisStore::connect(&server.url, common::test_config("idem:", Arc::new(clock.clone()))).await.expect("connect");
    let mut admin = server.admin().await;
    let r = claim(&store, req("p", "k1", b"b")).await;
    let _: () = redis::cmd("SCRIPT").arg("FLUSH").query_async(&mut admin).await.expect("SCRIPT FLUSH");
    let before: String = redis::cmd("INFO").arg("commandstats").query_async(&mut admin).await.expect("INFO");
    store.complete(r.id, r.token, StoredResponse::new(200, vec![], vec![])).await.expect("complete after NOSCRIPT");
    let r2 = claim(&store, req("p", "k2", b"b")).await;
    assert_eq!(r2.token, FencingToken::first_at(clock.now()));
    let after: String = redis::cmd("INFO").arg("commandstats").query_async(&mut admin).await.expect("INFO");
    let loads = |s: &str| stat(s, "cmdstat_script|load");
    assert!(loads(&after) >= loads(&before) + 2, "both scripts were loaded again:\n{after}");
    // Calls go by SHA: EVALSHA counts, plain EVAL never.
    assert!(stat(&after, "cmdstat_evalsha") >= 4);
    assert_eq!(stat(&after, "cmdstat_eval"), 0);
}

fn stat(info: &str, name: &str) -> u64 {
    info.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(":calls=")))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// An evicting policy with a memory limit refuses to start by default; `Warn` starts.
#[tokio::test]
async fn evicting_policies_are_refused_by_default() {
    for policy in ["allkeys-lru", "volatile-lru"] {
        let server = common::PrivateRedis::start(&["--maxmemory", "64mb", "--maxmemory-policy", policy]).await;
        let e = RedisStore::connect(&server.url, Config::default()).await.expect_err("refused");
        assert!(matches!(&e, Error::EvictingPolicy { policy: p, maxmemory } if p == policy && *maxmemory == 64 << 20));
        assert!(!e.is_retryable());
        RedisStore::connect(&server.url, Config::default().with_eviction_check(EvictionCheck::Warn))
            .await
            .expect("Warn starts anyway");
    }
    let safe = common::PrivateRedis::start(&["--maxmemory", "64mb", "--maxmemory-policy", "noeviction"]).await;
    RedisStore::connect(&safe.url, Config::default()).await.expect("noeviction is safe");
}

/// Where CONFIG is disabled (managed Redis), the check warns and the store starts.
#[tokio::test]
async fn disabled_config_command_warns_and_starts() {
    let server = common::PrivateRedis::start(&["--rename-command", "CONFIG", ""]).await;
    let store = RedisStore::connect(&server.url, Config::default()).await.expect("starts without CONFIG");
    claim(&store, req("p", "k", b"b")).await;
}

/// With a real replica, `WAIT 1` after claim, extend and complete succeeds and the replica
/// has the record (also when the script must be reloaded inside the pipeline); asking for
/// more replicas than exist refuses a claim retryably before writing it (`Shortfall::Strict`,
/// read at start-up) and writes a renewal with the replica there is. Writing to the replica
/// itself gives a retryable `READONLY`.
#[tokio::test]
async fn wait_for_replicas_and_readonly() {
    let primary = common::PrivateRedis::start(&[]).await;
    let port = primary.url.rsplit(':').next().expect("port").to_owned();
    let replica = common::PrivateRedis::start(&["--replicaof", "127.0.0.1", &port]).await;
    let mut padmin = primary.admin().await;
    for _ in 0..400 {
        let info: String = redis::cmd("INFO").arg("replication").query_async(&mut padmin).await.expect("INFO");
        if info.contains("connected_slaves:1") && info.contains("state=online") {
            break;
        }
        // Waiting for the replica's initial sync: no clock is involved.
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let ack = |replicas| Some(ReplicaAck::new(replicas, Duration::from_millis(1_000)));
    let store = RedisStore::connect(&primary.url, Config::default().with_replica_ack(ack(1))).await.expect("connect");
    let r = claim(&store, req("p", "k", b"b")).await;
    let mut radmin = replica.admin().await;
    let state = state_byte(&mut radmin, &store.record_key(r.id)).await;
    assert_eq!(state, Some(IN_FLIGHT), "WAIT returned, so the replica has the claim");
    let e = store.extend(r.id, r.token, Duration::from_secs(600)).await.expect("extend");
    assert_eq!(
        lease_end(&mut radmin, &store.record_key(r.id)).await,
        Some(e.lease_expires_at.0),
        "WAIT returned, so the replica has the renewed lease"
    );
    // The script cache is gone (as after a failover): the pipelined EVALSHA + WAIT reloads it.
    let _: () = redis::cmd("SCRIPT").arg("FLUSH").query_async(&mut padmin).await.expect("SCRIPT FLUSH");
    store.complete(r.id, r.token, StoredResponse::new(200, vec![], vec![])).await.expect("complete");
    let state = state_byte(&mut radmin, &store.record_key(r.id)).await;
    assert_eq!(state, Some(2), "completed");

    let greedy = RedisStore::connect(
        &primary.url,
        Config::default().with_replica_ack(Some(ReplicaAck::new(2, Duration::from_millis(100)))),
    )
    .await
    .expect("connect");
    // The store read at start-up that the server has one replica of the two it wants: Strict
    // refuses the claim before writing anything, at once, instead of a WAIT that must fail.
    let e = greedy.claim(req("p", "k2", b"b")).await.expect_err("only one replica exists");
    assert!(e.is_retryable(), "{e:?}");
    let src = std::error::Error::source(&e).and_then(|s| s.downcast_ref::<Error>());
    assert!(matches!(src, Some(Error::ReplicaShortfall { acked: 1, wanted: 2, timeout_ms: 0, .. })), "{src:?}");
    assert!(greedy.get(req("p", "k2", b"b").id()).await.expect("get").is_none(), "refused before writing");
    // A renewal of a claim made before is written and waits for the replica there is.
    let k2 = claim(&store, req("p", "k2", b"b")).await;
    let e = greedy.extend(k2.id, k2.token, Duration::from_secs(600)).await.expect("written with one replica");
    assert_eq!(lease_end(&mut radmin, &store.record_key(k2.id)).await, Some(e.lease_expires_at.0), "on the replica");

    let on_replica = RedisStore::connect(&replica.url, Config::default()).await.expect("connect to replica");
    let e = on_replica.claim(req("p", "k3", b"b")).await.expect_err("READONLY");
    assert!(e.is_retryable(), "READONLY after a failover is retryable: {e:?}");
}

/// Differential test: a random sequence of claims, reclaims, completes, fails, extends,
/// journal writes and reads, gets and clock moves over a few keys gives exactly the model's
/// outcomes.
#[tokio::test]
async fn random_operations_match_the_model() {
    let (store, clock) = test_store().await;
    let mut model = Spec::new();
    let mut rng = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = move |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    let keys = ["a", "b", "c"];
    let bodies: [&[u8]; 2] = [b"one", b"two"];
    for step in 0..1_000 {
        let k = keys[next(3) as usize];
        let body = bodies[next(2) as usize];
        let now = clock.now();
        let r = req("p", k, body);
        let lease_ttl = Duration::from_millis([0, 1, 1_000, 5_000][next(4) as usize]);
        let retention = Duration::from_millis([0, 2_000, 10_000][next(3) as usize]);
        let r = ClaimRequest::new(r.scope().clone(), r.key().clone(), r.fingerprint(), lease_ttl, retention);
        let current = model.get(r.id(), now);
        let token = current.as_ref().map_or(FencingToken::FIRST, |c| c.token);
        let token = FencingToken(token.0.saturating_sub(next(2)));
        match next(9) {
            0 | 1 => {
                let m = model.claim(&r, now);
                let s = store.claim(r.clone()).await.expect("claim");
                assert_eq!(s, m, "step {step}: claim");
            }
            2 => {
                let rr =
                    ReclaimRequest { id: r.id(), expected: token, fingerprint: r.fingerprint(), lease_ttl, retention };
                let m = model.reclaim(&rr, now);
                let s = store.reclaim(rr).await.expect("reclaim");
                assert_eq!(s, m, "step {step}: reclaim");
            }
            3 => {
                let resp = StoredResponse::new(200 + next(3) as u16, vec![("x".into(), body.to_vec())], body.to_vec());
                let m = model.complete(r.id(), token, resp.clone(), now);
                let s = store.complete(r.id(), token, resp).await;
                assert_same(step, "complete", (s, m), (&store, &model), r.id(), now).await;
            }
            4 => {
                let m = model.fail(r.id(), token, now);
                let s = store.fail(r.id(), token).await;
                assert_same(step, "fail", (s, m), (&store, &model), r.id(), now).await;
            }
            5 => {
                let name = ["step-a", "step-b"][next(2) as usize];
                let value = format!("{name} at step {step}").into_bytes();
                let overwrite = next(2) == 1;
                let m = model.journal_put(r.id(), token, name, value.clone(), overwrite, now);
                let s = store.journal_put(r.id(), token, name, value, overwrite).await;
                match (s, m) {
                    (Ok(s), Ok(m)) => assert_eq!(s, m, "step {step}: journal_put"),
                    (Err(StoreError::LeaseLost { current: a, .. }), Err(StoreError::LeaseLost { current: b, .. })) => {
                        assert_eq!(a, b, "step {step}: journal_put lease lost")
                    }
                    (s, m) => panic!("step {step}: journal_put: store {s:?}, model {m:?}"),
                }
            }
            7 => {
                let m = model.extend(r.id(), token, lease_ttl, now);
                let s = store.extend(r.id(), token, lease_ttl).await;
                assert_same(step, "extend", (s, m), (&store, &model), r.id(), now).await;
            }
            6 => {
                let name = ["step-a", "step-b"][next(2) as usize];
                assert_eq!(
                    store.journal_get(r.id(), name).await.expect("journal_get"),
                    model.journal_get(r.id(), name, now),
                    "step {step}: journal_get"
                );
            }
            _ => {
                assert_eq!(store.get(r.id()).await.expect("get"), model.get(r.id(), now), "step {step}: get");
            }
        }
        clock.advance_ms([0, 1, 999, 1_000, 4_999, 5_000, 9_000][next(7) as usize] as i64);
        assert_eq!(
            store.get(r.id()).await.expect("get"),
            model.get(r.id(), clock.now()),
            "step {step}: get after the clock moved"
        );
    }
}

/// Compares a complete's, fail's or extend's outcome on the store and the model; when it
/// applied, also the record as written, read back from both at the write's `now` (a receipt
/// carries only the token and the times).
async fn assert_same(
    step: usize,
    op: &str,
    (s, m): (Result<Receipt, StoreError>, Result<Receipt, StoreError>),
    (store, model): (&RedisStore, &Spec),
    id: RecordId,
    now: UnixMillis,
) {
    match (s, m) {
        (Ok(s), Ok(m)) => {
            assert_eq!(s, m, "step {step}: {op}");
            let got = store.get(id).await.expect("get");
            assert_eq!(got, model.get(id, now), "step {step}: {op}: the record as written");
            assert_eq!(got.as_ref().map(Receipt::of), Some(s), "step {step}: {op}: the receipt reports the record");
        }
        (
            Err(StoreError::LeaseLost { id: a, presented: b, current: c }),
            Err(StoreError::LeaseLost { id: x, presented: y, current: z }),
        ) => assert_eq!((a, b, c), (x, y, z), "step {step}: {op} lease lost"),
        (s, m) => panic!("step {step}: {op}: store {s:?}, model {m:?}"),
    }
}

/// The header's state byte is the documented one (operators read it: byte 1 of field `h`).
#[tokio::test]
async fn state_bytes() {
    let (store, _clock) = test_store().await;
    let mut admin = common::admin().await;
    let r = claim(&store, req("p", "k", b"b")).await;
    let key = store.record_key(r.id);
    assert_eq!(state_byte(&mut admin, &key).await, Some(IN_FLIGHT));
    let f = store.fail(r.id, r.token).await.expect("fail");
    let f = written(&store, r.id, f).await;
    assert_eq!(f.state, RecordState::Failed);
    assert_eq!(state_byte(&mut admin, &key).await, Some(FAILED));
    let r = claim(&store, req("p", "k2", b"b")).await;
    store.complete(r.id, r.token, StoredResponse::new(200, vec![], vec![])).await.expect("complete");
    assert_eq!(state_byte(&mut admin, &store.record_key(r.id)).await, Some(2));
}

/// A RESP3 connection (`?protocol=resp3`) reads the same replies: missing fields and the
/// absent token come back as RESP3 nulls, not as errors.
#[tokio::test]
async fn resp3_connections_work() {
    let clock = ManualClock::starting_now();
    let url = format!("{}/?protocol=resp3", common::url().trim_end_matches('/'));
    let config = common::test_config(&common::fresh_prefix(), Arc::new(clock.clone()));
    let store = RedisStore::connect(&url, config).await.unwrap_or_else(|e| common::unreachable(&url, &e));
    let info: String = redis::cmd("CLIENT").arg("INFO").query_async(&mut store.connection()).await.expect("INFO");
    assert!(info.split_whitespace().any(|f| f == "resp=3"), "the connection speaks RESP3: {info}");
    let r = claim(&store, req("p", "k", b"b")).await;
    let ClaimOutcome::Existing { record, .. } = store.claim(req("p", "k", b"b")).await.expect("claim") else {
        panic!("second claim sees the first")
    };
    assert_eq!(record, r);
    let f = store.fail(r.id, r.token).await.expect("fail");
    let f = written(&store, r.id, f).await;
    let lost = store.complete(r.id, r.token, StoredResponse::new(200, vec![], vec![])).await;
    assert!(matches!(lost, Err(StoreError::LeaseLost { current: Some(t), .. }) if t == r.token));
    let gone = store.fail(req("p", "never", b"b").id(), FencingToken::FIRST).await;
    assert!(matches!(gone, Err(StoreError::LeaseLost { current: None, .. })), "{gone:?}");
    assert_eq!(store.get(r.id).await.expect("get"), Some(f));
    assert_eq!(store.get(req("p", "never", b"b").id()).await.expect("get"), None);
}

/// Pins: the loser of two first requests never overwrites the winner (as a plain `SETEX`
/// would): 32 claims of one key through 4 independent connections, as from 4 API servers,
/// have exactly one winner, and every loser sees the winner's record.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_first_claims_across_connections_have_one_winner() {
    let clock = ManualClock::starting_now();
    let prefix = common::fresh_prefix();
    let mut stores = Vec::new();
    for _ in 0..4 {
        stores.push(common::connect(common::test_config(&prefix, Arc::new(clock.clone()))).await);
    }
    let barrier = Arc::new(tokio::sync::Barrier::new(32));
    let tasks: Vec<_> = (0..32)
        .map(|i| {
            let store = stores[i % 4].clone();
            let barrier = Arc::clone(&barrier);
            tokio::spawn(async move {
                let r = req("p", "first", format!("body {}", i % 2).as_bytes());
                barrier.wait().await;
                store.claim(r).await.expect("claim")
            })
        })
        .collect();
    let mut winners = Vec::new();
    let mut losers = Vec::new();
    for t in tasks {
        match t.await.expect("task") {
            ClaimOutcome::Claimed(r) => winners.push(r),
            ClaimOutcome::Existing { record, .. } => losers.push(record),
        }
    }
    assert_eq!(winners.len(), 1, "exactly one first request wins");
    assert!(losers.iter().all(|r| *r == winners[0]), "every loser sees the winner's record, unchanged");
    assert_eq!(stores[3].get(winners[0].id).await.expect("get").as_ref(), Some(&winners[0]));
}

/// Memory full under `noeviction`: a write fails with a retryable `OOM` and changes
/// nothing (the claim stays in flight, no half-stored response); once memory is freed the
/// same calls succeed.
#[tokio::test]
async fn out_of_memory_under_noeviction_is_retryable_and_changes_nothing() {
    let server = common::PrivateRedis::start(&["--maxmemory-policy", "noeviction"]).await;
    let clock = ManualClock::starting_now();
    let store =
        RedisStore::connect(&server.url, common::test_config("idem:", Arc::new(clock.clone()))).await.expect("connect");
    let r = claim(&store, req("p", "k", b"b")).await;
    let mut admin = server.admin().await;
    // A limit below what the server already uses: under noeviction every write is refused.
    let info: String = redis::cmd("INFO").arg("memory").query_async(&mut admin).await.expect("INFO");
    let used: u64 = info
        .lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("used_memory");
    let set_limit = |limit: u64| {
        let mut admin = admin.clone();
        async move {
            let _: () = redis::cmd("CONFIG")
                .arg("SET")
                .arg("maxmemory")
                .arg(limit)
                .query_async(&mut admin)
                .await
                .expect("CONFIG SET maxmemory on the private server");
        }
    };
    set_limit(used / 2).await;
    let response = StoredResponse::new(200, vec![], vec![7; 1024]);
    let e = store.complete(r.id, r.token, response.clone()).await.expect_err("OOM");
    assert!(e.is_retryable(), "{e:?}");
    let e = store.claim(req("p", "k2", b"b")).await.expect_err("OOM");
    assert!(e.is_retryable(), "{e:?}");
    assert_eq!(store.get(r.id).await.expect("reads still work"), Some(r.clone()));
    assert_eq!(store.get(req("p", "k2", b"b").id()).await.expect("get"), None);
    set_limit(0).await;
    let done = store.complete(r.id, r.token, response.clone()).await.expect("complete after memory is freed");
    let done = written(&store, r.id, done).await;
    assert_eq!(done.response, Some(response));
}

/// Journal entries are fields of the record's hash: a reclaim keeps them (a retry resumes
/// its steps), the first write wins unless overwriting, values round-trip byte-exact, and
/// a claim that replaces an expired record starts with none.
#[tokio::test]
async fn journal_lives_and_dies_with_its_record() {
    let (store, clock) = test_store().await;
    assert!(store.capabilities().journal);
    let r = claim(&store, req("p", "k", b"b")).await;
    let bytes: Vec<u8> = (0..=255u8).rev().collect();
    assert_eq!(
        store.journal_put(r.id, r.token, "charge", bytes.clone(), false).await.expect("put"),
        JournalWrite::Written
    );
    assert_eq!(
        store.journal_put(r.id, r.token, "charge", b"second".to_vec(), false).await.expect("put"),
        JournalWrite::Exists(bytes.clone()),
        "the first write wins"
    );
    let mut admin = common::admin().await;
    let field: Vec<u8> = admin.hget(store.record_key(r.id), "j:charge").await.expect("HGET");
    assert_eq!(field, bytes);

    let f = store.fail(r.id, r.token).await.expect("fail");
    let f = written(&store, r.id, f).await;
    let stale = store.journal_put(r.id, r.token, "charge", b"late".to_vec(), true).await;
    assert!(matches!(stale, Err(StoreError::LeaseLost { current: Some(t), .. }) if t == r.token), "{stale:?}");
    let ReclaimOutcome::Reclaimed(n) = store.reclaim(reclaim_of(&f, RETENTION)).await.expect("reclaim") else {
        panic!("reclaimable")
    };
    assert_eq!(store.journal_get(r.id, "charge").await.expect("get"), Some(bytes.clone()), "a reclaim keeps entries");
    assert_eq!(
        store.journal_put(n.id, n.token, "charge", b"done".to_vec(), true).await.expect("overwrite"),
        JournalWrite::Written
    );
    assert_eq!(store.journal_get(r.id, "charge").await.expect("get"), Some(b"done".to_vec()));
    assert_eq!(store.journal_get(r.id, "other").await.expect("get"), None);

    clock.set(n.expires_at);
    assert_eq!(store.journal_get(r.id, "charge").await.expect("get"), None, "gone with its record");
    let again = claim(&store, req("p", "k", b"b")).await;
    assert!(again.token > n.token);
    assert_eq!(store.journal_get(r.id, "charge").await.expect("get"), None, "a new claim starts with no entries");
}

/// On a Redis Cluster node every script touches only its declared key (a cross-slot or
/// undeclared key would be refused), and the record key hashes by its `{id}` tag. Runs the
/// whole life of a record on a private single-node cluster that owns all 16384 slots.
#[tokio::test]
async fn cluster_node_accepts_every_script() {
    // The node writes its nodes.conf into the private server's own temporary directory.
    let server = common::PrivateRedis::start(&["--cluster-enabled", "yes"]).await;
    let mut admin = server.admin().await;
    let _: () =
        redis::cmd("CLUSTER").arg("ADDSLOTSRANGE").arg(0).arg(16383).query_async(&mut admin).await.expect("ADDSLOTS");
    for _ in 0..200 {
        let info: String = redis::cmd("CLUSTER").arg("INFO").query_async(&mut admin).await.expect("CLUSTER INFO");
        if info.contains("cluster_state:ok") {
            break;
        }
        // Waiting for the node to declare the cluster up: no clock is involved.
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let clock = ManualClock::starting_now();
    let store = RedisStore::connect(&server.url, common::test_config("idem:", Arc::new(clock.clone())))
        .await
        .expect("connect to the cluster node");
    let r = claim(&store, req("p", "k", b"b")).await;
    let key = store.record_key(r.id);
    let slot: u16 = redis::cmd("CLUSTER").arg("KEYSLOT").arg(&key).query_async(&mut admin).await.expect("KEYSLOT");
    let tag_slot: u16 =
        redis::cmd("CLUSTER").arg("KEYSLOT").arg(r.id.to_hex()).query_async(&mut admin).await.expect("KEYSLOT");
    assert_eq!(slot, tag_slot, "the record id is the hash tag");
    store.journal_put(r.id, r.token, "step", b"v".to_vec(), false).await.expect("journal_put");
    let e = store.extend(r.id, r.token, Duration::from_secs(120)).await.expect("extend");
    assert_eq!(e.expires_at.0, clock.now_ms() + 120_000);
    let f = store.fail(r.id, r.token).await.expect("fail");
    let f = written(&store, r.id, f).await;
    let ReclaimOutcome::Reclaimed(n) = store.reclaim(reclaim_of(&f, RETENTION)).await.expect("reclaim") else {
        panic!("reclaimable")
    };
    let done = store.complete(n.id, n.token, StoredResponse::new(201, vec![], b"ok".to_vec())).await.expect("complete");
    let done = written(&store, n.id, done).await;
    assert_eq!(store.get(r.id).await.expect("get"), Some(done));
    assert_eq!(store.journal_get(r.id, "step").await.expect("journal_get"), Some(b"v".to_vec()));
}

/// A claim that replaces a record past its retention takes the larger of the old token + 1
/// and `first_at(now)`, exactly: the comparison of the two values half by half (equal high
/// halves, a carry from the low 32 bits into the high ones that overtakes the clock's
/// token or not) and saturation at `u64::MAX`.
#[tokio::test]
async fn claim_after_retention_continues_the_token_exactly() {
    let (store, clock) = test_store().await;
    let mut admin = common::admin().await;
    // Low 16 bits of the clock non-zero, so the clock's token has a non-zero low half.
    let t = (clock.now_ms() & !0xffff) | 0x1234;
    let first = FencingToken::first_at(UnixMillis(t)).0;
    let (fh, fl) = (first >> 32, first & 0xffff_ffff);
    assert!(fh > 0 && fl > 0, "{first:#x}");
    let cases = [
        (1, first),
        (first - 2, first),
        (first - 1, first),
        (first, first + 1),
        ((fh << 32) - 1, first),
        ((fh << 32) | 0xffff_ffff, (fh + 1) << 32),
        ((fh + 1) << 32, ((fh + 1) << 32) + 1),
        ((1 << 60) + 1, (1 << 60) + 2),
        (u64::MAX, u64::MAX),
    ];
    for (i, (old, _)) in cases.into_iter().enumerate() {
        let r = req("p", &format!("expired-{i}"), b"b");
        // Written at t - 60 s with 60 s retention: expired at t.
        write_raw(&mut admin, &store.record_key(r.id()), &r, FAILED, old, t - 60_000).await;
    }
    clock.set(UnixMillis(t));
    for (i, (old, new)) in cases.into_iter().enumerate() {
        let c = claim(&store, req("p", &format!("expired-{i}"), b"b")).await;
        assert_eq!(c.token, FencingToken(new), "case {i}: old token {old:#x}");
        assert_eq!(
            c.token,
            FencingToken(old).next().max(FencingToken::first_at(clock.now())),
            "case {i}: the core rule"
        );
    }
}

/// The first token of a fresh record is exactly `FencingToken::first_at` of the script's
/// clock reading, computed in Lua as two 32-bit halves: at the epoch (the floor, 1), where
/// the shifted clock crosses from the low half into the high one, at the cap of 2^47 - 1
/// ms and past it, at the largest test clock (2^53 - 1), and today.
#[tokio::test]
async fn first_tokens_match_first_at_at_the_boundaries() {
    let (store, clock) = test_store().await;
    let today = clock.now_ms();
    let readings =
        [0, 1, 0xffff, 0x1_0000, 0x1_0001, (1 << 32) - 1, 1 << 32, (1 << 47) - 1, 1 << 47, (1 << 53) - 1, today];
    for (i, t) in readings.into_iter().enumerate() {
        clock.set(UnixMillis(t));
        let c = claim(&store, req("p", &format!("first-{i}"), b"b")).await;
        assert_eq!(c.token, FencingToken::first_at(UnixMillis(t)), "clock {t}");
        assert_eq!(c.created_at, UnixMillis(t));
    }
    // The values themselves, independently of first_at.
    let at = |t: i64| FencingToken::first_at(UnixMillis(t)).0;
    assert_eq!((at(0), at(1), at(0xffff), at(0x1_0000)), (1, 1 << 16, 0xffff_0000, 1 << 32));
    assert_eq!(at(1 << 47), at((1 << 47) - 1));
    assert_eq!(at((1 << 47) - 1), (u64::MAX >> 1) & !0xffff);
}

/// Renewing a lease moves the key's native expiry only when it moves the record's
/// retention end: a longer lease inside retention leaves `PEXPIRETIME` alone, one past it
/// moves `expires_at` and the key's expiry (plus the grace) with it, and a shorter one
/// changes nothing at all. On the server's clock.
#[tokio::test]
async fn extend_moves_native_expiry_with_the_retention_end() {
    let grace = 1_500_i64;
    let store = common::connect(
        Config::default().with_prefix(common::fresh_prefix()).with_expiry_grace(Duration::from_millis(1_500)),
    )
    .await;
    let mut admin = common::admin().await;
    let r = claim(&store, req("p", "k", b"b")).await;
    let key = store.record_key(r.id);
    assert_eq!(pexpiretime(&mut admin, &key).await, r.expires_at.0 + grace);

    let e = store.extend(r.id, r.token, Duration::from_secs(30)).await.expect("extend");
    let e = written(&store, r.id, e).await;
    assert!(e.lease_expires_at.0 >= r.created_at.0 + 30_000 && e.lease_expires_at.0 < r.expires_at.0);
    assert_eq!((e.token, e.state, e.expires_at, e.created_at), (r.token, r.state, r.expires_at, r.created_at));
    assert_eq!(pexpiretime(&mut admin, &key).await, r.expires_at.0 + grace, "retention did not move");

    let f = store.extend(r.id, r.token, Duration::from_secs(600)).await.expect("extend");
    let f = written(&store, r.id, f).await;
    assert!(f.lease_expires_at.0 >= e.lease_expires_at.0 + 570_000);
    assert_eq!(f.expires_at, f.lease_expires_at, "retention follows the lease");
    assert_eq!(pexpiretime(&mut admin, &key).await, f.expires_at.0 + grace, "the key follows the record");
    assert_eq!(store.get(r.id).await.expect("get"), Some(f.clone()));

    let g = store.extend(r.id, r.token, Duration::from_secs(1)).await.expect("a shorter renewal is no error");
    assert_eq!(g, Receipt::of(&f), "a lease never moves earlier");
    assert_eq!(written(&store, r.id, g).await, f, "a lease never moves earlier");
    assert_eq!(pexpiretime(&mut admin, &key).await, f.expires_at.0 + grace);
    let _: () = admin.del(&key).await.expect("clean up own key");
}

/// Under a test clock, a renewal that moves the retention end gives the key the record's
/// remaining time on that clock plus the grace (as a claim does); a lease of `u64::MAX`
/// seconds saturates at `i64::MAX` like the model and leaves the key without an expiry.
#[tokio::test]
async fn extend_under_a_test_clock_and_at_the_64_bit_limit() {
    let (store, clock) = test_store().await;
    let mut admin = common::admin().await;
    let r = claim(&store, req("p", "k", b"b")).await;
    clock.advance_ms(4_000);
    let e = store.extend(r.id, r.token, Duration::from_secs(300)).await.expect("extend");
    assert_eq!((e.lease_expires_at.0, e.expires_at.0), (clock.now_ms() + 300_000, clock.now_ms() + 300_000));
    let pttl: i64 = admin.pttl(store.record_key(r.id)).await.expect("PTTL");
    let want = 300_000 + idem_core::time::duration_ms(common::TEST_GRACE);
    assert!(pttl > want - 5_000 && pttl <= want, "300 s remaining + grace, got {pttl} ms");

    let mut model = Spec::new();
    let m = match model.claim(&req("p", "k", b"b"), r.created_at) {
        ClaimOutcome::Claimed(m) => m,
        other => panic!("model claims: {other:?}"),
    };
    assert_eq!(m, r);
    let m = model.extend(r.id, r.token, Duration::from_secs(300), clock.now()).expect("model extends");
    assert_eq!(m, e);
    assert_eq!(store.get(r.id).await.expect("get"), model.get(r.id, clock.now()), "the record as written");
    let forever = store.extend(r.id, r.token, Duration::from_secs(u64::MAX)).await.expect("extend");
    let m = model.extend(r.id, r.token, Duration::from_secs(u64::MAX), clock.now()).expect("model extends");
    assert_eq!(forever, m);
    assert_eq!((forever.lease_expires_at.0, forever.expires_at.0), (i64::MAX, i64::MAX));
    assert_eq!(pexpiretime(&mut admin, &store.record_key(r.id)).await, -1, "no native expiry past 2^53 ms");
    let got = store.get(r.id).await.expect("get");
    assert_eq!(got, model.get(r.id, clock.now()), "the record as written");
    assert_eq!(got.as_ref().map(Receipt::of), Some(forever));
}

/// Every write a late owner of `old` can attempt on the record that replaced it (`new`) is
/// refused with `LeaseLost` naming the new token, and leaves it as it was.
async fn assert_late_owner_fenced(store: &RedisStore, old: &Record, new: &Record) {
    let lost = |e: Result<(), StoreError>, op: &str| match e {
        Err(StoreError::LeaseLost { id, presented, current }) => {
            assert_eq!((id, presented, current), (new.id, old.token, Some(new.token)), "{op}");
        }
        other => panic!("{op} with the old generation's token: {other:?}"),
    };
    let done = store.complete(old.id, old.token, StoredResponse::new(200, vec![], b"late".to_vec())).await;
    lost(done.map(drop), "complete");
    lost(store.extend(old.id, old.token, Duration::from_secs(60)).await.map(drop), "extend");
    lost(store.journal_put(old.id, old.token, "step", b"late".to_vec(), true).await.map(drop), "journal_put");
    lost(store.fail(old.id, old.token).await.map(drop), "fail");
    assert_eq!(store.get(new.id).await.expect("get").as_ref(), Some(new), "the new generation is untouched");
    assert_eq!(store.journal_get(new.id, "step").await.expect("journal_get"), None);
}

/// Retries `op` while it fails retryably (a connection that died with the server is
/// noticed by the next command; the manager reconnects behind it), at most 40 times.
async fn retrying<T, F: std::future::Future<Output = Result<T, StoreError>>>(mut op: impl FnMut() -> F) -> T {
    for _ in 0..40 {
        match op().await {
            Ok(v) => return v,
            Err(e) if e.is_retryable() => {
                // Waiting for the reconnect: no clock is involved.
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            Err(e) => panic!("not retryable: {e:?}"),
        }
    }
    panic!("still failing after 40 tries")
}

/// A restart without persistence loses every record with its token, and the next claim of
/// the same key starts a later generation from the server's clock: its token is above the
/// lost one, so the old holder's late complete, extend, journal write and fail are all
/// refused. (With a counter the new record would start at 1 again.)
#[tokio::test]
async fn a_restart_without_persistence_starts_a_later_generation() {
    let mut server = common::PrivateRedis::start(&[]).await;
    let store = RedisStore::connect(&server.url, Config::default()).await.expect("connect");
    let r = req("p", "k", b"b");
    let old = claim(&store, r.clone()).await;
    assert_eq!(old.token, FencingToken::first_at(old.created_at));
    let put = store.journal_put(old.id, old.token, "step", b"v".to_vec(), false).await.expect("journal_put");
    assert_eq!(put, JournalWrite::Written);
    server.restart().await;
    assert_eq!(retrying(|| store.get(old.id)).await, None, "the restart lost the record");
    let new = claim(&store, r).await;
    assert_eq!(new.token, FencingToken::first_at(new.created_at));
    assert!(new.token > old.token, "new {} after old {}", new.token, old.token);
    assert_late_owner_fenced(&store, &old, &new).await;
}

/// Redis removes an expired record's key itself (native expiry, no grace), and with it the
/// token; the next claim still gets a token above the removed one, and the old holder's
/// late writes are refused. On the shared server and its clock.
#[tokio::test]
async fn native_expiry_starts_a_later_generation() {
    let store = common::connect(Config::default().with_prefix(common::fresh_prefix())).await;
    let mut admin = common::admin().await;
    let r = req("p", "k", b"b");
    let (lease, retention) = (Duration::from_millis(50), Duration::from_millis(100));
    let r = ClaimRequest::new(r.scope().clone(), r.key().clone(), r.fingerprint(), lease, retention);
    let old = claim(&store, r.clone()).await;
    let put = store.journal_put(old.id, old.token, "step", b"v".to_vec(), false).await.expect("journal_put");
    assert_eq!(put, JournalWrite::Written);
    let key = store.record_key(old.id);
    let vanished = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let n: i64 = admin.exists(&key).await.expect("EXISTS");
            if n == 0 {
                break;
            }
            // Polling Redis until it expires the key: no clock is read.
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    vanished.expect("Redis removes the key at its native expiry");
    let new = claim(&store, r).await;
    assert_eq!(new.token, FencingToken::first_at(new.created_at));
    assert!(new.token > old.token, "new {} after old {}", new.token, old.token);
    assert_late_owner_fenced(&store, &old, &new).await;
    let _: () = admin.del(&key).await.expect("clean up own key");
}

/// Pins: a `WAIT` shortfall after a claim left the claim in flight with nobody running its
/// handler, so every retry got 409 until the lease ended. With the only replica paused
/// (SIGSTOP), a claim under `WAIT 1` fails retryably and leaves the record failed (released
/// under its own token); once the replica is back, the retry reclaims it at once and runs.
///
/// Pins `docs/failures.md#replica-acknowledgement-falls-short-after-a-claim`.
#[tokio::test]
async fn wait_shortfall_after_a_claim_releases_it() {
    let primary = common::PrivateRedis::start(&[]).await;
    let port = primary.url.rsplit(':').next().expect("port").to_owned();
    let replica = common::PrivateRedis::start(&["--replicaof", "127.0.0.1", &port]).await;
    let mut padmin = primary.admin().await;
    for _ in 0..400 {
        let info: String = redis::cmd("INFO").arg("replication").query_async(&mut padmin).await.expect("INFO");
        if info.contains("connected_slaves:1") && info.contains("state=online") {
            break;
        }
        // Waiting for the replica's initial sync: no clock is involved.
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let config = Config::default().with_replica_ack(Some(ReplicaAck::new(1, Duration::from_millis(300))));
    let store = RedisStore::connect(&primary.url, config).await.expect("connect");
    let r = req("p", "paused", b"b");
    replica.signal("STOP");
    let e = store.claim(r.clone()).await.expect_err("the replica cannot acknowledge");
    replica.signal("CONT");
    let src = std::error::Error::source(&e).and_then(|s| s.downcast_ref::<Error>());
    assert!(e.is_retryable() && matches!(src, Some(Error::ReplicaShortfall { acked: 0, wanted: 1, .. })), "{e:?}");
    let left = store.get(r.id()).await.expect("get").expect("WAIT never rolls back the write");
    assert_eq!(left.state, RecordState::Failed, "the claim was released, not left in flight for a lease");
    // "Back" means acknowledging again: a replica resumed by SIGCONT on a loaded machine
    // took longer than a 300 ms WAIT to catch up, so the retry's WAIT fell short. The retry
    // runs on a second handle whose WAIT budget leaves room for a slow replica.
    let acked: i64 = redis::cmd("WAIT").arg(1).arg(10_000).query_async(&mut padmin).await.expect("WAIT");
    assert_eq!(acked, 1, "the resumed replica acknowledges within 10 s");
    let patient = Config::default().with_replica_ack(Some(ReplicaAck::new(1, Duration::from_secs(10))));
    let store = RedisStore::connect(&primary.url, patient).await.expect("connect");
    // The retry: claim finds the failed record, reclaims it at once, and WAIT now succeeds.
    let ClaimOutcome::Existing { record, .. } = store.claim(r).await.expect("claim") else { panic!("exists") };
    let ReclaimOutcome::Reclaimed(rec) =
        store.reclaim(reclaim_of(&record, Duration::from_secs(60))).await.expect("reclaim with the replica back")
    else {
        panic!("a released claim is reclaimable at once")
    };
    assert_eq!(rec.token.0, left.token.0 + 1);
}

/// Pins: a Redis without persistence started quietly, and its restart lost every claim and
/// journal, so retries booted VMs again (phantom VMs in a retry storm). The check reads
/// `appendonly`/`appendfsync`/`save`: `Refuse` refuses a server without AOF or RDB and one
/// with `appendfsync no`; `Warn` (the default) starts; AOF `everysec` passes `Refuse`.
///
/// Pins `docs/failures.md#redis-restart-without-persistence`.
#[tokio::test]
async fn persistence_check_flags_servers_that_lose_records() {
    let refuse = || Config::default().with_persistence_check(PersistenceCheck::Refuse);
    // PrivateRedis runs with --save "" --appendonly no unless told otherwise.
    let none = common::PrivateRedis::start(&[]).await;
    let e = RedisStore::connect(&none.url, refuse()).await.expect_err("no persistence is refused");
    assert!(matches!(&e, Error::NotDurable { problem, .. } if problem.contains("neither AOF nor RDB")), "{e:?}");
    assert!(!e.is_retryable());
    RedisStore::connect(&none.url, Config::default()).await.expect("the default warns and starts");

    let fsync_no = common::PrivateRedis::start(&["--appendonly", "yes", "--appendfsync", "no"]).await;
    let e = RedisStore::connect(&fsync_no.url, refuse()).await.expect_err("appendfsync no is refused");
    assert!(matches!(&e, Error::NotDurable { problem, .. } if problem.contains("appendfsync no")), "{e:?}");

    let aof = common::PrivateRedis::start(&["--appendonly", "yes", "--appendfsync", "everysec"]).await;
    RedisStore::connect(&aof.url, refuse()).await.expect("AOF everysec passes");
    let rdb = common::PrivateRedis::start(&["--save", "3600 1"]).await;
    RedisStore::connect(&rdb.url, refuse()).await.expect("RDB snapshots pass (their loss is documented)");
}

/// Pins: a `WAIT` that failed outright after its claim ran (here an ACL user without the
/// `WAIT` command; also a writable replica) failed the call while the claim stayed in
/// flight with nobody running its handler, so the key answered 409 for a whole lease. The
/// failed WAIT is treated like a shortfall: the claim is released (failed under its own
/// token) and the retry reclaims it at once; the error names WAIT and is not retryable
/// (a permission problem does not go away by retrying).
///
/// Pins `docs/failures.md#redis-wait-refused-or-redirected-past-its-budget`.
#[tokio::test]
async fn a_refused_wait_after_a_claim_releases_it() {
    let server = common::PrivateRedis::start(&[]).await;
    let mut admin = server.admin().await;
    let () = redis::cmd("ACL")
        .arg(&["SETUSER", "app", "on", ">pw", "~*", "+@all", "-wait"])
        .query_async(&mut admin)
        .await
        .expect("ACL SETUSER");
    let url = server.url.replacen("redis://", "redis://app:pw@", 1);
    let config = Config::default().with_replica_ack(Some(ReplicaAck::new(0, Duration::from_millis(100))));
    let store = RedisStore::connect(&url, config).await.expect("connect as the restricted user");
    let r = req("p", "k", b"b");
    let e = store.claim(r.clone()).await.expect_err("WAIT is refused");
    let left = store.get(r.id()).await.expect("get").expect("the claim ran before WAIT");
    assert_eq!(left.state, RecordState::Failed, "released, not left in flight for a lease");
    let src = std::error::Error::source(&e).and_then(|s| s.downcast_ref::<Error>());
    assert!(matches!(src, Some(Error::Command { operation: "WAIT", .. })), "{e:?}");
    assert!(!e.is_retryable(), "NOPERM is not fixed by retrying: {e:?}");
    // The operator grants WAIT; the retry finds the released claim and reclaims it at once.
    let () = redis::cmd("ACL").arg(&["SETUSER", "app", "+wait"]).query_async(&mut admin).await.expect("grant WAIT");
    let ClaimOutcome::Existing { record, .. } = store.claim(r).await.expect("claim") else { panic!("exists") };
    let ReclaimOutcome::Reclaimed(rec) =
        store.reclaim(reclaim_of(&record, Duration::from_secs(60))).await.expect("reclaim")
    else {
        panic!("a released claim is reclaimable at once")
    };
    assert_eq!(rec.token.0, left.token.0 + 1);
}

/// Guards: over RESP3 (`?protocol=resp3`) `CONFIG GET` answers a map, not pairs; a check
/// that only read pairs would see "CONFIG refused", warn, and start on an evicting or
/// non-durable server. Both checks must refuse over RESP3 as over RESP2.
#[tokio::test]
async fn start_up_checks_read_resp3_replies() {
    let lru = common::PrivateRedis::start(&["--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"]).await;
    let e = RedisStore::connect(&format!("{}?protocol=resp3", lru.url), Config::default())
        .await
        .expect_err("an evicting policy is refused over RESP3");
    assert!(matches!(e, Error::EvictingPolicy { .. }), "{e:?}");
    let none = common::PrivateRedis::start(&[]).await;
    let refuse = Config::default().with_persistence_check(PersistenceCheck::Refuse);
    let e = RedisStore::connect(&format!("{}?protocol=resp3", none.url), refuse)
        .await
        .expect_err("no persistence is refused over RESP3");
    assert!(matches!(e, Error::NotDurable { .. }), "{e:?}");
}
