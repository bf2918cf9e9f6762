//! A private six-node Redis Cluster (three primaries, three replicas) for tests that
//! migrate slots, fail over or kill nodes, so the shared cluster on 7000-7005 stays
//! healthy for everyone else. Started from `redis-server` and `redis-cli --cluster create`
//! on six consecutive loopback ports in a temporary directory; every node is killed (by its
//! pid) on drop. Used by idem-redis' `cluster_faults` tests and by leasebroker's cluster
//! storm (which includes this file by path).

#![allow(dead_code, reason = "each test binary uses a different subset of these helpers")]
#![allow(unreachable_pub, reason = "test helper module, not a public API")]

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use idem_redis::redis;

/// The cluster. Node `i` listens on `base + i`.
pub struct PrivateCluster {
    base: u16,
    children: Vec<Option<Child>>,
    dir: tempfile::TempDir,
}

/// One `CLUSTER NODES` line: the node's port, whether it is a primary, its primary's id
/// (replicas), its own id, whether it is marked failed, and its slot ranges.
#[derive(Clone, Debug)]
pub struct NodeInfo {
    pub port: u16,
    pub id: String,
    pub primary: bool,
    pub primary_id: Option<String>,
    pub failed: bool,
    pub slots: Vec<(u16, u16)>,
}

impl PrivateCluster {
    /// Starts six nodes on `base..base + 6` (node timeout `node_timeout_ms`) and joins
    /// them into a cluster with one replica per primary. Returns once every node reports
    /// `cluster_state:ok` and every replica's link is up.
    pub async fn start(base: u16, node_timeout_ms: u64) -> Self {
        for port in (base..base + 6).chain(base + 10_000..base + 10_006) {
            // A node left over from an interrupted run would answer in place of a new one.
            assert!(
                std::net::TcpListener::bind(("127.0.0.1", port)).is_ok(),
                "port {port} is in use (a redis-server left over from an interrupted test run? stop it by its pid)"
            );
        }
        let dir = tempfile::Builder::new().prefix("idem-redis-cluster-").tempdir().expect("temp dir");
        let mut cluster = Self { base, children: Vec::new(), dir };
        for i in 0..6 {
            let child = cluster.spawn(i, node_timeout_ms);
            cluster.children.push(Some(child));
        }
        for i in 0..6 {
            cluster.wait_answers(base + i).await;
        }
        let addrs: Vec<String> = (0..6).map(|i| format!("127.0.0.1:{}", base + i)).collect();
        let status = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("redis-cli must be on PATH for the cluster tests (Debian's redis-tools)");
        assert!(status.success(), "redis-cli --cluster create on ports {base}..{}", base + 5);
        cluster.wait_healthy().await;
        cluster
    }

    fn spawn(&self, i: u16, node_timeout_ms: u64) -> Child {
        let port = self.base + i;
        let dir = self.dir.path().join(port.to_string());
        std::fs::create_dir_all(&dir).expect("node dir");
        Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
            .args(["--dir", dir.to_str().expect("utf-8 dir")])
            .args(["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"])
            .args(["--cluster-node-timeout", &node_timeout_ms.to_string()])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server must be on PATH for the cluster tests")
    }

    /// Node URLs, as `RedisStore::connect_cluster` takes them.
    pub fn urls(&self) -> Vec<String> {
        (0..6).map(|i| format!("redis://127.0.0.1:{}", self.base + i)).collect()
    }

    /// A plain (non-cluster) connection to one node.
    pub async fn node(&self, port: u16) -> redis::aio::MultiplexedConnection {
        let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).expect("url");
        let config = redis::AsyncConnectionConfig::new().set_response_timeout(Some(Duration::from_secs(5)));
        client.get_multiplexed_async_connection_with_config(&config).await.expect("node connection")
    }

    async fn try_node(&self, port: u16) -> Option<redis::aio::MultiplexedConnection> {
        let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).ok()?;
        let config = redis::AsyncConnectionConfig::new()
            .set_response_timeout(Some(Duration::from_secs(2)))
            .set_connection_timeout(Some(Duration::from_secs(1)));
        client.get_multiplexed_async_connection_with_config(&config).await.ok()
    }

    async fn wait_answers(&self, port: u16) {
        for _ in 0..200 {
            if let Some(mut c) = self.try_node(port).await {
                let pong: Result<String, _> = redis::cmd("PING").query_async(&mut c).await;
                if pong.is_ok() {
                    return;
                }
            }
            // Waiting for a child process to listen: no clock is involved.
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("private cluster node {port} did not start");
    }

    fn live(&self) -> impl Iterator<Item = u16> + '_ {
        self.children.iter().enumerate().filter(|(_, c)| c.is_some()).map(|(i, _)| self.base + i as u16)
    }

    /// Every live node says `cluster_state:ok`, none is marked failed, every primary with
    /// slots has a replica whose link is up.
    pub async fn healthy(&self) -> bool {
        for port in self.live().collect::<Vec<_>>() {
            let Some(mut c) = self.try_node(port).await else { return false };
            let info: Result<String, _> = redis::cmd("CLUSTER").arg("INFO").query_async(&mut c).await;
            if !info.is_ok_and(|i| i.contains("cluster_state:ok")) {
                return false;
            }
            let repl: Result<String, _> = redis::cmd("INFO").arg("replication").query_async(&mut c).await;
            match repl {
                Ok(r) if r.contains("role:slave") && !r.contains("master_link_status:up") => return false,
                Ok(_) => {}
                Err(_) => return false,
            }
        }
        let Some(nodes) = self.nodes().await else { return false };
        let live: Vec<u16> = self.live().collect();
        let primaries: Vec<&NodeInfo> = nodes.iter().filter(|n| n.primary && !n.slots.is_empty()).collect();
        primaries.len() == 3
            && nodes.iter().filter(|n| live.contains(&n.port)).all(|n| !n.failed)
            && primaries.iter().all(|p| {
                nodes
                    .iter()
                    .any(|r| r.primary_id.as_deref() == Some(p.id.as_str()) && live.contains(&r.port) && !r.failed)
            })
    }

    /// Waits (up to 60 s) until [`PrivateCluster::healthy`]. A forced failover's old
    /// primary resyncs as a replica; under the test command's load (every suite at once on
    /// two cores) that once took more than 30 s.
    pub async fn wait_healthy(&self) {
        for _ in 0..600 {
            if self.healthy().await {
                return;
            }
            // Waiting for gossip and replication to settle: no clock is involved.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("private cluster on {}..{} did not become healthy: {:?}", self.base, self.base + 5, self.nodes().await);
    }

    /// `CLUSTER NODES` as seen by the first live node that answers.
    pub async fn nodes(&self) -> Option<Vec<NodeInfo>> {
        for port in self.live().collect::<Vec<_>>() {
            let Some(mut c) = self.try_node(port).await else { continue };
            let Ok(text) = redis::cmd("CLUSTER").arg("NODES").query_async::<String>(&mut c).await else { continue };
            return Some(text.lines().filter_map(parse_node_line).collect());
        }
        None
    }

    /// The primaries with slots, in port order.
    pub async fn primaries(&self) -> Vec<NodeInfo> {
        let mut p: Vec<NodeInfo> = self
            .nodes()
            .await
            .expect("a node answers")
            .into_iter()
            .filter(|n| n.primary && !n.slots.is_empty())
            .collect();
        p.sort_by_key(|n| n.port);
        p
    }

    /// The replica of the primary on `port`.
    pub async fn replica_of(&self, port: u16) -> u16 {
        let nodes = self.nodes().await.expect("a node answers");
        let id = &nodes.iter().find(|n| n.port == port).expect("primary").id;
        nodes.iter().find(|n| n.primary_id.as_ref() == Some(id)).expect("a replica").port
    }

    /// The port of the primary serving `key` now.
    pub async fn primary_for(&self, key: &str) -> u16 {
        let port = self.live().next().expect("a live node");
        let mut c = self.node(port).await;
        let slot: u16 = redis::cmd("CLUSTER").arg("KEYSLOT").arg(key).query_async(&mut c).await.expect("KEYSLOT");
        self.primaries()
            .await
            .into_iter()
            .find(|p| p.slots.iter().any(|&(lo, hi)| (lo..=hi).contains(&slot)))
            .expect("slot served")
            .port
    }

    /// SIGKILLs the node on `port` (by its pid): a crash, no goodbye to the cluster.
    pub fn kill(&mut self, port: u16) {
        let i = usize::from(port - self.base);
        if let Some(mut child) = self.children[i].take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the killed node on `port` again from its `nodes.conf` (it rejoins; a demoted
    /// primary comes back as a replica of its successor).
    pub async fn restart(&mut self, port: u16, node_timeout_ms: u64) {
        let i = port - self.base;
        let child = self.spawn(i, node_timeout_ms);
        self.children[usize::from(i)] = Some(child);
        self.wait_answers(port).await;
    }

    /// Moves `slots` from the primary on `from` to the primary on `to` the way
    /// `redis-cli --cluster reshard` does: `IMPORTING` on the target, `MIGRATING` on the
    /// source, `MIGRATE` of each key in batches, then `SETSLOT NODE` on both (and the
    /// other primaries). Keys written meanwhile are redirected with `ASK`, then `MOVED`.
    pub async fn migrate_slots(&self, slots: &[u16], from: u16, to: u16) {
        let nodes = self.nodes().await.expect("a node answers");
        let id = |port: u16| nodes.iter().find(|n| n.port == port).expect("node").id.clone();
        let (from_id, to_id) = (id(from), id(to));
        let (mut src, mut dst) = (self.node(from).await, self.node(to).await);
        for &slot in slots {
            let () = redis::cmd("CLUSTER")
                .arg("SETSLOT")
                .arg(slot)
                .arg("IMPORTING")
                .arg(&from_id)
                .query_async(&mut dst)
                .await
                .expect("IMPORTING");
            let () = redis::cmd("CLUSTER")
                .arg("SETSLOT")
                .arg(slot)
                .arg("MIGRATING")
                .arg(&to_id)
                .query_async(&mut src)
                .await
                .expect("MIGRATING");
            loop {
                let keys: Vec<Vec<u8>> = redis::cmd("CLUSTER")
                    .arg("GETKEYSINSLOT")
                    .arg(slot)
                    .arg(100)
                    .query_async(&mut src)
                    .await
                    .expect("GETKEYSINSLOT");
                if keys.is_empty() {
                    break;
                }
                let mut migrate = redis::cmd("MIGRATE");
                migrate.arg("127.0.0.1").arg(to).arg("").arg(0).arg(5000).arg("REPLACE").arg("KEYS");
                for k in &keys {
                    migrate.arg(k.as_slice());
                }
                let _: redis::Value = migrate.query_async(&mut src).await.expect("MIGRATE");
            }
            for port in self.primaries().await.iter().map(|p| p.port).chain([from, to]) {
                let mut c = self.node(port).await;
                let () = redis::cmd("CLUSTER")
                    .arg("SETSLOT")
                    .arg(slot)
                    .arg("NODE")
                    .arg(&to_id)
                    .query_async(&mut c)
                    .await
                    .expect("SETSLOT NODE");
            }
        }
    }
}

fn parse_node_line(line: &str) -> Option<NodeInfo> {
    let f: Vec<&str> = line.split_whitespace().collect();
    if f.len() < 8 {
        return None;
    }
    let port = f[1].split('@').next()?.rsplit(':').next()?.parse().ok()?;
    let flags = f[2];
    let slots = f[8..]
        .iter()
        .filter(|s| !s.starts_with('['))
        .filter_map(|s| match s.split_once('-') {
            Some((lo, hi)) => Some((lo.parse().ok()?, hi.parse().ok()?)),
            None => s.parse().ok().map(|n| (n, n)),
        })
        .collect();
    Some(NodeInfo {
        port,
        id: f[0].to_owned(),
        primary: flags.contains("master"),
        primary_id: (f[3] != "-").then(|| f[3].to_owned()),
        failed: flags.contains("fail"),
        slots,
    })
}

impl Drop for PrivateCluster {
    fn drop(&mut self) {
        for child in self.children.iter_mut().flatten() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
