//! [`Config`]: how a [`crate::RedisStore`] connects and behaves, with the two policies it
//! carries: [`EvictionCheck`] (what to do about an evicting server) and [`ReplicaAck`]
//! (whether to wait for replicas).

use std::sync::Arc;
use std::time::Duration;

use idem_core::Clock;

use crate::error::Error;

/// Default key prefix.
pub const DEFAULT_PREFIX: &str = "idem:";

/// How long one connection attempt of [`crate::RedisStore::connect`] may take.
pub(crate) const CONNECTION_TIMEOUT: Duration = Duration::from_secs(1);

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

/// What the start-up check concludes about a server's eviction settings.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    Safe,
    Warn,
    Refuse,
}

impl EvictionCheck {
    /// Whether `policy` with `maxmemory` bytes (0: no limit) can evict idem's keys, and
    /// what this check says to do about it.
    pub(crate) fn verdict(self, policy: &str, maxmemory: u64) -> Verdict {
        // Every policy but noeviction evicts: allkeys-* any key, volatile-* any key with a
        // TTL, and every idem record has one.
        if policy == "noeviction" {
            return Verdict::Safe;
        }
        if maxmemory == 0 {
            return Verdict::Warn;
        }
        match self {
            EvictionCheck::Refuse => Verdict::Refuse,
            EvictionCheck::Warn => Verdict::Warn,
        }
    }
}

/// What to do at start-up when a server would lose its records on a restart.
///
/// Redis keeps records in memory; what survives a restart depends on its persistence
/// settings, and every record a restart loses lets a retry claim the key afresh and run its
/// handler again (a second VM booted, a second charge). The check reads `appendonly`,
/// `appendfsync` and `save` on the server, or on every primary of a cluster:
///
/// | setting | what a restart loses | check |
/// |---|---|---|
/// | `appendonly yes`, `appendfsync always` | nothing acknowledged | passes |
/// | `appendonly yes`, `appendfsync everysec` | a process crash: nothing; a host crash or power loss: about the last second | passes |
/// | `appendonly yes`, `appendfsync no` | a host crash or power loss: whatever the kernel had not flushed (Linux: up to about 30 s) | flagged |
/// | `appendonly no`, `save` set (RDB snapshots only) | everything since the last snapshot (minutes, by the `save` rules) | passes, named in the docs |
/// | `appendonly no`, `save ""` | every record | flagged |
///
/// A flagged server is refused ([`PersistenceCheck::Refuse`], [`Error::NotDurable`]) or
/// logged as a `tracing` warning ([`PersistenceCheck::Warn`]). Where `CONFIG` is disabled
/// the store cannot tell and warns.
///
/// The default is [`PersistenceCheck::Warn`], unlike [`EvictionCheck`]: a server without
/// persistence is a common, deliberate setup (caches, CI, this project's own test server on
/// port 6379 runs `--save "" --appendonly no`), it loses records only when it restarts,
/// and replicas (with [`ReplicaAck`]) cover a process crash without any disk. Choose
/// `Refuse` where the store must not start on a server whose restart runs requests twice.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum PersistenceCheck {
    /// Refuse to start ([`Error::NotDurable`]) on a flagged server.
    Refuse,
    /// Start, logging a `tracing` warning that names the setting and what it loses (the
    /// default).
    #[default]
    Warn,
}

/// What the persistence check concludes from a server's `appendonly`, `appendfsync` and
/// `save`: `None` when a restart keeps the records (up to the losses the table above
/// names), or why it is flagged.
pub(crate) fn persistence_problem(appendonly: &str, appendfsync: &str, save: &str) -> Option<&'static str> {
    if appendonly.eq_ignore_ascii_case("yes") {
        if appendfsync.eq_ignore_ascii_case("no") {
            return Some(
                "appendfsync no: the kernel decides when the AOF reaches the disk, so a host crash or power loss \
                 loses the claims and stored responses of up to about the last 30 s",
            );
        }
        return None;
    }
    if save.trim().is_empty() {
        return Some("neither AOF nor RDB snapshots: a restart loses every claim and stored response");
    }
    None
}

/// Replica acknowledgement after the writes that matter: `WAIT replicas timeout`, in the
/// same pipeline as the script of a claim, reclaim, lease renewal (extend) or complete.
///
/// When the call returns `Ok`, at least `replicas` replicas had received the write. Redis
/// replication stays asynchronous: WAIT rolls nothing back, and a failover may still promote
/// a replica that had not received the write; it narrows the window, it does not close it.
/// A shortfall (or a `WAIT` that fails outright, e.g. refused by an ACL) fails the call with
/// [`Error::ReplicaShortfall`] (retryable) and leaves the write on the primary; a claim or
/// reclaim is released first (marked failed under its own token), so the retry reclaims it
/// at once. A `WAIT` blocks the node's multiplexed connection until it returns, so a shard
/// known to have fewer replicas than required gets no `WAIT` it cannot meet, but the
/// [`Shortfall`] choice. The full semantics: `docs/redis.md#replica-acknowledgement-wait`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplicaAck {
    /// Replicas that must acknowledge.
    pub(crate) replicas: u32,
    /// How long to wait for them.
    pub(crate) timeout: Duration,
    /// What a shard with fewer replicas than `replicas` gets.
    pub(crate) shortfall: Shortfall,
}

/// What [`ReplicaAck`] does on a shard (or single server) known to have fewer replicas than
/// it requires; what each loses on a further failure: `docs/contract.md#redis-and-valkey`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Shortfall {
    /// Refuse new claims and reclaims there before writing ([`Error::ReplicaShortfall`],
    /// retryable: a 503 with `Retry-After`), so no handler starts on a record one more
    /// failure could lose; a record already there is still answered (a replay, a 409 in
    /// flight), and the other shards keep serving. Renewals and completions of claims made
    /// before wait for the replicas there are: refusing them would not undo the handler's
    /// work, only make a retry run it again. The default.
    #[default]
    Strict,
    /// Acknowledge every write with the replicas there are (`WAIT 0` returns at once), warn, and
    /// count each such write in `idem_redis_degraded_writes_total`.
    Degrade,
}

impl ReplicaAck {
    /// Wait until `replicas` replicas acknowledged each write, for at most `timeout`
    /// (sent to Redis in whole milliseconds), [`Shortfall::Strict`] on a shard with fewer.
    #[must_use]
    pub const fn new(replicas: u32, timeout: Duration) -> Self {
        Self { replicas, timeout, shortfall: Shortfall::Strict }
    }

    /// What a shard with fewer replicas than required gets (see [`Shortfall`]).
    #[must_use]
    pub const fn with_shortfall(self, shortfall: Shortfall) -> Self {
        Self { shortfall, ..self }
    }

    /// The timeout as `WAIT` takes it, ms.
    pub(crate) fn timeout_ms(&self) -> u64 {
        u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX)
    }
}

/// How a [`crate::RedisStore`] behaves. Build with `Config::default()` and the `with_*`
/// methods.
#[derive(Clone, Debug)]
pub struct Config {
    pub(crate) prefix: String,
    pub(crate) eviction_check: EvictionCheck,
    pub(crate) persistence_check: PersistenceCheck,
    pub(crate) replica_ack: Option<ReplicaAck>,
    pub(crate) response_timeout: Duration,
    pub(crate) expiry_grace: Duration,
    pub(crate) clock: Option<Arc<dyn Clock>>,
}

impl Default for Config {
    /// Prefix `idem:`, [`EvictionCheck::Refuse`], [`PersistenceCheck::Warn`], no WAIT, 2 s response timeout, 1 s
    /// connection timeout, no expiry grace, the server's clock.
    fn default() -> Self {
        Self {
            prefix: DEFAULT_PREFIX.to_owned(),
            eviction_check: EvictionCheck::default(),
            persistence_check: PersistenceCheck::default(),
            replica_ack: None,
            response_timeout: Duration::from_secs(2),
            expiry_grace: Duration::ZERO,
            clock: None,
        }
    }
}

impl Config {
    idem_core::setters! {
        /// The namespace every key starts with: records live at `<prefix>{<record id hex>}`.
        /// Must not contain `{` or `}` (the braces around the id are the Cluster hash tag).
        #[must_use]
        pub fn with_prefix(prefix: impl Into<String>) => prefix = prefix.into();

        /// What to do when `maxmemory-policy` may evict keys (see [`EvictionCheck`]).
        #[must_use]
        pub fn with_eviction_check(check: EvictionCheck) => eviction_check = check;

        /// What to do when the server (every primary of a cluster) would lose records on a
        /// restart (see [`PersistenceCheck`]).
        #[must_use]
        pub fn with_persistence_check(check: PersistenceCheck) => persistence_check = check;

        /// Wait for replicas after claim, reclaim, extend and complete (see [`ReplicaAck`]).
        #[must_use]
        pub fn with_replica_ack(ack: Option<ReplicaAck>) => replica_ack = ack;

        /// How long one command may take before the call fails with a retryable timeout
        /// (raised to the WAIT timeout plus 500 ms when [`ReplicaAck`] is set). A timed-out
        /// write may still have been applied: a retry then sees the claim as in flight.
        /// Applies to [`crate::RedisStore::connect`]; a connection passed to
        /// [`crate::RedisStore::from_connection`] keeps its own.
        #[must_use]
        pub fn with_response_timeout(timeout: Duration) => response_timeout = timeout;

        /// How long a record's key outlives its `expires_at` in Redis (default zero: the key
        /// expires exactly at `expires_at`). Logically the record is gone at `expires_at`
        /// either way: every read and script checks. Fencing tokens stay unique across record
        /// generations without it (a new generation's first token comes from the server's
        /// clock, `docs/redis.md#fencing-tokens-and-the-servers-clock`); a grace adds that a record claimed again within it
        /// continues its old token + 1 even if the server's clock stepped back meanwhile, at the
        /// cost of memory. A renewal ([`idem_core::Store::extend`]) that moves `expires_at`
        /// moves the key's expiry to the new `expires_at` plus the grace.
        #[must_use]
        pub fn with_expiry_grace(grace: Duration) => expiry_grace = grace;

        /// Reads time from `clock` instead of the server's `TIME`. Without it (the default)
        /// every script reads the server's `TIME`, so application servers with skewed clocks
        /// still agree on when a lease ends: leave it unset in production.
        ///
        /// For tests: the conformance suite passes its `ManualClock`, whose reading goes to
        /// every script as an argument. Key expiry then follows this clock too: instead of
        /// `PEXPIREAT expires_at`, a key gets `PEXPIRE` of the record's remaining time on
        /// `clock` plus the [expiry grace](Config::with_expiry_grace). Real time keeps running
        /// while a test clock stands still, so set a grace longer than the test, or Redis may
        /// drop a key that the test clock still sees live. The clock must read between the
        /// Unix epoch and 2^53 ms.
        #[must_use]
        pub fn with_clock(clock: Arc<dyn Clock>) => clock = Some(clock);
    }

    pub(crate) fn validate(&self) -> Result<(), Error> {
        if self.prefix.contains(['{', '}']) {
            return Err(Error::Config("the key prefix must not contain `{` or `}` (they delimit the hash tag)"));
        }
        Ok(())
    }

    pub(crate) fn effective_response_timeout(&self) -> Duration {
        match self.replica_ack {
            Some(ack) => self.response_timeout.max(ack.timeout + Duration::from_millis(500)),
            None => self.response_timeout,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_noeviction_is_safe() {
        assert_eq!(EvictionCheck::Refuse.verdict("noeviction", 1 << 30), Verdict::Safe);
        for policy in [
            "allkeys-lru",
            "allkeys-lfu",
            "allkeys-random",
            "volatile-lru",
            "volatile-lfu",
            "volatile-random",
            "volatile-ttl",
        ] {
            assert_eq!(EvictionCheck::Refuse.verdict(policy, 1 << 30), Verdict::Refuse, "{policy}");
            assert_eq!(EvictionCheck::Warn.verdict(policy, 1 << 30), Verdict::Warn, "{policy}");
            // No memory limit: nothing is evicted until someone sets one.
            assert_eq!(EvictionCheck::Refuse.verdict(policy, 0), Verdict::Warn, "{policy}");
        }
    }

    #[test]
    fn persistence_settings_are_flagged_as_documented() {
        assert_eq!(persistence_problem("yes", "always", ""), None);
        assert_eq!(persistence_problem("yes", "everysec", ""), None);
        assert!(persistence_problem("yes", "no", "3600 1").is_some());
        assert_eq!(persistence_problem("no", "everysec", "3600 1 300 100"), None);
        assert!(persistence_problem("no", "everysec", "").is_some());
        assert_eq!(Config::default().persistence_check, PersistenceCheck::Warn);
    }

    #[test]
    fn braces_in_the_prefix_are_refused() {
        assert!(Config::default().with_prefix("a{b}:").validate().is_err());
        assert!(Config::default().with_prefix("tenant-7:idem:").validate().is_ok());
    }

    #[test]
    fn wait_timeout_raises_the_response_timeout() {
        let c = Config::default()
            .with_response_timeout(Duration::from_secs(1))
            .with_replica_ack(Some(ReplicaAck::new(1, Duration::from_secs(3))));
        assert_eq!(c.effective_response_timeout(), Duration::from_millis(3_500));
    }
}
