//! SIGKILL inside the create handler must not leak or double anything: `idem-harness serve`
//! (the demo's server) runs as a child process, is killed with SIGKILL at crash points inside the create
//! handler (before allocate, between allocate and lease, between lease and boot, around
//! the boot, before the worker row, after completion), and is restarted on the same store
//! while idem-client keeps retrying each logical operation with its one key. At the end:
//! one node, one lease, one booted VM and one worker per logical operation, every reply a
//! 201, every replay byte-identical to it, nothing in the inventory that no worker owns.
//!
//! `IDEM_CRASH_KILLS` sets the kills per backend (default 100); `IDEM_CRASH_CLIENTS` the
//! logical operations in flight at once (default 8). The crash plan's parsing is pinned
//! here too.

use std::collections::{BTreeMap, HashSet};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem_client::{IdempotentClient, OperationKey, RetryPolicy};
use idem_harness::crash::POINTS;
use leasebroker::crash::CrashPlan;
use leasebroker::state::{LEASES, NODES, Stats, VMS, WORKERS, Worker};
use rand::seq::SliceRandom;
use redb::{ReadableDatabase, ReadableTable};

/// In-flight lease of the child, ms: longer than a create takes under load, short enough
/// that a retry after a kill reclaims soon.
const LEASE_MS: &str = "300";

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// One run of `leasebroker serve`.
struct Server {
    child: Child,
    lines: Receiver<String>,
}

/// How to start the child: its address, store flag, state file and log.
#[derive(Clone)]
struct Launch {
    addr: String,
    store: String,
    state: PathBuf,
    log: PathBuf,
}

impl Launch {
    fn spawn(&self, crash_at: Option<&str>) -> Server {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log).unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem-harness"));
        cmd.args(["serve", "--addr", &self.addr, "--store", &self.store, "--lease-ms", LEASE_MS])
            .args(["--retention-ms", "600000", "--state"])
            .arg(&self.state)
            .env_remove("LEASEBROKER_CRASH_AT")
            .env_remove("LEASEBROKER_CRASH_RATE")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log));
        if let Some(p) = crash_at {
            cmd.args(["--crash-at", p]);
        }
        let mut child = cmd.spawn().expect("spawn idem-harness serve");
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut server = Server { child, lines };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match server.lines.recv_timeout(Duration::from_millis(100)) {
                Ok(l) if l.starts_with("LISTENING ") => return server,
                Ok(_) | Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    let status = server.child.wait().unwrap();
                    panic!("{}: the server exited before listening ({status}); log:\n{}", self.store, self.log_tail());
                }
            }
            assert!(Instant::now() < deadline, "{}: no LISTENING line in 20 s; log:\n{}", self.store, self.log_tail());
        }
    }

    fn log_tail(&self) -> String {
        let s = std::fs::read_to_string(&self.log).unwrap_or_default();
        s.lines().rev().take(20).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n")
    }
}

impl Server {
    /// SIGKILL (`Child::kill` sends SIGKILL on Unix) and reap.
    fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What the supervisor did.
#[derive(Default, Debug)]
struct Kills {
    per_point: BTreeMap<String, u64>,
    restarts: u64,
}

/// Restarts the child until `stop`, arming one crash point per run (a shuffled round
/// robin over all points) while fewer than `target` kills were made; SIGKILLs it as soon
/// as it reports reaching the point.
fn supervise(launch: &Launch, target: u64, kills: &AtomicU64, stop: &AtomicBool, log: &Mutex<Kills>) {
    let mut order: Vec<&str> = Vec::new();
    loop {
        let arm = if kills.load(Ordering::SeqCst) < target {
            if order.is_empty() {
                order = POINTS.to_vec();
                order.shuffle(&mut rand::rng());
            }
            order.pop()
        } else {
            None
        };
        let server = launch.spawn(arm);
        log.lock().unwrap().restarts += 1;
        loop {
            match server.lines.recv_timeout(Duration::from_millis(20)) {
                Ok(line) => {
                    if let Some(point) = line.strip_prefix("CRASHPOINT ") {
                        server.kill();
                        kills.fetch_add(1, Ordering::SeqCst);
                        *log.lock().unwrap().per_point.entry(point.to_string()).or_default() += 1;
                        break;
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    if stop.load(Ordering::SeqCst) {
                        server.kill();
                        return;
                    }
                }
                Err(RecvTimeoutError::Disconnected) => {
                    panic!("{}: the server died on its own; log:\n{}", launch.store, launch.log_tail())
                }
            }
        }
    }
}

/// One logical operation: its key, request body, principal and the final reply.
struct Op {
    key: OperationKey,
    token: String,
    body: String,
    status: u16,
    reply: Vec<u8>,
}

fn free_addr() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

async fn get_json<T: serde::de::DeserializeOwned>(http: &reqwest::Client, url: String) -> T {
    http.get(url).send().await.unwrap().json().await.unwrap()
}

/// Everything the simulated infrastructure holds, for the leak check: every node, lease
/// and VM should belong to exactly one worker.
#[derive(Debug, Default)]
struct Inventory {
    /// Allocated nodes: (allocation sub-key, node).
    nodes: Vec<(String, String)>,
    /// Leases: (lease sub-key, lease, node).
    leases: Vec<(String, String, String)>,
    /// Booted VMs: (VM, tag, node).
    vms: Vec<(String, String, String)>,
    /// Every worker row, deleted ones included.
    workers: Vec<Worker>,
}

/// Reads the inventory from the infra state file of a server that is no longer running.
fn inventory(state: &Path) -> Inventory {
    let db = redb::Database::create(state).unwrap();
    let tx = db.begin_read().unwrap();
    let mut inv = Inventory::default();
    for e in tx.open_table(NODES).unwrap().iter().unwrap() {
        let (k, v) = e.unwrap();
        inv.nodes.push((k.value().to_string(), v.value().to_string()));
    }
    for e in tx.open_table(LEASES).unwrap().iter().unwrap() {
        let (k, v) = e.unwrap();
        let (lease, node) = v.value().split_once(' ').unwrap_or((v.value(), ""));
        inv.leases.push((k.value().to_string(), lease.to_string(), node.to_string()));
    }
    for e in tx.open_table(VMS).unwrap().iter().unwrap() {
        let (k, v) = e.unwrap();
        let (tag, node) = v.value().split_once(' ').unwrap_or((v.value(), ""));
        inv.vms.push((k.value().to_string(), tag.to_string(), node.to_string()));
    }
    for e in tx.open_table(WORKERS).unwrap().iter().unwrap() {
        let (_, v) = e.unwrap();
        inv.workers.push(serde_json::from_slice(v.value()).unwrap());
    }
    inv
}

fn body(op: u64) -> String {
    format!(r#"{{"image":"worker-base:2025.11","cpu":4,"memory_gb":16,"labels":{{"op":"{op}"}}}}"#)
}

/// Runs the crash loop on `store` and checks the end state.
fn crash_run(backend: &str, store: &str, dir: &Path) {
    let target = env_usize("IDEM_CRASH_KILLS", 100) as u64;
    let clients = env_usize("IDEM_CRASH_CLIENTS", 8);
    let addr = free_addr();
    let base = format!("http://{addr}");
    let launch =
        Launch { addr, store: store.to_string(), state: dir.join("state.redb"), log: dir.join("leasebroker.log") };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let http = reqwest::Client::new();
    let prefix = uuid::Uuid::new_v4().simple().to_string();
    let started = Instant::now();

    // Probe: a store without the step journal cannot run resumable handlers at all.
    let probe = launch.spawn(None);
    let (status, text) = rt.block_on(async {
        let r = http
            .post(format!("{base}/v1/workers"))
            .bearer_auth(format!("{prefix}-probe"))
            .header("idempotency-key", "probe")
            .header("content-type", "application/json")
            .body(body(0))
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    });
    probe.kill();
    assert!(
        !text.contains("journal-unsupported"),
        "{backend}: the store has no step journal yet (journal_put/journal_get return Unsupported), so resumable \
         handlers answer 500 journal-unsupported and the crash test cannot run: {text}"
    );
    assert_eq!(status, 201, "{backend}: probe create: {text}");

    let kills = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let log = Arc::new(Mutex::new(Kills::default()));
    let supervisor = {
        let (launch, kills, stop, log) = (launch.clone(), Arc::clone(&kills), Arc::clone(&stop), Arc::clone(&log));
        std::thread::spawn(move || supervise(&launch, target, &kills, &stop, &log))
    };

    // The client keeps retrying for as long as the run can take: it checks what retries
    // converge on, not how fast. On a loaded machine (CI's two cores shared by every crash
    // run at once) a server restarted a hundred times was down for long stretches, and one
    // operation ran out of a 120 s budget while the run itself was sound.
    let policy = RetryPolicy::default()
        .with_budget(Duration::from_secs(600))
        .with_max_attempts(100_000)
        .with_backoff(Duration::from_millis(20), Duration::from_millis(300))
        .with_attempt_timeout(Duration::from_secs(10));
    let client = Arc::new(IdempotentClient::new(http.clone(), policy));
    let next_op = Arc::new(AtomicU64::new(1));
    let ops: Vec<Op> = rt.block_on(async {
        let mut tasks = Vec::new();
        for c in 0..clients {
            let (client, kills, next_op) = (Arc::clone(&client), Arc::clone(&kills), Arc::clone(&next_op));
            let (url, token) = (format!("{base}/v1/workers"), format!("{prefix}-{}", c % 3));
            tasks.push(tokio::spawn(async move {
                let mut done = Vec::new();
                while kills.load(Ordering::SeqCst) < target {
                    let n = next_op.fetch_add(1, Ordering::SeqCst);
                    let (key, body) = (OperationKey::generate(), body(n));
                    let reply = client
                        .request(reqwest::Method::POST, url.clone(), &key)
                        .header("authorization", &format!("Bearer {token}"))
                        .json_body(body.clone())
                        .send()
                        .await;
                    let reply = reply.unwrap_or_else(|e| panic!("operation {n} ({key:?}): {e}"));
                    done.push(Op {
                        key,
                        token: token.clone(),
                        body,
                        status: reply.status.as_u16(),
                        reply: reply.body.to_vec(),
                    });
                }
                done
            }));
        }
        let mut ops = Vec::new();
        for t in tasks {
            ops.extend(t.await.unwrap());
        }
        ops
    });
    stop.store(true, Ordering::SeqCst);
    supervisor.join().unwrap();
    let crash_phase = started.elapsed();

    // End state, on a clean restart of the same store; the inventory from its state file
    // once it is stopped.
    let server = launch.spawn(None);
    let (stats, replays) = rt.block_on(async {
        let stats: Stats = get_json(&http, format!("{base}/admin/stats")).await;
        let mut replays = Vec::new();
        for op in &ops {
            let r = http
                .post(format!("{base}/v1/workers"))
                .bearer_auth(&op.token)
                .header("idempotency-key", op.key.as_str())
                .header("content-type", "application/json")
                .body(op.body.clone())
                .send()
                .await
                .unwrap();
            let replayed = r.headers().get("idempotent-replayed").is_some_and(|v| v == "true");
            replays.push((r.status().as_u16(), replayed, r.bytes().await.unwrap().to_vec()));
        }
        (stats, replays)
    });
    server.kill();
    let inventory = inventory(&launch.state);
    let kills_log = log.lock().unwrap();
    let n = ops.len() as u64 + 1; // + the probe
    println!(
        "{backend}: {} kills ({:?}), {} restarts, {} operations, crash phase {:.1} s, total {:.1} s",
        kills.load(Ordering::SeqCst),
        kills_log.per_point,
        kills_log.restarts,
        n,
        crash_phase.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    println!("{backend}: stats {stats:?}");

    assert!(kills.load(Ordering::SeqCst) >= target, "{backend}: kills");
    if target >= 4 * POINTS.len() as u64 {
        for p in POINTS {
            assert!(kills_log.per_point.get(p).copied().unwrap_or(0) > 0, "{backend}: no kill at {p}");
        }
    }
    let mut ids = HashSet::new();
    for (op, (status, replayed, bytes)) in ops.iter().zip(&replays) {
        assert_eq!(op.status, 201, "{backend}: {}", String::from_utf8_lossy(&op.reply));
        assert_eq!((*status, *replayed), (201, true), "{backend}: replay of {:?}", op.key);
        assert_eq!(bytes, &op.reply, "{backend}: the replay differs from the reply the client got");
        let w: Worker = serde_json::from_slice(&op.reply).unwrap();
        assert!(ids.insert(w.id.clone()), "{backend}: two operations got worker {}", w.id);
    }
    // One of everything per logical operation.
    assert_eq!(
        (stats.workers, stats.allocations, stats.leases, stats.boots),
        (n, n, n, n),
        "{backend}: workers, allocations, leases, boots"
    );
    // Nothing leaked: every node, lease and VM belongs to exactly one worker.
    let inv = &inventory;
    let k = ops.len() + 1;
    assert_eq!(
        (inv.nodes.len(), inv.leases.len(), inv.vms.len(), inv.workers.len()),
        (k, k, k, k),
        "{backend}: inventory"
    );
    let owned = |f: fn(&Worker) -> &str| inv.workers.iter().map(|w| f(w).to_string()).collect::<HashSet<_>>();
    assert_eq!(owned(|w| &w.node), inv.nodes.iter().map(|(_, n)| n.clone()).collect(), "{backend}: nodes");
    assert_eq!(owned(|w| &w.lease), inv.leases.iter().map(|(_, l, _)| l.clone()).collect(), "{backend}: leases");
    assert_eq!(owned(|w| &w.vm), inv.vms.iter().map(|(v, _, _)| v.clone()).collect(), "{backend}: VMs");
    assert_eq!(inv.vms.iter().map(|(_, tag, _)| tag).collect::<HashSet<_>>().len(), inv.vms.len(), "{backend}: tags");
    for w in &inv.workers {
        let vm = inv.vms.iter().find(|(v, _, _)| *v == w.vm).unwrap();
        assert_eq!(vm.2, w.node, "{backend}: {} booted on another node than its worker's", w.vm);
    }
}

#[test]
fn sigkill_inside_create_on_redb() {
    let dir = tempfile::tempdir().unwrap();
    crash_run("redb", &format!("redb:{}", dir.path().join("lb.redb").display()), dir.path());
}

#[test]
fn sigkill_inside_create_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    crash_run("sqlite", &format!("sqlite:{}", dir.path().join("lb.sqlite").display()), dir.path());
}

#[cfg(feature = "live-tests")]
#[test]
fn sigkill_inside_create_on_redis() {
    // The real Redis on loopback (scripts/services starts it); fresh keys and principals per run.
    let dir = tempfile::tempdir().unwrap();
    let url = std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    crash_run("redis", &url, dir.path());
}

#[cfg(feature = "live-tests")]
#[test]
fn sigkill_inside_create_on_postgres() {
    // The real PostgreSQL on loopback (scripts/services starts it); fresh keys and principals per run.
    let dir = tempfile::tempdir().unwrap();
    let url = std::env::var("IDEM_POSTGRES_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    crash_run("postgres", &url, dir.path());
}

#[test]
fn crash_plans_arm_named_points_and_refuse_unknown_ones() {
    let p = CrashPlan::parse_in(&POINTS, "after_lease, after_boot", 1.0, false).unwrap();
    assert!(p.is_armed());
    assert_eq!(p.armed().collect::<Vec<_>>(), ["after_lease", "after_boot"]);
    assert_eq!(CrashPlan::parse_in(&POINTS, "any", 0.5, true).unwrap().armed().collect::<Vec<_>>(), POINTS);
    assert!(!CrashPlan::parse_in(&POINTS, "", 1.0, false).unwrap().is_armed());
    assert!(!CrashPlan::parse_in(&POINTS, "any", 0.0, false).unwrap().is_armed());
    assert!(CrashPlan::parse_in(&POINTS, "after_lunch", 1.0, false).unwrap_err().contains("after_lunch"));
    // The SQL variant's points (`leasebroker-sql --crash-at`).
    let tx = CrashPlan::parse("tx_after_commit", 1.0, false).unwrap();
    assert_eq!(tx.armed().collect::<Vec<_>>(), ["tx_after_commit"]);
    assert!(CrashPlan::parse("after_lease", 1.0, false).is_err());
}

#[tokio::test]
async fn an_unarmed_point_returns() {
    let p = CrashPlan::parse_in(&POINTS, "after_lease", 1.0, false).unwrap();
    p.point("before_allocate").await;
    p.point("not_a_point").await;
}
