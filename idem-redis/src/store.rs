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

/// A script: its shebang line (Redis 7 script flags), `common.lua`, then the body (after
/// `arith.lua` for reclaim and fail).
///
/// The shebang makes Redis enforce what the layout promises: a script may only touch keys
/// in the slot of its declared key (on a Cluster node), a write script is refused up front
/// on a replica (`READONLY`) and when memory is full (`OOM`), and read-only scripts declare
/// `no-writes`.
macro_rules! script {
    ($shebang:literal, $($file:literal),+) => {
        Script::new(concat!(
            $shebang,
            "\n",
            include_str!("scripts/common.lua"),
            $("\n", include_str!(concat!("scripts/", $file))),+
        ))
    };
}

/// Built once per process: `Script` hashes its source at construction; every call is
/// `EVALSHA`, and on `NOSCRIPT` (a restarted or failed-over server, a `SCRIPT FLUSH`) the
/// store loads the source and sends the call again (`RedisStore::run`).
static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| Scripts {
    claim: script!("#!lua", "claim.lua"),
    reclaim: script!("#!lua", "arith.lua", "reclaim.lua"),
    complete: script!("#!lua", "complete.lua"),
    fail: script!("#!lua", "arith.lua", "fail.lua"),
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
                if now >= 1 << 53 {
                    // The scripts hold the clock in a Lua double, exact below 2^53.
                    return Err(Error::Config("the test clock reads past 2^53 ms").into());
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
        let now = match items.next() {
            Some(Value::Int(n)) if n >= 0 => n,
            _ => return Err(bad("no time")),
        };
        Ok(Self { status, now: UnixMillis(now), rest: items.collect() })
    }

    fn is(&self, status: &str) -> bool {
        self.status == status.as_bytes()
    }

    /// The `i`th value after the time, if it is a string (a Lua `false` comes back as nil).
    fn bytes(&self, i: usize) -> Option<&[u8]> {
        self.rest.get(i).and_then(as_bytes)
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

fn missing_field(id: RecordId, field: &'static str) -> StoreError {
    corrupt(id, field, CodecError::Malformed(postcard::Error::DeserializeUnexpectedEnd))
}

/// The header (the first [`HEADER_LEN`] bytes of hash field `h`, see `common.lua`): the
/// fixed-layout part of a record that the scripts decide on. Byte 0 is this version. The
/// scope field follows it in the same hash field.
const HEADER_FORMAT: u8 = 2;
/// Version, state, five big-endian u64 (token, created_at, started_at, lease_expires_at,
/// expires_at), fingerprint.
const HEADER_LEN: usize = 2 + 5 * 8 + 32;
/// State bytes of the header.
const STATE_IN_FLIGHT: u8 = 1;
const STATE_COMPLETED: u8 = 2;
const STATE_FAILED: u8 = 3;
/// First byte of the scope (principal, endpoint and idempotency key, postcard), which
/// follows the header in field `h`.
const SCOPE_FORMAT: u8 = 1;

/// The header's fields, decoded.
#[derive(Debug, PartialEq, Eq)]
struct Header {
    state: RecordState,
    token: FencingToken,
    created_at: UnixMillis,
    started_at: UnixMillis,
    lease_expires_at: UnixMillis,
    expires_at: UnixMillis,
    fingerprint: Fingerprint,
}

impl Header {
    fn decode(id: RecordId, h: &[u8]) -> Result<Self, StoreError> {
        let field = "h";
        let (&version, _) = h.split_first().ok_or_else(|| corrupt(id, field, CodecError::Empty))?;
        if version != HEADER_FORMAT {
            return Err(corrupt(id, field, CodecError::UnknownVersion(version)));
        }
        let h: &[u8; HEADER_LEN] =
            h.get(..HEADER_LEN).and_then(|h| h.try_into().ok()).ok_or_else(|| bad_field(id, field))?;
        let u64_at = |at: usize| {
            let mut b = [0; 8];
            b.copy_from_slice(&h[at..at + 8]);
            u64::from_be_bytes(b)
        };
        let time_at = |at: usize| i64::try_from(u64_at(at)).map(UnixMillis).map_err(|_| bad_field(id, field));
        let state = match h[1] {
            STATE_IN_FLIGHT => RecordState::InFlight,
            STATE_COMPLETED => RecordState::Completed,
            STATE_FAILED => RecordState::Failed,
            _ => return Err(bad_field(id, field)),
        };
        let mut fingerprint = [0; 32];
        fingerprint.copy_from_slice(&h[42..]);
        Ok(Self {
            state,
            token: FencingToken(u64_at(2)),
            created_at: time_at(10)?,
            started_at: time_at(18)?,
            lease_expires_at: time_at(26)?,
            expires_at: time_at(34)?,
            fingerprint: Fingerprint(fingerprint),
        })
    }
}

fn encode_response(response: &StoredResponse) -> Vec<u8> {
    // Serialising plain data into a Vec cannot fail; an empty result would decode to a
    // typed error rather than panic.
    postcard::to_extend(response, vec![RESPONSE_FORMAT]).unwrap_or_default()
}

fn decode_response(id: RecordId, bytes: &[u8]) -> Result<StoredResponse, StoreError> {
    let field = "r";
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

/// The scope after the header in field `h`: version byte, then postcard of (principal,
/// endpoint, key).
fn encode_scope(scope: &Scope, key: &IdempotencyKey) -> Vec<u8> {
    let parts = (scope.principal.0.as_str(), scope.endpoint.0.as_str(), key.as_str());
    postcard::to_extend(&parts, vec![SCOPE_FORMAT]).unwrap_or_default()
}

fn decode_scope(id: RecordId, bytes: &[u8]) -> Result<(Scope, IdempotencyKey), StoreError> {
    let field = "h (scope)";
    let (&version, rest) = bytes.split_first().ok_or_else(|| corrupt(id, field, CodecError::Empty))?;
    if version != SCOPE_FORMAT {
        return Err(corrupt(id, field, CodecError::UnknownVersion(version)));
    }
    let ((principal, endpoint, key), tail) = postcard::take_from_bytes::<(String, String, IdempotencyKey)>(rest)
        .map_err(|e| corrupt(id, field, CodecError::Malformed(e)))?;
    if !tail.is_empty() {
        return Err(corrupt(id, field, CodecError::Trailing(tail.len())));
    }
    if RecordId::derive(&principal, &endpoint, key.as_str()) != id {
        // Scope and key must hash to the key the record lives at.
        return Err(bad_field(id, field));
    }
    Ok((Scope { principal: Principal(principal), endpoint: Endpoint(endpoint) }, key))
}

/// Builds a record from a script's `h, response or nil` (starting at `rest[0]`).
/// `completed`: the response the caller just stored, with `h` as it was before (complete
/// ships neither back); otherwise the response is decoded from the reply.
fn decode_record(id: RecordId, reply: &Reply, completed: Option<StoredResponse>) -> Result<Record, StoreError> {
    let h = reply.bytes(0).ok_or_else(|| missing_field(id, "h"))?;
    let mut header = Header::decode(id, h)?;
    let (scope, key) = decode_scope(id, &h[HEADER_LEN..])?;
    let response = match completed {
        Some(r) => {
            header.state = RecordState::Completed;
            Some(r)
        }
        None if header.state == RecordState::Completed => {
            Some(decode_response(id, reply.bytes(1).ok_or_else(|| missing_field(id, "r"))?)?)
        }
        None => None,
    };
    Ok(Record {
        id,
        scope,
        key,
        fingerprint: header.fingerprint,
        state: header.state,
        token: header.token,
        response,
        created_at: header.created_at,
        started_at: header.started_at,
        lease_expires_at: header.lease_expires_at,
        expires_at: header.expires_at,
    })
}

fn lease_lost(op: &'static str, id: RecordId, presented: FencingToken, reply: &Reply) -> StoreError {
    let current = match reply.rest.first() {
        None | Some(Value::Nil) => None,
        Some(v) => match as_bytes(v).and_then(|b| <[u8; 8]>::try_from(b).ok()) {
            Some(t) => Some(FencingToken(u64::from_be_bytes(t))),
            None => return unexpected(op, "lease lost without a readable token"),
        },
    };
    StoreError::LeaseLost { id, presented, current }
}

/// Lease and retention in ms as the scripts take them: two big-endian u64.
fn ttl_arg(lease_ms: i64, retention_ms: i64) -> [u8; 16] {
    let mut out = [0; 16];
    out[..8].copy_from_slice(&lease_ms.max(0).to_be_bytes());
    out[8..].copy_from_slice(&retention_ms.max(0).to_be_bytes());
    out
}

#[async_trait]
impl Store for RedisStore {
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        const OP: &str = "claim";
        let key = self.record_key(req.id);
        let call = Call::new(&SCRIPTS.claim, key)
            .arg(self.clock_arg()?)
            .arg(&ttl_arg(req.lease_ms(), req.retention_ms())[..])
            .arg(self.grace_ms())
            .arg(&req.fingerprint.0[..])
            .arg(encode_scope(&req.scope, &req.key));
        let (reply, acked) = self.run(OP, &call, Kind::AckedWrite).await?;
        if reply.is("claimed") {
            let header = reply.bytes(0).ok_or_else(|| unexpected(OP, "claimed without a header"))?;
            // The scope after the header is the request's own.
            let h = Header::decode(req.id, header)?;
            let record = Record {
                id: req.id,
                scope: req.scope,
                key: req.key,
                fingerprint: h.fingerprint,
                state: h.state,
                token: h.token,
                response: None,
                created_at: h.created_at,
                started_at: h.started_at,
                lease_expires_at: h.lease_expires_at,
                expires_at: h.expires_at,
            };
            self.check_ack(acked)?;
            Ok(ClaimOutcome::Claimed(record))
        } else if reply.is("existing") {
            let record = decode_record(req.id, &reply, None)?;
            Ok(ClaimOutcome::Existing { record, now: reply.now })
        } else if reply.is("corrupt") {
            Err(bad_field(req.id, "h"))
        } else {
            Err(unexpected(OP, "unknown status"))
        }
    }

    async fn reclaim(&self, req: ReclaimRequest) -> Result<ReclaimOutcome, StoreError> {
        const OP: &str = "reclaim";
        let key = self.record_key(req.id);
        let call = Call::new(&SCRIPTS.reclaim, key)
            .arg(self.clock_arg()?)
            .arg(&req.expected.0.to_be_bytes()[..])
            .arg(&req.fingerprint.0[..])
            .arg(&ttl_arg(req.lease_ms(), req.retention_ms())[..])
            .arg(self.grace_ms());
        let (reply, acked) = self.run(OP, &call, Kind::AckedWrite).await?;
        if reply.is("reclaimed") {
            let record = decode_record(req.id, &reply, None)?;
            self.check_ack(acked)?;
            Ok(ReclaimOutcome::Reclaimed(record))
        } else if reply.is("conflict") {
            let record = decode_record(req.id, &reply, None)?;
            Ok(ReclaimOutcome::Conflict { current: Some(record), now: reply.now })
        } else if reply.is("absent") {
            Ok(ReclaimOutcome::Conflict { current: None, now: reply.now })
        } else if reply.is("corrupt") {
            Err(bad_field(req.id, "h"))
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
        let call = Call::new(&SCRIPTS.complete, key)
            .arg(self.clock_arg()?)
            .arg(&token.0.to_be_bytes()[..])
            .arg(encoded.as_slice());
        let (reply, acked) = self.run(OP, &call, Kind::AckedWrite).await?;
        if reply.is("ok") {
            let record = decode_record(id, &reply, Some(response))?;
            self.check_ack(acked)?;
            Ok(record)
        } else if reply.is("lost") {
            Err(lease_lost(OP, id, token, &reply))
        } else if reply.is("corrupt") {
            Err(bad_field(id, "h"))
        } else {
            Err(unexpected(OP, "unknown status"))
        }
    }

    async fn fail(&self, id: RecordId, token: FencingToken) -> Result<Record, StoreError> {
        const OP: &str = "fail";
        let key = self.record_key(id);
        let call = Call::new(&SCRIPTS.fail, key).arg(self.clock_arg()?).arg(&token.0.to_be_bytes()[..]);
        let (reply, _) = self.run(OP, &call, Kind::Write).await?;
        if reply.is("ok") {
            decode_record(id, &reply, None)
        } else if reply.is("lost") {
            Err(lease_lost(OP, id, token, &reply))
        } else if reply.is("corrupt") {
            Err(bad_field(id, "h"))
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
            decode_record(id, &reply, None).map(Some)
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
            .arg(&token.0.to_be_bytes()[..])
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
            Err(bad_field(id, "h"))
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
        let scope = Scope::new("p", Endpoint::new("POST", "/x")).expect("scope");
        let id = RecordId::derive(&scope.principal.0, &scope.endpoint.0, key.as_str());
        assert_eq!(decode_scope(id, &encode_scope(&scope, &key)).expect("decodes"), (scope.clone(), key.clone()));
        // Another record's scope does not decode under this id.
        let other = RecordId::derive("q", &scope.endpoint.0, key.as_str());
        assert!(matches!(decode_scope(other, &encode_scope(&scope, &key)), Err(StoreError::Corrupt { .. })));
    }

    #[test]
    fn header_decodes_and_refuses_bad_layouts() {
        let id = RecordId::derive("p", "e", "k");
        let mut h = vec![HEADER_FORMAT, STATE_COMPLETED];
        for v in [(1u64 << 53) + 1, 10, 11, 12, i64::MAX as u64] {
            h.extend_from_slice(&v.to_be_bytes());
        }
        h.extend_from_slice(&[7; 32]);
        let d = Header::decode(id, &h).expect("decodes");
        assert_eq!(d.token, FencingToken((1 << 53) + 1));
        assert_eq!((d.state, d.expires_at), (RecordState::Completed, UnixMillis(i64::MAX)));
        let bad = |f: &dyn Fn(&mut Vec<u8>)| {
            let mut b = h.clone();
            f(&mut b);
            matches!(Header::decode(id, &b), Err(StoreError::Corrupt { .. }))
        };
        assert!(bad(&|b| b[0] = 3), "unknown version");
        assert!(bad(&|b| b[1] = 9), "unknown state");
        assert!(bad(&|b| b.truncate(40)), "short");
        assert!(bad(&|b| b[34] = 0x80), "timestamp past i64::MAX");
        assert!(bad(&|b| b.clear()), "empty");
    }

    #[test]
    fn wait_timeout_raises_the_response_timeout() {
        let c = RedisConfig::new()
            .with_response_timeout(Duration::from_secs(1))
            .with_replica_ack(Some(ReplicaAck { replicas: 1, timeout: Duration::from_secs(3) }));
        assert_eq!(c.effective_response_timeout(), Duration::from_millis(3_500));
    }
}
