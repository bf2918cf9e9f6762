//! A crash test for stores on a local file: a process killed with SIGKILL in the middle of
//! commits loses no write it promised to keep, hands out no fencing token twice, and
//! leaves a file that the next process opens. A store that answers a completion, a
//! journal write or a reclaim before the commit holding it is durable fails it.
//!
//! [`main`] is the whole `main` of a test target with `harness = false`. The test binary
//! runs itself again as a child (when `child_env` names a file). The child runs several
//! callers on fresh keys, each printing a line per acknowledged step (`claimed N T`,
//! `journaled N T`, `failed N T`, `reclaimed N T`, `completed N T`, with T the fencing
//! token): most claim and complete, some write a journal entry (the intent a side effect
//! needs) between the two, some fail after the journal entry and reclaim. After
//! [`KILL_AFTER`] lines the parent tells the child to hold: every caller finishes its
//! step and from then on only claims (the child prints `holding` once all have switched),
//! so the claims after `holding` lie between a claim and the first durable write after
//! it: a store that answers a claim before it is durable (from memory, to be written with
//! a later commit) loses them there. The parent kills the child, reopens the file and
//! checks every line against the store:
//! - no acknowledged claim, completion, journal entry, fail or reclaim is lost;
//! - every record holds the token printed last for it (or, for a write the kill cut off
//!   before its line, the next one).
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
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::{
    ClaimOutcome, ClaimRequest, Endpoint, FencingToken, Fingerprint, IdempotencyKey, JournalWrite, ReclaimOutcome,
    ReclaimRequest, RecordState, Scope, Store, StoredResponse,
};

/// Lines the parent reads before it tells the child to hold.
pub const KILL_AFTER: usize = 400;
/// Claims the parent reads after `holding` before it kills the child.
pub const HELD_CLAIMS: usize = 32;
/// Concurrent callers in the child, so that batches hold several operations.
const CALLERS: usize = 16;
/// The journal entry every journaling caller writes.
const STEP: &str = "intent";
const LEASE: Duration = Duration::from_secs(300);
const RETENTION: Duration = Duration::from_secs(3600);

/// What the parent found after the kill.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Report {
    /// Keys with at least one acknowledged step.
    pub keys: usize,
    /// Keys acknowledged as completed (all found completed).
    pub completed: usize,
    /// Claims acknowledged after `holding` (between a claim and the next durable write).
    pub held: usize,
}

/// What a caller does with each of its keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    /// claim, complete.
    Complete,
    /// claim, journal entry, complete.
    Journal,
    /// claim, journal entry, fail, reclaim, complete.
    Reclaim,
}

fn role(caller: usize) -> Role {
    match caller % 4 {
        0 | 1 => Role::Complete,
        2 => Role::Journal,
        _ => Role::Reclaim,
    }
}

fn request(n: usize) -> ClaimRequest {
    let scope = Scope::new("killed-process", Endpoint::new("POST", "/v1/workers")).expect("scope");
    let key = IdempotencyKey::parse(format!("k{n}").as_bytes()).expect("key");
    ClaimRequest::new(scope, key, Fingerprint::of_bytes(b"{}"), LEASE, RETENTION)
}

fn body(n: usize) -> Vec<u8> {
    format!("{{\"worker\":{n}}}").into_bytes()
}

/// Runs the crash test: as the child when `child_env` is set, else as the parent, which
/// spawns the child on `file_name` in a temporary directory and returns what it found.
/// `open` opens the store on a path, in the child and again in the parent after the kill.
///
/// # Panics
/// When an acknowledged write (a claim included) is missing after the kill, a token
/// repeats, or anything the test needs (spawning, the file, a runtime) fails.
pub fn main<S: Store + 'static>(child_env: &str, file_name: &str, open: impl Fn(&Path) -> S) -> Report {
    match std::env::var_os(child_env) {
        Some(path) => {
            child(open(Path::new(&path)));
            Report::default()
        }
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
    // The parent's "hold" arrives on stdin.
    let hold = Arc::new(AtomicBool::new(false));
    let holding = Arc::new(AtomicUsize::new(0));
    {
        let hold = Arc::clone(&hold);
        std::thread::spawn(move || {
            let mut line = String::new();
            if std::io::stdin().read_line(&mut line).is_ok() {
                hold.store(true, Ordering::SeqCst);
            }
        });
    }
    runtime.block_on(async {
        let tasks: Vec<_> = (0..CALLERS)
            .map(|caller| {
                let (store, say, hold, holding) =
                    (Arc::clone(&store), say.clone(), Arc::clone(&hold), Arc::clone(&holding));
                tokio::spawn(async move {
                    let mut held = false;
                    // Runs until the parent kills the process.
                    for n in (caller..).step_by(CALLERS) {
                        if !held && hold.load(Ordering::SeqCst) {
                            held = true;
                            if holding.fetch_add(1, Ordering::SeqCst) + 1 == CALLERS {
                                say("holding".into());
                            }
                            // Nobody claims before every caller has stopped writing, so
                            // the claims after `holding` are the only writes left.
                            while holding.load(Ordering::SeqCst) < CALLERS {
                                tokio::task::yield_now().await;
                            }
                        }
                        let ClaimOutcome::Claimed(r) = store.claim(request(n)).await.expect("claim") else {
                            panic!("fresh key k{n} was not claimed");
                        };
                        say(format!("claimed {n} {}", r.token));
                        if held {
                            continue;
                        }
                        let mut token = r.token;
                        if role(caller) != Role::Complete {
                            let wrote = store.journal_put(r.id, token, STEP, body(n), false).await.expect("journal");
                            assert_eq!(wrote, JournalWrite::Written, "k{n}");
                            say(format!("journaled {n} {token}"));
                        }
                        if role(caller) == Role::Reclaim {
                            store.fail(r.id, token).await.expect("fail");
                            say(format!("failed {n} {token}"));
                            let req = ReclaimRequest {
                                id: r.id,
                                expected: token,
                                fingerprint: r.fingerprint,
                                lease_ttl: LEASE,
                                retention: RETENTION,
                            };
                            let ReclaimOutcome::Reclaimed(again) = store.reclaim(req).await.expect("reclaim") else {
                                panic!("k{n}: the failed record was not reclaimed");
                            };
                            token = again.token;
                            say(format!("reclaimed {n} {token}"));
                        }
                        store
                            .complete(r.id, token, StoredResponse::new(201, Vec::new(), body(n)))
                            .await
                            .expect("complete");
                        say(format!("completed {n} {token}"));
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.expect("caller");
        }
    });
}

/// The strongest acknowledged step of a key and its token.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Step {
    Claimed,
    Journaled,
    Failed,
    Reclaimed,
    Completed,
}

fn parent<S: Store>(child_env: &str, file_name: &str, open: impl Fn(&Path) -> S) -> Report {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join(file_name);
    let mut child = Command::new(std::env::current_exe().expect("test binary path"))
        .env(child_env, &path)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn child");
    let mut stdin = child.stdin.take().expect("child stdin");
    let mut lines = BufReader::new(child.stdout.take().expect("child stdout")).lines();
    let mut seen = Vec::new();
    let mut next = |seen: &mut Vec<String>| {
        let line = lines.next().expect("the child stopped early").expect("child output");
        seen.push(line);
    };
    while seen.len() < KILL_AFTER {
        next(&mut seen);
    }
    writeln!(stdin, "hold").and_then(|()| stdin.flush()).expect("tell the child to hold");
    while seen.last().map(String::as_str) != Some("holding") {
        next(&mut seen);
    }
    let marker = seen.len();
    while seen.len() < marker + HELD_CLAIMS {
        next(&mut seen);
    }
    child.kill().expect("SIGKILL the child");
    child.wait().expect("reap the child");
    // Lines printed before the kill landed were acknowledged too.
    seen.extend(lines.map_while(Result::ok));

    let mut acked: BTreeMap<usize, (Step, FencingToken)> = BTreeMap::new();
    let mut held = 0;
    for (i, line) in seen.iter().enumerate() {
        if line == "holding" {
            continue;
        }
        let mut parts = line.split(' ');
        let (what, n, token) = (parts.next(), parts.next(), parts.next());
        let n: usize = n.and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("a `<what> <n> <token>` line: {line}"));
        let token = FencingToken(token.and_then(|t| t.parse().ok()).unwrap_or_else(|| panic!("a token: {line}")));
        let step = match what {
            Some("claimed") => Step::Claimed,
            Some("journaled") => Step::Journaled,
            Some("failed") => Step::Failed,
            Some("reclaimed") => Step::Reclaimed,
            Some("completed") => Step::Completed,
            _ => panic!("unknown line {line}"),
        };
        if i >= marker {
            held += 1;
        }
        // One caller per key, so a key's lines come in the order of its steps.
        acked.insert(n, (step, token));
    }

    let store = open(&path);
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let mut report = Report { keys: acked.len(), held, ..Report::default() };
    runtime.block_on(async {
        for (&n, &(step, token)) in &acked {
            let id = request(n).id();
            let Some(r) = store.get(id).await.expect("get") else {
                panic!("k{n}: acknowledged as {step:?} with token {token} and lost in the kill");
            };
            // A write whose line the kill cut off may have committed: one step further.
            match step {
                Step::Completed => {
                    report.completed += 1;
                    assert_eq!(r.state, RecordState::Completed, "k{n}: acknowledged completion lost");
                    assert_eq!(r.token, token, "k{n}");
                    let stored =
                        r.response.as_ref().and_then(|resp| resp.body_bytes().ok().flatten().map(|b| b.into_owned()));
                    assert_eq!(stored, Some(body(n)), "k{n}");
                }
                Step::Reclaimed => {
                    assert_eq!(r.token, token, "k{n}: acknowledged reclaim lost (the token would be handed out again)");
                    assert!(matches!(r.state, RecordState::InFlight | RecordState::Completed), "k{n}: {:?}", r.state);
                }
                Step::Failed => {
                    let reclaimed = r.state == RecordState::InFlight && r.token == token.next();
                    assert!(
                        (r.state == RecordState::Failed && r.token == token) || reclaimed,
                        "k{n}: acknowledged fail lost: {:?} token {}",
                        r.state,
                        r.token
                    );
                }
                // The next step (a journal write, a fail) keeps the token.
                Step::Journaled | Step::Claimed => {
                    assert_eq!(r.token, token, "k{n}: token after the kill");
                }
            }
            // Key n is caller n % CALLERS's.
            if step >= Step::Journaled && role(n % CALLERS) != Role::Complete {
                let entry = store.journal_get(id, STEP).await.expect("journal get");
                assert_eq!(entry, Some(body(n)), "k{n}: acknowledged journal entry lost");
            }
        }
    });
    println!(
        "killed_process: {} acknowledged keys ({} completed, {} claimed after `holding`); every acknowledged write \
         survived SIGKILL",
        report.keys, report.completed, report.held
    );
    report
}
