//! Errors of the Redis backend, and which of them a retry can fix.

use idem_core::StoreError;
use redis::{ErrorKind, RedisError, ServerErrorKind};

/// Backend name carried by [`StoreError::Unavailable`].
pub(crate) const BACKEND: &str = "redis";

/// What went wrong talking to Redis.
///
/// The store's methods return [`StoreError`]; this type is its `source` (for
/// [`StoreError::Unavailable`]) and what [`crate::RedisStore::connect`] returns. The driver's
/// own [`RedisError`] is kept as the source, never flattened into a string.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The connection URL does not parse or names an unsupported scheme.
    #[error("invalid Redis URL")]
    Url(#[source] RedisError),
    /// The configuration is unusable (the message says why).
    #[error("invalid idem-redis configuration: {0}")]
    Config(&'static str),
    /// A Redis command failed: connection refused or dropped, timeout, or an error reply.
    #[error("Redis {operation} failed")]
    Command {
        /// What was being done (`connect`, `claim`, `WAIT`, ...).
        operation: &'static str,
        /// The driver's error.
        #[source]
        source: RedisError,
    },
    /// The server's `maxmemory-policy` may evict keys, so it can silently drop an in-flight
    /// claim and let a duplicate request run; refused by [`crate::EvictionCheck::Refuse`].
    #[error(
        "Redis maxmemory-policy is {policy} with maxmemory {maxmemory} bytes: an evicting policy can drop an \
         in-flight claim and run a request twice; set `maxmemory-policy noeviction` (or choose EvictionCheck::Warn)"
    )]
    EvictingPolicy {
        /// The server's `maxmemory-policy`.
        policy: String,
        /// The server's `maxmemory`, bytes (0: no limit).
        maxmemory: u64,
    },
    /// A server (`node`: its address on a cluster, `server` otherwise) would lose records on
    /// a restart; refused by [`crate::PersistenceCheck::Refuse`].
    #[error(
        "Redis {node} would lose idempotency records on a restart ({problem}); a lost claim runs its request \
         again: enable AOF (`appendonly yes`, `appendfsync everysec` or `always`) or choose PersistenceCheck::Warn"
    )]
    NotDurable {
        /// The server checked.
        node: String,
        /// The setting and what it loses.
        problem: &'static str,
    },
    /// `WAIT` returned before enough replicas acknowledged the write, or (`timeout_ms` 0) a
    /// claim under [`crate::Shortfall::Strict`] was refused before writing because its shard
    /// has too few replicas. A written claim has already been released (see
    /// [`crate::ReplicaAck`]), so no claim is left that nobody owns.
    #[error(
        "replica shortfall on {node}: {acked} of {wanted} replicas acknowledged within {timeout_ms} ms (0: refused before writing)"
    )]
    ReplicaShortfall {
        /// The shard's primary (`server` on a single server; `unknown` where the replicas could not be read).
        node: String,
        /// Replicas that acknowledged.
        acked: u64,
        /// Replicas asked for.
        wanted: u64,
        /// The WAIT timeout, ms.
        timeout_ms: u64,
    },
    /// A script replied in a shape this build does not understand (a server-side script
    /// of another version, or a foreign value at one of our keys).
    #[error("Redis {operation} returned an unexpected reply: {detail}")]
    UnexpectedReply {
        /// The operation.
        operation: &'static str,
        /// What was wrong.
        detail: &'static str,
    },
}

impl Error {
    pub(crate) fn command(operation: &'static str, source: RedisError) -> Self {
        Error::Command { operation, source }
    }

    /// Whether the same call may succeed if retried: connection refused, reset or timed
    /// out, and the server replies that mean "not now" (`READONLY` after a failover,
    /// `LOADING`, `TRYAGAIN`, `CLUSTERDOWN`, `MASTERDOWN`, `BUSY`, `OOM` under
    /// `noeviction`, `NOREPLICAS`, and `MOVED`/`ASK` past the redirect budget), and a
    /// `WAIT` shortfall.
    /// Bad URLs, configuration, authentication, permission and unknown replies are not.
    #[must_use]
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Command { source, .. } => is_retryable_redis(source),
            Error::ReplicaShortfall { .. } => true,
            Error::Url(_)
            | Error::Config(_)
            | Error::EvictingPolicy { .. }
            | Error::NotDurable { .. }
            | Error::UnexpectedReply { .. } => false,
        }
    }

    fn operation(&self) -> &'static str {
        match self {
            Error::Url(_) => "connect",
            Error::Config(_) => "configure",
            Error::Command { operation, .. } | Error::UnexpectedReply { operation, .. } => operation,
            Error::EvictingPolicy { .. } => "check maxmemory-policy",
            Error::NotDurable { .. } => "check persistence",
            Error::ReplicaShortfall { .. } => "WAIT",
        }
    }
}

/// Retry classification of a driver error (see [`Error::is_retryable`]).
pub(crate) fn is_retryable_redis(e: &RedisError) -> bool {
    match e.kind() {
        // Refused, reset, broken pipe, EOF, timeouts: the connection manager reconnects.
        ErrorKind::Io | ErrorKind::ClusterConnectionNotFound => true,
        ErrorKind::Server(
            ServerErrorKind::ReadOnly
            | ServerErrorKind::BusyLoading
            | ServerErrorKind::TryAgain
            | ServerErrorKind::ClusterDown
            | ServerErrorKind::MasterDown
            // A slot that kept moving past the store's redirect budget (the script did not
            // run): the crate refreshes its slot map meanwhile, so the retry lands.
            | ServerErrorKind::Moved
            | ServerErrorKind::Ask,
        ) => true,
        // `BUSY`: another client's script is running past the busy threshold. `OOM`: memory
        // is full under `noeviction`; records expiring free it. `NOREPLICAS`: fewer replicas
        // than `min-replicas-to-write` are connected right now.
        ErrorKind::Extension => matches!(e.code(), Some("BUSY" | "OOM" | "NOREPLICAS")),
        _ => e.is_timeout() || e.is_connection_dropped() || e.is_connection_refusal(),
    }
}

impl From<Error> for StoreError {
    fn from(e: Error) -> Self {
        let retryable = e.is_retryable();
        let operation = e.operation();
        StoreError::unavailable(BACKEND, operation, retryable, e)
    }
}
