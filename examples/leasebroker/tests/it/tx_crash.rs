//! SIGKILL inside and right after the handler's own transaction: `leasebroker-sql` runs as
//! a child process and is killed at the transaction's crash points
//! (`leasebroker::crash::TX_POINTS`: after the worker row's insert, before the commit,
//! right after the commit, after the response) and restarted on the same database, while
//! clients retry each logical operation with its one key until it gets a 201. On
//! PostgreSQL and on MariaDB (the servers `scripts/services` starts).
//!
//! - Transactional completion (the store's `complete_in`): every operation ends with
//!   exactly one worker row and one stored response, the 201's worker id is that row, and
//!   a later replay is byte-identical.
//! - Separate completion (the handler commits, then the layer completes): the same run,
//!   killed right after the handler's commit, leaves operations with two worker rows. That
//!   half proves the first can fail: it is the double execution transactional completion
//!   removes.
//!
//! `IDEM_TX_CRASH_KILLS` sets the kills of each transactional run (default 100); the
//! separate runs make 10.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use leasebroker::crash::TX_POINTS;
use leasebroker::sqlworkers;
use rand::seq::SliceRandom;

/// In-flight lease of the child, ms: a retry after a kill reclaims soon.
const LEASE_MS: &str = "300";
/// Logical operations in flight at once.
const CLIENTS: usize = 6;

fn postgres_url() -> String {
    std::env::var("IDEM_POSTGRES_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

fn mysql_url() -> String {
    std::env::var("IDEM_MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned())
}

fn free_addr() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").to_string()
}

struct Server {
    child: Child,
    lines: Receiver<String>,
}

impl Server {
    fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Launch {
    addr: String,
    url: String,
    namespace: String,
    completion: &'static str,
}

impl Launch {
    fn spawn(&self, crash_at: Option<&str>) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_leasebroker-sql"))
            .args(["--addr", &self.addr, "--database", &self.url, "--namespace", &self.namespace])
            .args(["--completion", self.completion, "--lease-ms", LEASE_MS, "--crash-at", crash_at.unwrap_or("")])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn leasebroker-sql");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let server = Server { child, lines };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match server.lines.recv_timeout(Duration::from_millis(100)) {
                Ok(l) if l.starts_with("LISTENING ") => return server,
                Err(RecvTimeoutError::Disconnected) => {
                    panic!("leasebroker-sql exited before listening (is {} up? scripts/services)", self.url)
                }
                _ => assert!(Instant::now() < deadline, "leasebroker-sql did not listen within 20 s"),
            }
        }
    }
}

/// Restarts the child until `stop`, arming one of `points` per run while fewer than
/// `target` kills were made; SIGKILLs it as soon as it reports reaching the point.
fn supervise(
    launch: &Launch,
    points: &[&'static str],
    target: u64,
    kills: &AtomicU64,
    stop: &AtomicBool,
    per_point: &Mutex<BTreeMap<String, u64>>,
) {
    let mut order: Vec<&str> = Vec::new();
    loop {
        let arm = if kills.load(Ordering::SeqCst) < target {
            if order.is_empty() {
                order = points.to_vec();
                order.shuffle(&mut rand::rng());
            }
            order.pop()
        } else {
            None
        };
        let server = launch.spawn(arm);
        loop {
            match server.lines.recv_timeout(Duration::from_millis(20)) {
                Ok(line) => {
                    if let Some(point) = line.strip_prefix("CRASHPOINT ") {
                        server.kill();
                        kills.fetch_add(1, Ordering::SeqCst);
                        *per_point
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .entry(point.to_owned())
                            .or_default() += 1;
                        break;
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    if stop.load(Ordering::SeqCst) {
                        server.kill();
                        return;
                    }
                }
                Err(RecvTimeoutError::Disconnected) => panic!("leasebroker-sql died on its own"),
            }
        }
    }
}

/// Sends the operation `key` until it gets a 201; returns the body.
async fn run_op(http: &reqwest::Client, base: &str, key: &str, deadline: Instant) -> Vec<u8> {
    loop {
        assert!(Instant::now() < deadline, "operation {key} never got a 201");
        let sent = http
            .post(format!("{base}/v1/sql/workers"))
            .header("authorization", "Bearer crash-test")
            .header("idempotency-key", key)
            .send()
            .await;
        if let Ok(res) = sent {
            let status = res.status().as_u16();
            if let Ok(body) = res.bytes().await {
                if status == 201 {
                    return body.to_vec();
                }
                // 409 in flight (the killed attempt's lease), 503 while the store restarts.
                assert!(matches!(status, 409 | 503), "operation {key}: unexpected {status}: {body:?}");
            }
        }
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
}

/// The outcome of one run: per operation, its first 201 body and its worker rows.
struct Outcome {
    kills: BTreeMap<String, u64>,
    ops: Vec<(String, Vec<u8>)>,
    rows: BTreeMap<String, Vec<i64>>,
    replays: Vec<(String, u16, bool, Vec<u8>)>,
}

/// The worker rows, per operation, and the run's tables dropped.
async fn rows_then_drop(url: &str, namespace: &str) -> Vec<(String, i64)> {
    let table = sqlworkers::table(url, namespace);
    let select = format!("SELECT op, id FROM {table} ORDER BY id");
    if sqlworkers::is_mysql(url) {
        use idem_mysql::sqlx;
        let pool = sqlx::MySqlPool::connect(url).await.expect("connect");
        let found = sqlx::query_as(&select).fetch_all(&pool).await.expect("worker rows");
        let tables = ["workers", "journal", "records", "schema_migrations"].map(|t| format!("`{namespace}_{t}`"));
        sqlx::raw_sql(&format!("DROP TABLE {}", tables.join(", "))).execute(&pool).await.expect("drop tables");
        found
    } else {
        use idem_postgres::sqlx;
        let pool = sqlx::PgPool::connect(url).await.expect("connect");
        let found = sqlx::query_as(&select).fetch_all(&pool).await.expect("worker rows");
        sqlx::raw_sql(&format!("DROP SCHEMA \"{namespace}\" CASCADE")).execute(&pool).await.expect("drop schema");
        found
    }
}

fn crash_run(url: String, completion: &'static str, points: &[&'static str], target: u64) -> Outcome {
    let namespace = format!("idem_test_txcrash_{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let launch = Arc::new(Launch { addr: free_addr(), url, namespace, completion });
    let kills = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let per_point = Arc::new(Mutex::new(BTreeMap::new()));
    let supervisor = {
        let (launch, kills, stop, per_point) =
            (Arc::clone(&launch), Arc::clone(&kills), Arc::clone(&stop), Arc::clone(&per_point));
        let points = points.to_vec();
        std::thread::spawn(move || supervise(&launch, &points, target, &kills, &stop, &per_point))
    };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let base = format!("http://{}", launch.addr);
    let outcome = rt.block_on(async {
        let http = reqwest::Client::builder().timeout(Duration::from_secs(3)).build().expect("client");
        let deadline = Instant::now() + Duration::from_secs(600);
        let mut clients = Vec::new();
        for c in 0..CLIENTS {
            let (http, base, kills) = (http.clone(), base.clone(), Arc::clone(&kills));
            clients.push(tokio::spawn(async move {
                let mut done = Vec::new();
                // Operations until the kills are made, then two more each with no crash.
                let mut after = 0;
                while after < 2 {
                    if kills.load(Ordering::SeqCst) >= target {
                        after += 1;
                    }
                    let key = format!("op-{c}-{}", uuid::Uuid::new_v4().simple());
                    let body = run_op(&http, &base, &key, deadline).await;
                    done.push((key, body));
                }
                done
            }));
        }
        let mut ops = Vec::new();
        for c in clients {
            ops.extend(c.await.expect("client"));
        }
        // Every operation once more: the stored response, replayed.
        let mut replays = Vec::new();
        for (key, _) in &ops {
            let res = http
                .post(format!("{base}/v1/sql/workers"))
                .header("authorization", "Bearer crash-test")
                .header("idempotency-key", key.as_str())
                .send()
                .await
                .expect("replay");
            let replayed = res.headers().get("idempotent-replayed").is_some_and(|v| v == "true");
            let status = res.status().as_u16();
            replays.push((key.clone(), status, replayed, res.bytes().await.expect("body").to_vec()));
        }
        stop.store(true, Ordering::SeqCst);
        let mut rows: BTreeMap<String, Vec<i64>> = BTreeMap::new();
        for (op, id) in rows_then_drop(&launch.url, &launch.namespace).await {
            rows.entry(op).or_default().push(id);
        }
        (ops, rows, replays)
    });
    supervisor.join().expect("supervisor");
    let kills = per_point.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
    let (ops, rows, replays) = outcome;
    Outcome { kills, ops, rows, replays }
}

fn id_of(body: &[u8]) -> i64 {
    let v: serde_json::Value = serde_json::from_slice(body).expect("json body");
    v["id"].as_i64().expect("id")
}

fn transactional_completion_leaves_one_row_and_one_response(url: String) {
    let target = std::env::var("IDEM_TX_CRASH_KILLS").ok().and_then(|v| v.parse().ok()).unwrap_or(100);
    let out = crash_run(url, "transactional", &TX_POINTS, target);
    let total: u64 = out.kills.values().sum();
    eprintln!("transactional: {total} kills {:?}, {} operations", out.kills, out.ops.len());
    assert!(total >= target, "only {total} kills");
    for p in TX_POINTS {
        assert!(out.kills.get(p).copied().unwrap_or(0) > 0, "point {p} was never killed at: {:?}", out.kills);
    }
    for (key, body) in &out.ops {
        let rows = out.rows.get(key).cloned().unwrap_or_default();
        assert_eq!(rows, vec![id_of(body)], "operation {key}: worker rows {rows:?}, reply {body:?}");
    }
    assert_eq!(out.rows.len(), out.ops.len(), "worker rows of operations no client made");
    let first: BTreeMap<_, _> = out.ops.iter().cloned().collect();
    for (key, status, replayed, body) in &out.replays {
        assert_eq!((*status, *replayed), (201, true), "operation {key}: not a replay");
        assert_eq!(body, &first[key], "operation {key}: the replay differs from the first reply");
    }
}

fn separate_completion_runs_the_handler_twice(url: String) {
    let out = crash_run(url, "separate", &["tx_after_commit"], 10);
    let doubled: Vec<_> = out.rows.iter().filter(|(_, ids)| ids.len() > 1).collect();
    eprintln!(
        "separate: kills {:?}, {} operations, {} with two or more worker rows",
        out.kills,
        out.ops.len(),
        doubled.len()
    );
    assert!(
        !doubled.is_empty(),
        "a kill between the handler's commit and the layer's completion must leave the row and an in-flight record; \
         the retry then inserts a second row"
    );
}

#[test]
fn sigkill_around_transactional_completion_leaves_one_row_and_one_response_on_postgres() {
    transactional_completion_leaves_one_row_and_one_response(postgres_url());
}

#[test]
fn sigkill_after_the_commit_with_separate_completion_runs_the_handler_twice_on_postgres() {
    separate_completion_runs_the_handler_twice(postgres_url());
}

#[test]
fn sigkill_around_transactional_completion_leaves_one_row_and_one_response_on_mysql() {
    transactional_completion_leaves_one_row_and_one_response(mysql_url());
}

#[test]
fn sigkill_after_the_commit_with_separate_completion_runs_the_handler_twice_on_mysql() {
    separate_completion_runs_the_handler_twice(mysql_url());
}
