//! A process killed (SIGKILL) in the middle of group commits loses no claim it had
//! acknowledged, and leaves a file the next process opens cleanly: outcomes are sent only
//! after their batch committed, so "claimed" always means "on disk".
//!
//! The test binary re-executes itself: with `IDEM_SQLITE_KILL_DB` set it is a child that
//! claims fresh keys from several callers as fast as it can and prints `acked kN` after each
//! claim returns. The parent kills it mid-stream, then checks that every acknowledged key
//! has its in-flight record, with token 1, in the file.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use idem_core::{ClaimOutcome, ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, RecordState, Scope, Store};
use idem_sqlite::{Config, SqliteStore};

const CHILD_ENV: &str = "IDEM_SQLITE_KILL_DB";
/// Acknowledgements the parent waits for before it kills the child.
const KILL_AFTER: usize = 300;
/// Concurrent callers in the child, so batches hold several claims.
const CALLERS: usize = 16;

fn request(i: usize) -> ClaimRequest {
    let scope = Scope::new("killed", Endpoint::new("POST", "/kill")).expect("scope");
    let key = IdempotencyKey::parse(format!("k{i}").as_bytes()).expect("key");
    ClaimRequest::new(scope, key, Fingerprint::of_bytes(b"body"), Duration::from_secs(300), Duration::from_secs(3600))
}

fn main() {
    match std::env::var(CHILD_ENV) {
        Ok(path) => child(&path),
        Err(_) => parent(),
    }
}

fn child(path: &str) {
    let store = Arc::new(SqliteStore::open(path, Config::default()).expect("child opens the store"));
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let out = Arc::new(std::sync::Mutex::new(std::io::stdout()));
    runtime.block_on(async {
        let tasks: Vec<_> = (0..CALLERS)
            .map(|caller| {
                let (store, out) = (Arc::clone(&store), Arc::clone(&out));
                tokio::spawn(async move {
                    // Runs until the parent kills the process.
                    for i in (caller..).step_by(CALLERS) {
                        let outcome = store.claim(request(i)).await.expect("claim");
                        assert!(matches!(outcome, ClaimOutcome::Claimed(_)), "fresh key k{i} was not claimed");
                        let mut out = out.lock().expect("stdout");
                        writeln!(out, "acked k{i}").and_then(|()| out.flush()).expect("stdout");
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.expect("caller");
        }
    });
}

fn parent() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("killed.sqlite3");
    let mut child = Command::new(std::env::current_exe().expect("test binary path"))
        .env(CHILD_ENV, &path)
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn child");
    let mut lines = BufReader::new(child.stdout.take().expect("child stdout")).lines();
    let mut acked = Vec::new();
    while acked.len() < KILL_AFTER {
        let line = lines.next().expect("the child stopped early").expect("child output");
        acked.push(line);
    }
    child.kill().expect("SIGKILL the child");
    child.wait().expect("reap the child");
    // Lines written before the kill were acknowledged too.
    acked.extend(lines.map_while(Result::ok));

    let store = SqliteStore::open(&path, Config::default()).expect("the file opens after the kill");
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    runtime.block_on(async {
        for line in &acked {
            let i: usize = line.strip_prefix("acked k").and_then(|n| n.parse().ok()).expect("an ack line");
            let record = store.get(request(i).id).await.expect("get").unwrap_or_else(|| panic!("acked k{i} was lost"));
            assert_eq!((record.state, record.token.0), (RecordState::InFlight, 1), "k{i}");
        }
    });
    println!("killed_process: {} acknowledged claims all survived SIGKILL", acked.len());
}
