//! Claim + complete throughput of `SqliteStore` (one writer thread, group commit) against
//! a naive baseline that commits each statement on its own, at 1 and 32 concurrent
//! callers, both with WAL and `synchronous = FULL` on the same schema.
//!
//! One operation = claim a fresh idempotency key, then complete it with a ~200-byte
//! response: what every first request costs the store. Run with
//! `cargo bench -p idem-sqlite --bench group_commit`; `IDEM_BENCH_SECS` sets the length
//! of each measurement (default 3 s), `IDEM_BENCH_DIR` where the files go (default the
//! system temp dir; use a real disk, fsync on tmpfs is free).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem_core::{ClaimOutcome, ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, Scope, Store, StoredResponse};
use idem_sqlite::{Config, SqliteStore};
use rusqlite::{Connection, ErrorCode, params};

const CALLERS: [usize; 2] = [1, 32];

fn request(caller: usize, i: u64) -> ClaimRequest {
    let scope = Scope::new(format!("bench-{caller}"), Endpoint::new("POST", "/v1/workers")).expect("scope");
    let key = IdempotencyKey::parse(format!("key-{caller}-{i}").as_bytes()).expect("key");
    ClaimRequest::new(scope, key, Fingerprint::of_bytes(b"{}"), Duration::from_secs(300), Duration::from_secs(86_400))
}

fn response() -> StoredResponse {
    StoredResponse::new(
        201,
        vec![("content-type".into(), b"application/json".to_vec()), ("location".into(), b"/v1/workers/42".to_vec())],
        vec![b'x'; 160],
    )
}

fn temp_dir() -> tempfile::TempDir {
    match std::env::var_os("IDEM_BENCH_DIR") {
        Some(dir) => tempfile::tempdir_in(dir),
        None => tempfile::tempdir(),
    }
    .expect("bench dir")
}

/// Library: `callers` tasks, each claim + complete in a loop.
fn library(callers: usize, run: Duration) -> f64 {
    let dir = temp_dir();
    let store = Arc::new(SqliteStore::open(dir.path().join("lib.sqlite3"), Config::default()).expect("open"));
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    runtime.block_on(async {
        let tasks: Vec<_> = (0..callers)
            .map(|caller| {
                let (store, done, stop) = (Arc::clone(&store), Arc::clone(&done), Arc::clone(&stop));
                tokio::spawn(async move {
                    let mut i = 0;
                    while !stop.load(Ordering::Relaxed) {
                        let ClaimOutcome::Claimed(r) = store.claim(request(caller, i)).await.expect("claim") else {
                            panic!("fresh key was not claimed");
                        };
                        store.complete(r.id, r.token, response()).await.expect("complete");
                        done.fetch_add(1, Ordering::Relaxed);
                        i += 1;
                    }
                })
            })
            .collect();
        tokio::time::sleep(run).await;
        stop.store(true, Ordering::Relaxed);
        for t in tasks {
            t.await.expect("caller");
        }
    });
    done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64()
}

/// Retries a statement that hit `SQLITE_BUSY` (a WAL snapshot that went stale between the
/// statement's read and its write is reported busy without calling the busy handler).
fn with_retry<T>(busy: &AtomicU64, mut f: impl FnMut() -> rusqlite::Result<T>) -> T {
    loop {
        match f() {
            Err(e) if e.sqlite_error_code() == Some(ErrorCode::DatabaseBusy) => {
                busy.fetch_add(1, Ordering::Relaxed);
            }
            other => return other.expect("naive statement"),
        }
    }
}

/// Baseline: `callers` threads with their own connection; the claim is one autocommit
/// `INSERT ... ON CONFLICT DO NOTHING`, the completion one autocommit `UPDATE ... WHERE
/// token = ?`, so every statement is its own transaction and its own fsync.
fn naive(callers: usize, run: Duration) -> (f64, u64) {
    let dir = temp_dir();
    let path = dir.path().join("naive.sqlite3");
    // Same file format, schema and pragmas: open (WAL, migrations) with the library once.
    drop(SqliteStore::open(&path, Config::default()).expect("create schema"));
    let done = Arc::new(AtomicU64::new(0));
    let busy = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let encoded = idem_core::codec::encode_response(&response());
    let started = Instant::now();
    std::thread::scope(|s| {
        for caller in 0..callers {
            let (path, done, busy, stop, encoded) = (&path, &done, &busy, &stop, &encoded);
            s.spawn(move || {
                let conn = Connection::open(path).expect("open");
                conn.busy_timeout(Duration::from_secs(30)).expect("busy timeout");
                conn.pragma_update(None, "synchronous", "FULL").expect("synchronous");
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) {
                    let req = request(caller, i);
                    let now = i64::try_from(
                        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_millis(),
                    )
                    .expect("ms");
                    let inserted = with_retry(busy, || {
                        conn.prepare_cached(
                            "INSERT INTO idem_records (id, principal, endpoint, key, fingerprint, state, token, \
                             created_at, started_at, lease_expires_at, expires_at, response) \
                             VALUES (?1, ?2, ?3, ?4, ?5, 'in_flight', 1, ?6, ?6, ?7, ?8, NULL) \
                             ON CONFLICT (id) DO NOTHING",
                        )?
                        .execute(params![
                            &req.id().as_bytes()[..],
                            req.scope().clone().principal.as_str(),
                            req.scope().clone().endpoint.as_str(),
                            req.key().clone().as_str(),
                            &req.fingerprint().as_bytes()[..],
                            now,
                            now + req.lease_ms(),
                            now + req.retention_ms(),
                        ])
                    });
                    assert_eq!(inserted, 1, "fresh key was not claimed");
                    let completed = with_retry(busy, || {
                        conn.prepare_cached(
                            "UPDATE idem_records SET state = 'completed', response = ?2 \
                             WHERE id = ?1 AND token = 1 AND state = 'in_flight'",
                        )?
                        .execute(params![&req.id().as_bytes()[..], encoded])
                    });
                    assert_eq!(completed, 1, "completion lost its lease");
                    done.fetch_add(1, Ordering::Relaxed);
                    i += 1;
                }
            });
        }
        std::thread::sleep(run);
        stop.store(true, Ordering::Relaxed);
    });
    (done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64(), busy.load(Ordering::Relaxed))
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` runs this too, briefly.
    let quick = std::env::args().any(|a| a == "--test") || !std::env::args().any(|a| a == "--bench");
    let secs: f64 = std::env::var("IDEM_BENCH_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(3.0);
    let run = if quick { Duration::from_millis(200) } else { Duration::from_secs_f64(secs) };
    println!("claim+complete throughput, WAL, synchronous=FULL, {:.1} s per measurement", run.as_secs_f64());
    println!("{:>8} {:>16} {:>16} {:>8} {:>12}", "callers", "library ops/s", "naive ops/s", "ratio", "naive busy");
    for callers in CALLERS {
        let lib = library(callers, run);
        let (base, busy) = naive(callers, run);
        println!("{callers:>8} {lib:>16.0} {base:>16.0} {:>7.1}x {busy:>12}", lib / base);
    }
}
