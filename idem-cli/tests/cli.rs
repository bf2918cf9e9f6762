//! The built `idem` binary against real stores: a stuck claim made through the store is
//! shown in flight with its lease, `release` refuses a live lease without `--force` and
//! frees it with it (or once the lease expired), and the next request's claim reclaims
//! the record and runs; `list`, `stats`, `sweep` and `--json` outputs are parsed and
//! checked; a bad URL exits 2 and a missing record 1. One test per backend, each on its
//! own file, key prefix or schema.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idem_core::{
    ClaimOutcome, ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, Record, RecordState, RequestParts, Scope, Store,
    StoredResponse,
};
use idem_http::{BearerToken, IdempotencyLayer};
use serde_json::Value;

#[path = "cli/check.rs"]
mod check;

const ENDPOINT: &str = "POST /v1/workers/{id}/reboot";
const LONG_LEASE: Duration = Duration::from_secs(300);
/// Short enough that nothing stays behind on a shared Redis for long.
const RETENTION: Duration = Duration::from_secs(600);

/// What one run of the binary did.
pub(crate) struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Run {
    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {}", self.stdout))
    }
}

fn idem(store: &str, args: &[&str]) -> Run {
    let out = Command::new(env!("CARGO_BIN_EXE_idem"))
        .arg("--store")
        .arg(store)
        .args(args)
        .env_remove("IDEM_STORE")
        .envs(emulator_credentials(store))
        .output()
        .expect("run the idem binary");
    Run {
        code: out.status.code().expect("exit code"),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// The emulator's dummy credentials for a `dynamodb://` run, unless the environment has
/// real ones (the SDK's default chain would otherwise go on to profiles and EC2 metadata).
fn emulator_credentials(store: &str) -> Vec<(&'static str, String)> {
    if !store.starts_with("dynamodb:") || std::env::var_os("AWS_ACCESS_KEY_ID").is_some() {
        return Vec::new();
    }
    vec![("AWS_ACCESS_KEY_ID", "test".into()), ("AWS_SECRET_ACCESS_KEY", "test".into())]
}

fn local_ms() -> i64 {
    i64::try_from(SystemTime::now().duration_since(UNIX_EPOCH).expect("clock").as_millis()).expect("ms")
}

/// Opens the backend's store from the test process. Embedded stores are closed (dropped)
/// before the binary runs: redb allows one opener per file.
type Open = Box<dyn Fn() -> Pin<Box<dyn Future<Output = Arc<dyn Store>> + Send>> + Send + Sync>;

/// The concrete path the requests go to (the endpoint is its route template).
const PATH: &str = "/v1/workers/7/reboot";

fn body(key: &str) -> String {
    format!("{{\"reboot\":\"{key}\"}}")
}

/// The claim the HTTP layer makes for a POST of [`body`] to [`PATH`] with `key`: the same
/// scope and the same fingerprint (method, path, `content-type`, body).
fn request(principal: &str, key: &str, lease: Duration, retention: Duration) -> ClaimRequest {
    let scope = Scope::new(principal, Endpoint::from(ENDPOINT.to_owned())).expect("scope");
    let body = body(key);
    let key = IdempotencyKey::parse(key.as_bytes()).expect("key");
    let headers: [(&str, &[u8]); 1] = [("content-type", b"application/json")];
    let parts = RequestParts { method: "POST", path: PATH, query: None, headers: &headers, body: body.as_bytes() };
    ClaimRequest::new(scope, key, Fingerprint::of(&parts), lease, retention)
}

/// Sends the client's retry through the real layer on `store`; returns the status and how
/// many times the handler ran.
async fn retry_through_the_layer(store: Arc<dyn Store>, token: &str, key: &str) -> (u16, usize) {
    use axum::routing::post;
    use tower::ServiceExt as _;
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&runs);
    let handler = move || {
        let counted = Arc::clone(&counted);
        async move {
            counted.fetch_add(1, Ordering::SeqCst);
            (axum::http::StatusCode::CREATED, "rebooted")
        }
    };
    let app = axum::Router::new().route("/v1/workers/{id}/reboot", post(handler)).layer(IdempotencyLayer::new(store));
    let req = axum::http::Request::post(PATH)
        .header("authorization", format!("Bearer {token}"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(axum::body::Body::from(body(key)))
        .expect("request");
    let resp = app.oneshot(req).await.expect("infallible");
    (resp.status().as_u16(), runs.load(Ordering::SeqCst))
}

async fn claimed(store: &dyn Store, req: ClaimRequest) -> Record {
    match store.claim(req).await.expect("claim") {
        ClaimOutcome::Claimed(r) => r,
        other => panic!("expected a fresh claim, got {other:?}"),
    }
}

/// Waits until this machine's clock is past `t` (ms): a hang guard, not a timing bound.
async fn until_past(t: i64) {
    for _ in 0..2_000 {
        if local_ms() > t {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("the clock never passed {t}");
}

/// The whole operator story on one backend. `native_expiry`: the store removes records
/// itself (sweep reports zero).
async fn operator_story(url: &str, open: Open, native_expiry: bool) {
    let bearer = format!("cli-{}", uuid::Uuid::new_v4().simple());
    let principal = BearerToken::principal_for(bearer.as_bytes());
    let store = open().await;
    // A stuck claim (its process died), a completed record, a failed one, a claim whose
    // lease already ran out, and a record past its retention.
    let stuck = claimed(store.as_ref(), request(&principal, "stuck", LONG_LEASE, RETENTION)).await;
    until_past(stuck.started_at.0).await;
    let done = claimed(store.as_ref(), request(&principal, "done", LONG_LEASE, RETENTION)).await;
    let response = StoredResponse::new(201, vec![], b"{\"id\":1}".to_vec());
    store.complete(done.id, done.token, response).await.expect("complete");
    let done = store.get(done.id).await.expect("get").expect("the completed record");
    let broke = claimed(store.as_ref(), request(&principal, "broke", LONG_LEASE, RETENTION)).await;
    store.fail(broke.id, broke.token).await.expect("fail");
    let lapsed = claimed(store.as_ref(), request(&principal, "lapsed", Duration::from_millis(1), RETENTION)).await;
    let gone = claimed(store.as_ref(), request(&principal, "gone", Duration::ZERO, Duration::ZERO)).await;
    until_past(lapsed.lease_expires_at.0.max(gone.expires_at.0)).await;
    drop(store);

    // inspect by scope and key: in flight, its token, a live lease.
    let run = idem(url, &["--json", "inspect", "--principal", &principal, "--endpoint", ENDPOINT, "--key", "stuck"]);
    assert_eq!(run.code, 0, "inspect: {}", run.stderr);
    let shown = &run.json()["record"];
    assert_eq!(shown["record_id"], stuck.id.to_hex(), "the CLI derives the layer's record id");
    assert_eq!(shown["state"], "in_flight");
    assert_eq!(shown["token"], stuck.token.0);
    assert_eq!(shown["lease_live"], true);
    assert_eq!(shown["lease_expires_at_ms"], stuck.lease_expires_at.0);
    let remaining = shown["lease_remaining_ms"].as_u64().expect("remaining ms");
    assert!(remaining > 0 && remaining <= 300_000, "remaining lease {remaining} ms");
    assert_eq!(shown["response"], Value::Null);
    // The quoted (structured-field) spelling of the key is the same record.
    let run =
        idem(url, &["--json", "inspect", "--principal", &principal, "--endpoint", ENDPOINT, "--key", "\"stuck\""]);
    assert_eq!(run.json()["record"]["record_id"], stuck.id.to_hex());
    // By record id, as text.
    let run = idem(url, &["inspect", "--record-id", &done.id.to_hex()]);
    assert_eq!(run.code, 0, "inspect: {}", run.stderr);
    assert!(run.stdout.contains("completed") && run.stdout.contains("201"), "{}", run.stdout);

    // list: the principal's four live records; by state; by age.
    let run = idem(url, &["--json", "list", "--principal", &principal]);
    assert_eq!(run.code, 0, "list: {}", run.stderr);
    let listing = run.json();
    let mut listed: Vec<String> =
        listing["records"].as_array().expect("records").iter().map(|r| r["record_id"].to_string()).collect();
    listed.sort();
    let mut expected: Vec<String> = [&stuck, &done, &broke, &lapsed].iter().map(|r| format!("\"{}\"", r.id)).collect();
    expected.sort();
    assert_eq!(listed, expected, "live records only: the expired one is not listed");
    assert_eq!(listing["more"], false);
    let run = idem(url, &["--json", "list", "--principal", &principal, "--state", "in_flight", "--limit", "1"]);
    let page = run.json();
    assert_eq!(page["count"], 1);
    assert_eq!(page["more"], true, "two in-flight records, a page of one");
    let next = page["next_after"].as_str().expect("next_after").to_owned();
    let run = idem(url, &["--json", "list", "--principal", &principal, "--state", "in_flight", "--after", &next]);
    assert_eq!(run.json()["count"], 1, "the second page holds the other in-flight record");
    let run = idem(url, &["--json", "list", "--principal", &principal, "--min-age", "1h"]);
    assert_eq!(run.json()["count"], 0, "nothing started an hour ago");
    let run = idem(url, &["list", "--principal", &principal, "--state", "failed"]);
    assert!(run.stdout.contains(&broke.id.to_hex()) && run.stdout.contains("1 records"), "{}", run.stdout);

    // stats: counts by state and the oldest in-flight claim.
    let run = idem(url, &["--json", "stats", "--principal", &principal]);
    assert_eq!(run.code, 0, "stats: {}", run.stderr);
    let stats = run.json();
    assert_eq!(
        (
            &stats["records"],
            &stats["in_flight"],
            &stats["in_flight_lease_expired"],
            &stats["completed"],
            &stats["failed"]
        ),
        (&Value::from(4), &Value::from(2), &Value::from(1), &Value::from(1), &Value::from(1))
    );
    assert_eq!(stats["oldest_in_flight"]["record_id"], stuck.id.to_hex(), "the stuck claim started first");

    // release of a live claim without --force: refused, nothing changed.
    let target = ["--principal", principal.as_str(), "--endpoint", ENDPOINT, "--key", "stuck"];
    let run = idem(url, &[&["release"], &target[..]].concat());
    assert_eq!(run.code, 4, "a live lease needs --force: {}", run.stderr);
    assert!(run.stderr.contains("--force"), "{}", run.stderr);
    let run = idem(url, &[&["--json", "inspect"], &target[..]].concat());
    assert_eq!(run.json()["record"]["state"], "in_flight", "the refused release changed nothing");
    assert_eq!(run.json()["record"]["token"], stuck.token.0);

    // release --force: a fenced fail with the record's token.
    let run = idem(url, &[&["--json", "release", "--force"], &target[..]].concat());
    assert_eq!(run.code, 0, "release --force: {}", run.stderr);
    let released = run.json();
    assert_eq!((&released["released"], &released["forced"]), (&Value::Bool(true), &Value::Bool(true)));
    assert_eq!(released["record"]["state"], "failed");
    assert_eq!(released["record"]["token"], stuck.token.0, "fail keeps the token");
    // Again: already failed, nothing to do.
    let run = idem(url, &[&["release"], &target[..]].concat());
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(run.stdout.contains("already released"), "{}", run.stdout);

    // An expired lease needs no --force.
    let run = idem(url, &["--json", "release", "--record-id", &lapsed.id.to_hex()]);
    assert_eq!(run.code, 0, "release of an expired lease: {}", run.stderr);
    assert_eq!(run.json()["forced"], false);
    assert_eq!(run.json()["record"]["state"], "failed");

    // A completed record is never "released".
    let run = idem(url, &["release", "--force", "--record-id", &done.id.to_hex()]);
    assert_eq!(run.code, 4, "{}", run.stderr);

    // The client's next request with the stuck key, through the real layer: the record is
    // reclaimed and the handler runs once.
    let store = open().await;
    let (status, runs) = retry_through_the_layer(Arc::clone(&store), &bearer, "stuck").await;
    assert_eq!((status, runs), (201, 1), "the released key runs again");
    let record = store.get(stuck.id).await.expect("get").expect("record");
    assert_eq!(record.state, RecordState::Completed, "the retry completed the record");
    assert_eq!(record.token, stuck.token.next(), "the retry held the next token");
    // The control: a live claim nobody released still answers 409 and runs nothing.
    claimed(store.as_ref(), request(&principal, "held", LONG_LEASE, RETENTION)).await;
    let (status, runs) = retry_through_the_layer(Arc::clone(&store), &bearer, "held").await;
    assert_eq!((status, runs), (409, 0), "a live claim is not run again");
    // The old owner is fenced: its completion is refused.
    let late = store.complete(stuck.id, stuck.token, StoredResponse::new(200, vec![], vec![])).await;
    assert!(late.is_err_and(|e| e.is_lease_lost()), "the released owner's write is lease lost");
    drop(store);

    // sweep: one bounded call.
    let run = idem(url, &["--json", "sweep", "--limit", "100"]);
    assert_eq!(run.code, 0, "sweep: {}", run.stderr);
    let swept = run.json();
    assert_eq!(swept["native_expiry"], native_expiry);
    let removed = swept["removed"].as_u64().expect("removed");
    if native_expiry {
        assert_eq!(removed, 0, "a store that expires records itself sweeps nothing");
    } else {
        assert!(removed >= 1, "the record past its retention is swept");
    }
    assert!(swept["more"].is_boolean());

    // A missing record: exit 1 with a clear message, as JSON too.
    let run = idem(url, &["inspect", "--principal", &principal, "--endpoint", ENDPOINT, "--key", "never-sent"]);
    assert_eq!(run.code, 1, "{}", run.stderr);
    assert!(run.stderr.contains("no record"), "{}", run.stderr);
    let run =
        idem(url, &["--json", "release", "--principal", &principal, "--endpoint", ENDPOINT, "--key", "never-sent"]);
    assert_eq!(run.code, 1);
    assert_eq!(run.json()["error"]["kind"], "not_found");

    // `idem check` passes against the demo server on this store.
    check::demo_passes_check(open().await).await;
}

#[test]
fn bad_urls_and_arguments_exit_2_with_one_line() {
    for url in [
        "memory:",
        "mysql://u@h/db?prefix=Bad-Name",
        "redis-cluster://nohostport",
        "redis://h:1?prefix=a{b}",
        "redb://",
    ] {
        let run = idem(url, &["stats"]);
        assert_eq!(run.code, 2, "{url}: {}", run.stderr);
        assert_eq!(run.stderr.lines().count(), 1, "one clear line: {}", run.stderr);
        assert!(run.stdout.is_empty());
    }
    let run = idem("redb:///nonexistent/idem-cli-test.redb", &["--json", "stats"]);
    assert_eq!(run.code, 2, "a missing file is never created: {}", run.stderr);
    assert_eq!(run.json()["error"]["kind"], "usage");
    assert!(!std::path::Path::new("/nonexistent/idem-cli-test.redb").exists());
    let run = idem("redb:///tmp/x.redb", &["inspect", "--record-id", "xyz"]);
    assert_eq!(run.code, 2, "a bad record id: {}", run.stderr);
    let run = idem("redb:///tmp/x.redb", &["inspect", "--principal", "p", "--endpoint", "reboot", "--key", "k"]);
    assert_eq!(run.code, 2, "an endpoint without a method: {}", run.stderr);
}

fn temp_file(dir: &tempfile::TempDir, name: &str) -> PathBuf {
    dir.path().join(name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redb_end_to_end() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = temp_file(&dir, "records.redb");
    let url = format!("redb://{}", path.display());
    let open: Open = Box::new(move || {
        let path = path.clone();
        Box::pin(async move {
            let store =
                tokio::task::spawn_blocking(move || idem_redb::RedbStore::open(&path, idem_redb::Config::default()))
                    .await
                    .expect("join")
                    .expect("open redb");
            Arc::new(store) as Arc<dyn Store>
        })
    });
    operator_story(&url, open, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_end_to_end() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = temp_file(&dir, "records.db");
    let url = format!("sqlite://{}", path.display());
    let open: Open = Box::new(move || {
        let path = path.clone();
        Box::pin(async move {
            let store = tokio::task::spawn_blocking(move || {
                idem_sqlite::SqliteStore::open(&path, idem_sqlite::Config::default())
            })
            .await
            .expect("join")
            .expect("open sqlite");
            Arc::new(store) as Arc<dyn Store>
        })
    });
    operator_story(&url, open, false).await;
}

#[cfg(feature = "live-tests")]
fn redis_config(prefix: &str) -> idem_redis::Config {
    idem_redis::Config::default().with_prefix(prefix).with_eviction_check(idem_redis::EvictionCheck::Warn)
}

#[cfg(feature = "live-tests")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_end_to_end() {
    let server = std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
    let prefix = format!("idem-cli-test-{}:", uuid::Uuid::new_v4().simple());
    let url = format!("{server}?prefix={prefix}");
    let open: Open = Box::new(move || {
        let (server, prefix) = (server.clone(), prefix.clone());
        Box::pin(async move {
            let store = idem_redis::RedisStore::connect(&server, redis_config(&prefix)).await.expect("Redis on 6379");
            Arc::new(store) as Arc<dyn Store>
        })
    });
    operator_story(&url, open, true).await;
}

#[cfg(feature = "live-tests")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_end_to_end() {
    let nodes: Vec<String> = match std::env::var("IDEM_REDIS_CLUSTER_URLS") {
        Ok(v) => v.split(',').map(|s| s.trim().to_owned()).filter(|s| !s.is_empty()).collect(),
        Err(_) => (7000..=7005).map(|p| format!("redis://127.0.0.1:{p}")).collect(),
    };
    let hosts: Vec<&str> = nodes.iter().map(|n| n.trim_start_matches("redis://").trim_end_matches('/')).collect();
    let prefix = format!("idem-cli-test-{}:", uuid::Uuid::new_v4().simple());
    let url = format!("redis-cluster://{}?prefix={prefix}", hosts.join(","));
    let open: Open = Box::new(move || {
        let (nodes, prefix) = (nodes.clone(), prefix.clone());
        Box::pin(async move {
            let store = idem_redis::RedisStore::connect_cluster(&nodes, redis_config(&prefix))
                .await
                .expect("the Redis Cluster (scripts/redis-cluster, or IDEM_REDIS_CLUSTER_URLS)");
            Arc::new(store) as Arc<dyn Store>
        })
    });
    operator_story(&url, open, true).await;
}

#[cfg(feature = "live-tests")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_end_to_end() {
    let server =
        std::env::var("IDEM_POSTGRES_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    // The Postgres suites' naming (`idem_test_<unix seconds>_...`), so a run that dies
    // before dropping its schema is cleaned up by their next run.
    let secs = SystemTime::now().duration_since(UNIX_EPOCH).expect("clock").as_secs();
    let schema = format!("idem_test_{secs}_cli{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let url = format!("{server}?schema={schema}");
    let open: Open = {
        let (server, schema) = (server.clone(), schema.clone());
        Box::new(move || {
            let (server, schema) = (server.clone(), schema.clone());
            Box::pin(async move {
                let config = idem_postgres::Config::default().with_schema(&schema);
                let store = idem_postgres::PostgresStore::connect(&server, config).await.expect("Postgres on 5432");
                Arc::new(store) as Arc<dyn Store>
            })
        })
    };
    // The schema goes away whether or not the story passes.
    let dropper = SchemaDrop { server: server.clone(), schema: schema.clone() };
    operator_story(&url, open, false).await;
    dropper.drop_now().await;
}

#[cfg(feature = "live-tests")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_end_to_end() {
    let server = std::env::var("IDEM_MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned());
    // The MySQL suite's naming (`idem_test_<unix seconds>_...`), so a run that dies before
    // dropping its tables is cleaned up by that suite's next run.
    let secs = SystemTime::now().duration_since(UNIX_EPOCH).expect("clock").as_secs();
    let prefix = format!("idem_test_{secs}_cli{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let url = format!("{server}?prefix={prefix}");
    let open: Open = {
        let (server, prefix) = (server.clone(), prefix.clone());
        Box::new(move || {
            let (server, prefix) = (server.clone(), prefix.clone());
            Box::pin(async move {
                // Creates the tables: the CLI itself never does.
                let config = idem_mysql::Config::default().with_table_prefix(&prefix);
                let store = idem_mysql::MySqlStore::connect(&server, config).await.expect("MariaDB on 3306");
                Arc::new(store) as Arc<dyn Store>
            })
        })
    };
    operator_story(&url, open, false).await;
    let store = idem_mysql::MySqlStore::connect(&server, idem_mysql::Config::default().with_table_prefix(&prefix))
        .await
        .expect("MariaDB on 3306");
    let drop = format!("DROP TABLE `{prefix}_records`, `{prefix}_journal`, `{prefix}_schema_migrations`");
    idem_mysql::sqlx::raw_sql(&drop).execute(store.pool()).await.expect("drop tables");
}

#[cfg(all(feature = "live-tests", feature = "dynamodb"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamodb_end_to_end() {
    use idem_dynamodb::aws_sdk_dynamodb::config::{BehaviorVersion, Credentials, Region};
    let endpoint = std::env::var("IDEM_DYNAMODB_URL").unwrap_or_else(|_| "http://127.0.0.1:5005".to_owned());
    let table = format!("idem-cli-test-{}", uuid::Uuid::new_v4().simple());
    let url = format!("dynamodb://{table}?endpoint={endpoint}&region=us-east-1");
    let open: Open = Box::new(move || {
        let (endpoint, table) = (endpoint.clone(), table.clone());
        Box::pin(async move {
            let (key, secret) = match emulator_credentials("dynamodb:").as_slice() {
                [] => (
                    std::env::var("AWS_ACCESS_KEY_ID").expect("key"),
                    std::env::var("AWS_SECRET_ACCESS_KEY").expect("secret"),
                ),
                _ => ("test".to_owned(), "test".to_owned()),
            };
            let http = aws_smithy_http_client::Builder::new()
                .tls_provider(aws_smithy_http_client::tls::Provider::Rustls(
                    aws_smithy_http_client::tls::rustls_provider::CryptoMode::Ring,
                ))
                .build_https();
            let config = idem_dynamodb::aws_sdk_dynamodb::Config::builder()
                .behavior_version(BehaviorVersion::latest())
                .region(Region::new("us-east-1"))
                .endpoint_url(&endpoint)
                .credentials_provider(Credentials::new(key, secret, None, None, "idem-cli-tests"))
                .http_client(http)
                .build();
            let client = idem_dynamodb::aws_sdk_dynamodb::Client::from_conf(config);
            // Creates the table: the CLI itself never does.
            let store =
                idem_dynamodb::DynamoStore::from_client(client, idem_dynamodb::Config::default().with_table(table))
                    .await
                    .expect("DynamoDB emulator on 127.0.0.1:5005 (scripts/moto, or IDEM_DYNAMODB_URL)");
            Arc::new(store) as Arc<dyn Store>
        })
    });
    operator_story(&url, open, false).await;
}

/// Drops the test's schema.
#[cfg(feature = "live-tests")]
struct SchemaDrop {
    server: String,
    schema: String,
}

#[cfg(feature = "live-tests")]
impl SchemaDrop {
    async fn drop_now(self) {
        let store = idem_postgres::PostgresStore::connect(
            &self.server,
            idem_postgres::Config::default().with_schema(&self.schema),
        )
        .await
        .expect("Postgres");
        let drop = format!("DROP SCHEMA \"{}\" CASCADE", self.schema);
        idem_postgres::sqlx::raw_sql(&drop).execute(store.pool()).await.expect("drop schema");
    }
}

/// Opens a fresh redb store at `path` from the test process.
async fn open_redb(path: PathBuf) -> Arc<dyn Store> {
    let store = tokio::task::spawn_blocking(move || idem_redb::RedbStore::open(&path, idem_redb::Config::default()))
        .await
        .expect("join")
        .expect("open redb");
    Arc::new(store)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_by_bearer_token_finds_the_default_resolvers_record() {
    // Regression: `--principal TOKEN` misses every record the default `BearerToken` resolver
    // wrote (stored as `bearer:<hash>`), and the CLI had no way to name it from the token.
    let dir = tempfile::tempdir().expect("temp dir");
    let path = temp_file(&dir, "bearer.redb");
    let url = format!("redb://{}", path.display());
    let token = "alice";
    let store = open_redb(path.clone()).await;
    let record = claimed(
        store.as_ref(),
        request(&BearerToken::principal_for(token.as_bytes()), "k-bearer", LONG_LEASE, RETENTION),
    )
    .await;
    drop(store);
    let by_token = ["--json", "inspect", "--bearer", token, "--endpoint", ENDPOINT, "--key", "k-bearer"];
    let run = idem(&url, &by_token);
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_eq!(run.json()["record"]["record_id"], record.id.to_hex());
    assert_eq!(run.json()["record"]["principal"], BearerToken::principal_for(token.as_bytes()));
    let run = idem(&url, &["inspect", "--principal", token, "--endpoint", ENDPOINT, "--key", "k-bearer"]);
    assert_eq!(run.code, 1, "the raw token is not the stored principal: {}", run.stderr);
    let run = idem(&url, &["inspect", "--principal", "p", "--bearer", token, "--endpoint", ENDPOINT, "--key", "k"]);
    assert_eq!(run.code, 2, "--principal and --bearer together: {}", run.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sealed_response_is_shown_as_sealed_not_as_status_0() {
    // Regression: `inspect` showed a response stored by `IdempotencyLayer::with_sealing` as
    // "status 0, 1 headers", as if the handler had answered with status 0.
    use axum::routing::post;
    use tower::ServiceExt as _;
    let dir = tempfile::tempdir().expect("temp dir");
    let path = temp_file(&dir, "sealed.redb");
    let url = format!("redb://{}", path.display());
    let store = open_redb(path.clone()).await;
    let sealing = idem_http::Sealing::new(idem_http::SealingKeys::new(7, [9; 32]));
    let layer = IdempotencyLayer::new(store).with_sealing(sealing);
    let app = axum::Router::new()
        .route("/v1/workers/{id}/reboot", post(|| async { (axum::http::StatusCode::CREATED, "rebooted") }))
        .layer(layer);
    let req = axum::http::Request::post(PATH)
        .header("authorization", "Bearer sealer")
        .header("idempotency-key", "k-sealed")
        .header("content-type", "application/json")
        .body(axum::body::Body::from(body("k-sealed")))
        .expect("request");
    let resp = app.oneshot(req).await.expect("infallible");
    assert_eq!(resp.status().as_u16(), 201);
    // The layer (and its store) must be gone before the binary opens the redb file.
    let target = ["inspect", "--bearer", "sealer", "--endpoint", ENDPOINT, "--key", "k-sealed"];
    let mut json_args = vec!["--json"];
    json_args.extend(target);
    let run = idem(&url, &json_args);
    assert_eq!(run.code, 0, "{}", run.stderr);
    let response = &run.json()["record"]["response"];
    assert_eq!(response["sealed"]["key_id"], 7, "{response}");
    assert!(response["status"].is_null(), "{response}");
    assert!(response["headers"].is_null(), "{response}");
    let run = idem(&url, &target);
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(run.stdout.contains("sealed with key 7"), "{}", run.stdout);
    assert!(!run.stdout.contains("response       0,"), "{}", run.stdout);
}

/// `stats` on a Redis Cluster shows each primary's replicas against `wait=N` from the URL
/// (the shared cluster: one replica per primary), and a primary short of it is flagged.
#[cfg(feature = "live-tests")]
#[test]
fn stats_shows_each_primarys_replicas_against_wait() {
    let hosts: Vec<String> = match std::env::var("IDEM_REDIS_CLUSTER_URLS") {
        Ok(v) => {
            v.split(',').map(|s| s.trim().trim_start_matches("redis://").trim_end_matches('/').to_owned()).collect()
        }
        Err(_) => (7000..=7005).map(|p| format!("127.0.0.1:{p}")).collect(),
    };
    let prefix = format!("idem-cli-test-{}:", uuid::Uuid::new_v4().simple());
    for (wait, short) in [(1, false), (2, true)] {
        let url = format!("redis-cluster://{}?prefix={prefix}&wait={wait}", hosts.join(","));
        let run = idem(&url, &["--json", "stats"]);
        assert_eq!(run.code, 0, "{}", run.stderr);
        let replicas = &run.json()["replicas"];
        assert_eq!(replicas["required"], wait);
        let primaries = replicas["primaries"].as_array().expect("primaries");
        assert_eq!(primaries.len(), 3, "{replicas}");
        for p in primaries {
            assert_eq!((p["replicas"].as_u64(), p["short"].as_bool()), (Some(1), Some(short)), "{p}");
        }
        let text = idem(&url, &["stats"]).stdout;
        assert_eq!(text.contains("SHORT"), short, "{text}");
    }
}
