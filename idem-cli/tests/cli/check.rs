//! `idem check` from the outside, both ways: it passes against the demo server (the
//! leasebroker app `leasebroker serve` runs) on every store, and against a small server
//! that keeps every rule; and it fails, naming the rule, against copies of that server
//! that each break one rule. `--dry-run` sends nothing.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use idem_core::Store;

use super::Run;

const WORKER: &str = r#"{"image":"worker-base:2025.11","cpu":2,"memory_gb":4}"#;

fn check(url: &str, args: &[&str]) -> Run {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["--json", "check", url])
        .args(args)
        .env_remove("IDEM_STORE")
        .output()
        .expect("run the idem binary");
    Run {
        code: out.status.code().expect("exit code"),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// The rules a `--json` report says failed, by name.
fn failed(run: &Run) -> BTreeSet<String> {
    let report = run.json();
    let rules = report["rules"].as_array().unwrap_or_else(|| panic!("no rules in {}", run.stdout));
    assert_eq!(rules.len(), 8, "every rule reported: {}", run.stdout);
    rules.iter().filter(|r| r["passed"] == false).map(|r| r["rule"].as_str().expect("rule name").to_owned()).collect()
}

/// The demo server over `store`, with a handler slow enough that racers meet its claim.
pub(super) async fn demo_passes_check(store: Arc<dyn Store>) {
    let dir = tempfile::tempdir().expect("temp dir");
    let db = redb::Database::create(dir.path().join("infra.redb")).expect("infra file");
    let infra = leasebroker::state::Infra::new(Arc::new(db)).expect("infra tables");
    let mut config = leasebroker::app::Config::default();
    config.faults.work_ms = 300;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let server = leasebroker::server::Server::start(listener, store, infra, &config).expect("start the demo");
    let url = format!("{}/v1/workers", server.url());
    let tokens = [format!("check-a-{}", uuid::Uuid::new_v4()), format!("check-b-{}", uuid::Uuid::new_v4())];
    let run = tokio::task::spawn_blocking(move || {
        check(&url, &["--body", WORKER, "--bearer", &tokens[0], "--bearer", &tokens[1]])
    })
    .await
    .expect("join");
    assert_eq!(run.code, 0, "idem check against the demo: {}{}", run.stdout, run.stderr);
    assert_eq!(failed(&run), BTreeSet::new());
    assert_eq!(run.json()["passed"], true);
    server.stop().await.expect("stop the demo");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_on_the_memory_store_passes_check() {
    demo_passes_check(Arc::new(idem_core::MemoryStore::new())).await;
}

/// The one rule a server breaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Break {
    /// Keeps every rule: shows the checks pass on an implementation other than idem's.
    Nothing,
    /// Runs every request.
    NoIdempotency,
    /// Keys records by key alone, whoever sends it.
    Unscoped,
    /// Never compares the request: another body with a used key gets the stored answer.
    MismatchReplayed,
    /// A replay renders the body again (a new timestamp) instead of sending the stored one.
    ReplayRenders,
    /// An in-flight 409 without `Retry-After`.
    ConflictWithoutRetryAfter,
    /// Runs every request, yet stamps every answer with one `Idempotency-Key-Expires`, as a
    /// gateway that adds the header without keeping a record would.
    StampsExpires,
    /// A replay sends the stored status, body and `Location` but not the stored
    /// `Content-Type` (the framework's default instead).
    ReplayDropsContentType,
    /// Takes a key with a space inside (and keys of at most 40 bytes).
    InnerSpaceAccepted,
    /// Breaks nothing: answers every operation 202 with one body and no `Location`, so a
    /// replay is told from a new operation by its marker alone.
    ConstantBody,
    /// Breaks nothing: a request that meets a running claim waits for its outcome and
    /// replays it (a bounded wait), so racers get replays instead of 409s.
    WaitsForOutcome,
}

impl Break {
    fn keeps_records(self) -> bool {
        !matches!(self, Break::NoIdempotency | Break::StampsExpires)
    }
}

enum Entry {
    Running { body: Bytes },
    Done { body: Bytes, id: u64, answer: Vec<u8> },
}

struct Mini {
    breaks: Break,
    records: Mutex<HashMap<(String, Vec<u8>), Entry>>,
    next_id: AtomicU64,
    requests: AtomicUsize,
    expires: String,
    max_key_len: usize,
}

fn problem(status: StatusCode, kind: &str) -> Response {
    let body =
        format!(r#"{{"type":"https://example.test/problems#{kind}","title":"{kind}","status":{}}}"#, status.as_u16());
    (status, [(header::CONTENT_TYPE, "application/problem+json")], body).into_response()
}

fn answer(breaks: Break, id: u64) -> Vec<u8> {
    if breaks == Break::ConstantBody {
        return br#"{"status":"accepted"}"#.to_vec();
    }
    let at = SystemTime::now().duration_since(UNIX_EPOCH).expect("clock").as_nanos();
    format!(r#"{{"id":{id},"rendered_at":{at}}}"#).into_bytes()
}

impl Mini {
    fn created(&self, id: u64, body: Vec<u8>, replayed: bool) -> Response {
        let mut res = (
            StatusCode::CREATED,
            [(header::LOCATION, format!("/ops/{id}")), (header::CONTENT_TYPE, "application/json".to_owned())],
            body,
        )
            .into_response();
        if self.breaks == Break::ConstantBody {
            *res.status_mut() = StatusCode::ACCEPTED;
            res.headers_mut().remove(header::LOCATION);
        }
        if replayed && self.breaks == Break::ReplayDropsContentType {
            res.headers_mut().remove(header::CONTENT_TYPE);
        }
        if self.breaks != Break::NoIdempotency {
            res.headers_mut().insert("idempotency-key-expires", self.expires.parse().expect("date"));
        }
        if replayed {
            res.headers_mut().insert("idempotent-replayed", "true".parse().expect("value"));
        }
        res
    }

    /// The key as the draft spells it: a token or an sf-string, 1 to `max_key_len` visible
    /// ASCII.
    fn key(&self, headers: &HeaderMap) -> Option<Vec<u8>> {
        let mut fields = headers.get_all("idempotency-key").iter();
        let (Some(field), None) = (fields.next(), fields.next()) else {
            return None;
        };
        let raw = field.as_bytes();
        let key = match raw.strip_prefix(b"\"") {
            Some(rest) => rest.strip_suffix(b"\"")?,
            None => raw,
        };
        let space = u8::from(self.breaks != Break::InnerSpaceAccepted);
        let valid =
            !key.is_empty() && key.len() <= self.max_key_len && key.iter().all(|b| (0x20 + space..=0x7e).contains(b));
        valid.then(|| key.to_vec())
    }

    async fn handle(self: Arc<Self>, method: Method, headers: HeaderMap, body: Bytes) -> Response {
        self.requests.fetch_add(1, Ordering::SeqCst);
        if method == Method::GET {
            return (StatusCode::OK, "[]").into_response();
        }
        let Some(principal) = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).map(str::to_owned)
        else {
            return problem(StatusCode::UNAUTHORIZED, "no-principal");
        };
        let slot = if !self.breaks.keeps_records() {
            None
        } else {
            if !headers.contains_key("idempotency-key") {
                return problem(StatusCode::BAD_REQUEST, "missing-key");
            }
            let Some(key) = self.key(&headers) else {
                return problem(StatusCode::BAD_REQUEST, "bad-key");
            };
            let scope = if self.breaks == Break::Unscoped { String::new() } else { principal };
            let slot = (scope, key);
            if self.breaks == Break::WaitsForOutcome {
                // While the same request runs, waits; then decides on its outcome.
                while matches!(self.records.lock().expect("lock").get(&slot), Some(Entry::Running { body: b }) if *b == body)
                {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            let mut records = self.records.lock().expect("lock");
            match records.get(&slot) {
                Some(Entry::Running { body: b } | Entry::Done { body: b, .. })
                    if *b != body && self.breaks != Break::MismatchReplayed =>
                {
                    return problem(StatusCode::CONFLICT, "mismatch");
                }
                Some(Entry::Running { .. }) => {
                    let mut res = problem(StatusCode::CONFLICT, "in-flight");
                    if self.breaks != Break::ConflictWithoutRetryAfter {
                        res.headers_mut().insert(header::RETRY_AFTER, "1".parse().expect("value"));
                    }
                    return res;
                }
                Some(Entry::Done { id, answer: stored, .. }) => {
                    let again =
                        if self.breaks == Break::ReplayRenders { answer(self.breaks, *id) } else { stored.clone() };
                    return self.created(*id, again, true);
                }
                None => {}
            }
            records.insert(slot.clone(), Entry::Running { body: body.clone() });
            Some(slot)
        };
        // Long enough that every racer arrives while the first one runs.
        tokio::time::sleep(Duration::from_millis(400)).await;
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        let stored = answer(self.breaks, id);
        if let Some(slot) = slot {
            self.records.lock().expect("lock").insert(slot, Entry::Done { body, id, answer: stored.clone() });
        }
        self.created(id, stored, false)
    }
}

/// Serves a [`Mini`] on a free port: its URL and the server, to count requests.
async fn mini(breaks: Break) -> (String, Arc<Mini>) {
    let max_key_len = if breaks == Break::InnerSpaceAccepted { 40 } else { 255 };
    let state = Arc::new(Mini {
        max_key_len,
        breaks,
        records: Mutex::new(HashMap::new()),
        next_id: AtomicU64::new(1),
        requests: AtomicUsize::new(0),
        expires: httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(86_400)),
    });
    let app = axum::Router::new().route(
        "/ops",
        axum::routing::any({
            let state = state.clone();
            move |method: Method, headers: HeaderMap, body: Bytes| state.clone().handle(method, headers, body)
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}/ops", listener.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, state)
}

async fn check_mini(breaks: Break) -> Run {
    let (url, server) = mini(breaks).await;
    let max_key_len = server.max_key_len.to_string();
    tokio::task::spawn_blocking(move || {
        check(&url, &["--body", r#"{"n":1}"#, "--bearer", "a", "--bearer", "b", "--max-key-len", &max_key_len])
    })
    .await
    .expect("join")
}

fn set(rules: &[&str]) -> BTreeSet<String> {
    rules.iter().map(|r| (*r).to_owned()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_keeps_every_rule_passes() {
    let run = check_mini(Break::Nothing).await;
    assert_eq!(failed(&run), BTreeSet::new(), "{}", run.stdout);
    assert_eq!(run.code, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn servers_that_keep_every_rule_their_own_way_pass() {
    // A 202 with one body for every operation failed `scope` ("the first principal's
    // answer") although the second principal's answer carried no replay marker.
    let run = check_mini(Break::ConstantBody).await;
    assert_eq!(failed(&run), BTreeSet::new(), "{}", run.stdout);
    let run = check_mini(Break::WaitsForOutcome).await;
    assert_eq!(failed(&run), BTreeSet::new(), "{}", run.stdout);
    let report = run.json();
    let concurrent = report["rules"].as_array().expect("rules").iter().find(|r| r["rule"] == "concurrent").cloned();
    let saw = concurrent.expect("concurrent row")["saw"].as_str().expect("saw").to_owned();
    assert!(saw.contains("7 got the replay"), "racers that waited: {saw}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_broken_rule_fails_check_by_name() {
    // The rules each server breaks, and only those: every other rule still passes.
    let cases = [
        (
            Break::NoIdempotency,
            set(&["key-syntax", "missing-key", "replay", "mismatch", "scope", "concurrent", "key-expires"]),
        ),
        (Break::Unscoped, set(&["scope"])),
        (Break::MismatchReplayed, set(&["mismatch"])),
        // Every rule that compares a replay with its first answer.
        (Break::ReplayRenders, set(&["key-syntax", "replay", "mismatch", "scope", "concurrent", "key-expires"])),
        (Break::ConflictWithoutRetryAfter, set(&["concurrent"])),
        // The header alone passed key-expires: its date was the same on a retry that ran again.
        (
            Break::StampsExpires,
            set(&["key-syntax", "missing-key", "replay", "mismatch", "scope", "concurrent", "key-expires"]),
        ),
        // Same status, body and Location passed every replay comparison.
        (
            Break::ReplayDropsContentType,
            set(&["key-syntax", "replay", "mismatch", "scope", "concurrent", "key-expires"]),
        ),
        // With --max-key-len 40, the key with a space inside was 42 bytes: refused for its
        // length, it passed; and every rule's 41-byte key was refused, failing them all.
        (Break::InnerSpaceAccepted, set(&["key-syntax"])),
    ];
    for (breaks, expected) in cases {
        let run = check_mini(breaks).await;
        assert_eq!(failed(&run), expected, "{breaks:?}: {}", run.stdout);
        assert_eq!(run.code, 5, "{breaks:?}: a failed rule exits 5");
        assert_eq!(run.json()["passed"], false);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_rule_says_what_it_saw() {
    let run = check_mini(Break::ConflictWithoutRetryAfter).await;
    let report = run.json();
    let row = report["rules"].as_array().expect("rules").iter().find(|r| r["rule"] == "concurrent").cloned();
    let saw = row.expect("concurrent row")["saw"].as_str().expect("saw").to_owned();
    assert!(saw.contains("409") && saw.contains("without Retry-After"), "{saw}");
    let run = check_mini(Break::Unscoped).await;
    assert!(run.stdout.contains("not scoped by principal"), "{}", run.stdout);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dry_run_sends_nothing_and_counts_the_operations() {
    let (url, server) = mini(Break::Nothing).await;
    let run = tokio::task::spawn_blocking(move || {
        check(&url, &["--body", r#"{"n":1}"#, "--bearer", "a", "--bearer", "b", "--dry-run", "--racers", "4"])
    })
    .await
    .expect("join");
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_eq!(server.requests.load(Ordering::SeqCst), 0, "a dry run sent a request");
    let report = run.json();
    let requests = report["requests"].as_array().expect("requests");
    // 8 key-syntax, 1 missing-key, 2 replay, 3 mismatch, 3 scope, 4 racers + 1, 4 GETs, 2 key-expires.
    assert_eq!(requests.len(), 28);
    // One operation per fresh key and principal: key-syntax 2, replay, mismatch, scope 2,
    // concurrent, key-expires.
    assert_eq!(report["operations"], 8);
    assert!(report.to_string().find("Bearer a").is_none(), "a credential's value was printed");
    // A real run sends exactly what the dry run listed.
    let (url, server) = mini(Break::Nothing).await;
    let run = tokio::task::spawn_blocking(move || {
        check(&url, &["--body", r#"{"n":1}"#, "--bearer", "a", "--bearer", "b", "--racers", "4"])
    })
    .await
    .expect("join");
    assert_eq!(run.code, 0, "{}", run.stdout);
    assert_eq!(server.requests.load(Ordering::SeqCst), 28);
    assert_eq!(server.next_id.load(Ordering::SeqCst) - 1, 8, "operations run");
}

#[test]
fn bad_check_arguments_exit_2() {
    let run = check("http://127.0.0.1:9/ops", &["--body", "{}", "--bearer", "a"]);
    assert_eq!(run.code, 2, "one credential and the scope rule: {}", run.stdout);
    assert!(run.json()["error"]["message"].as_str().expect("message").contains("--skip scope"));
    let run = check("http://127.0.0.1:9/ops", &["--body", "not json", "--bearer", "a", "--skip", "scope"]);
    assert_eq!(run.code, 2, "a body the checker cannot vary");
    let run = check("not a url", &["--body", "{}", "--bearer", "a", "--skip", "scope"]);
    assert_eq!(run.code, 2);
    let run = check("http://127.0.0.1:9/ops", &["--body", "{}", "--method", "GET", "--skip", "scope"]);
    assert_eq!(run.code, 2, "a safe method");
}

#[test]
fn a_url_without_an_http_scheme_or_a_zero_timeout_exits_2() {
    // These parsed, then every request failed: exit 5 and eight rules blamed for a typo.
    for url in ["localhost:8080/ops", "ftp://127.0.0.1/ops", "file:///tmp/ops", "http://"] {
        let run = check(url, &["--body", "{}", "--skip", "scope"]);
        assert_eq!(run.code, 2, "{url}: {}{}", run.stdout, run.stderr);
        assert!(run.json()["error"]["message"].as_str().expect("message").contains("http://"), "{}", run.stdout);
    }
    let bad = [
        &["--timeout", "0s"][..],
        &["--header", "Idempotency-Key: mine"],
        &["--body", "@/nonexistent/body.json"],
        &["--header", "no colon"],
        &["--credential", "Bad Name: x"],
        &["--replayed-header", "bad name"],
    ];
    for args in bad {
        let mut all = vec!["--skip", "scope"];
        if !args.contains(&"--body") {
            all.extend(["--body", "{}"]);
        }
        all.extend_from_slice(args);
        let run = check("http://127.0.0.1:9/ops", &all);
        assert_eq!(run.code, 2, "{args:?}: {}{}", run.stdout, run.stderr);
        assert!(run.json()["error"]["kind"] == "usage", "{args:?}: {}", run.stdout);
    }
    // Too short to hold a fresh key: clap refuses it.
    let run = check("http://127.0.0.1:9/ops", &["--body", "{}", "--skip", "scope", "--max-key-len", "8"]);
    assert_eq!(run.code, 2, "{}", run.stderr);
}

/// What a proxy in front of a server does wrong.
#[derive(Clone, Copy, Debug)]
enum ProxyFault {
    /// Drops the `Idempotency-Key` field on the way in.
    StripsKey,
    /// Keeps a 409 and answers every later request with that key from it.
    Caches409,
}

/// An answer a caching proxy kept: status, headers, body.
type Kept = (u16, HeaderMap, Bytes);

/// A reverse proxy in front of `upstream`, with one fault.
async fn proxy(upstream: String, fault: ProxyFault) -> String {
    let client = reqwest::Client::new();
    let cache: Arc<Mutex<HashMap<Vec<u8>, Kept>>> = Arc::default();
    let forward = move |method: Method, headers: HeaderMap, body: Bytes| {
        let (client, upstream, cache) = (client.clone(), upstream.clone(), cache.clone());
        async move {
            let key = headers.get("idempotency-key").map(|v| v.as_bytes().to_vec());
            if let (ProxyFault::Caches409, Some(k)) = (fault, &key)
                && let Some((status, headers, body)) = cache.lock().expect("lock").get(k).cloned()
            {
                return (StatusCode::from_u16(status).expect("status"), headers, body).into_response();
            }
            let mut sent = headers.clone();
            sent.remove(header::HOST);
            if let ProxyFault::StripsKey = fault {
                sent.remove("idempotency-key");
            }
            let res = client.request(method, &upstream).headers(sent).body(body).send().await.expect("upstream");
            let status = res.status().as_u16();
            let headers = res.headers().clone();
            let body = res.bytes().await.expect("upstream body");
            if let (ProxyFault::Caches409, Some(k), 409) = (fault, key, status) {
                cache.lock().expect("lock").insert(k, (status, headers.clone(), body.clone()));
            }
            (StatusCode::from_u16(status).expect("status"), headers, body).into_response()
        }
    };
    let app = axum::Router::new().route("/ops", axum::routing::any(forward));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}/ops", listener.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_that_breaks_the_contract_fails_check() {
    // The server behind keeps every rule; what fails is the proxy's doing.
    let cases = [
        // Every keyed request reaches the server keyless and is refused; the keyless and
        // safe rules still pass.
        (ProxyFault::StripsKey, set(&["key-syntax", "replay", "mismatch", "scope", "concurrent", "key-expires"])),
        // The cached in-flight 409 answers the retry after the race, the cached mismatch
        // answers the first body again.
        (ProxyFault::Caches409, set(&["mismatch", "concurrent"])),
    ];
    for (fault, expected) in cases {
        let (upstream, _server) = mini(Break::Nothing).await;
        let url = proxy(upstream, fault).await;
        let run = tokio::task::spawn_blocking(move || {
            check(&url, &["--body", r#"{"n":1}"#, "--bearer", "a", "--bearer", "b"])
        })
        .await
        .expect("join");
        assert_eq!(failed(&run), expected, "{fault:?}: {}", run.stdout);
        assert_eq!(run.code, 5);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_never_answers_costs_one_timeout_a_rule() {
    // Each batch waited out its own --timeout: 22 of them here, minutes against a host that
    // drops packets at the default 10 s.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}/ops", listener.local_addr().expect("addr"));
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    let started = std::time::Instant::now();
    let run =
        tokio::task::spawn_blocking(move || check(&url, &["--body", "{}", "--skip", "scope", "--timeout", "300ms"]))
            .await
            .expect("join");
    assert_eq!(run.code, 5, "{}", run.stdout);
    assert!(run.stdout.contains("timed out"), "{}", run.stdout);
    // 7 rules of one timeout each (2.1 s); a timeout a batch would be 6.6 s.
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
}

/// A usage error clap itself finds (an unknown option, a value out of range, a missing
/// argument) printed clap's text and no JSON under `--json`.
#[test]
fn a_usage_error_under_json_is_one_json_document() {
    for args in [&["--racers", "1", "--body", "{}"][..], &["--bogus"], &[]] {
        let run = check("http://127.0.0.1:9/ops", args);
        assert_eq!(run.code, 2, "{args:?}");
        assert_eq!(run.json()["error"]["kind"], "usage", "{args:?}: {}", run.stdout);
    }
}
