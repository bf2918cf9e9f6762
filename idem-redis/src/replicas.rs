//! What the store knows of each primary's replicas, held against [`ReplicaAck`]: read at
//! start-up and after a topology change, lowered by every `WAIT` that fell short. A `WAIT`
//! that cannot be met blocks the node's one multiplexed connection for its whole timeout, and
//! every call to that shard queues behind it (`docs/redis.md#a-shard-without-enough-replicas`).

use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::config::{ReplicaAck, Shortfall};
use crate::error::Error;

/// `(first slot, last slot, primary, replicas)`; a single server owns every slot.
pub(crate) type Shard = (u16, u16, String, u32);

/// The shards, when they were read, and whether a call met a topology change since.
#[derive(Debug, Default)]
pub(crate) struct Replicas(Mutex<(Vec<Shard>, Option<Instant>, bool)>);

impl Replicas {
    fn lock(&self) -> MutexGuard<'_, (Vec<Shard>, Option<Instant>, bool)> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The `WAIT` a write to `key` sends: `ack` where its shard has the replicas; where it
    /// has fewer, a claim (or reclaim) under [`Shortfall::Strict`] is refused before writing,
    /// and any other write waits for the replicas there are, counted as degraded.
    pub(crate) fn plan(&self, key: &str, ack: ReplicaAck, claims: bool) -> Result<ReplicaAck, Error> {
        let (state, slot) = (self.lock(), slot(key));
        let Some((_, _, node, n)) = state.0.iter().find(|s| (s.0..=s.1).contains(&slot)) else { return Ok(ack) };
        if *n >= ack.replicas {
            Ok(ack)
        } else if claims && ack.shortfall == Shortfall::Strict {
            let (acked, wanted) = (u64::from(*n), u64::from(ack.replicas));
            Err(Error::ReplicaShortfall { node: node.clone(), acked, wanted, timeout_ms: 0 })
        } else {
            metrics::counter!("idem_redis_degraded_writes_total", "node" => node.clone()).increment(1);
            Ok(ReplicaAck { replicas: *n, ..ack })
        }
    }

    /// A `WAIT` for `key` counted `acked` replicas (`None`: a call met a topology change):
    /// the shard has no more until the next read. Returns the shard's primary.
    pub(crate) fn fell_short(&self, key: &str, acked: Option<u64>, ack: ReplicaAck) -> String {
        let mut state = self.lock();
        state.2 = true;
        let Some(acked) = acked else { return String::new() };
        let slot = slot(key);
        let Some(shard) = state.0.iter_mut().find(|s| (s.0..=s.1).contains(&slot)) else {
            return "unknown".into();
        };
        let acked = u32::try_from(acked).unwrap_or(u32::MAX);
        if acked < shard.3 {
            warn(&shard.2, acked, ack);
            shard.3 = acked;
        }
        shard.2.clone()
    }

    /// Whether to read the shards again now: after a topology change, or while one is
    /// short (to see its replica come back), at most once a second.
    pub(crate) fn due(&self, ack: ReplicaAck) -> bool {
        let mut state = self.lock();
        let due = (state.2 || state.0.iter().any(|s| s.3 < ack.replicas))
            && state.1.is_none_or(|t| t.elapsed() >= Duration::from_secs(1));
        if due {
            (state.1, state.2) = (Some(Instant::now()), false);
        }
        due
    }

    /// The shards as just read: warns once of each primary short of `ack` and sets the
    /// `idem_redis_replicas` gauge.
    pub(crate) fn set(&self, shards: Vec<Shard>, ack: Option<ReplicaAck>) {
        let mut state = self.lock();
        for (_, _, node, n) in &shards {
            metrics::gauge!("idem_redis_replicas", "node" => node.clone()).set(f64::from(*n));
            let known = state.0.iter().find(|s| &s.2 == node).map(|s| s.3);
            if let Some(ack) = ack.filter(|a| *n < a.replicas && known != Some(*n)) {
                warn(node, *n, ack);
            }
        }
        (state.0, state.1) = (shards, Some(Instant::now()));
    }
}

fn warn(node: &str, replicas: u32, ack: ReplicaAck) {
    tracing::warn!(
        backend = "redis",
        node,
        replicas,
        required = ack.replicas,
        shortfall = ?ack.shortfall,
        "idem-redis: primary {node} has {replicas} replica(s) of {} required: Strict refuses its claims (503), \
         Degrade writes with the replicas there are",
        ack.replicas
    );
}

/// The Redis Cluster slot of `key`: CRC16 (XMODEM) of its hash tag, mod 16384 (the live
/// tests hold it against `CLUSTER KEYSLOT`).
fn slot(key: &str) -> u16 {
    let tag = key.split_once('{').and_then(|(_, rest)| rest.split_once('}')).map_or(key, |(tag, _)| tag);
    let crc = if tag.is_empty() { key } else { tag }.bytes().fold(0u16, |crc, b| {
        (0..8).fold(crc ^ (u16::from(b) << 8), |c, _| if c & 0x8000 != 0 { (c << 1) ^ 0x1021 } else { c << 1 })
    });
    crc % 16_384
}
