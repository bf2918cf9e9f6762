//! `idem stats` on Redis: each primary's replicas against the replica acknowledgement the
//! deployment requires. The requirement is the CLI's own `wait=N` option on a `redis://` or
//! `redis-cluster://` URL (as the application's `ReplicaAck::new(N, …)`), taken out before
//! the URL is parsed; without it the replicas are shown with nothing to hold them against.

use serde_json::{Value, json};

use crate::url::StoreUrl;

/// The primaries and their replicas, and the requirement if one was given.
#[derive(Debug)]
pub(crate) struct Replicas {
    required: Option<u32>,
    primaries: Vec<(String, u32)>,
}

/// Takes `wait=N` out of the query of a Redis URL: the URL without it, and `N`. Other URLs
/// pass through untouched (their own parsing refuses a `wait` they do not know).
pub(crate) fn take_wait(url: &str) -> Result<(String, Option<u32>), String> {
    let redis = url.starts_with("redis://") || url.starts_with("rediss://") || url.starts_with("redis-cluster://");
    let Some((base, query)) = url.split_once('?').filter(|_| redis) else { return Ok((url.to_owned(), None)) };
    let mut wait = None;
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.strip_prefix("wait=") {
            Some(n) => {
                wait = Some(n.parse::<u32>().map_err(|_| format!("bad store URL {url:?}: wait={n:?} is not a count"))?)
            }
            None => kept.push(pair),
        }
    }
    let rebuilt = if kept.is_empty() { base.to_owned() } else { format!("{base}?{}", kept.join("&")) };
    Ok((rebuilt, wait))
}

/// Reads the replicas of a Redis store (`None` for any other backend).
pub(crate) async fn read(url: &StoreUrl, required: Option<u32>) -> Result<Option<Replicas>, String> {
    // As the CLI opens its stores: an evicting server is reported, not refused.
    let config = idem_redis::Config::default().with_eviction_check(idem_redis::EvictionCheck::Warn);
    let store = match url {
        StoreUrl::Redis { url, .. } => idem_redis::RedisStore::connect(url, config).await,
        StoreUrl::RedisCluster { nodes, .. } => idem_redis::RedisStore::connect_cluster(nodes, config).await,
        _ => return Ok(None),
    };
    let store = store.map_err(|e| format!("cannot read the replicas: {e}"))?;
    let primaries = store.replicas().await.map_err(|e| format!("cannot read the replicas: {e}"))?;
    Ok(Some(Replicas { required, primaries }))
}

impl Replicas {
    /// Whether `n` replicas fall short of the requirement.
    fn short(&self, n: u32) -> bool {
        self.required.is_some_and(|r| n < r)
    }

    /// `{"required": N|null, "primaries": [{"node", "replicas", "short"}]}`.
    pub(crate) fn json(&self) -> Value {
        let primaries: Vec<Value> = self
            .primaries
            .iter()
            .map(|(node, n)| json!({ "node": node, "replicas": n, "short": self.short(*n) }))
            .collect();
        json!({ "required": self.required, "primaries": primaries })
    }

    /// One line per primary, a short one flagged with what the store does about it.
    pub(crate) fn text(&self) -> String {
        let required = self.required.map_or_else(|| "not given (add ?wait=N to the URL)".to_owned(), |r| r.to_string());
        let mut s = format!("replicas required: {required}\n");
        for (node, n) in &self.primaries {
            let flag =
                if self.short(*n) { "  SHORT: Strict refuses its claims (503), Degrade writes with fewer" } else { "" };
            s.push_str(&format!("  primary {node:<22} replicas {n}{flag}\n"));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::take_wait;

    #[test]
    fn wait_is_taken_out_of_redis_urls_only() {
        let (url, wait) = take_wait("redis-cluster://h:7000,h:7001?prefix=p:&wait=1").expect("parses");
        assert_eq!((url.as_str(), wait), ("redis-cluster://h:7000,h:7001?prefix=p:", Some(1)));
        assert_eq!(take_wait("redis://h:6379?wait=2").expect("parses"), ("redis://h:6379".to_owned(), Some(2)));
        assert_eq!(take_wait("postgres://u@h/db?wait=1").expect("other").1, None);
        assert!(take_wait("redis://h:6379?wait=x").is_err());
    }
}
