//! What the store knows of each primary's replicas, held against [`ReplicaAck`]: read at
//! start-up and again after a call met a topology change, and lowered by every `WAIT` that
//! fell short. Knowing it lets a write skip a `WAIT` that cannot be met: a `WAIT` blocks the
//! node's one multiplexed connection for its whole timeout, so every call to that shard
//! queues behind it (`docs/redis.md#a-shard-without-enough-replicas`).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::config::{ReplicaAck, Shortfall};
use crate::error::Error;

/// How soon a short or changed topology is read again (a replica that came back, a
/// promoted primary), at most once per this interval.
const RECHECK: Duration = Duration::from_secs(1);

#[derive(Debug, Default)]
pub(crate) struct Replicas(Mutex<State>);

#[derive(Debug, Default)]
struct State {
    /// `(first slot, last slot, primary, replicas)`; a single server owns every slot.
    shards: Vec<(u16, u16, String, u32)>,
    /// When the shards were last read, and whether a call since met a topology change.
    checked: Option<Instant>,
    stale: bool,
}

impl Replicas {
    /// The `WAIT` a write to `key` sends: the configured one where the shard has the
    /// replicas; where it has fewer, a claim or reclaim under [`Shortfall::Strict`] is
    /// refused before it writes, and any other write waits for the replicas there are
    /// (counted in `idem_redis_degraded_writes_total`).
    pub(crate) fn plan(&self, key: &str, ack: ReplicaAck, claims: bool) -> Result<ReplicaAck, Error> {
        let state = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let slot = slot(key);
        let Some((_, _, node, n)) = state.shards.iter().find(|s| (s.0..=s.1).contains(&slot)) else { return Ok(ack) };
        if *n >= ack.replicas {
            return Ok(ack);
        }
        if claims && ack.shortfall == Shortfall::Strict {
            return Err(Error::ReplicaShortfall {
                node: node.clone(),
                acked: (*n).into(),
                wanted: ack.replicas.into(),
                timeout_ms: 0,
            });
        }
        metrics::counter!("idem_redis_degraded_writes_total", "node" => node.clone()).increment(1);
        Ok(ReplicaAck { replicas: *n, ..ack })
    }

    /// A `WAIT` for `key` counted only `acked` replicas: the shard has no more until the
    /// next read. Returns the shard's primary.
    pub(crate) fn fell_short(&self, key: &str, acked: u64, ack: ReplicaAck) -> String {
        let mut state = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        state.stale = true;
        let slot = slot(key);
        let Some(shard) = state.shards.iter_mut().find(|s| (s.0..=s.1).contains(&slot)) else { return "server".into() };
        let acked = u32::try_from(acked).unwrap_or(u32::MAX);
        if acked < shard.3 {
            warn(&shard.2, acked, ack);
            shard.3 = acked;
        }
        shard.2.clone()
    }

    /// A call met a topology change (a redirect, a dropped node, `CLUSTERDOWN`).
    pub(crate) fn topology_changed(&self) {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).stale = true;
    }

    /// Whether to read the shards again now (and, if so, nobody else does for a while).
    pub(crate) fn due(&self, ack: ReplicaAck) -> bool {
        let mut state = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let short = state.shards.iter().any(|s| s.3 < ack.replicas);
        let due = (state.stale || short) && state.checked.is_none_or(|t| t.elapsed() >= RECHECK);
        if due {
            (state.checked, state.stale) = (Some(Instant::now()), false);
        }
        due
    }

    /// The shards as just read: warns of each primary short of `ack` (once, until it
    /// changes) and sets the `idem_redis_replicas` gauge.
    pub(crate) fn set(&self, shards: Vec<(u16, u16, String, u32)>, ack: Option<ReplicaAck>) {
        let mut state = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        for (_, _, node, n) in &shards {
            metrics::gauge!("idem_redis_replicas", "node" => node.clone()).set(f64::from(*n));
            let known = state.shards.iter().find(|s| &s.2 == node).map(|s| s.3);
            match ack {
                Some(ack) if *n < ack.replicas && known != Some(*n) => warn(node, *n, ack),
                _ => {}
            }
        }
        (state.shards, state.checked) = (shards, Some(Instant::now()));
    }
}

fn warn(node: &str, replicas: u32, ack: ReplicaAck) {
    tracing::warn!(
        backend = "redis",
        node,
        replicas,
        required = ack.replicas,
        shortfall = ?ack.shortfall,
        "idem-redis: primary {node} has {replicas} replica(s), {} required: under Strict its claims are refused \
         (503), under Degrade its writes wait for the replicas there are",
        ack.replicas
    );
}

/// The Redis Cluster slot of `key`: CRC16 (XMODEM) of its hash tag, mod 16384.
fn slot(key: &str) -> u16 {
    let tag = key.split_once('{').and_then(|(_, rest)| rest.split_once('}')).map_or(key, |(tag, _)| tag);
    let tag = if tag.is_empty() { key } else { tag };
    let crc = tag.bytes().fold(0u16, |crc, b| {
        (0..8).fold(crc ^ (u16::from(b) << 8), |c, _| if c & 0x8000 != 0 { (c << 1) ^ 0x1021 } else { c << 1 })
    });
    crc % 16_384
}

#[cfg(test)]
mod tests {
    #[test]
    fn slots_match_redis() {
        // `CLUSTER KEYSLOT` on Redis 7.0.
        assert_eq!(super::slot("foo"), 12_182);
        assert_eq!(super::slot("idem:{foo}"), 12_182);
        assert_eq!(super::slot("123456789"), 12_739);
    }
}
