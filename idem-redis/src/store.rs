//! [`RedisStore`]: the [`Store`] contract on Redis, one hash per record, Lua compare-and-set.

use std::fmt;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use async_trait::async_trait;
use idem_core::codec::CodecError;
use idem_core::time::duration_ms;
use idem_core::{
    Capabilities, ClaimOutcome, ClaimRequest, Clock, Endpoint, FencingToken, Fingerprint, IdempotencyKey, JournalWrite,
    Principal, ReclaimOutcome, ReclaimRequest, Record, RecordId, RecordState, Scope, Store, StoreError, StoredResponse,
    SweepOutcome, UnixMillis,
};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Script, Value};

use crate::error::Error;

/// Default key prefix.
pub const DEFAULT_PREFIX: &str = "idem:";

/// First byte of an encoded stored response (the `response` hash field): the format
/// version, then postcard.
const RESPONSE_FORMAT: u8 = 1;

/// What to do at start-up when the server's `maxmemory-policy` may evict keys.
///
/// Redis evicts only once `maxmemory` is reached, and then an `allkeys-*` policy may drop
/// any key and a `volatile-*` policy any key with a TTL, which is every idem record. A
/// dropped in-flight claim looks absent to the next retry, which claims again and runs the
/// handler a second time. Safe settings: `maxmemory-policy noeviction` (writes fail with
/// `OOM` when memory is full; the HTTP layer answers 503, nothing runs twice), or a
/// dedicated instance with `maxmemory 0` (no limit).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum EvictionCheck {
    /// Refuse to start ([`Error::EvictingPolicy`]) when the policy evicts and `maxmemory`
    /// is set. The default: a store that may run a request twice should not start quietly.
    /// An evicting policy without a memory limit only warns, since nothing is evicted
    /// until someone sets one.
    #[default]
    Refuse,
    /// Start anyway, logging a `tracing` warning (for shared or managed instances whose
    /// policy the application cannot change).
    Warn,
}

/// Replica acknowledgement after the writes that matter: `WAIT replicas timeout` after a
/// claim, a reclaim and a complete.
///
/// What it guarantees: when the call returns `Ok`, at least `replicas` replicas had
/// received the write. What it does not: Redis replication stays asynchronous, so WAIT
/// does not roll back a write that was not acknowledged (the store then returns a
/// retryable [`Error::ReplicaShortfall`], and the write stays on the primary), and a
/// failover may still promote a replica that had not received it (Sentinel and Cluster
/// pick the most up-to-date replica they can reach, not necessarily an acknowledging one).
/// It narrows the window in which a failover loses a claim or a stored response; it does
/// not close it.
///
/// WAIT goes in the same pipeline as the script, on the same connection, so it covers that
/// write even if the connection is replaced right after (both then fail, retryably). It is
/// sent with every claim, reclaim and complete, and checked only when the call wrote. WAIT
/// blocks the (multiplexed) connection until the acknowledgement or the timeout, so every
/// concurrent call on the same store waits behind it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplicaAck {
    /// Replicas that must acknowledge.
    pub replicas: u32,
    /// How long to wait for them.
    pub timeout: Duration,
}

/// How a [`RedisStore`] behaves. Build with [`RedisConfig::new`] and the `with_*` methods.
#[derive(Clone, Debug)]
pub struct RedisConfig {
    prefix: String,
    eviction_check: EvictionCheck,
    replica_ack: Option<ReplicaAck>,
    response_timeout: Duration,
    connection_timeout: Duration,
    expiry_grace: Duration,
    test_clock: Option<Arc<dyn Clock>>,
}

impl Default for RedisConfig {
    fn default() -> Self {
        Self::new()
    }
}

impl RedisConfig {
    /// Defaults: prefix `idem:`, [`EvictionCheck::Refuse`], no WAIT, 2 s response
    /// timeout, 1 s connection timeout, no expiry grace, the server's clock.
    #[must_use]
    pub fn new() -> Self {
        Self {
            prefix: DEFAULT_PREFIX.to_owned(),
            eviction_check: EvictionCheck::default(),
            replica_ack: None,
            response_timeout: Duration::from_secs(2),
            connection_timeout: Duration::from_secs(1),
            expiry_grace: Duration::ZERO,
            test_clock: None,
        }
    }

    /// The namespace every key starts with: records live at `<prefix>{<record id hex>}`.
    /// Must not contain `{` or `}` (the braces around the id are the Cluster hash tag).
    #[must_use]
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// What to do when `maxmemory-policy` may evict keys (see [`EvictionCheck`]).
    #[must_use]
    pub fn with_eviction_check(mut self, check: EvictionCheck) -> Self {
        self.eviction_check = check;
        self
    }

    /// Wait for replicas after claim, reclaim and complete (see [`ReplicaAck`]).
    #[must_use]
    pub fn with_replica_ack(mut self, ack: Option<ReplicaAck>) -> Self {
        self.replica_ack = ack;
        self
    }

    /// How long one command may take before the call fails with a retryable timeout
    /// (raised to the WAIT timeout plus 500 ms when [`ReplicaAck`] is set). A timed-out
    /// write may still have been applied: a retry then sees the claim as in flight.
    #[must_use]
    pub fn with_response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// How long one connection attempt may take.
    #[must_use]
    pub fn with_connection_timeout(mut self, timeout: Duration) -> Self {
        self.connection_timeout = timeout;
        self
    }

    /// How long a record's key outlives its `expires_at` in Redis (default zero: the key
    /// expires exactly at `expires_at`). Logically the record is gone at `expires_at`
    /// either way: every read and script checks. A grace keeps the fencing token growing
    /// when a record is claimed again shortly after it expired, at the cost of memory.
    #[must_use]
    pub fn with_expiry_grace(mut self, grace: Duration) -> Self {
        self.expiry_grace = grace;
        self
    }

    /// **Test only.** Replaces the server's `TIME` with `clock`, passed to every script as
    /// an argument, so a test can move time (the conformance suite passes its
    /// `ManualClock`). Key expiry then follows the test clock too: instead of `PEXPIREAT
    /// expires_at`, a key gets `PEXPIRE` of the record's remaining time on `clock` plus the
    /// [expiry grace](RedisConfig::with_expiry_grace). Real time keeps running while a test
    /// clock stands still, so set a grace longer than the test, or Redis may drop a key that
    /// the test clock still sees live. In production leave it unset: the point of the
    /// server's clock is that application servers with skewed clocks agree on lease expiry.
    /// The clock must not read before the Unix epoch.
    #[must_use]
    pub fn with_test_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.test_clock = Some(clock);
        self
    }

    fn validate(&self) -> Result<(), Error> {
        if self.prefix.contains(['{', '}']) {
            return Err(Error::Config("the key prefix must not contain `{` or `}` (they delimit the hash tag)"));
        }
        Ok(())
    }

    fn effective_response_timeout(&self) -> Duration {
        match self.replica_ack {
            Some(ack) => self.response_timeout.max(ack.timeout + Duration::from_millis(500)),
            None => self.response_timeout,
        }
    }
}

struct Scripts {
    claim: Script,
    reclaim: Script,
    complete: Script,
    fail: Script,
    get: Script,
    journal_put: Script,
    journal_get: Script,
}

/// A script: its shebang line (Redis 7 script flags), `common.lua`, then the body.
///
/// The shebang makes Redis enforce what the layout promises: a script may only touch keys
/// in the slot of its declared key (on a Cluster node), a write script is refused up front
/// on a replica (`READONLY`) and when memory is full (`OOM`), and read-only scripts declare
/// `no-writes`.
macro_rules! script {
    ($shebang:literal, $file:literal) => {
        Script::new(concat!(
            $shebang,
            "\n",
            include_str!("scripts/common.lua"),
            "\n",
            include_str!(concat!("scripts/", $file))
        ))
    };
}

/// Built once per process: `Script` hashes its source at construction; every call is
/// `EVALSHA`, and on `NOSCRIPT` (a restarted or failed-over server, a `SCRIPT FLUSH`) the
/// store loads the source and sends the call again (`RedisStore::run`).
static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| Scripts {
    claim: script!("#!lua", "claim.lua"),
    reclaim: script!("#!lua", "reclaim.lua"),
    complete: script!("#!lua", "complete.lua"),
    fail: script!("#!lua", "fail.lua"),
    get: script!("#!lua flags=no-writes", "get.lua"),
    journal_put: script!("#!lua", "journal_put.lua"),
    journal_get: script!("#!lua flags=no-writes", "journal_get.lua"),
});

/// Idempotency records in Redis (or Valkey): one hash per record, claim/reclaim/complete/
/// fail as Lua compare-and-set scripts, retention as the key's native expiry, time from the
/// server. Cheap to clone; clones share one reconnecting connection.
#[derive(Clone)]
pub struct RedisStore {
    conn: ConnectionManager,
    config: Arc<RedisConfig>,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.config.prefix)
            .field("replica_ack", &self.config.replica_ack)
            .field("test_clock", &self.config.test_clock.is_some())
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// Connects to `url` (`redis://[user:password@]host:port[/db]`, `rediss://` needs a TLS
    /// feature of the `redis` crate), checks `maxmemory-policy` (see [`EvictionCheck`]) and
    /// loads the scripts.
    ///
    /// # Errors
    /// [`Error::Url`] for a bad URL, [`Error::Config`] for a bad prefix, [`Error::Command`]
    /// when the server cannot be reached (retryable) or refuses the scripts,
    /// [`Error::EvictingPolicy`] under [`EvictionCheck::Refuse`].
    pub async fn connect(url: &str, config: RedisConfig) -> Result<Self, Error> {
        config.validate()?;
        let client = redis::Client::open(url).map_err(Error::Url)?;
        let manager_config = ConnectionManagerConfig::new()
            .set_response_timeout(Some(config.effective_response_timeout()))
            .set_connection_timeout(Some(config.connection_timeout))
            .set_number_of_retries(2);
        let conn = ConnectionManager::new_with_config(client, manager_config)
            .await
            .map_err(|e| Error::command("connect", e))?;
        Self::from_connection(conn, config).await
    }

    /// Uses an existing connection (shared with the rest of the application); runs the same
    /// start-up checks as [`RedisStore::connect`]. The connection's own response timeout
    /// applies.
    ///
    /// # Errors
    /// As [`RedisStore::connect`], minus the URL.
    pub async fn from_connection(conn: ConnectionManager, config: RedisConfig) -> Result<Self, Error> {
        config.validate()?;
        let store = Self { conn, config: Arc::new(config) };
        store.check_eviction_policy().await?;
        let mut conn = store.conn.clone();
        for script in [
            &SCRIPTS.claim,
            &SCRIPTS.reclaim,
            &SCRIPTS.complete,
            &SCRIPTS.fail,
            &SCRIPTS.get,
            &SCRIPTS.journal_put,
            &SCRIPTS.journal_get,
        ] {
            script.prepare_invoke().load_async(&mut conn).await.map_err(|e| Error::command("SCRIPT LOAD", e))?;
        }
        Ok(store)
    }

    /// The key of record `id`: `<prefix>{<64 hex digits>}`. The braces make the id the
    /// Redis Cluster hash tag, so any companion key of the record lands in the same slot.
    #[must_use]
    pub fn record_key(&self, id: RecordId) -> String {
        format!("{}{{{}}}", self.config.prefix, id.to_hex())
    }

    /// The store's connection (a clone: same reconnecting, multiplexed connection), e.g.
    /// for health checks.
    #[must_use]
    pub fn connection(&self) -> ConnectionManager {
        self.conn.clone()
    }

    /// The configuration the store runs with.
    #[must_use]
    pub fn config(&self) -> &RedisConfig {
        &self.config
    }

    async fn check_eviction_policy(&self) -> Result<(), Error> {
        let mut conn = self.conn.clone();
        let reply: Result<Vec<(String, String)>, _> =
            redis::cmd("CONFIG").arg("GET").arg("maxmemory*").query_async(&mut conn).await;
        let pairs = match reply {
            Ok(pairs) => pairs,
            Err(e) if e.kind() == redis::ErrorKind::Io => return Err(Error::command("CONFIG GET", e)),
            Err(e) => {
                // Managed services often rename or forbid CONFIG.
                tracing::warn!(
                    error = %e,
                    "idem-redis: cannot read maxmemory-policy (CONFIG GET refused); make sure the server runs with \
                     `maxmemory-policy noeviction`: an evicting policy can drop an in-flight claim and run a request twice"
                );
                return Ok(());
            }
        };
        let get = |name: &str| pairs.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str());
        let policy = get("maxmemory-policy").unwrap_or("noeviction").to_owned();
        let maxmemory = get("maxmemory").and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        match eviction_verdict(&policy, maxmemory, self.config.eviction_check) {
            Verdict::Safe => Ok(()),
            Verdict::Warn => {
                tracing::warn!(
                    policy = %policy,
                    maxmemory,
                    "idem-redis: maxmemory-policy {policy} can evict idempotency records (every record has a TTL); \
                     an evicted in-flight claim lets a duplicate request run. Use `maxmemory-policy noeviction`."
                );
                Ok(())
            }
            Verdict::Refuse => Err(Error::EvictingPolicy { policy, maxmemory }),
        }
    }

    fn clock_arg(&self) -> Result<String, StoreError> {
        match &self.config.test_clock {
            None => Ok(String::new()),
            Some(clock) => {
                let now = clock.now().0;
                if now < 0 {
                    return Err(Error::Config("the test clock reads before the Unix epoch").into());
                }
                Ok(now.to_string())
            }
        }
    }

    fn grace_ms(&self) -> i64 {
        duration_ms(self.config.expiry_grace)
    }

    /// Runs `call`. For [`Kind::AckedWrite`] with [`ReplicaAck`] configured, sends `WAIT` in
    /// the same pipeline, so it runs on the connection that made the write (a reconnect
    /// between the two would make WAIT count nothing) and costs no extra round trip.
    ///
    /// Writes are never sent twice after a connection error: whether the first one ran is
    /// unknown, and the caller's retry goes through claim again. A [`Kind::Read`] is sent
    /// once more after an I/O error, which covers the common case of a connection that died
    /// while idle (a server restart, an idle timeout): the connection manager only notices
    /// when the next command fails.
    async fn run(&self, op: &'static str, call: &Call<'_>, kind: Kind) -> Result<(Reply, Option<u64>), StoreError> {
        let mut conn = self.conn.clone();
        let ack = if kind == Kind::AckedWrite { self.config.replica_ack } else { None };
        let mut loaded = false;
        let mut resent = false;
        loop {
            let result = match ack {
                None => call.evalsha().query_async::<Value>(&mut conn).await.map(|v| (v, None)),
                Some(ack) => {
                    let mut pipe = redis::pipe();
                    pipe.add_command(call.evalsha());
                    pipe.cmd("WAIT").arg(ack.replicas).arg(timeout_ms(ack.timeout));
                    pipe.query_async::<(Value, u64)>(&mut conn).await.map(|(v, n)| (v, Some(n)))
                }
            };
            match result {
                Ok((value, acked)) => return Ok((Reply::parse(op, value)?, acked)),
                // The server forgot the script (restart, failover, SCRIPT FLUSH): it did not
                // run. Load it and send the call again, once.
                Err(e) if !loaded && e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                    call.script.prepare_invoke().load_async(&mut conn).await.map_err(|e| Error::command(op, e))?;
                    loaded = true;
                }
                Err(e) if !resent && kind == Kind::Read && e.kind() == redis::ErrorKind::Io => resent = true,
                Err(e) => return Err(Error::command(op, e).into()),
            }
        }
    }

    /// After a write that WAIT covered: fails when too few replicas acknowledged it.
    fn check_ack(&self, acked: Option<u64>) -> Result<(), StoreError> {
        match (self.config.replica_ack, acked) {
            (Some(ack), Some(acked)) if acked < u64::from(ack.replicas) => Err(Error::ReplicaShortfall {
                acked,
                wanted: u64::from(ack.replicas),
                timeout_ms: timeout_ms(ack.timeout),
            }
            .into()),
            _ => Ok(()),
        }
    }
}

/// What a script call does, for [`RedisStore::run`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// Reads only: safe to send again.
    Read,
    /// Writes; never sent again after a connection error.
    Write,
    /// Writes that [`ReplicaAck`] covers (claim, reclaim, complete).
    AckedWrite,
}

fn timeout_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// One script call: `EVALSHA sha 1 key args...`.
struct Call<'a> {
    script: &'a Script,
    key: String,
    args: Vec<Vec<u8>>,
}

impl<'a> Call<'a> {
    fn new(script: &'a Script, key: String) -> Self {
        Self { script, key, args: Vec::with_capacity(8) }
    }

    fn arg(mut self, arg: impl redis::ToRedisArgs) -> Self {
        arg.write_redis_args(&mut self.args);
        self
    }

    fn evalsha(&self) -> redis::Cmd {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(self.script.get_hash()).arg(1).arg(self.key.as_str());
        for a in &self.args {
            cmd.arg(a.as_slice());
        }
        cmd
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    Safe,
    Warn,
    Refuse,
}

/// Whether `policy` with `maxmemory` bytes (0: no limit) can evict idem's keys, and what
/// `check` says to do about it.
fn eviction_verdict(policy: &str, maxmemory: u64, check: EvictionCheck) -> Verdict {
    // Every policy but noeviction evicts: allkeys-* any key, volatile-* any key with a TTL,
    // and every idem record has one.
    if policy == "noeviction" {
        return Verdict::Safe;
    }
    if maxmemory == 0 {
        return Verdict::Warn;
    }
    match check {
        EvictionCheck::Refuse => Verdict::Refuse,
        EvictionCheck::Warn => Verdict::Warn,
    }
}

/// A script's reply: `{status, now, rest...}`.
struct Reply {
    status: Vec<u8>,
    now: UnixMillis,
    rest: Vec<Value>,
}

impl Reply {
    fn parse(op: &'static str, value: Value) -> Result<Self, Error> {
        let bad = |detail| Error::UnexpectedReply { operation: op, detail };
        let Value::Array(items) = value else { return Err(bad("not an array")) };
        let mut items = items.into_iter();
        let status = items.next().and_then(into_bytes).ok_or_else(|| bad("no status"))?;
        let now = items.next().as_ref().and_then(as_bytes).and_then(parse_i64).ok_or_else(|| bad("no time"))?;
        Ok(Self { status, now: UnixMillis(now), rest: items.collect() })
    }

    fn is(&self, status: &str) -> bool {
        self.status == status.as_bytes()
    }
}

fn into_bytes(v: Value) -> Option<Vec<u8>> {
    match v {
        Value::BulkString(b) => Some(b),
        Value::SimpleString(s) => Some(s.into_bytes()),
        _ => None,
    }
}

fn as_bytes(v: &Value) -> Option<&[u8]> {
    match v {
        Value::BulkString(b) => Some(b),
        Value::SimpleString(s) => Some(s.as_bytes()),
        _ => None,
    }
}

/// Whether `b` is a canonical non-negative decimal (digits only, no leading zero), the only
/// form the scripts write and the only one their string comparisons are correct for.
fn is_canonical(b: &[u8]) -> bool {
    !b.is_empty() && b.iter().all(u8::is_ascii_digit) && (b.len() == 1 || b[0] != b'0')
}

fn parse_i64(b: &[u8]) -> Option<i64> {
    if !is_canonical(b) {
        return None;
    }
    std::str::from_utf8(b).ok()?.parse().ok()
}

fn parse_u64(b: &[u8]) -> Option<u64> {
    if !is_canonical(b) {
        return None;
    }
    std::str::from_utf8(b).ok()?.parse().ok()
}

fn unexpected(op: &'static str, detail: &'static str) -> StoreError {
    Error::UnexpectedReply { operation: op, detail }.into()
}

/// A corrupt record: logs which field, returns the typed error.
fn corrupt(id: RecordId, field: &'static str, source: CodecError) -> StoreError {
    tracing::warn!(record = %id, field, error = %source, "idem-redis: stored record does not decode");
    StoreError::Corrupt { id: Some(id), source }
}

fn bad_field(id: RecordId, field: &'static str) -> StoreError {
    corrupt(id, field, CodecError::Malformed(postcard::Error::DeserializeBadEncoding))
}

/// Hash fields in the order the scripts return them (`FIELDS` in `common.lua`).
mod field {
    pub(super) const VERSION: usize = 0;
    pub(super) const STATE: usize = 1;
    pub(super) const TOKEN: usize = 2;
    pub(super) const FINGERPRINT: usize = 3;
    pub(super) const PRINCIPAL: usize = 4;
    pub(super) const ENDPOINT: usize = 5;
    pub(super) const KEY: usize = 6;
    pub(super) const CREATED_AT: usize = 7;
    pub(super) const STARTED_AT: usize = 8;
    pub(super) const LEASE_EXPIRES_AT: usize = 9;
    pub(super) const EXPIRES_AT: usize = 10;
    pub(super) const RESPONSE: usize = 11;
}

const STATE_IN_FLIGHT: &str = "in_flight";
const STATE_COMPLETED: &str = "completed";
const STATE_FAILED: &str = "failed";

fn encode_response(response: &StoredResponse) -> Vec<u8> {
    // Serialising plain data into a Vec cannot fail; an empty result would decode to a
    // typed error rather than panic.
    postcard::to_extend(response, vec![RESPONSE_FORMAT]).unwrap_or_default()
}

fn decode_response(id: RecordId, bytes: &[u8]) -> Result<StoredResponse, StoreError> {
    let field = "response";
    let (&version, rest) = bytes.split_first().ok_or_else(|| corrupt(id, field, CodecError::Empty))?;
    if version != RESPONSE_FORMAT {
        return Err(corrupt(id, field, CodecError::UnknownVersion(version)));
    }
    let (response, tail) =
        postcard::take_from_bytes::<StoredResponse>(rest).map_err(|e| corrupt(id, field, CodecError::Malformed(e)))?;
    if !tail.is_empty() {
        return Err(corrupt(id, field, CodecError::Trailing(tail.len())));
    }
    Ok(response)
}

/// `IdempotencyKey` has no unchecked constructor; it deserialises from its serde form,
/// which for postcard is the string's own encoding. The record id check in
/// [`decode_record`] then proves principal, endpoint and key are the ones hashed.
fn decode_key(s: &str) -> Option<IdempotencyKey> {
    let bytes = postcard::to_allocvec(s).ok()?;
    postcard::from_bytes(&bytes).ok()
}

/// Builds a record from the script's fields (`FIELDS` order). `response`: the response the
/// caller just stored (complete does not ship it back); otherwise it is decoded from the
/// field.
fn decode_record(id: RecordId, f: &[Value], response: Option<StoredResponse>) -> Result<Record, StoreError> {
    let get = |i: usize, name: &'static str| {
        f.get(i)
            .and_then(as_bytes)
            .ok_or_else(|| corrupt(id, name, CodecError::Malformed(postcard::Error::DeserializeUnexpectedEnd)))
    };
    let text = |i: usize, name: &'static str| {
        get(i, name).and_then(|b| std::str::from_utf8(b).map_err(|_| bad_field(id, name)))
    };
    let time = |i: usize, name: &'static str| {
        get(i, name).and_then(|b| parse_i64(b).map(UnixMillis).ok_or_else(|| bad_field(id, name)))
    };

    let version = get(field::VERSION, "v")?;
    if version != b"1" {
        let v = parse_u64(version).and_then(|v| u8::try_from(v).ok()).unwrap_or(u8::MAX);
        return Err(corrupt(id, "v", CodecError::UnknownVersion(v)));
    }
    let state = match text(field::STATE, "state")? {
        STATE_IN_FLIGHT => RecordState::InFlight,
        STATE_COMPLETED => RecordState::Completed,
        STATE_FAILED => RecordState::Failed,
        _ => return Err(bad_field(id, "state")),
    };
    let token = get(field::TOKEN, "token").and_then(|b| parse_u64(b).ok_or_else(|| bad_field(id, "token")))?;
    let fingerprint = get(field::FINGERPRINT, "fingerprint")
        .and_then(|b| <[u8; 32]>::try_from(b).map_err(|_| bad_field(id, "fingerprint")))?;
    let principal = text(field::PRINCIPAL, "principal")?.to_owned();
    let endpoint = text(field::ENDPOINT, "endpoint")?.to_owned();
    let key = text(field::KEY, "key").and_then(|k| decode_key(k).ok_or_else(|| bad_field(id, "key")))?;
    if RecordId::derive(&principal, &endpoint, key.as_str()) != id {
        // Scope and key must hash to the key the record lives at.
        return Err(bad_field(id, "key"));
    }
    let response = match (state, response) {
        (RecordState::Completed, Some(r)) => Some(r),
        (RecordState::Completed, None) => {
            let bytes = get(field::RESPONSE, "response")?;
            Some(decode_response(id, bytes)?)
        }
        (_, _) => None,
    };
    Ok(Record {
        id,
        scope: Scope { principal: Principal(principal), endpoint: Endpoint(endpoint) },
        key,
        fingerprint: Fingerprint(fingerprint),
        state,
        token: FencingToken(token),
        response,
        created_at: time(field::CREATED_AT, "created_at")?,
        started_at: time(field::STARTED_AT, "started_at")?,
        lease_expires_at: time(field::LEASE_EXPIRES_AT, "lease_expires_at")?,
        expires_at: time(field::EXPIRES_AT, "expires_at")?,
    })
}

fn lease_lost(op: &'static str, id: RecordId, presented: FencingToken, reply: &Reply) -> StoreError {
    let current = match reply.rest.first() {
        None | Some(Value::Nil) => None,
        Some(v) => match as_bytes(v).and_then(parse_u64) {
            Some(t) => Some(FencingToken(t)),
            None => return unexpected(op, "lease lost without a readable token"),
        },
    };
    StoreError::LeaseLost { id, presented, current }
}

#[async_trait]
impl Store for RedisStore {
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        const OP: &str = "claim";
        let key = self.record_key(req.id);
        let call = Call::new(&SCRIPTS.claim, key)
            .arg(self.clock_arg()?)
            .arg(req.lease_ms())
            .arg(req.retention_ms())
            .arg(self.grace_ms())
            .arg(&req.fingerprint.0[..])
            .arg(req.scope.principal.0.as_str())
            .arg(req.scope.endpoint.0.as_str())
            .arg(req.key.as_str());
        let (reply, acked) = self.run(OP, &call, Kind::AckedWrite).await?;
        if reply.is("claimed") {
            let num = |i: usize| reply.rest.get(i).and_then(as_bytes).and_then(parse_i64);
            let (Some(token), Some(lease_expires_at), Some(expires_at)) = (num(0), num(1), num(2)) else {
                return Err(unexpected(OP, "claimed without token and times"));
            };
            let token = u64::try_from(token).map_err(|_| unexpected(OP, "negative token"))?;
            let record = Record {
                id: req.id,
                scope: req.scope,
                key: req.key,
                fingerprint: req.fingerprint,
                state: RecordState::InFlight,
                token: FencingToken(token),
                response: None,
                created_at: reply.now,
                started_at: reply.now,
                lease_expires_at: UnixMillis(lease_expires_at),
                expires_at: UnixMillis(expires_at),
            };
            self.check_ack(acked)?;
            Ok(ClaimOutcome::Claimed(record))
        } else if reply.is("existing") {
            let record = decode_record(req.id, &reply.rest, None)?;
            Ok(ClaimOutcome::Existing { record, now: reply.now })
        } else if reply.is("corrupt") {
            Err(bad_field(req.id, "v/token/expires_at"))
        } else {
            Err(unexpected(OP, "unknown status"))
        }
    }

    async fn reclaim(&self, req: ReclaimRequest) -> Result<ReclaimOutcome, StoreError> {
        const OP: &str = "reclaim";
        let key = self.record_key(req.id);
        let call = Call::new(&SCRIPTS.reclaim, key)
            .arg(self.clock_arg()?)
            .arg(req.expected.0)
            .arg(&req.fingerprint.0[..])
            .arg(req.lease_ms())
            .arg(req.retention_ms())
            .arg(self.grace_ms());
        let (reply, acked) = self.run(OP, &call, Kind::AckedWrite).await?;
        if reply.is("reclaimed") {
            let record = decode_record(req.id, &reply.rest, None)?;
            self.check_ack(acked)?;
            Ok(ReclaimOutcome::Reclaimed(record))
        } else if reply.is("conflict") {
            let record = decode_record(req.id, &reply.rest, None)?;
            Ok(ReclaimOutcome::Conflict { current: Some(record), now: reply.now })
        } else if reply.is("absent") {
            Ok(ReclaimOutcome::Conflict { current: None, now: reply.now })
        } else if reply.is("corrupt") {
            Err(bad_field(req.id, "v/token/lease_expires_at/expires_at"))
        } else {
            Err(unexpected(OP, "unknown status"))
        }
    }

    async fn complete(
        &self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Record, StoreError> {
        const OP: &str = "complete";
        let key = self.record_key(id);
        let encoded = encode_response(&response);
        let call = Call::new(&SCRIPTS.complete, key).arg(self.clock_arg()?).arg(token.0).arg(encoded.as_slice());
        let (reply, acked) = self.run(OP, &call, Kind::AckedWrite).await?;
        if reply.is("ok") {
            let record = decode_record(id, &reply.rest, Some(response))?;
            self.check_ack(acked)?;
            Ok(record)
        } else if reply.is("lost") {
            Err(lease_lost(OP, id, token, &reply))
        } else if reply.is("corrupt") {
            Err(bad_field(id, "v/token/expires_at"))
        } else {
            Err(unexpected(OP, "unknown status"))
        }
    }

    async fn fail(&self, id: RecordId, token: FencingToken) -> Result<Record, StoreError> {
        const OP: &str = "fail";
        let key = self.record_key(id);
        let call = Call::new(&SCRIPTS.fail, key).arg(self.clock_arg()?).arg(token.0);
        let (reply, _) = self.run(OP, &call, Kind::Write).await?;
        if reply.is("ok") {
            decode_record(id, &reply.rest, None)
        } else if reply.is("lost") {
            Err(lease_lost(OP, id, token, &reply))
        } else if reply.is("corrupt") {
            Err(bad_field(id, "v/token/lease_expires_at/expires_at"))
        } else {
            Err(unexpected(OP, "unknown status"))
        }
    }

    async fn get(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        const OP: &str = "get";
        let key = self.record_key(id);
        let call = Call::new(&SCRIPTS.get, key).arg(self.clock_arg()?);
        let (reply, _) = self.run(OP, &call, Kind::Read).await?;
        if reply.is("found") {
            decode_record(id, &reply.rest, None).map(Some)
        } else if reply.is("absent") {
            Ok(None)
        } else {
            Err(unexpected(OP, "unknown status"))
        }
    }

    /// Redis expires records itself (`PEXPIREAT` at `expires_at`): nothing to sweep.
    async fn sweep(&self, _limit: usize) -> Result<SweepOutcome, StoreError> {
        Ok(SweepOutcome::default())
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::new().with_native_expiry(true).with_server_clock(true).with_shared(true).with_journal(true)
    }

    /// Entries are fields `j:<name>` of the record's hash (see `journal_put.lua`).
    async fn journal_put(
        &self,
        id: RecordId,
        token: FencingToken,
        name: &str,
        value: Vec<u8>,
        overwrite: bool,
    ) -> Result<JournalWrite, StoreError> {
        const OP: &str = "journal_put";
        let call = Call::new(&SCRIPTS.journal_put, self.record_key(id))
            .arg(self.clock_arg()?)
            .arg(token.0)
            .arg(name)
            .arg(value.as_slice())
            .arg(if overwrite { "1" } else { "0" });
        let (mut reply, _) = self.run(OP, &call, Kind::Write).await?;
        if reply.is("written") {
            Ok(JournalWrite::Written)
        } else if reply.is("exists") {
            let stored =
                reply.rest.pop().and_then(into_bytes).ok_or_else(|| unexpected(OP, "exists without a value"))?;
            Ok(JournalWrite::Exists(stored))
        } else if reply.is("lost") {
            Err(lease_lost(OP, id, token, &reply))
        } else if reply.is("corrupt") {
            Err(bad_field(id, "v/token/expires_at"))
        } else {
            Err(unexpected(OP, "unknown status"))
        }
    }

    async fn journal_get(&self, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        const OP: &str = "journal_get";
        let call = Call::new(&SCRIPTS.journal_get, self.record_key(id)).arg(self.clock_arg()?).arg(name);
        let (mut reply, _) = self.run(OP, &call, Kind::Read).await?;
        if reply.is("found") {
            reply.rest.pop().and_then(into_bytes).map(Some).ok_or_else(|| unexpected(OP, "found without a value"))
        } else if reply.is("absent") {
            Ok(None)
        } else {
            Err(unexpected(OP, "unknown status"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_noeviction_is_safe() {
        assert_eq!(eviction_verdict("noeviction", 1 << 30, EvictionCheck::Refuse), Verdict::Safe);
        for policy in [
            "allkeys-lru",
            "allkeys-lfu",
            "allkeys-random",
            "volatile-lru",
            "volatile-lfu",
            "volatile-random",
            "volatile-ttl",
        ] {
            assert_eq!(eviction_verdict(policy, 1 << 30, EvictionCheck::Refuse), Verdict::Refuse, "{policy}");
            assert_eq!(eviction_verdict(policy, 1 << 30, EvictionCheck::Warn), Verdict::Warn, "{policy}");
            // No memory limit: nothing is evicted until someone sets one.
            assert_eq!(eviction_verdict(policy, 0, EvictionCheck::Refuse), Verdict::Warn, "{policy}");
        }
    }

    #[test]
    fn braces_in_the_prefix_are_refused() {
        assert!(RedisConfig::new().with_prefix("a{b}:").validate().is_err());
        assert!(RedisConfig::new().with_prefix("tenant-7:idem:").validate().is_ok());
    }

    #[test]
    fn response_round_trips_byte_exact() {
        let id = RecordId::derive("p", "e", "k");
        let r = StoredResponse::new(201, vec![("etag".into(), vec![0, 0xff, b'"'])], (0..=255u8).collect());
        assert_eq!(decode_response(id, &encode_response(&r)).expect("decodes"), r);
        assert!(matches!(decode_response(id, &[]), Err(StoreError::Corrupt { .. })));
        assert!(matches!(decode_response(id, &[9, 1]), Err(StoreError::Corrupt { .. })));
        let mut long = encode_response(&r);
        long.push(0);
        assert!(matches!(decode_response(id, &long), Err(StoreError::Corrupt { .. })));
    }

    #[test]
    fn keys_that_reparse_differently_still_decode() {
        // A key made of visible ASCII that starts with a quote would not survive
        // `IdempotencyKey::parse` again; the serde path keeps it as stored.
        let key = IdempotencyKey::parse(br#""\"x""#).expect("sf-string key");
        assert_eq!(key.as_str(), "\"x");
        assert_eq!(decode_key(key.as_str()), Some(key));
    }

    #[test]
    fn wait_timeout_raises_the_response_timeout() {
        let c = RedisConfig::new()
            .with_response_timeout(Duration::from_secs(1))
            .with_replica_ack(Some(ReplicaAck { replicas: 1, timeout: Duration::from_secs(3) }));
        assert_eq!(c.effective_response_timeout(), Duration::from_millis(3_500));
    }
}
