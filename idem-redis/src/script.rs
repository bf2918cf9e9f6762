//! The Lua scripts (in `src/scripts/`) and everything that crosses their boundary: how
//! they are built and loaded, how one is called (`EVALSHA`, `NOSCRIPT` reload, pipelined
//! `WAIT`), the reply each gives, and the record bytes they read and write (the header
//! and scope in hash field `h`, the response in field `r`).

use std::sync::LazyLock;

use idem_core::codec::{CodecError, decode_response};
use idem_core::{
    Endpoint, FencingToken, Fingerprint, IdempotencyKey, Principal, Receipt, Record, RecordId, RecordState, Scope,
    StoreError, StoredResponse, UnixMillis,
};
use redis::aio::ConnectionLike;
#[cfg(feature = "cluster")]
use redis::cluster_async::ClusterConnection;
#[cfg(feature = "cluster")]
use redis::cluster_routing::SingleNodeRoutingInfo;
use redis::{ErrorKind, RedisError, Script, ServerErrorKind, Value};

use crate::config::ReplicaAck;
use crate::conn::Connection;
use crate::error::Error;

/// How a script may be sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// Reads only: safe to send again.
    Read,
    /// Writes; never sent again after a connection error.
    Write,
    /// Writes that [`ReplicaAck`] covers (claim, reclaim, complete, extend).
    AckedWrite,
}

/// One script and what calling it is called in errors.
pub(crate) struct Op {
    name: &'static str,
    kind: Kind,
    /// The full source, for `SCRIPT LOAD` and for `EVAL` after a `NOSCRIPT` on a cluster.
    source: &'static str,
    script: Script,
}

impl Op {
    fn new(name: &'static str, kind: Kind, source: &'static str) -> Self {
        Self { name, kind, source, script: Script::new(source) }
    }
}

pub(crate) struct Scripts {
    pub(crate) claim: Op,
    pub(crate) reclaim: Op,
    pub(crate) complete: Op,
    pub(crate) extend: Op,
    pub(crate) fail: Op,
    pub(crate) get: Op,
    pub(crate) journal_put: Op,
    pub(crate) journal_get: Op,
}

/// A script: its shebang line (Redis 7 script flags), `common.lua`, then the body (after
/// `arith.lua` for reclaim, extend and fail).
///
/// The shebang makes Redis enforce what the layout promises: a script may only touch keys
/// in the slot of its declared key (on a Cluster node), a write script is refused up front
/// on a replica (`READONLY`) and when memory is full (`OOM`), and read-only scripts declare
/// `no-writes`.
macro_rules! script {
    ($shebang:literal, $($file:literal),+) => {
        concat!(
            $shebang,
            "\n",
            include_str!("scripts/common.lua"),
            $("\n", include_str!(concat!("scripts/", $file))),+
        )
    };
}

/// Built once per process: `Script` hashes its source at construction; every call is
/// `EVALSHA`, and on `NOSCRIPT` (a restarted or failed-over server, a `SCRIPT FLUSH`) the
/// call loads the source and is sent again ([`Call::send`]).
pub(crate) static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| Scripts {
    claim: Op::new("claim", Kind::AckedWrite, script!("#!lua", "claim.lua")),
    reclaim: Op::new("reclaim", Kind::AckedWrite, script!("#!lua", "arith.lua", "reclaim.lua")),
    complete: Op::new("complete", Kind::AckedWrite, script!("#!lua", "complete.lua")),
    extend: Op::new("extend", Kind::AckedWrite, script!("#!lua", "arith.lua", "extend.lua")),
    fail: Op::new("fail", Kind::Write, script!("#!lua", "arith.lua", "fail.lua")),
    get: Op::new("get", Kind::Read, script!("#!lua flags=no-writes", "get.lua")),
    journal_put: Op::new("journal_put", Kind::Write, script!("#!lua", "journal_put.lua")),
    journal_get: Op::new("journal_get", Kind::Read, script!("#!lua flags=no-writes", "journal_get.lua")),
});

/// Loads every script into the script cache (`SCRIPT LOAD`) of the server, or of every
/// primary of a cluster, so the first calls need no `NOSCRIPT` round trip and a server that
/// refuses scripts fails at start-up.
pub(crate) async fn load_all(conn: &mut Connection) -> Result<(), Error> {
    let s = &*SCRIPTS;
    for op in [&s.claim, &s.reclaim, &s.complete, &s.extend, &s.fail, &s.get, &s.journal_put, &s.journal_get] {
        let mut load = redis::cmd("SCRIPT");
        load.arg("LOAD").arg(op.source);
        for (_node, reply) in conn.on_every_primary(load).await.map_err(|e| Error::command("SCRIPT LOAD", e))? {
            reply.map_err(|e| Error::command("SCRIPT LOAD", e))?;
        }
    }
    Ok(())
}

/// How many `MOVED`/`ASK` redirects one call follows before it gives up (retryably). A
/// slot moves once per migration; more than a few in a row means the topology is churning.
#[cfg(feature = "cluster")]
const MAX_REDIRECTS: usize = 5;

/// One script call: `EVALSHA sha 1 key args...`.
pub(crate) struct Call {
    op: &'static Op,
    key: String,
    args: Vec<Vec<u8>>,
}

impl Call {
    pub(crate) fn new(op: &'static Op, key: String) -> Self {
        Self { op, key, args: Vec::with_capacity(8) }
    }

    pub(crate) fn arg(mut self, arg: impl redis::ToRedisArgs) -> Self {
        arg.write_redis_args(&mut self.args);
        self
    }

    /// The record key and whether the call claims (claim, reclaim), for a write that
    /// [`ReplicaAck`] covers; `None` for any other call.
    pub(crate) fn acked(&self) -> Option<(&str, bool)> {
        (self.op.kind == Kind::AckedWrite).then_some((self.key.as_str(), matches!(self.op.name, "claim" | "reclaim")))
    }

    fn evalsha(&self) -> redis::Cmd {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(self.op.script.get_hash()).arg(1).arg(self.key.as_str());
        for a in &self.args {
            cmd.arg(a.as_slice());
        }
        cmd
    }

    /// `EVAL source 1 key args...`: runs the script and leaves it in the script cache of
    /// the node that ran it.
    #[cfg(feature = "cluster")]
    fn eval(&self) -> redis::Cmd {
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(self.op.source).arg(1).arg(self.key.as_str());
        for a in &self.args {
            cmd.arg(a.as_slice());
        }
        cmd
    }

    /// Sends the call. For a write that [`ReplicaAck`] covers, `WAIT` goes in the same
    /// pipeline, so it runs on the connection that made the write (a reconnect between the
    /// two would make WAIT count nothing) and costs no extra round trip; the count it
    /// returns is in [`Reply::acked`].
    ///
    /// Writes are never sent twice after a connection error: whether the first one ran is
    /// unknown, and the caller's retry goes through claim again. A read is sent once more
    /// after an I/O error, which covers the common case of a connection that died while
    /// idle (a server restart, an idle timeout): the connection manager only notices when
    /// the next command fails.
    pub(crate) async fn send(&self, conn: Connection, ack: Option<ReplicaAck>) -> Result<Reply, StoreError> {
        let ack = if self.op.kind == Kind::AckedWrite { ack } else { None };
        match conn {
            Connection::Single(mut c) => self.send_single(&mut c, ack).await,
            #[cfg(feature = "cluster")]
            Connection::Cluster(mut c) => self.send_cluster(&mut c, ack).await,
        }
    }

    async fn send_single(&self, conn: &mut impl ConnectionLike, ack: Option<ReplicaAck>) -> Result<Reply, StoreError> {
        let op = self.op.name;
        let mut loaded = false;
        let mut resent = false;
        loop {
            let result = match ack {
                None => self.evalsha().query_async::<Value>(conn).await.map(|v| (v, None)),
                Some(ack) => {
                    let mut pipe = redis::pipe();
                    pipe.add_command(self.evalsha());
                    pipe.cmd("WAIT").arg(ack.replicas).arg(ack.timeout_ms());
                    // Raw replies, not `query_async`: that turns an error reply of WAIT into
                    // an error of the whole call, although the script before it ran.
                    match conn.req_packed_commands(&pipe, 0, 2).await {
                        Ok(values) => split_acked(values, 0),
                        Err(e) => Err(e),
                    }
                }
            };
            match result {
                Ok((value, acked)) => return Ok(Reply::parse(op, value, acked)?),
                // The server forgot the script (restart, failover, SCRIPT FLUSH): it did not
                // run. Load it and send the call again, once.
                Err(e) if !loaded && e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                    tracing::debug!(
                        backend = "redis",
                        op,
                        "idem-redis: NOSCRIPT; reloading the script and sending again"
                    );
                    self.op.script.prepare_invoke().load_async(conn).await.map_err(|e| Error::command(op, e))?;
                    loaded = true;
                }
                Err(e) if !resent && self.op.kind == Kind::Read && e.kind() == ErrorKind::Io => {
                    tracing::debug!(backend = "redis", op, error = %e, "idem-redis: read failed on I/O; sending once more");
                    resent = true;
                }
                Err(e) => return Err(Error::command(op, e).into()),
            }
        }
    }

    /// On a cluster: the pipeline goes to the primary that owns the record key's slot. The
    /// `redis` crate runs without retries of its own (it would resend a write after a
    /// dropped connection); the store follows the replies that say the script did not run:
    /// `MOVED`/`ASK` (to that node, after `ASKING` for `ASK`, at most [`MAX_REDIRECTS`]
    /// times) and `NOSCRIPT` (as `EVAL` to the same node). Everything else fails the call
    /// (a read is sent once more after an I/O error). Why: `docs/redis.md#redis-cluster`.
    #[cfg(feature = "cluster")]
    async fn send_cluster(&self, conn: &mut ClusterConnection, ack: Option<ReplicaAck>) -> Result<Reply, StoreError> {
        let op = self.op.name;
        // Where to send: `None` routes by the key's slot; `Some` is a redirect's node.
        let mut target: Option<(String, u16)> = None;
        let mut asking = false;
        let mut eval = false;
        let mut resent = false;
        let mut hops = 0;
        loop {
            let mut pipe = redis::pipe();
            if asking {
                pipe.cmd("ASKING");
            }
            pipe.add_command(if eval { self.eval() } else { self.evalsha() });
            if let Some(ack) = ack {
                pipe.cmd("WAIT").arg(ack.replicas).arg(ack.timeout_ms());
            }
            let n = pipe.len();
            let result = match &target {
                None => conn.req_packed_commands(&pipe, 0, n).await,
                Some((host, port)) => {
                    let route = SingleNodeRoutingInfo::ByAddress { host: host.clone(), port: *port };
                    conn.route_pipeline(pipe, 0, n, route).await
                }
            };
            let redirect = |e: &RedisError| {
                let (addr, _slot) = e.redirect_node()?;
                let (host, port) = addr.rsplit_once(':')?;
                Some((host.to_owned(), port.parse::<u16>().ok()?))
            };
            let err = match result {
                Ok(values) if ack.is_some() => match split_acked(values, usize::from(asking)) {
                    Ok((value, acked)) => return Ok(Reply::parse(op, value, acked)?),
                    Err(e) => e,
                },
                Ok(mut values) => match values.drain(usize::from(asking)..).next() {
                    Some(Value::ServerError(e)) => RedisError::from(e),
                    Some(value) => return Ok(Reply::parse(op, value, None)?),
                    None => return Err(Error::UnexpectedReply { operation: op, detail: "no reply" }.into()),
                },
                Err(e) => e,
            };
            match err.kind() {
                ErrorKind::Server(ServerErrorKind::Moved | ServerErrorKind::Ask) if hops < MAX_REDIRECTS => {
                    let Some(node) = redirect(&err) else { return Err(Error::command(op, err).into()) };
                    asking = err.kind() == ErrorKind::Server(ServerErrorKind::Ask);
                    tracing::debug!(backend = "redis", op, node = ?node, asking, "idem-redis: cluster redirect; sending again");
                    target = Some(node);
                    hops += 1;
                }
                ErrorKind::Server(ServerErrorKind::NoScript) if !eval => {
                    tracing::debug!(backend = "redis", op, "idem-redis: NOSCRIPT on a cluster node; sending as EVAL");
                    eval = true;
                }
                ErrorKind::Io if !resent && self.op.kind == Kind::Read => {
                    tracing::debug!(backend = "redis", op, error = %err, "idem-redis: read failed on I/O; sending once more");
                    resent = true;
                }
                _ => return Err(Error::command(op, err).into()),
            }
        }
    }
}

/// Splits the raw replies of `[ASKING,] script, WAIT` (`skip`: 1 after `ASKING`): `Err`
/// when the script itself was answered with an error (it did not run, or failed whole);
/// otherwise its reply and what WAIT said. A WAIT that failed after the script ran is
/// kept as its own `Err` inside: the caller must still learn that the write happened.
fn split_acked(values: Vec<Value>, skip: usize) -> Result<(Value, Option<Result<u64, Error>>), RedisError> {
    let mut values = values.into_iter().skip(skip);
    let script = match values.next() {
        Some(Value::ServerError(e)) => return Err(e.into()),
        Some(value) => value,
        None => return Err((ErrorKind::UnexpectedReturnType, "no reply to the script").into()),
    };
    let acked = match values.next() {
        Some(Value::Int(n)) => Ok(u64::try_from(n).unwrap_or(0)),
        Some(Value::ServerError(e)) => Err(Error::command("WAIT", e.into())),
        _ => Err(Error::UnexpectedReply { operation: "WAIT", detail: "not a count" }),
    };
    Ok((script, Some(acked)))
}

/// A script's reply: `{status, now, rest...}`, and the replicas `WAIT` counted.
pub(crate) struct Reply {
    op: &'static str,
    status: Vec<u8>,
    pub(crate) now: UnixMillis,
    rest: Vec<Value>,
    /// What the `WAIT` sent after the script said: the replicas that acknowledged the
    /// write, or why WAIT failed (an ACL without `WAIT`, a writable replica); `None`: no
    /// `WAIT` was sent. A WAIT error leaves the script's write in place, exactly as a
    /// shortfall does, so the store treats both alike ([`crate::RedisStore`]'s
    /// `check_claim_ack` releases a claim after either).
    pub(crate) acked: Option<Result<u64, Error>>,
}

impl Reply {
    fn parse(op: &'static str, value: Value, acked: Option<Result<u64, Error>>) -> Result<Self, Error> {
        let bad = |detail| Error::UnexpectedReply { operation: op, detail };
        let Value::Array(items) = value else { return Err(bad("not an array")) };
        let mut items = items.into_iter();
        let status = items.next().and_then(into_bytes).ok_or_else(|| bad("no status"))?;
        let now = match items.next() {
            Some(Value::Int(n)) if n >= 0 => n,
            _ => return Err(bad("no time")),
        };
        Ok(Self { op, status, now: UnixMillis(now), rest: items.collect(), acked })
    }

    pub(crate) fn is(&self, status: &str) -> bool {
        self.status == status.as_bytes()
    }

    /// The `i`th value after the time, if it is a string (a Lua `false` comes back as nil).
    fn bytes(&self, i: usize) -> Option<&[u8]> {
        self.rest.get(i).and_then(as_bytes)
    }

    /// The last value, which must be a string (`found`, `exists`: a journal entry).
    pub(crate) fn into_value(mut self) -> Result<Vec<u8>, StoreError> {
        let op = self.op;
        self.rest.pop().and_then(into_bytes).ok_or_else(|| unexpected(op, "no value"))
    }

    /// The error for any status the caller did not expect: `corrupt` (the script found a
    /// header it cannot read) or one this build does not know.
    pub(crate) fn refusal(&self, id: RecordId) -> StoreError {
        if self.is("corrupt") { bad_field(id, "h") } else { unexpected(self.op, "unknown status") }
    }

    /// `lost`: the presented token does not own the record; the reply carries the current
    /// token, if the record exists.
    pub(crate) fn lease_lost(&self, id: RecordId, presented: FencingToken) -> StoreError {
        let current = match self.rest.first() {
            None | Some(Value::Nil) => None,
            Some(v) => match as_bytes(v).and_then(|b| <[u8; 8]>::try_from(b).ok()) {
                Some(t) => Some(FencingToken(u64::from_be_bytes(t))),
                None => return unexpected(self.op, "lease lost without a readable token"),
            },
        };
        StoreError::LeaseLost { id, presented, current }
    }

    /// The record a claim just wrote: the header in the reply, the scope and key the
    /// claim itself carried (the script does not send them back).
    pub(crate) fn claimed(&self, id: RecordId, scope: Scope, key: IdempotencyKey) -> Result<Record, StoreError> {
        let h = self.bytes(0).ok_or_else(|| unexpected(self.op, "claimed without a header"))?;
        Ok(Header::decode(id, h)?.into_record(id, scope, key, None))
    }

    /// The receipt in a reply of `h, …` after the time: the header's times alone (a fenced
    /// write answers no more, so neither the scope nor a response is decoded).
    pub(crate) fn receipt(&self, id: RecordId) -> Result<Receipt, StoreError> {
        let h = self.bytes(0).ok_or_else(|| missing_field(id, "h"))?;
        let header = Header::decode(id, h)?;
        Ok(Receipt { token: header.token, lease_expires_at: header.lease_expires_at, expires_at: header.expires_at })
    }

    /// The record in a reply of `h, response or nil` after the time.
    pub(crate) fn record(&self, id: RecordId) -> Result<Record, StoreError> {
        let h = self.bytes(0).ok_or_else(|| missing_field(id, "h"))?;
        let header = Header::decode(id, h)?;
        let (scope, key) = decode_scope(id, &h[HEADER_LEN..])?;
        let response = if header.state == RecordState::Completed {
            let r = self.bytes(1).ok_or_else(|| missing_field(id, "r"))?;
            Some(decode_response(r).map_err(|e| corrupt(id, "r", e))?)
        } else {
            None
        };
        Ok(header.into_record(id, scope, key, response))
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
    corrupt(id, field, CodecError::BadField { field, reason: "not a value this crate writes".into() })
}

fn missing_field(id: RecordId, field: &'static str) -> StoreError {
    corrupt(id, field, CodecError::BadField { field, reason: "missing".into() })
}

/// A duration in ms as the scripts take it: a big-endian u64 (negative reads as zero).
pub(crate) fn ms_arg(ms: i64) -> [u8; 8] {
    ms.max(0).to_be_bytes()
}

/// Lease and retention in ms as the scripts take them: two big-endian u64.
pub(crate) fn ttl_arg(lease_ms: i64, retention_ms: i64) -> [u8; 16] {
    let mut out = [0; 16];
    out[..8].copy_from_slice(&lease_ms.max(0).to_be_bytes());
    out[8..].copy_from_slice(&retention_ms.max(0).to_be_bytes());
    out
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
        let u64_at = |at: usize| u64::from_be_bytes(std::array::from_fn(|i| h[at + i]));
        let time_at = |at: usize| i64::try_from(u64_at(at)).map(UnixMillis).map_err(|_| bad_field(id, field));
        let state = match h[1] {
            STATE_IN_FLIGHT => RecordState::InFlight,
            STATE_COMPLETED => RecordState::Completed,
            STATE_FAILED => RecordState::Failed,
            _ => return Err(bad_field(id, field)),
        };
        Ok(Self {
            state,
            token: FencingToken(u64_at(2)),
            created_at: time_at(10)?,
            started_at: time_at(18)?,
            lease_expires_at: time_at(26)?,
            expires_at: time_at(34)?,
            fingerprint: Fingerprint::from_bytes(std::array::from_fn(|i| h[42 + i])),
        })
    }

    fn into_record(self, id: RecordId, scope: Scope, key: IdempotencyKey, response: Option<StoredResponse>) -> Record {
        Record {
            id,
            scope,
            key,
            fingerprint: self.fingerprint,
            state: self.state,
            token: self.token,
            response,
            created_at: self.created_at,
            started_at: self.started_at,
            lease_expires_at: self.lease_expires_at,
            expires_at: self.expires_at,
        }
    }
}

/// The scope after the header in field `h`: version byte, then postcard of (principal,
/// endpoint, key).
pub(crate) fn encode_scope(scope: &Scope, key: &IdempotencyKey) -> Vec<u8> {
    let parts = (scope.principal.as_str(), scope.endpoint.as_str(), key.as_str());
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
    // A blank principal never owns a record: refused like any other damage.
    let principal = Principal::new(principal).map_err(|_| bad_field(id, field))?;
    Ok((Scope { principal, endpoint: Endpoint::from(endpoint) }, key))
}

#[cfg(test)]
mod tests {
    use idem_core::codec::encode_response;

    use super::*;

    /// A `found` reply as `get.lua` sends it: status, time, `h`, `r`.
    fn found(h: Vec<u8>, r: Option<Vec<u8>>) -> Reply {
        let r = r.map_or(Value::Nil, Value::BulkString);
        let value = Value::Array(vec![Value::BulkString(b"found".to_vec()), Value::Int(7), Value::BulkString(h), r]);
        Reply::parse("get", value, None).expect("parses")
    }

    fn header(state: u8) -> Vec<u8> {
        let mut h = vec![HEADER_FORMAT, state];
        for v in [(1u64 << 53) + 1, 10, 11, 12, i64::MAX as u64] {
            h.extend_from_slice(&v.to_be_bytes());
        }
        h.extend_from_slice(&[7; 32]);
        h
    }

    /// Pins: a WAIT that failed after its script ran (`[ASKING,] script, WAIT` with WAIT
    /// answered by an error) was reported as a failed call, hiding that the write happened;
    /// the script's reply must come through with WAIT's error beside it, after `ASKING` too.
    ///
    /// Pins `docs/failures.md#redis-wait-refused-or-redirected-past-its-budget`.
    #[test]
    fn a_failed_wait_keeps_the_script_reply() {
        let noperm = || redis::parse_redis_value(b"-NOPERM no WAIT for you\r\n").expect("an error reply");
        let script = || Value::Array(vec![Value::BulkString(b"claimed".to_vec()), Value::Int(1)]);
        for skip in [0, 1] {
            let mut values = vec![Value::Okay; skip];
            values.extend([script(), noperm()]);
            let (value, acked) = split_acked(values, skip).expect("the script ran");
            assert_eq!(value, script());
            assert!(matches!(acked, Some(Err(Error::Command { operation: "WAIT", .. }))), "{acked:?}");
        }
        let (_, acked) = split_acked(vec![Value::Okay, script(), Value::Int(1)], 1).expect("ran");
        assert!(matches!(acked, Some(Ok(1))));
        // The script itself refused (NOSCRIPT, MOVED): the call did not run, whatever WAIT says.
        let e = split_acked(vec![noperm(), Value::Int(0)], 0).expect_err("script error");
        assert_eq!(e.code(), Some("NOPERM"));
    }

    #[test]
    fn response_field_round_trips_byte_exact_and_garbage_is_corrupt() {
        let scope = Scope::new("p", Endpoint::new("POST", "/x")).expect("scope");
        let key = IdempotencyKey::parse(b"k").expect("key");
        let id = RecordId::derive(scope.principal.as_str(), scope.endpoint.as_str(), key.as_str());
        let mut h = header(STATE_COMPLETED);
        h.extend_from_slice(&encode_scope(&scope, &key));
        let r = StoredResponse::new(201, vec![("etag".into(), vec![0, 0xff, b'"'])], (0..=255u8).collect());
        let record = found(h.clone(), Some(encode_response(&r))).record(id).expect("decodes");
        assert_eq!(record.response, Some(r.clone()));
        assert_eq!((record.scope, record.key), (scope, key));
        let mut long = encode_response(&r);
        long.push(0);
        for bad in [vec![], vec![9, 1], long] {
            let e = found(h.clone(), Some(bad)).record(id);
            assert!(matches!(e, Err(StoreError::Corrupt { id: Some(i), .. }) if i == id), "{e:?}");
        }
        // Completed without a response field.
        assert!(matches!(found(h, None).record(id), Err(StoreError::Corrupt { .. })));
    }

    #[test]
    fn keys_that_reparse_differently_still_decode() {
        // A key made of visible ASCII that starts with a quote would not survive
        // `IdempotencyKey::parse` again; the serde path keeps it as stored.
        let key = IdempotencyKey::parse(br#""\"x""#).expect("sf-string key");
        assert_eq!(key.as_str(), "\"x");
        let scope = Scope::new("p", Endpoint::new("POST", "/x")).expect("scope");
        let id = RecordId::derive(scope.principal.as_str(), scope.endpoint.as_str(), key.as_str());
        assert_eq!(decode_scope(id, &encode_scope(&scope, &key)).expect("decodes"), (scope.clone(), key.clone()));
        // Another record's scope does not decode under this id.
        let other = RecordId::derive("q", scope.endpoint.as_str(), key.as_str());
        assert!(matches!(decode_scope(other, &encode_scope(&scope, &key)), Err(StoreError::Corrupt { .. })));
    }

    #[test]
    fn header_decodes_and_refuses_bad_layouts() {
        let id = RecordId::derive("p", "e", "k");
        let h = header(STATE_COMPLETED);
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
}
