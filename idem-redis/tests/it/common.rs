//! Shared helpers of the Redis integration tests: the server URL, a clear failure when it
//! is down, and stores on fresh random prefixes.

#![allow(dead_code, reason = "each test binary uses a different subset of these helpers")]
#![allow(unreachable_pub, reason = "test helper module, not a public API")]

use std::sync::Arc;
use std::time::Duration;

use idem_core::Clock;
use idem_redis::{Config, RedisStore};

/// The Redis every test talks to: `IDEM_REDIS_URL`, default `redis://127.0.0.1:6379`.
pub fn url() -> String {
    std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// The one message a developer without Redis sees.
pub fn unreachable(url: &str, e: &(dyn std::error::Error + 'static)) -> ! {
    let mut e: String = {
        let mut chain = vec![e.to_string()];
        let mut source = e.source();
        while let Some(s) = source {
            chain.push(s.to_string());
            source = s.source();
        }
        chain.join(": ")
    };
    e.truncate(300);
    panic!(
        "Redis is not reachable at {url} ({e}). These tests need a real Redis: start one with\n    \
         redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save \"\" --appendonly no\n\
         or point IDEM_REDIS_URL at one."
    )
}

/// A fresh namespace for one scenario.
pub fn fresh_prefix() -> String {
    format!("idem-test:{}:", uuid::Uuid::new_v4().simple())
}

/// How long test keys outlive their `expires_at`: tests move a manual clock ahead of the
/// server's, and the keys must still be there when the test clock looks at them.
pub const TEST_GRACE: Duration = Duration::from_secs(600);

/// The configuration tests use: `prefix`, the test clock, a grace for native expiry.
pub fn test_config(prefix: &str, clock: Arc<dyn Clock>) -> Config {
    Config::default().with_prefix(prefix).with_clock(clock).with_expiry_grace(TEST_GRACE)
}

/// Connects to [`url`] or fails the test with the start-up hint.
pub async fn connect(config: Config) -> RedisStore {
    let url = url();
    match RedisStore::connect(&url, config).await {
        Ok(store) => store,
        Err(e) if e.is_retryable() => unreachable(&url, &e),
        Err(e) => panic!("cannot open the Redis store at {url}: {e:?}"),
    }
}

/// A plain second connection to the same server, for inspecting and killing.
pub async fn admin() -> redis::aio::MultiplexedConnection {
    let url = url();
    let client = redis::Client::open(url.as_str()).unwrap_or_else(|e| unreachable(&url, &e));
    client.get_multiplexed_async_connection().await.unwrap_or_else(|e| unreachable(&url, &e))
}

/// A private `redis-server` on a free port, for tests that need a server configured
/// differently (an evicting policy, CONFIG disabled) or that block or restart the server,
/// so the shared one is never disturbed. Killed (by its own pid) on drop.
///
/// It runs in a temporary directory of its own (`--dir`): a replica's initial sync, a
/// cluster node's `nodes.conf` and any RDB file land there, never in the crate's
/// directory (the test's working directory), and go with the server. It never persists
/// (`--save ""`, `--appendonly no`), so a [restart](PrivateRedis::restart) loses every key.
pub struct PrivateRedis {
    child: std::process::Child,
    /// The command line after the fixed options, kept for a restart.
    args: Vec<String>,
    port: u16,
    /// Its working directory, removed after the server is killed.
    dir: tempfile::TempDir,
    /// Its URL.
    pub url: String,
}

impl PrivateRedis {
    /// Starts `redis-server` with `args` on a free port and waits until it answers.
    pub async fn start(args: &[&str]) -> Self {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("free port");
            l.local_addr().expect("addr").port()
        };
        let dir = tempfile::Builder::new().prefix("idem-redis-test-").tempdir().expect("temp dir");
        let args: Vec<String> = args.iter().map(|&a| a.to_owned()).collect();
        let child = spawn(port, &dir, &args);
        let url = format!("redis://127.0.0.1:{port}");
        let server = Self { child, args, port, dir, url };
        server.wait_ready().await;
        server
    }

    /// Kills the server (by its pid) and starts it again on the same port, with the same
    /// options and directory: every key is gone (nothing persists), as after a crash or a
    /// restart of a server without persistence. Returns once the new server answers.
    pub async fn restart(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.child = spawn(self.port, &self.dir, &self.args);
        self.wait_ready().await;
    }

    async fn wait_ready(&self) {
        let client = redis::Client::open(self.url.as_str()).expect("url");
        for _ in 0..200 {
            if let Ok(mut c) = client.get_multiplexed_async_connection().await {
                let pong: Result<String, _> = redis::cmd("PING").query_async(&mut c).await;
                if pong.is_ok() {
                    return;
                }
            }
            // Waiting for a child process to start listening: no clock is involved.
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("private redis-server on port {} did not start", self.port);
    }

    /// Sends `SIG<name>` (`STOP`, `CONT`) to the server process (by its pid).
    pub fn signal(&self, name: &str) {
        let status = std::process::Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.child.id().to_string())
            .status()
            .expect("kill");
        assert!(status.success(), "kill -{name} of the private redis-server");
    }

    /// A plain connection to it.
    pub async fn admin(&self) -> redis::aio::MultiplexedConnection {
        let client = redis::Client::open(self.url.as_str()).expect("url");
        client.get_multiplexed_async_connection().await.expect("private redis connection")
    }
}

/// Spawns `redis-server` on `port` in `dir`, without persistence, with `args` appended.
fn spawn(port: u16, dir: &tempfile::TempDir, args: &[String]) -> std::process::Child {
    let port_s = port.to_string();
    let dir_s = dir.path().to_str().expect("utf-8 temp dir");
    let mut cmd = std::process::Command::new("redis-server");
    cmd.args(["--bind", "127.0.0.1", "--port", &port_s, "--save", "", "--appendonly", "no", "--dir", dir_s]);
    cmd.args(args);
    cmd.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null());
    cmd.spawn().expect(
        "redis-server must be on PATH for this test (install Redis; the shared server alone is not enough here)",
    )
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The cluster the cluster suite talks to: `IDEM_REDIS_CLUSTER_URLS` (comma-separated),
/// default the six nodes `scripts/redis-cluster` starts on 127.0.0.1:7000-7005 (or from
/// `IDEM_REDIS_CLUSTER_PORT`, as the script does).
pub fn cluster_urls() -> Vec<String> {
    match std::env::var("IDEM_REDIS_CLUSTER_URLS") {
        Ok(v) => v.split(',').map(|s| s.trim().to_owned()).filter(|s| !s.is_empty()).collect(),
        Err(_) => {
            // The same six ports as `scripts/redis-cluster`, which IDEM_REDIS_CLUSTER_PORT moves.
            let base =
                std::env::var("IDEM_REDIS_CLUSTER_PORT").ok().and_then(|p| p.parse::<u16>().ok()).unwrap_or(7000);
            (base..=base + 5).map(|p| format!("redis://127.0.0.1:{p}")).collect()
        }
    }
}

/// Connects to the cluster at [`cluster_urls`] or fails the test with the start-up hint.
pub async fn connect_cluster(config: Config) -> RedisStore {
    let urls = cluster_urls();
    match RedisStore::connect_cluster(&urls, config).await {
        Ok(store) => store,
        Err(e) => panic!(
            "the Redis Cluster at {urls:?} is not usable ({e}: {:?}). These tests need a real cluster: start one \
             with scripts/redis-cluster (six nodes on 127.0.0.1:7000-7005), or point IDEM_REDIS_CLUSTER_URLS at one.",
            std::error::Error::source(&e).map(ToString::to_string)
        ),
    }
}
