//! Sealed responses through the layer on every backend: a replay opens what
//! `complete` sealed; a sealed response moved onto another record with the backend's own
//! commands, or with one byte flipped, is answered 503 and the handler does not run again;
//! the stored bytes never hold the plaintext; key rotation; unsealed records.
//!
//! Real servers: Redis at `IDEM_REDIS_URL` (default `redis://127.0.0.1:6379`) under a
//! fresh key prefix, PostgreSQL at `IDEM_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`) in a fresh schema; both removed afterwards.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use idem_core::seal::{SEALED_HEADER, SEALED_STATUS, Sealing, SealingKeys};
use idem_core::{Endpoint, IdempotencyKey, MemoryStore, RecordId, Scope, Store};
use idem_http::IdempotencyLayer;
use redb::{ReadableDatabase, ReadableTable};
use tower::ServiceExt;

const PRINCIPAL: &str = "tenant-sealed";

/// The handler: counts its runs, answers 201 with a secret in a header and in the body.
#[derive(Clone)]
struct App {
    runs: Arc<AtomicUsize>,
    secret: String,
}

impl App {
    fn new() -> Self {
        Self { runs: Arc::default(), secret: format!("bootstrap-{}", uuid::Uuid::new_v4().simple()) }
    }

    fn router(&self, layer: IdempotencyLayer) -> Router {
        let (runs, secret) = (self.runs.clone(), self.secret.clone());
        Router::new()
            .route(
                "/v1/workers",
                post(move || {
                    let (runs, secret) = (runs.clone(), secret.clone());
                    async move {
                        runs.fetch_add(1, Ordering::SeqCst);
                        (
                            StatusCode::CREATED,
                            [("x-bootstrap-token", secret.clone())],
                            format!("{{\"token\":\"{secret}\"}}"),
                        )
                    }
                }),
            )
            .layer(layer.with_principal_resolver(|_: &http::request::Parts| Some(PRINCIPAL.to_owned())))
    }

    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }
}

fn layer(store: Arc<dyn Store>, keys: Option<SealingKeys>) -> IdempotencyLayer {
    let layer = IdempotencyLayer::new(store);
    match keys {
        Some(keys) => layer.with_sealing(Sealing::new(keys)),
        None => layer,
    }
}

fn record_id(key: &str) -> RecordId {
    let scope = Scope::new(PRINCIPAL, Endpoint::new("POST", "/v1/workers")).expect("scope");
    scope.record_id(&IdempotencyKey::parse(key.as_bytes()).expect("key"))
}

/// Sends one keyed POST; returns status, `Idempotent-Replayed`, the token header and body.
async fn send(router: &Router, key: &str) -> (StatusCode, bool, Option<String>, String) {
    let req = Request::post("/v1/workers")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Body::from("{\"image\":\"base\"}"))
        .expect("request");
    let res = router.clone().oneshot(req).await.expect("infallible");
    let status = res.status();
    let replayed = res.headers().get("idempotent-replayed").is_some_and(|v| v == "true");
    let token = res.headers().get("x-bootstrap-token").map(|v| v.to_str().expect("ascii").to_owned());
    let body = res.into_body().collect().await.expect("body").to_bytes();
    (status, replayed, token, String::from_utf8_lossy(&body).into_owned())
}

fn keys_v1() -> SealingKeys {
    SealingKeys::new(1, [0x11; 32])
}

/// A backend, and its own commands on the stored response bytes.
enum Raw {
    Memory,
    Redb(idem_redb::RedbStore),
    Sqlite(idem_sqlite::SqliteStore),
    Redis { store: idem_redis::RedisStore, conn: redis::aio::MultiplexedConnection },
    Postgres { pool: idem_postgres::sqlx::PgPool, schema: String },
}

struct Backend {
    store: Arc<dyn Store>,
    raw: Raw,
    cleanup: Option<Box<dyn FnOnce() + Send>>,
    _dir: Option<tempfile::TempDir>,
}

impl Drop for Backend {
    fn drop(&mut self) {
        if let Some(cleanup) = self.cleanup.take() {
            cleanup();
        }
    }
}

fn redis_url() -> String {
    std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

fn postgres_url() -> String {
    std::env::var("IDEM_POSTGRES_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

async fn open(name: &'static str) -> Backend {
    match name {
        "memory" => {
            let s = MemoryStore::new();
            Backend { store: Arc::new(s), raw: Raw::Memory, cleanup: None, _dir: None }
        }
        "redb" => {
            let dir = tempfile::tempdir().expect("temp dir");
            let s = idem_redb::RedbStore::open(dir.path().join("idem.redb"), idem_redb::Config::default())
                .expect("open redb");
            Backend { store: Arc::new(s.clone()), raw: Raw::Redb(s), cleanup: None, _dir: Some(dir) }
        }
        "sqlite" => {
            let dir = tempfile::tempdir().expect("temp dir");
            let s = idem_sqlite::SqliteStore::open(dir.path().join("idem.sqlite3"), idem_sqlite::Config::default())
                .expect("open sqlite");
            Backend { store: Arc::new(s.clone()), raw: Raw::Sqlite(s), cleanup: None, _dir: Some(dir) }
        }
        "redis" => {
            let url = redis_url();
            let prefix = format!("idem-test:sealed:{}:", uuid::Uuid::new_v4().simple());
            let s = idem_redis::RedisStore::connect(&url, idem_redis::Config::default().with_prefix(prefix.clone()))
                .await
                .unwrap_or_else(|e| panic!("Redis is not reachable at {url}: {e}; these tests need a real Redis"));
            let conn = redis::Client::open(url.as_str())
                .expect("url")
                .get_multiplexed_async_connection()
                .await
                .expect("redis connection");
            let cleanup = move || {
                // Drop runs inside the test's runtime: do the blocking I/O on a thread.
                let _ = std::thread::spawn(move || -> redis::RedisResult<()> {
                    let mut c = redis::Client::open(url.as_str())?.get_connection()?;
                    let keys: Vec<String> = redis::cmd("KEYS").arg(format!("{prefix}*")).query(&mut c)?;
                    if !keys.is_empty() {
                        redis::cmd("DEL").arg(keys).query::<()>(&mut c)?;
                    }
                    Ok(())
                })
                .join();
            };
            Backend {
                store: Arc::new(s.clone()),
                raw: Raw::Redis { store: s, conn },
                cleanup: Some(Box::new(cleanup)),
                _dir: None,
            }
        }
        "postgres" => {
            let url = postgres_url();
            let schema = format!("idem_test_sealed_{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
            let s = idem_postgres::PostgresStore::connect(
                &url,
                idem_postgres::Config::default().with_schema(schema.clone()).with_max_connections(2),
            )
            .await
            .unwrap_or_else(|e| panic!("PostgreSQL is not reachable at {url}: {e}; these tests need a real server"));
            let cleanup = {
                let schema = schema.clone();
                move || {
                    let _ = std::thread::spawn(move || {
                        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
                        rt.block_on(async {
                            use idem_postgres::sqlx::{self, Connection as _};
                            if let Ok(mut c) = sqlx::PgConnection::connect(&url).await {
                                let drop = format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE");
                                let _ = sqlx::Executor::execute(&mut c, sqlx::raw_sql(&drop)).await;
                            }
                        });
                    })
                    .join();
                }
            };
            Backend {
                store: Arc::new(s.clone()),
                raw: Raw::Postgres { pool: s.pool().clone(), schema },
                cleanup: Some(Box::new(cleanup)),
                _dir: None,
            }
        }
        other => unreachable!("no backend {other}"),
    }
}

impl Backend {
    /// The response bytes exactly as the backend keeps them (for redb, the whole record).
    async fn raw_response(&mut self, id: RecordId) -> Option<Vec<u8>> {
        match &mut self.raw {
            Raw::Memory => None,
            Raw::Redb(s) => {
                let tx = s.database().expect("the database is open").begin_read().expect("read tx");
                let table = tx.open_table(idem_redb::table::RECORDS).expect("table");
                table.get(id.as_bytes()).expect("get").map(|v| v.value().to_vec())
            }
            Raw::Sqlite(s) => {
                let c = rusqlite::Connection::open(s.path()).expect("open");
                c.query_row("SELECT response FROM idem_records WHERE id = ?1", [&id.as_bytes()[..]], |r| r.get(0))
                    .expect("row")
            }
            Raw::Redis { store, conn } => {
                redis::cmd("HGET").arg(store.record_key(id)).arg("r").query_async(conn).await.expect("HGET")
            }
            Raw::Postgres { pool, schema } => {
                let sql = format!("SELECT response FROM \"{schema}\".records WHERE id = $1");
                idem_postgres::sqlx::query_scalar(&sql).bind(&id.as_bytes()[..]).fetch_one(&*pool).await.expect("row")
            }
        }
    }

    /// Copies record `from`'s stored response onto record `to`, with the backend's own
    /// commands (no `Store` call). Returns false for the memory store, which has none.
    async fn move_response(&mut self, from: RecordId, to: RecordId) -> bool {
        match &mut self.raw {
            Raw::Memory => return false,
            Raw::Redb(s) => {
                let db = s.database().expect("the database is open");
                let tx = db.begin_write().expect("write tx");
                {
                    let mut table = tx.open_table(idem_redb::table::RECORDS).expect("table");
                    let src = idem_core::codec::decode(table.get(from.as_bytes()).expect("get").expect("from").value())
                        .expect("decodes");
                    let mut dst = idem_core::codec::decode(table.get(to.as_bytes()).expect("get").expect("to").value())
                        .expect("decodes");
                    dst.response = src.response;
                    table.insert(to.as_bytes(), idem_core::codec::encode(&dst).as_slice()).expect("insert");
                }
                tx.commit().expect("commit");
            }
            Raw::Sqlite(s) => {
                let c = rusqlite::Connection::open(s.path()).expect("open");
                let n = c
                    .execute(
                        "UPDATE idem_records SET response = (SELECT response FROM idem_records WHERE id = ?1) WHERE id = ?2",
                        [&from.as_bytes()[..], &to.as_bytes()[..]],
                    )
                    .expect("update");
                assert_eq!(n, 1);
            }
            Raw::Redis { store, conn } => {
                let bytes: Vec<u8> =
                    redis::cmd("HGET").arg(store.record_key(from)).arg("r").query_async(conn).await.expect("HGET");
                let () = redis::cmd("HSET")
                    .arg(store.record_key(to))
                    .arg("r")
                    .arg(bytes)
                    .query_async(conn)
                    .await
                    .expect("HSET");
            }
            Raw::Postgres { pool, schema } => {
                let sql = format!(
                    "UPDATE \"{schema}\".records SET response = (SELECT response FROM \"{schema}\".records WHERE id = $1) WHERE id = $2"
                );
                let q = idem_postgres::sqlx::query(&sql).bind(&from.as_bytes()[..]).bind(&to.as_bytes()[..]);
                assert_eq!(q.execute(&*pool).await.expect("update").rows_affected(), 1);
            }
        }
        true
    }

    /// Flips the last byte of record `id`'s stored response (the end of the AEAD tag) with
    /// the backend's own commands. Returns false for the memory store.
    async fn flip_last_byte(&mut self, id: RecordId) -> bool {
        let Some(mut bytes) = self.raw_response(id).await else { return false };
        if let Raw::Redb(_) = self.raw {
            // redb keeps the whole record: flip the last byte of the sealed body inside it
            // (an `Identity` body is stored as is, so this is one byte of the stored value).
            let mut record = idem_core::codec::decode(&bytes).expect("decodes");
            let Some(idem_core::StoredBody::Identity(body)) = record.response.as_mut().map(|r| &mut r.body) else {
                panic!("redb: not a sealed body");
            };
            let last = body.len() - 1;
            body[last] ^= 0x01;
            let flipped = idem_core::codec::encode(&record);
            assert_eq!(flipped.len(), bytes.len());
            assert_eq!(flipped.iter().zip(&bytes).filter(|(a, b)| a != b).count(), 1, "one byte differs");
            bytes = flipped;
        } else {
            let last = bytes.len() - 1;
            bytes[last] ^= 0x01;
        }
        match &mut self.raw {
            Raw::Memory => return false,
            Raw::Redb(s) => {
                let db = s.database().expect("the database is open");
                let tx = db.begin_write().expect("write tx");
                tx.open_table(idem_redb::table::RECORDS)
                    .expect("table")
                    .insert(id.as_bytes(), bytes.as_slice())
                    .expect("insert");
                tx.commit().expect("commit");
            }
            Raw::Sqlite(s) => {
                let c = rusqlite::Connection::open(s.path()).expect("open");
                let n = c
                    .execute(
                        "UPDATE idem_records SET response = ?1 WHERE id = ?2",
                        rusqlite::params![bytes, &id.as_bytes()[..]],
                    )
                    .expect("update");
                assert_eq!(n, 1);
            }
            Raw::Redis { store, conn } => {
                let () = redis::cmd("HSET")
                    .arg(store.record_key(id))
                    .arg("r")
                    .arg(bytes)
                    .query_async(conn)
                    .await
                    .expect("HSET");
            }
            Raw::Postgres { pool, schema } => {
                let sql = format!("UPDATE \"{schema}\".records SET response = $1 WHERE id = $2");
                let q = idem_postgres::sqlx::query(&sql).bind(&bytes).bind(&id.as_bytes()[..]);
                assert_eq!(q.execute(&*pool).await.expect("update").rows_affected(), 1);
            }
        }
        true
    }
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle.as_bytes())
}

/// The whole sealing story on one backend.
async fn sealed_round_trip_move_and_flip(name: &'static str) {
    let mut backend = open(name).await;
    let app = App::new();
    let router = app.router(layer(backend.store.clone(), Some(keys_v1())));
    let (k1, k2) = (format!("k1-{}", uuid::Uuid::new_v4().simple()), format!("k2-{}", uuid::Uuid::new_v4().simple()));

    // First request runs the handler; the retry replays status, header and body.
    let first = send(&router, &k1).await;
    assert_eq!((first.0, first.1), (StatusCode::CREATED, false), "{name}: {first:?}");
    let replay = send(&router, &k1).await;
    assert_eq!(replay.0, StatusCode::CREATED, "{name}: {replay:?}");
    assert!(replay.1, "{name}: replayed");
    assert_eq!(replay.2.as_deref(), Some(app.secret.as_str()), "{name}: the header is replayed");
    assert_eq!(replay.3, first.3, "{name}: the body is replayed");
    assert_eq!(app.runs(), 1, "{name}");

    // The backend keeps the sealed form only: status 0, one header, no plaintext.
    let (id1, id2) = (record_id(&k1), record_id(&k2));
    let stored = backend.store.get(id1).await.expect("get").expect("the record is there").response.expect("completed");
    assert_eq!(stored.status, SEALED_STATUS, "{name}");
    assert_eq!(stored.header(SEALED_HEADER), Some(&b"v1;1"[..]), "{name}");
    assert!(!contains(&idem_core::codec::encode_response(&stored), &app.secret), "{name}: plaintext through the Store");
    if let Some(raw) = backend.raw_response(id1).await {
        assert!(!contains(&raw, &app.secret), "{name}: the secret is in the stored bytes");
        assert!(!contains(&raw, "x-bootstrap-token"), "{name}: a header name is in the stored bytes");
    }

    // Another record of the same tenant gets a sealed response of its own.
    assert_eq!(send(&router, &k2).await.0, StatusCode::CREATED, "{name}");
    assert_eq!(app.runs(), 2, "{name}");

    // k1's sealed response copied onto k2 with the backend's own commands: 503, no run.
    if backend.move_response(id1, id2).await {
        let moved = send(&router, &k2).await;
        assert_eq!(moved.0, StatusCode::SERVICE_UNAVAILABLE, "{name}: a moved seal opened: {moved:?}");
        assert!(!moved.3.contains(&app.secret), "{name}: the moved secret leaked");
        assert_eq!(app.runs(), 2, "{name}: a moved seal ran the handler");
        // k1 itself is untouched.
        assert!(send(&router, &k1).await.1, "{name}");
    }
    // One byte flipped in place: 503, no run.
    if backend.flip_last_byte(id1).await {
        let flipped = send(&router, &k1).await;
        assert_eq!(flipped.0, StatusCode::SERVICE_UNAVAILABLE, "{name}: a flipped seal opened: {flipped:?}");
        assert_eq!(flipped.2, None, "{name}");
        assert_eq!(app.runs(), 2, "{name}: a flipped seal ran the handler");
    }
    if name != "memory" {
        // Without sealing the same handler's secret is in the stored bytes: the check
        // above can fail.
        let plain = App::new();
        let plain_router = plain.router(layer(backend.store.clone(), None));
        let k3 = format!("k3-{}", uuid::Uuid::new_v4().simple());
        assert_eq!(send(&plain_router, &k3).await.0, StatusCode::CREATED);
        let raw = backend.raw_response(record_id(&k3)).await.expect("raw bytes");
        assert!(contains(&raw, &plain.secret), "{name}: unsealed bytes hold the plaintext");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_sealed_round_trip() {
    sealed_round_trip_move_and_flip("memory").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redb_sealed_round_trip_move_and_flip() {
    sealed_round_trip_move_and_flip("redb").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_sealed_round_trip_move_and_flip() {
    sealed_round_trip_move_and_flip("sqlite").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_sealed_round_trip_move_and_flip() {
    sealed_round_trip_move_and_flip("redis").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_sealed_round_trip_move_and_flip() {
    sealed_round_trip_move_and_flip("postgres").await;
}

/// Rotation: the old key still opens, the new key seals, a record sealed by a removed key
/// gives 503 without a second run.
async fn rotation(name: &'static str) {
    let backend = open(name).await;
    let app = App::new();
    let (old, new) =
        (format!("old-{}", uuid::Uuid::new_v4().simple()), format!("new-{}", uuid::Uuid::new_v4().simple()));
    let v1 = app.router(layer(backend.store.clone(), Some(keys_v1())));
    assert_eq!(send(&v1, &old).await.0, StatusCode::CREATED);

    let both = app.router(layer(backend.store.clone(), Some(keys_v1().with_key(2, [0x22; 32]))));
    let replay = send(&both, &old).await;
    assert!(replay.0 == StatusCode::CREATED && replay.1, "{name}: the old key no longer opens: {replay:?}");
    assert_eq!(send(&both, &new).await.0, StatusCode::CREATED);
    let stored = backend.store.get(record_id(&new)).await.expect("get").expect("record").response.expect("completed");
    assert_eq!(stored.header(SEALED_HEADER), Some(&b"v1;2"[..]), "{name}: the newest key seals");
    assert_eq!(app.runs(), 2);

    let v2_only = app.router(layer(backend.store.clone(), Some(SealingKeys::new(2, [0x22; 32]))));
    assert!(send(&v2_only, &new).await.1, "{name}: key 2 opens its own seal");
    let removed = send(&v2_only, &old).await;
    assert_eq!(removed.0, StatusCode::SERVICE_UNAVAILABLE, "{name}: {removed:?}");
    assert_eq!(app.runs(), 2, "{name}: a record sealed by a removed key ran the handler");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_rotation() {
    rotation("memory").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_rotation() {
    rotation("redis").await;
}

/// Unsealed records once sealing is on: refused by default (a writer could otherwise
/// swap a sealed response for a plain one), replayed during a migration when accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_unsealed_records_are_refused_unless_accepted() {
    let backend = open("postgres").await;
    let app = App::new();
    let key = format!("plain-{}", uuid::Uuid::new_v4().simple());
    let plain = app.router(layer(backend.store.clone(), None));
    assert_eq!(send(&plain, &key).await.0, StatusCode::CREATED);

    let strict = app.router(layer(backend.store.clone(), Some(keys_v1())));
    assert_eq!(send(&strict, &key).await.0, StatusCode::SERVICE_UNAVAILABLE);
    let migrating =
        IdempotencyLayer::new(backend.store.clone()).with_sealing(Sealing::new(keys_v1()).accept_unsealed(true));
    let migrating = app.router(migrating);
    let replay = send(&migrating, &key).await;
    assert!(replay.0 == StatusCode::CREATED && replay.1, "{replay:?}");
    assert_eq!(replay.2.as_deref(), Some(app.secret.as_str()));
    assert_eq!(app.runs(), 1, "an unsealed record ran the handler again");
}

/// A router whose handler completes its own record on `raw` (the store without the
/// layer's wrappers, as `PostgresStore::complete_in` writes in the handler's transaction)
/// and says so with `CompletedByHandler`; `use_stored_form` picks what it stores.
fn completing_router(
    raw: Arc<MemoryStore>,
    keys: SealingKeys,
    runs: Arc<AtomicUsize>,
    use_stored_form: bool,
) -> Router {
    use axum::extract::Extension;
    use axum::response::IntoResponse;
    use idem_core::StoredResponse;
    use idem_http::{IdempotencyContext, ResponseCaching};
    let store: Arc<dyn Store> = raw.clone();
    let handler = move |Extension(ctx): Extension<IdempotencyContext>| {
        let (raw, runs) = (raw.clone(), runs.clone());
        async move {
            runs.fetch_add(1, Ordering::SeqCst);
            let plain = StoredResponse::new(201, vec![], b"{\"token\":\"own-secret\"}".to_vec());
            let stored = if use_stored_form { ctx.stored_form(plain) } else { plain };
            raw.complete(ctx.record_id(), ctx.token(), stored).await.expect("the handler's own completion");
            (StatusCode::CREATED, Extension(ResponseCaching::CompletedByHandler), "{\"token\":\"own-secret\"}")
                .into_response()
        }
    };
    Router::new()
        .route("/v1/workers", post(handler))
        .layer(layer(store, Some(keys)).with_principal_resolver(|_: &http::request::Parts| Some(PRINCIPAL.to_owned())))
}

// Pins: a handler completing its own record (CompletedByHandler) under sealing had no way
// to seal with the layer's keys, so it stored the plain response: the secret sat in the
// store unsealed and every retry got 503. `IdempotencyContext::stored_form` seals it.
#[tokio::test]
async fn a_handler_completing_its_own_record_stores_it_sealed_and_retries_replay() {
    let raw = Arc::new(MemoryStore::new());
    let runs = Arc::new(AtomicUsize::new(0));
    let router = completing_router(raw.clone(), keys_v1(), runs.clone(), true);
    let (status, replayed, _, body) = send(&router, "own-1").await;
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    assert!(body.contains("own-secret"));
    let stored = raw.get(record_id("own-1")).await.expect("get").expect("record").response.expect("completed");
    assert_eq!(stored.status, SEALED_STATUS, "the handler's completion is stored sealed");
    assert!(stored.header(SEALED_HEADER).is_some());
    assert!(!contains(&idem_core::codec::encode_response(&stored), "own-secret"), "plaintext in the store");
    let (status, replayed, _, body) = send(&router, "own-1").await;
    assert_eq!((status, replayed), (StatusCode::CREATED, true), "the retry replays the opened response");
    assert!(body.contains("own-secret"));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// What a handler that stores the plain response anyway gets: its own answer (the
/// completion committed), then 503 for every retry and never a second run.
#[tokio::test]
async fn a_handler_completing_its_own_record_unsealed_gets_503_on_retry_not_a_rerun() {
    let raw = Arc::new(MemoryStore::new());
    let runs = Arc::new(AtomicUsize::new(0));
    let router = completing_router(raw.clone(), keys_v1(), runs.clone(), false);
    assert_eq!(send(&router, "own-2").await.0, StatusCode::CREATED);
    let (status, replayed, _, body) = send(&router, "own-2").await;
    assert_eq!((status, replayed), (StatusCode::SERVICE_UNAVAILABLE, false));
    assert!(!body.contains("own-secret"));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A memory store on which the first attempt of a key finishes right after a duplicate's
/// claim found it in flight: its response is written plain (as by an instance without
/// sealing), so the duplicate's next read finds a completed record that does not open.
#[derive(Debug, Default)]
struct FinishesPlainAfterClaim {
    inner: MemoryStore,
}

#[async_trait::async_trait]
impl Store for FinishesPlainAfterClaim {
    async fn claim(&self, req: idem_core::ClaimRequest) -> Result<idem_core::ClaimOutcome, idem_core::StoreError> {
        let out = self.inner.claim(req).await?;
        if let idem_core::ClaimOutcome::Existing { record, .. } = &out
            && record.state == idem_core::RecordState::InFlight
        {
            let plain = idem_core::StoredResponse::new(201, vec![], b"{\"token\":\"plain\"}".to_vec());
            self.inner.complete(record.id, record.token, plain).await?;
        }
        Ok(out)
    }
    async fn reclaim(
        &self,
        req: idem_core::ReclaimRequest,
    ) -> Result<idem_core::ReclaimOutcome, idem_core::StoreError> {
        self.inner.reclaim(req).await
    }
    async fn complete(
        &self,
        id: RecordId,
        token: idem_core::FencingToken,
        r: idem_core::StoredResponse,
    ) -> Result<idem_core::Receipt, idem_core::StoreError> {
        self.inner.complete(id, token, r).await
    }
    async fn fail(
        &self,
        id: RecordId,
        token: idem_core::FencingToken,
    ) -> Result<idem_core::Receipt, idem_core::StoreError> {
        self.inner.fail(id, token).await
    }
    async fn extend(
        &self,
        id: RecordId,
        token: idem_core::FencingToken,
        lease: std::time::Duration,
    ) -> Result<idem_core::Receipt, idem_core::StoreError> {
        self.inner.extend(id, token, lease).await
    }
    async fn get(&self, id: RecordId) -> Result<Option<idem_core::Record>, idem_core::StoreError> {
        self.inner.get(id).await
    }
    async fn sweep(&self, limit: usize) -> Result<idem_core::SweepOutcome, idem_core::StoreError> {
        self.inner.sweep(limit).await
    }
    fn capabilities(&self) -> idem_core::Capabilities {
        self.inner.capabilities()
    }
}

// Pins: with a bounded in-flight wait, a record that stopped opening while the duplicate
// waited (completed unsealed, or sealed with a key this instance lacks) was answered 409
// in-flight with Retry-After, inviting retries, instead of 503 with x-should-retry: false
// like every other read of a record that does not open.
#[tokio::test]
async fn a_record_that_does_not_open_during_a_bounded_wait_is_a_503_not_a_409() {
    let store = Arc::new(FinishesPlainAfterClaim::default());
    // The first attempt: claimed with the fingerprint the duplicate's request has, still running.
    let headers: [(&str, &[u8]); 1] = [("content-type", b"application/json")];
    let fp = idem_core::Fingerprint::of(&idem_core::RequestParts {
        method: "POST",
        path: "/v1/workers",
        query: None,
        headers: &headers,
        body: b"{\"image\":\"base\"}",
    });
    let scope = Scope::new(PRINCIPAL, Endpoint::new("POST", "/v1/workers")).expect("scope");
    let key = IdempotencyKey::parse(b"wait-1").expect("key");
    let claim = idem_core::ClaimRequest::new(
        scope,
        key,
        fp,
        std::time::Duration::from_secs(60),
        std::time::Duration::from_secs(3600),
    );
    assert!(matches!(store.inner.claim(claim).await, Ok(idem_core::ClaimOutcome::Claimed(_))));
    let app = App::new();
    let waiting = layer(store.clone(), Some(keys_v1())).with_in_flight_wait(Some(std::time::Duration::from_secs(30)));
    let router = app.router(waiting);
    let req = Request::post("/v1/workers")
        .header("idempotency-key", "wait-1")
        .header("content-type", "application/json")
        .body(Body::from("{\"image\":\"base\"}"))
        .expect("request");
    let res = router.oneshot(req).await.expect("infallible");
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE, "a record that does not open is a 503");
    assert_eq!(res.headers().get("x-should-retry").map(|v| v.as_bytes()), Some(&b"false"[..]));
    assert_eq!(app.runs(), 0);
}
