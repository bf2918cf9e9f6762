//! A race between processes: several processes sharing one store file claim the same
//! idempotency keys at once, and every key must be claimed exactly once overall (the
//! [`Store::claim`] contract: of N concurrent claims of one id, exactly one gets
//! `Claimed`, across processes too). A store that decides a claim from its own memory
//! instead of inside the file's write transaction fails it: two processes both win.
//!
//! [`main`] is the whole `main` of a test target with `harness = false`. The test binary
//! runs itself again as a child (when `child_env` names a file): the child opens the
//! store, says `ready`, waits for `go` on stdin, claims every key with several callers at
//! once and prints one line per key (`won k17 <token> <created_at>` or `lost k17`). The
//! parent starts the children on a fresh file (so they also race through creating it),
//! releases them together, and checks the union of their reports and the file itself.
//!
//! ```no_run
//! # fn open_my_store(_path: &std::path::Path) -> idem_core::MemoryStore { idem_core::MemoryStore::new() }
//! // tests/two_processes.rs, with `harness = false` for it in Cargo.toml.
//! fn main() {
//!     idem_conformance::racing_processes::main("MY_STORE_RACE_DB", "race.db", |path| open_my_store(path));
//! }
//! ```

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use idem_core::{
    ClaimOutcome, ClaimRequest, Endpoint, FencingToken, Fingerprint, IdempotencyKey, RecordState, Scope, Store,
    UnixMillis,
};

/// Processes racing.
pub const CHILDREN: usize = 4;
/// Keys every process tries to claim.
pub const KEYS: usize = 400;
/// Concurrent callers per process.
const CALLERS: usize = 8;

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

/// Runs the race: as a child when `child_env` is set, else as the parent, which spawns
/// [`CHILDREN`] children on `file_name` in a temporary directory. `open` opens the store on
/// a path, in each child and again in the parent once they are done. The child's index
/// travels in `<child_env>_INDEX`.
///
/// # Panics
/// When a key is claimed by more than one process or by none, the file disagrees with the
/// reports, or anything the test needs (spawning, the file, a runtime) fails.
pub fn main<S: Store + 'static>(child_env: &str, file_name: &str, open: impl Fn(&Path) -> S) {
    let index_env = format!("{child_env}_INDEX");
    match std::env::var_os(child_env) {
        Some(path) => {
            let index: usize = std::env::var(&index_env).ok().and_then(|v| v.parse().ok()).expect("child index");
            child(open(Path::new(&path)), index);
        }
        None => parent(child_env, &index_env, file_name, open),
    }
}

fn child<S: Store + 'static>(store: S, index: usize) {
    let store = Arc::new(store);
    let mut out = std::io::stdout().lock();
    writeln!(out, "ready").expect("stdout");
    out.flush().expect("stdout");
    let mut go = String::new();
    std::io::stdin().read_line(&mut go).expect("stdin");
    assert_eq!(go.trim(), "go");

    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let results = runtime.block_on(async {
        // Each child walks the keys from a different offset with a few callers at a time,
        // so the processes take the write lock in turn many times and collide on keys in
        // the middle of each other's work.
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

fn parent<S: Store>(child_env: &str, index_env: &str, file_name: &str, open: impl Fn(&Path) -> S) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join(file_name);
    let exe = std::env::current_exe().expect("test binary path");
    let mut children: Vec<_> = (0..CHILDREN)
        .map(|index| {
            Command::new(&exe)
                .env(child_env, &path)
                .env(index_env, index.to_string())
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
    let store = open(&path);
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    runtime.block_on(async {
        for i in 0..KEYS {
            let record = store.get(request(i).id()).await.expect("get").expect("record exists");
            assert_eq!(
                (record.state, record.token),
                (RecordState::InFlight, FencingToken::first_at(record.created_at)),
                "k{i}"
            );
        }
    });
    println!(
        "racing_processes: {CHILDREN} processes raced for {KEYS} keys; each key claimed once (wins per process: \
         {per_child:?})"
    );
}
