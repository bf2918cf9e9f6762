//! A crash test for stores on a local file: a process killed with SIGKILL in the middle of
//! commits loses no write it had acknowledged, and leaves a file that the next process
//! opens. A store that answers a caller before the commit holding its write is durable
//! fails it.
//!
//! [`main`] is the whole `main` of a test target with `harness = false`. The test binary
//! runs itself again as a child (when `child_env` names a file). The child runs several
//! callers that each claim a fresh key, print `claimed N`, complete it and print
//! `completed N`, until it is killed. The parent kills it after enough lines, reopens the
//! file and checks every printed line against the stored records.
//!
//! ```no_run
//! # fn open_my_store(_path: &std::path::Path) -> idem_core::MemoryStore { idem_core::MemoryStore::new() }
//! // tests/killed_process.rs, with `[[test]] name = "killed_process"` and
//! // `harness = false` in Cargo.toml.
//! fn main() {
//!     idem_conformance::killed_process::main("MY_STORE_KILL_DB", "killed.db", |path| open_my_store(path));
//! }
//! ```

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::{
    ClaimOutcome, ClaimRequest, Endpoint, FencingToken, Fingerprint, IdempotencyKey, RecordState, Scope, Store,
    StoredResponse,
};

/// Lines the parent reads before it kills the child.
const KILL_AFTER: usize = 400;
/// Concurrent callers in the child, so that batches hold several operations.
const CALLERS: usize = 16;

fn request(n: usize) -> ClaimRequest {
    let scope = Scope::new("killed-process", Endpoint::new("POST", "/v1/workers")).expect("scope");
    let key = IdempotencyKey::parse(format!("k{n}").as_bytes()).expect("key");
    ClaimRequest::new(scope, key, Fingerprint::of_bytes(b"{}"), Duration::from_secs(300), Duration::from_secs(3600))
}

/// Runs the crash test: as the child when `child_env` is set, else as the parent, which
/// spawns the child on `file_name` in a temporary directory. `open` opens the store on a
/// path, in the child and again in the parent after the kill.
///
/// # Panics
/// When an acknowledged write is missing after the kill, or anything the test needs
/// (spawning, the file, a runtime) fails.
pub fn main<S: Store + 'static>(child_env: &str, file_name: &str, open: impl Fn(&Path) -> S) {
    match std::env::var_os(child_env) {
        Some(path) => child(open(Path::new(&path))),
        None => parent(child_env, file_name, open),
    }
}

fn child<S: Store + 'static>(store: S) {
    let store = Arc::new(store);
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let out = Arc::new(Mutex::new(std::io::stdout()));
    let say = move |line: String| {
        let mut out = out.lock().expect("stdout");
        writeln!(out, "{line}").and_then(|()| out.flush()).expect("stdout");
    };
    runtime.block_on(async {
        let tasks: Vec<_> = (0..CALLERS)
            .map(|caller| {
                let (store, say) = (Arc::clone(&store), say.clone());
                tokio::spawn(async move {
                    // Runs until the parent kills the process.
                    for n in (caller..).step_by(CALLERS) {
                        let ClaimOutcome::Claimed(r) = store.claim(request(n)).await.expect("claim") else {
                            panic!("fresh key k{n} was not claimed");
                        };
                        say(format!("claimed {n}"));
                        let body = format!("{{\"worker\":{n}}}").into_bytes();
                        store
                            .complete(r.id, r.token, StoredResponse::new(201, Vec::new(), body))
                            .await
                            .expect("complete");
                        say(format!("completed {n}"));
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.expect("caller");
        }
    });
}

fn parent<S: Store>(child_env: &str, file_name: &str, open: impl Fn(&Path) -> S) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join(file_name);
    let mut child = Command::new(std::env::current_exe().expect("test binary path"))
        .env(child_env, &path)
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn child");
    let mut lines = BufReader::new(child.stdout.take().expect("child stdout")).lines();
    let mut seen = Vec::new();
    while seen.len() < KILL_AFTER {
        seen.push(lines.next().expect("the child stopped early").expect("child output"));
    }
    child.kill().expect("SIGKILL the child");
    child.wait().expect("reap the child");
    // Lines printed before the kill landed were acknowledged too.
    seen.extend(lines.map_while(Result::ok));

    // The strongest acknowledged state of each key.
    let mut acked: BTreeMap<usize, RecordState> = BTreeMap::new();
    for line in &seen {
        let (what, n) = line.split_once(' ').expect("a `<what> <n>` line");
        let n: usize = n.parse().expect("a key number");
        let state = if what == "completed" { RecordState::Completed } else { RecordState::InFlight };
        let entry = acked.entry(n).or_insert(state);
        if state == RecordState::Completed {
            *entry = state;
        }
    }

    let store = open(&path);
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let completed = runtime.block_on(async {
        let mut completed = 0;
        for (&n, &state) in &acked {
            let r =
                store.get(request(n).id).await.expect("get").unwrap_or_else(|| panic!("acknowledged k{n} was lost"));
            assert_eq!(
                r.token,
                FencingToken::first_at(r.created_at),
                "k{n}: claimed once, the first token of its time"
            );
            match state {
                RecordState::Completed => {
                    completed += 1;
                    assert_eq!(r.state, RecordState::Completed, "acknowledged completion of k{n} was lost");
                    let body =
                        r.response.as_ref().and_then(|resp| resp.body_bytes().ok().flatten().map(|b| b.into_owned()));
                    assert_eq!(body, Some(format!("{{\"worker\":{n}}}").into_bytes()), "k{n}");
                }
                // The completion may have committed without its line being printed.
                _ => assert!(matches!(r.state, RecordState::InFlight | RecordState::Completed), "k{n}: {:?}", r.state),
            }
        }
        completed
    });
    println!("killed_process: {} acknowledged keys ({completed} completed) all survived SIGKILL", acked.len());
}
