//! [`RedisStore`]: the [`Store`] contract on Redis, one hash per record, Lua compare-and-set.
//!
//! Each operation is one script call ([`crate::script`] builds, sends and reads them);
//! this file picks the script, passes the arguments and turns its reply into the
//! contract's outcome.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt as _;
use idem_core::codec::encode_response;
use idem_core::time::duration_ms;
use idem_core::{
    Capabilities, ClaimOutcome, ClaimRequest, FencingToken, JournalWrite, ListFilter, Listing, Receipt, ReclaimOutcome,
    ReclaimRequest, Record, RecordId, Settlements, Store, StoreError, StoredResponse, SweepOutcome, UnixMillis,
};
use redis::RedisError;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
#[cfg(feature = "cluster")]
use redis::cluster::ClusterClientBuilder;

use crate::config::{CONNECTION_TIMEOUT, Config, Verdict, persistence_problem};
use crate::conn::Connection;
use crate::error::Error;
use crate::replicas::{Replicas, Shard};
use crate::script::{Call, Op, Reply, SCRIPTS, encode_scope, load_all, ms_arg, ttl_arg};

/// Idempotency records in Redis (or Valkey), a single node or a Redis Cluster: one hash per
/// record, claim/reclaim/complete/extend/fail as Lua compare-and-set scripts, retention as
/// the key's native expiry, time and first fencing tokens from the server's clock. Cheap to
/// clone; clones share one reconnecting connection.
#[derive(Clone, Debug)]
pub struct RedisStore {
    conn: Connection,
    config: Arc<Config>,
    replicas: Arc<Replicas>,
    wake: Arc<Wake>,
}

/// Where a waiting duplicate is woken from ([`Store::settlements`]).
#[derive(Debug, Default)]
struct Wake {
    /// The nodes a subscriber connects to, in turn; none on the application's connection.
    nodes: Vec<redis::Client>,
    settlements: Arc<Settlements>,
    /// The subscriber's task, once a waiter started it; ends with the last clone.
    task: OnceLock<tokio::task::JoinSet<()>>,
}

impl RedisStore {
    /// Connects to the single server at `url` (`redis://[user:password@]host:port[/db]`,
    /// `rediss://` needs a TLS feature of the `redis` crate), runs the start-up checks
    /// (`maxmemory-policy`, see [`crate::EvictionCheck`]; persistence, see
    /// [`crate::PersistenceCheck`]) and loads the scripts.
    ///
    /// # Errors
    /// [`Error::Url`] for a bad URL, [`Error::Config`] for a bad prefix, [`Error::Command`]
    /// when the server cannot be reached (retryable) or refuses the scripts,
    /// [`Error::EvictingPolicy`] under [`crate::EvictionCheck::Refuse`],
    /// [`Error::NotDurable`] under [`crate::PersistenceCheck::Refuse`].
    pub async fn connect(url: &str, config: Config) -> Result<Self, Error> {
        config.validate()?;
        let client = redis::Client::open(url).map_err(Error::Url)?;
        let manager_config = ConnectionManagerConfig::new()
            .set_response_timeout(Some(config.effective_response_timeout()))
            .set_connection_timeout(Some(CONNECTION_TIMEOUT))
            .set_number_of_retries(2);
        let conn = ConnectionManager::new_with_config(client.clone(), manager_config)
            .await
            .map_err(|e| Error::command("connect", e))?;
        let store = Self::from_connection(conn, config).await?;
        Ok(Self { wake: Arc::new(Wake { nodes: vec![client], ..Wake::default() }), ..store })
    }

    /// Connects to the Redis Cluster reachable at any of `nodes` (each a `redis://host:port`
    /// URL; one live node is enough, the rest of the topology is discovered), runs the
    /// start-up checks and loads the scripts on every primary. The cluster client is built
    /// as [`cluster_builder`] builds it (no retries of its own: it would send a write again
    /// after a dropped connection) with the config's timeouts.
    ///
    /// # Errors
    /// As [`RedisStore::connect`]; [`Error::Url`] also for an empty list.
    #[cfg(feature = "cluster")]
    pub async fn connect_cluster<I, S>(nodes: I, config: Config) -> Result<Self, Error>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        config.validate()?;
        let nodes: Vec<String> = nodes.into_iter().map(|n| n.as_ref().to_owned()).collect();
        if nodes.is_empty() {
            return Err(Error::Url(RedisError::from((redis::ErrorKind::InvalidClientConfig, "no cluster node given"))));
        }
        let subscribers = nodes.iter().filter_map(|n| redis::Client::open(n.as_str()).ok()).collect();
        let client = cluster_builder(nodes)
            .connection_timeout(CONNECTION_TIMEOUT)
            .response_timeout(config.effective_response_timeout())
            .build()
            .map_err(Error::Url)?;
        let conn = client.get_async_connection().await.map_err(|e| Error::command("connect", e))?;
        let store = Self::from_connection(conn, config).await?;
        Ok(Self { wake: Arc::new(Wake { nodes: subscribers, ..Wake::default() }), ..store })
    }

    /// Uses the application's own connection, shared with the rest of the application: a
    /// [`ConnectionManager`] to one server or (feature `cluster`) a
    /// `redis::cluster_async::ClusterConnection` (both convert into [`Connection`]); runs
    /// the same start-up checks as [`RedisStore::connect`]. The connection's own timeouts
    /// apply, not the config's. A cluster connection should be built with `retries(0)` (as
    /// `cluster_builder` does): with retries, the `redis` crate may send a write again after
    /// a dropped connection, and a claim that already ran then reads as another request's
    /// claim (`docs/redis.md#redis-cluster`).
    ///
    /// # Errors
    /// As [`RedisStore::connect`], minus the URL.
    pub async fn from_connection(conn: impl Into<Connection>, config: Config) -> Result<Self, Error> {
        config.validate()?;
        let store =
            Self { conn: conn.into(), config: Arc::new(config), replicas: Arc::default(), wake: Arc::default() };
        store.check_servers().await?;
        load_all(&mut store.conn.clone()).await?;
        if let (Some(_), Err(e)) = (store.config.replica_ack, store.replicas().await) {
            tracing::warn!(error = %e, "idem-redis: cannot read the primaries' replicas; every write sends its WAIT");
        }
        Ok(store)
    }

    /// Each primary (`host:port`; `server` on a single server) and its replicas (those
    /// `CLUSTER NODES` shows linked and not failed; a single server's `connected_slaves`).
    /// The store also goes by it from now on (it reads them itself at start-up and after
    /// topology changes), warning of a primary short of [`crate::ReplicaAck`].
    ///
    /// # Errors
    /// [`Error::Command`] when the server cannot be reached or refuses the command.
    pub async fn replicas(&self) -> Result<Vec<(String, u32)>, Error> {
        let (cmd, arg) = if self.conn.is_cluster() { ("CLUSTER", "NODES") } else { ("INFO", "replication") };
        let text: String = redis::cmd(cmd)
            .arg(arg)
            .query_async(&mut self.conn.clone())
            .await
            .map_err(|e| Error::command("read the replicas", e))?;
        let shards = if self.conn.is_cluster() {
            shards(&text)
        } else {
            let n = text.lines().find_map(|l| l.trim().strip_prefix("connected_slaves:")?.parse().ok());
            vec![(0, 16_383, "server".to_owned(), n.unwrap_or(0))]
        };
        let mut primaries: Vec<(String, u32)> = shards.iter().map(|s| (s.2.clone(), s.3)).collect();
        primaries.sort();
        primaries.dedup();
        self.replicas.set(shards, self.config.replica_ack);
        Ok(primaries)
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
    pub fn connection(&self) -> Connection {
        self.conn.clone()
    }

    /// The start-up checks, on the server or on every primary of a cluster: eviction
    /// policy and persistence. One `CONFIG GET` per primary.
    async fn check_servers(&self) -> Result<(), Error> {
        let mut cmd = redis::cmd("CONFIG");
        cmd.arg("GET")
            .arg("maxmemory")
            .arg("maxmemory-policy")
            .arg("appendonly")
            .arg("appendfsync")
            .arg("save")
            .arg("cluster-enabled");
        let replies = self.conn.clone().on_every_primary(cmd).await.map_err(|e| Error::command("CONFIG GET", e))?;
        for (node, reply) in replies {
            let pairs: Vec<(String, String)> = match reply
                .and_then(|v| redis::from_redis_value::<Vec<(String, String)>>(v).map_err(RedisError::from))
            {
                Ok(pairs) => pairs,
                Err(e) => {
                    // Managed services often rename or forbid CONFIG.
                    tracing::warn!(
                        node = %node,
                        error = %e,
                        "idem-redis: cannot read maxmemory-policy and persistence settings (CONFIG GET refused); make \
                         sure the server runs with `maxmemory-policy noeviction` (an evicting policy can drop an \
                         in-flight claim and run a request twice) and with AOF (a restart without persistence loses \
                         every claim)"
                    );
                    continue;
                }
            };
            let get = |name: &str| pairs.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str());
            if !self.conn.is_cluster() && get("cluster-enabled") == Some("yes") {
                self.check_single_node_cluster().await?;
            }
            self.check_eviction(&node, get("maxmemory-policy").unwrap_or("noeviction"), get("maxmemory"))?;
            // A server that does not report a setting is not flagged for it.
            let problem = persistence_problem(
                get("appendonly").unwrap_or("yes"),
                get("appendfsync").unwrap_or("everysec"),
                get("save").unwrap_or("900 1"),
            );
            // The settings this store runs on, as read (docs/observability.md).
            tracing::info!(
                backend = "redis",
                node = %node,
                prefix = %self.config.prefix,
                maxmemory_policy = get("maxmemory-policy").unwrap_or("unknown"),
                maxmemory = get("maxmemory").unwrap_or("unknown"),
                appendonly = get("appendonly").unwrap_or("unknown"),
                appendfsync = get("appendfsync").unwrap_or("unknown"),
                save = get("save").unwrap_or("unknown"),
                replica_ack = ?self.config.replica_ack,
                "idem-redis: store settings"
            );
            if let Some(problem) = problem {
                match self.config.persistence_check {
                    crate::PersistenceCheck::Refuse => return Err(Error::NotDurable { node, problem }),
                    crate::PersistenceCheck::Warn => tracing::warn!(
                        node = %node,
                        "idem-redis: Redis {node} would lose idempotency records on a restart ({problem}); a lost claim \
                         runs its request again. Enable AOF: `appendonly yes` with `appendfsync everysec` or `always`."
                    ),
                }
            }
        }
        Ok(())
    }

    /// A single-node connection to a node of a Cluster with several primaries would serve
    /// only that node's slots and fail every other key with `MOVED`, for good: refused at
    /// start-up. A one-primary cluster (it owns every slot) works on a single connection.
    async fn check_single_node_cluster(&self) -> Result<(), Error> {
        let info: String = redis::cmd("CLUSTER")
            .arg("INFO")
            .query_async(&mut self.conn.clone())
            .await
            .map_err(|e| Error::command("CLUSTER INFO", e))?;
        let size =
            info.lines().find_map(|l| l.trim().strip_prefix("cluster_size:")).and_then(|n| n.parse::<u32>().ok());
        if size.is_some_and(|n| n > 1) {
            return Err(Error::Config(
                "the server is a node of a Redis Cluster with several primaries: connect with \
                 RedisStore::connect_cluster (or pass a ClusterConnection); a single-node connection reaches only \
                 this node's slots",
            ));
        }
        Ok(())
    }

    fn check_eviction(&self, node: &str, policy: &str, maxmemory: Option<&str>) -> Result<(), Error> {
        let maxmemory = maxmemory.and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        match self.config.eviction_check.verdict(policy, maxmemory) {
            Verdict::Safe => Ok(()),
            Verdict::Warn => {
                tracing::warn!(
                    node = %node,
                    policy = %policy,
                    maxmemory,
                    "idem-redis: maxmemory-policy {policy} can evict idempotency records (every record has a TTL); \
                     an evicted in-flight claim lets a duplicate request run. Use `maxmemory-policy noeviction`."
                );
                Ok(())
            }
            Verdict::Refuse => Err(Error::EvictingPolicy { policy: policy.to_owned(), maxmemory }),
        }
    }

    /// A call of `op` on record `id`, its first argument the clock: the configured clock's
    /// reading in ms, or empty for the server's `TIME`.
    fn call(&self, op: &'static Op, id: RecordId) -> Result<Call, StoreError> {
        let clock = match &self.config.clock {
            None => String::new(),
            Some(clock) => {
                let now = clock.now().0;
                if now < 0 {
                    return Err(Error::Config("the clock reads before the Unix epoch").into());
                }
                if now >= 1 << 53 {
                    // The scripts hold the clock in a Lua double, exact below 2^53.
                    return Err(Error::Config("the clock reads past 2^53 ms").into());
                }
                now.to_string()
            }
        };
        Ok(Call::new(op, self.record_key(id)).arg(clock))
    }

    /// Sends `call`, with the `WAIT` its shard can meet (see [`crate::Shortfall`]).
    pub(crate) async fn send(&self, call: Call) -> Result<Reply, StoreError> {
        let (Some(ack), Some((key, claims))) = (self.config.replica_ack, call.acked()) else {
            return call.send(self.conn.clone(), self.config.replica_ack).await;
        };
        if let (true, Ok(runtime)) = (self.replicas.due(ack), tokio::runtime::Handle::try_current()) {
            let store = self.clone();
            runtime.spawn(async move { store.replicas().await });
        }
        let planned = self.replicas.plan(key, ack, claims)?;
        // A retryable failure may be a topology change (a failover, a redirect).
        let mut reply = call.send(self.conn.clone(), Some(planned)).await.inspect_err(|e| {
            if e.is_retryable() {
                self.replicas.fell_short(key, None, ack);
            }
        })?;
        if let Some(Ok(acked)) = reply.acked.take_if(|a| matches!(a, Ok(n) if *n < u64::from(planned.replicas))) {
            let (node, wanted) = (self.replicas.fell_short(key, Some(acked), ack), u64::from(planned.replicas));
            reply.acked = Some(Err(Error::ReplicaShortfall { node, acked, wanted, timeout_ms: ack.timeout_ms() }));
        }
        Ok(reply)
    }

    fn grace_ms(&self) -> i64 {
        duration_ms(self.config.expiry_grace)
    }

    /// The reply of a fenced write (`complete`, `extend`, `fail`): its receipt once the WAIT
    /// that covered it (if any) is checked, `LeaseLost` when `token` no longer holds `id`.
    fn receipt(&self, mut reply: Reply, id: RecordId, token: FencingToken) -> Result<Receipt, StoreError> {
        if reply.is("ok") {
            let receipt = reply.receipt(id)?;
            if let Some(Err(e)) = reply.acked.take() {
                return Err(e.into());
            }
            Ok(receipt)
        } else if reply.is("lost") {
            Err(reply.lease_lost(id, token))
        } else {
            Err(reply.refusal(id))
        }
    }

    /// After a claim or reclaim that WAIT covered: on a shortfall (or a WAIT that failed
    /// outright, e.g. an ACL without `WAIT`) the caller gets an error
    /// and will not run the handler, so the claim it just made would block every retry for
    /// a whole lease with nobody running. It is released first: marked failed under its own
    /// token (`fail.lua`, fenced), which a retry with the same fingerprint reclaims at once.
    /// If the release itself fails (the primary went away), the claim stays until its lease
    /// ends, as any claim of a crashed holder does.
    async fn check_claim_ack(&self, reply: &mut Reply, record: &Record) -> Result<(), StoreError> {
        // `send` turned a shortfall into an error beside the script's reply.
        let Some(Err(shortfall)) = reply.acked.take() else { return Ok(()) };
        if let Err(e) = self.fail(record.id, record.token).await {
            tracing::warn!(
                record = %record.id.to_hex(),
                error = %e,
                "idem-redis: could not release a claim whose WAIT fell short; it blocks its key until its lease ends"
            );
        }
        Err(shortfall.into())
    }

    /// The record id in a key `<prefix>{<64 hex digits>}`; `None` for any other key that
    /// happens to match the scan's pattern.
    fn id_of_key(&self, key: &[u8]) -> Option<RecordId> {
        let rest = key.strip_prefix(self.config.prefix.as_bytes())?;
        let hex = rest.strip_prefix(b"{")?.strip_suffix(b"}")?;
        RecordId::from_hex(std::str::from_utf8(hex).ok()?)
    }

    /// The server's `TIME` in ms (a listing that read no record still reports a `now`).
    async fn server_now(&self) -> Result<UnixMillis, StoreError> {
        let (secs, micros): (i64, i64) = redis::cmd("TIME")
            .query_async(&mut self.conn.clone())
            .await
            .map_err(|e| Error::command("read the server clock", e))?;
        Ok(UnixMillis(secs * 1_000 + micros / 1_000))
    }
}

#[async_trait]
impl Store for RedisStore {
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        // A shard short of replicas under Strict refuses a new claim, but a record already
        // there is still answered (a replay, a 409 in flight, a mismatch): only writes need them.
        if let Some(ack) = self.config.replica_ack.filter(|a| a.shortfall == crate::Shortfall::Strict)
            && let Err(refused) = self.replicas.plan(&self.record_key(req.id()), ack, true)
        {
            let found = self.send(self.call(&SCRIPTS.get, req.id())?).await?;
            if !found.is("found") {
                return Err(refused.into());
            }
            return Ok(ClaimOutcome::Existing { record: found.record(req.id())?, now: found.now });
        }
        let call = self
            .call(&SCRIPTS.claim, req.id())?
            .arg(&ttl_arg(req.lease_ms(), req.retention_ms())[..])
            .arg(self.grace_ms())
            .arg(&req.fingerprint().as_bytes()[..])
            .arg(encode_scope(req.scope(), req.key()));
        let mut reply = self.send(call).await?;
        if reply.is("claimed") {
            let record = reply.claimed(req.id(), req.scope().clone(), req.key().clone())?;
            self.check_claim_ack(&mut reply, &record).await?;
            Ok(ClaimOutcome::Claimed(record))
        } else if reply.is("existing") {
            Ok(ClaimOutcome::Existing { record: reply.record(req.id())?, now: reply.now })
        } else {
            Err(reply.refusal(req.id()))
        }
    }

    async fn reclaim(&self, req: ReclaimRequest) -> Result<ReclaimOutcome, StoreError> {
        let call = self
            .call(&SCRIPTS.reclaim, req.id)?
            .arg(&req.expected.0.to_be_bytes()[..])
            .arg(&req.fingerprint.as_bytes()[..])
            .arg(&ttl_arg(req.lease_ms(), req.retention_ms())[..])
            .arg(self.grace_ms());
        let mut reply = self.send(call).await?;
        if reply.is("reclaimed") {
            let record = reply.record(req.id)?;
            self.check_claim_ack(&mut reply, &record).await?;
            Ok(ReclaimOutcome::Reclaimed(record))
        } else if reply.is("conflict") {
            Ok(ReclaimOutcome::Conflict { current: Some(reply.record(req.id)?), now: reply.now })
        } else if reply.is("absent") {
            Ok(ReclaimOutcome::Conflict { current: None, now: reply.now })
        } else {
            Err(reply.refusal(req.id))
        }
    }

    async fn complete(
        &self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Receipt, StoreError> {
        let call = self.call(&SCRIPTS.complete, id)?.arg(&token.0.to_be_bytes()[..]).arg(encode_response(&response));
        self.receipt(self.send(call).await?, id, token)
    }

    /// One script (`extend.lua`); under [`crate::ReplicaAck`], `WAIT` follows it like a
    /// complete, so a renewal the primary applied also reached the replicas before the
    /// holder counts on it.
    async fn extend(&self, id: RecordId, token: FencingToken, lease_ttl: Duration) -> Result<Receipt, StoreError> {
        let call = self
            .call(&SCRIPTS.extend, id)?
            .arg(&token.0.to_be_bytes()[..])
            .arg(&ms_arg(duration_ms(lease_ttl))[..])
            .arg(self.grace_ms());
        self.receipt(self.send(call).await?, id, token)
    }

    async fn fail(&self, id: RecordId, token: FencingToken) -> Result<Receipt, StoreError> {
        self.receipt(self.send(self.call(&SCRIPTS.fail, id)?.arg(&token.0.to_be_bytes()[..])).await?, id, token)
    }

    async fn get(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        let reply = self.send(self.call(&SCRIPTS.get, id)?).await?;
        if reply.is("found") {
            reply.record(id).map(Some)
        } else if reply.is("absent") {
            Ok(None)
        } else {
            Err(reply.refusal(id))
        }
    }

    /// Redis expires records itself (`PEXPIREAT` at `expires_at`): nothing to sweep.
    async fn sweep(&self, _limit: usize) -> Result<SweepOutcome, StoreError> {
        Ok(SweepOutcome::default())
    }

    #[allow(clippy::needless_update, reason = "Redis has every capability today; one added later stays off")]
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            backend: "redis",
            native_expiry: true,
            server_clock: true,
            shared: true,
            journal: true,
            list: true,
            ..Capabilities::NONE
        }
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
        let call = self
            .call(&SCRIPTS.journal_put, id)?
            .arg(&token.0.to_be_bytes()[..])
            .arg(name)
            .arg(value.as_slice())
            .arg(if overwrite { "1" } else { "0" });
        let reply = self.send(call).await?;
        if reply.is("written") {
            Ok(JournalWrite::Written)
        } else if reply.is("exists") {
            reply.into_value().map(JournalWrite::Exists)
        } else if reply.is("lost") {
            Err(reply.lease_lost(id, token))
        } else {
            Err(reply.refusal(id))
        }
    }

    async fn journal_get(&self, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let reply = self.send(self.call(&SCRIPTS.journal_get, id)?.arg(name)).await?;
        if reply.is("found") {
            reply.into_value().map(Some)
        } else if reply.is("absent") {
            Ok(None)
        } else {
            Err(reply.refusal(id))
        }
    }

    /// Settled by `PUBLISH` on `<prefix>settled` from the complete and fail scripts of every
    /// process, heard by this store's subscriber task, started on the first waiter's Tokio
    /// runtime; `None` outside a runtime, and on the application's connection
    /// ([`RedisStore::from_connection`]), where the store has no address to subscribe at.
    fn settlements(&self) -> Option<&Settlements> {
        let (wake, runtime) = (&*self.wake, tokio::runtime::Handle::try_current().ok()?);
        if wake.nodes.is_empty() {
            return None;
        }
        wake.task.get_or_init(|| {
            let channel = format!("{}settled", self.config.prefix);
            let mut task = tokio::task::JoinSet::new();
            task.spawn_on(subscribe(wake.nodes.clone(), channel, Arc::clone(&wake.settlements)), &runtime);
            task
        });
        Some(&wake.settlements)
    }

    /// `SCAN` for `<prefix>{*}` on the server or every cluster primary, then each record
    /// read by the `get` script (so expiry, decoding and the clock are exactly `get`'s).
    /// Redis keeps no order, so every call scans the whole keyspace and reads every
    /// matching record; an operator tool, not a request path.
    async fn list(&self, filter: ListFilter) -> Result<Listing, StoreError> {
        let pattern = format!("{}{{*}}", glob_escape(&self.config.prefix));
        let keys = self.conn.clone().scan_every_primary(&pattern).await.map_err(|e| Error::command("list", e))?;
        let mut now = self.config.clock.as_ref().map(|c| c.now());
        let mut records = Vec::new();
        for key in keys {
            let Some(id) = self.id_of_key(&key) else { continue };
            if filter.after.is_some_and(|after| id <= after) {
                continue;
            }
            let reply = self.send(self.call(&SCRIPTS.get, id)?).await?;
            // The server's clock of the latest read: every record read was live then.
            now = Some(now.map_or(reply.now, |n: UnixMillis| n.max(reply.now)));
            if reply.is("found") {
                records.push(reply.record(id)?);
            } else if !reply.is("absent") {
                return Err(reply.refusal(id));
            }
        }
        let now = match now {
            Some(now) => now,
            None => self.server_now().await?,
        };
        Ok(filter.select(records, now))
    }
}

/// Wakes `hub`'s waiters from `SUBSCRIBE channel` on a connection of its own to one of
/// `nodes` (the next after a loss; a cluster carries `PUBLISH` to every node); a message
/// sent meanwhile is lost, and its waiter reads at the end of its pause.
async fn subscribe(nodes: Vec<redis::Client>, channel: String, hub: Arc<Settlements>) {
    for client in nodes.iter().cycle() {
        if let Ok(mut pubsub) = client.get_async_pubsub().await
            && pubsub.subscribe(&channel).await.is_ok()
        {
            let mut messages = pubsub.into_on_message();
            while let Some(message) = messages.next().await {
                if let Some(id) = std::str::from_utf8(message.get_payload_bytes()).ok().and_then(RecordId::from_hex) {
                    hub.settle(id);
                }
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// `s` with the glob characters of `SCAN MATCH` escaped, so a prefix matches only itself.
fn glob_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// `CLUSTER NODES` as `(first slot, last slot, "host:port", replicas)` for each slot range
/// of each primary; a replica marked failed (`fail`, `fail?`) or without a link is not
/// counted.
fn shards(nodes: &str) -> Vec<Shard> {
    let lines: Vec<Vec<&str>> =
        nodes.lines().map(|l| l.split_whitespace().collect()).filter(|f: &Vec<_>| f.len() >= 8).collect();
    let mut out = Vec::new();
    for p in lines.iter().filter(|f| f[2].contains("master") && !f[2].contains("fail")) {
        let addr = p[1].split('@').next().unwrap_or(p[1]);
        let n = lines.iter().filter(|r| r[3] == p[0] && !r[2].contains("fail") && r[7] == "connected").count();
        for range in p[8..].iter().filter(|s| !s.starts_with('[')) {
            let (lo, hi) = range.split_once('-').unwrap_or((range, range));
            if let (Ok(lo), Ok(hi)) = (lo.parse(), hi.parse()) {
                out.push((lo, hi, addr.to_owned(), u32::try_from(n).unwrap_or(u32::MAX)));
            }
        }
    }
    out
}

/// A [`ClusterClientBuilder`] for `nodes` as [`RedisStore::connect_cluster`] uses it:
/// `retries(0)`, so the `redis` crate never sends a write a second time on its own (the
/// store follows `MOVED` and `ASK` itself). Add timeouts, credentials or TLS, build the
/// client, and hand its async connection to [`RedisStore::from_connection`].
#[cfg(feature = "cluster")]
#[must_use]
pub fn cluster_builder<S: AsRef<str>>(nodes: impl IntoIterator<Item = S>) -> ClusterClientBuilder {
    ClusterClientBuilder::new(nodes.into_iter().map(|n| n.as_ref().to_owned()).collect::<Vec<_>>()).retries(0)
}
