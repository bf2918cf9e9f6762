//! Several processes sharing one SQLite file race to claim the same idempotency keys:
//! every key must be claimed exactly once overall (the `Store::claim` contract: of N
//! concurrent claims of one id, exactly one gets `Claimed`, across processes too).
//!
//! The test binary re-executes itself: with `IDEM_SQLITE_CHILD_DB` set it is a child that
//! opens the store, says `ready`, waits for `go` on stdin, claims every key at once and
//! prints one line per key (`won k17 <token> <created_at>` or `lost k17`). The parent starts the children on a
//! fresh file (so they also race through creating the file and running the migrations),
//! releases them together, and checks the union of their reports and the file itself.
//! Starting the children together also pins a second failure: processes opening one fresh
//! file at once got `SQLITE_BUSY` from the switch to WAL, which bypasses the busy handler.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use idem_core::{
    ClaimOutcome, ClaimRequest, Endpoint, FencingToken, Fingerprint, IdempotencyKey, RecordState, Scope, Store,
    UnixMillis,
};
use idem_sqlite::{Config, SqliteStore};

const CHILDREN: usize = 4;
const KEYS: usize = 400;
/// Concurrent callers per child.
const CALLERS: usize = 8;
const CHILD_ENV: &str = "IDEM_SQLITE_CHILD_DB";
const INDEX_ENV: &str = "IDEM_SQLITE_CHILD_INDEX";

fn request(i: usize) -> ClaimRequest {
    let scope = Scope::new("race", Endpoint::new("POST", "/race")).expect("scope");
    let key = IdempotencyKey::parse(format!("k{i}").as_bytes()).expect("key");
    ClaimRequest::new(
        scope,
        key,
        Fingerprint::of_bytes(b"same body"),
        Duration::from_secs(300),
        Duration::from_secs(3600),
    )
}

fn main() {
    match std::env::var(CHILD_ENV) {
        Ok(path) => child(&path),
        Err(_) => parent(),
    }
}

fn child(path: &str) {
    let index: usize = std::env::var(INDEX_ENV).ok().and_then(|v| v.parse().ok()).expect("child index");
    let store = Arc::new(
        SqliteStore::open(path, Config::default().with_max_batch(4).with_durable_claims(true))
            .expect("child opens the store"),
    );
    let mut out = std::io::stdout().lock();
    writeln!(out, "ready").expect("stdout");
    out.flush().expect("stdout");
    let mut go = String::new();
    std::io::stdin().read_line(&mut go).expect("stdin");
    assert_eq!(go.trim(), "go");

    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let results = runtime.block_on(async {
        // Each child walks the keys from a different offset with a few callers at a time,
        // and small batches, so the processes take the write lock in turn many times and
        // collide on keys in the middle of each other's work.
        let order: Vec<usize> = (0..KEYS).map(|n| (n + index * KEYS / CHILDREN) % KEYS).collect();
        let tasks: Vec<_> = (0..CALLERS)
            .map(|caller| {
                let store = Arc::clone(&store);
                let mine: Vec<usize> = order.iter().copied().skip(caller).step_by(CALLERS).collect();
                tokio::spawn(async move {
                    let mut out = Vec::with_capacity(mine.len());
                    for i in mine {
                        out.push((i, store.claim(request(i)).await));
                    }
                    out
                })
            })
            .collect();
        let mut results = Vec::with_capacity(KEYS);
        for t in tasks {
            results.extend(t.await.expect("claim task"));
        }
        results
    });
    for (i, outcome) in results {
        match outcome {
            Ok(ClaimOutcome::Claimed(r)) => writeln!(out, "won k{i} {} {}", r.token, r.created_at.0),
            Ok(ClaimOutcome::Existing { .. }) => writeln!(out, "lost k{i}"),
            Err(e) => writeln!(out, "error k{i} {e}"),
        }
        .expect("stdout");
    }
}

fn parent() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("shared.sqlite3");
    let exe = std::env::current_exe().expect("test binary path");
    let mut children: Vec<_> = (0..CHILDREN)
        .map(|index| {
            Command::new(&exe)
                .env(CHILD_ENV, &path)
                .env(INDEX_ENV, index.to_string())
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .expect("spawn child")
        })
        .collect();
    let mut readers: Vec<_> =
        children.iter_mut().map(|c| BufReader::new(c.stdout.take().expect("child stdout"))).collect();
    for r in &mut readers {
        let mut line = String::new();
        r.read_line(&mut line).expect("read ready");
        assert_eq!(line.trim(), "ready", "a child failed to open the store");
    }
    for c in &mut children {
        writeln!(c.stdin.as_mut().expect("child stdin"), "go").expect("release child");
    }

    let mut winners: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for (index, (child, reader)) in children.iter_mut().zip(readers).enumerate() {
        let mut lines = 0;
        for line in reader.lines() {
            let line = line.expect("child output");
            lines += 1;
            let mut words = line.split_whitespace();
            match (words.next(), words.next(), words.next(), words.next()) {
                // A first claim: the first token of the time it was claimed at.
                (Some("won"), Some(key), Some(token), Some(created_at))
                    if created_at.parse().ok().map(|ms| FencingToken::first_at(UnixMillis(ms)).to_string())
                        == Some(token.to_owned()) =>
                {
                    winners.entry(key.to_owned()).or_default().push(index);
                }
                (Some("lost"), Some(_), None, None) => {}
                _ => panic!("child {index} reported {line:?}"),
            }
        }
        assert_eq!(lines, KEYS, "child {index} did not report every key");
        assert!(child.wait().expect("child exit").success(), "child {index} failed");
    }

    assert_eq!(winners.len(), KEYS, "some keys were claimed by nobody");
    for (key, won_by) in &winners {
        assert_eq!(won_by.len(), 1, "{key} was claimed by children {won_by:?}");
    }
    let per_child: Vec<usize> = (0..CHILDREN).map(|c| winners.values().filter(|w| w.contains(&c)).count()).collect();

    // The file agrees: every key holds one in-flight record, claimed once (the first token
    // of its time).
    let store = SqliteStore::open(&path, Config::default().with_durable_claims(true)).expect("parent opens the store");
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    runtime.block_on(async {
        for i in 0..KEYS {
            let record = store.get(request(i).id).await.expect("get").expect("record exists");
            assert_eq!(
                (record.state, record.token),
                (RecordState::InFlight, FencingToken::first_at(record.created_at)),
                "k{i}"
            );
        }
    });
    println!(
        "two_processes: {CHILDREN} processes raced for {KEYS} keys; each key claimed once (wins per process: {per_child:?})"
    );
}
