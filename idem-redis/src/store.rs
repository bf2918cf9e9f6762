//! [`RedisStore`]: the [`Store`] contract on Redis, one hash per record, Lua compare-and-set.
//!
//! Each operation is one script call ([`crate::script`] builds, sends and reads them);
//! this file picks the script, passes the arguments and turns its reply into the
//! contract's outcome.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idem_core::codec::encode_response;
use idem_core::time::duration_ms;
use idem_core::{
    Capabilities, ClaimOutcome, ClaimRequest, FencingToken, JournalWrite, ReclaimOutcome, ReclaimRequest, Record,
    RecordId, Store, StoreError, StoredResponse, SweepOutcome,
};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use crate::config::{Config, Verdict};
use crate::error::Error;
use crate::script::{Call, Op, Reply, SCRIPTS, encode_scope, load_all, ms_arg, ttl_arg};

/// Idempotency records in Redis (or Valkey): one hash per record, claim/reclaim/complete/
/// extend/fail as Lua compare-and-set scripts, retention as the key's native expiry, time
/// and first fencing tokens from the server's clock. Cheap to clone; clones share one
/// reconnecting connection.
#[derive(Clone)]
pub struct RedisStore {
    conn: ConnectionManager,
    config: Arc<Config>,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.config.prefix)
            .field("replica_ack", &self.config.replica_ack)
            .field("clock", &self.config.clock.is_some())
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// Connects to `url` (`redis://[user:password@]host:port[/db]`, `rediss://` needs a TLS
    /// feature of the `redis` crate), checks `maxmemory-policy` (see
    /// [`crate::EvictionCheck`]) and loads the scripts.
    ///
    /// # Errors
    /// [`Error::Url`] for a bad URL, [`Error::Config`] for a bad prefix, [`Error::Command`]
    /// when the server cannot be reached (retryable) or refuses the scripts,
    /// [`Error::EvictingPolicy`] under [`crate::EvictionCheck::Refuse`].
    pub async fn connect(url: &str, config: Config) -> Result<Self, Error> {
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

    /// Uses the application's own connection (shared with the rest of the application);
    /// runs the same start-up checks as [`RedisStore::connect`]. The connection's own
    /// response and connection timeouts apply, not the config's.
    ///
    /// # Errors
    /// As [`RedisStore::connect`], minus the URL.
    pub async fn from_connection(conn: ConnectionManager, config: Config) -> Result<Self, Error> {
        config.validate()?;
        let store = Self { conn, config: Arc::new(config) };
        store.check_eviction_policy().await?;
        load_all(&mut store.conn.clone()).await?;
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
        match self.config.eviction_check.verdict(&policy, maxmemory) {
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

    async fn send(&self, call: Call) -> Result<Reply, StoreError> {
        call.send(self.conn.clone(), self.config.replica_ack).await
    }

    fn grace_ms(&self) -> i64 {
        duration_ms(self.config.expiry_grace)
    }

    /// After a write that WAIT covered: fails when too few replicas acknowledged it.
    fn check_ack(&self, reply: &Reply) -> Result<(), StoreError> {
        match (self.config.replica_ack, reply.acked) {
            (Some(ack), Some(acked)) if acked < u64::from(ack.replicas()) => {
                Err(Error::ReplicaShortfall { acked, wanted: u64::from(ack.replicas()), timeout_ms: ack.timeout_ms() }
                    .into())
            }
            _ => Ok(()),
        }
    }
}

#[async_trait]
impl Store for RedisStore {
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let call = self
            .call(&SCRIPTS.claim, req.id)?
            .arg(&ttl_arg(req.lease_ms(), req.retention_ms())[..])
            .arg(self.grace_ms())
            .arg(&req.fingerprint.0[..])
            .arg(encode_scope(&req.scope, &req.key));
        let reply = self.send(call).await?;
        if reply.is("claimed") {
            let record = reply.claimed(req.id, req.scope, req.key)?;
            self.check_ack(&reply)?;
            Ok(ClaimOutcome::Claimed(record))
        } else if reply.is("existing") {
            Ok(ClaimOutcome::Existing { record: reply.record(req.id, None)?, now: reply.now })
        } else {
            Err(reply.refusal(req.id))
        }
    }

    async fn reclaim(&self, req: ReclaimRequest) -> Result<ReclaimOutcome, StoreError> {
        let call = self
            .call(&SCRIPTS.reclaim, req.id)?
            .arg(&req.expected.0.to_be_bytes()[..])
            .arg(&req.fingerprint.0[..])
            .arg(&ttl_arg(req.lease_ms(), req.retention_ms())[..])
            .arg(self.grace_ms());
        let reply = self.send(call).await?;
        if reply.is("reclaimed") {
            let record = reply.record(req.id, None)?;
            self.check_ack(&reply)?;
            Ok(ReclaimOutcome::Reclaimed(record))
        } else if reply.is("conflict") {
            Ok(ReclaimOutcome::Conflict { current: Some(reply.record(req.id, None)?), now: reply.now })
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
    ) -> Result<Record, StoreError> {
        let call = self.call(&SCRIPTS.complete, id)?.arg(&token.0.to_be_bytes()[..]).arg(encode_response(&response));
        let reply = self.send(call).await?;
        if reply.is("ok") {
            let record = reply.record(id, Some(response))?;
            self.check_ack(&reply)?;
            Ok(record)
        } else if reply.is("lost") {
            Err(reply.lease_lost(id, token))
        } else {
            Err(reply.refusal(id))
        }
    }

    /// One script (`extend.lua`); under [`crate::ReplicaAck`], `WAIT` follows it like a
    /// complete, so a renewal the primary applied also reached the replicas before the
    /// holder counts on it.
    async fn extend(&self, id: RecordId, token: FencingToken, lease_ttl: Duration) -> Result<Record, StoreError> {
        let call = self
            .call(&SCRIPTS.extend, id)?
            .arg(&token.0.to_be_bytes()[..])
            .arg(&ms_arg(duration_ms(lease_ttl))[..])
            .arg(self.grace_ms());
        let reply = self.send(call).await?;
        if reply.is("ok") {
            let record = reply.record(id, None)?;
            self.check_ack(&reply)?;
            Ok(record)
        } else if reply.is("lost") {
            Err(reply.lease_lost(id, token))
        } else {
            Err(reply.refusal(id))
        }
    }

    async fn fail(&self, id: RecordId, token: FencingToken) -> Result<Record, StoreError> {
        let reply = self.send(self.call(&SCRIPTS.fail, id)?.arg(&token.0.to_be_bytes()[..])).await?;
        if reply.is("ok") {
            reply.record(id, None)
        } else if reply.is("lost") {
            Err(reply.lease_lost(id, token))
        } else {
            Err(reply.refusal(id))
        }
    }

    async fn get(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        let reply = self.send(self.call(&SCRIPTS.get, id)?).await?;
        if reply.is("found") {
            reply.record(id, None).map(Some)
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
}
