//! Sealed responses through the layer: a replay opens what `complete` sealed; a sealed
//! response moved onto another record with the backend's own commands, or with one byte
//! flipped, is answered 503 and the handler does not run again; the stored bytes never
//! hold the plaintext; key rotation; unsealed records.
//!
//! The moved and flipped seals and the look at the stored bytes need the backend's raw
//! access ([`crate::Backend::read_stored`], [`crate::Backend::overwrite_stored`]); without
//! it the scenario says so in a `variant:` line and checks the rest.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use idem_core::seal::{SEALED_HEADER, SEALED_STATUS, Sealing, SealingKeys};
use idem_core::{Endpoint, IdempotencyKey, RecordId, Scope, Store};
use idem_http::IdempotencyLayer;
use tower::ServiceExt;

use super::{HttpEnv, whole_record};

/// The principal every request of these scenarios resolves to, inside the scenario's own
/// random namespace (so the scenarios are safe on a shared server).
fn principal() -> &'static str {
    static P: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    P.get_or_init(|| format!("tenant-sealed-{}", uuid::Uuid::new_v4().simple()))
}

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
            .layer(layer.with_principal_resolver(|_: &http::request::Parts| Some(principal().to_owned())))
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
    let scope = Scope::new(principal(), Endpoint::new("POST", "/v1/workers")).expect("scope");
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

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle.as_bytes())
}

/// Copies record `from`'s stored response onto record `to` with the backend's raw access
/// (no `Store` call); false if it has none. Where the backend keeps each record as one
/// value, only the response inside it moves.
async fn move_response(env: &HttpEnv, from: RecordId, to: RecordId) -> bool {
    let Some(src) = env.read_stored(from).await else { return false };
    let dst = env.read_stored(to).await.expect("raw access reads every record");
    let bytes = match (whole_record(&src, from), whole_record(&dst, to)) {
        (Some(src), Some(mut dst)) => {
            dst.response = src.response;
            idem_core::codec::encode(&dst)
        }
        _ => src,
    };
    assert!(env.overwrite_stored(to, bytes).await, "{}: read_stored works but overwrite_stored does not", env.name);
    true
}

/// Flips the last byte of record `id`'s stored response (the end of the AEAD tag) with the
/// backend's raw access; false if it has none.
async fn flip_last_byte(env: &HttpEnv, id: RecordId) -> bool {
    let Some(mut bytes) = env.read_stored(id).await else { return false };
    if let Some(mut record) = whole_record(&bytes, id) {
        // The record kept as one value: flip the last byte of the sealed body inside it
        // (an `Identity` body is stored as is, so this is one byte of the stored value).
        let Some(idem_core::StoredBody::Identity(body)) = record.response.as_mut().map(|r| &mut r.body) else {
            panic!("{}: not a sealed body", env.name);
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
    assert!(env.overwrite_stored(id, bytes).await, "{}: read_stored works but overwrite_stored does not", env.name);
    true
}

/// The whole sealing story: replay, the stored form (no plaintext through the store or in
/// the stored bytes), a seal moved onto another record and a flipped byte answered 503
/// without a second run, and the plaintext in the stored bytes without sealing (so the
/// check can fail).
pub async fn round_trip_move_and_flip(env: HttpEnv) {
    let name = env.name;
    let app = App::new();
    let router = app.router(layer(env.dyn_store(), Some(keys_v1())));
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
    let stored = env.store.record(id1).await.expect("the record is there").response.expect("completed");
    assert_eq!(stored.status, SEALED_STATUS, "{name}");
    assert_eq!(stored.header(SEALED_HEADER), Some(&b"v1;1"[..]), "{name}");
    assert!(!contains(&idem_core::codec::encode_response(&stored), &app.secret), "{name}: plaintext through the Store");
    if let Some(raw) = env.read_stored(id1).await {
        assert!(!contains(&raw, &app.secret), "{name}: the secret is in the stored bytes");
        assert!(!contains(&raw, "x-bootstrap-token"), "{name}: a header name is in the stored bytes");
    } else {
        env.report("no raw access: the stored bytes are not searched for the plaintext");
    }

    // Another record of the same tenant gets a sealed response of its own.
    assert_eq!(send(&router, &k2).await.0, StatusCode::CREATED, "{name}");
    assert_eq!(app.runs(), 2, "{name}");

    // k1's sealed response copied onto k2 with the backend's own commands: 503, no run.
    if move_response(&env, id1, id2).await {
        let moved = send(&router, &k2).await;
        assert_eq!(moved.0, StatusCode::SERVICE_UNAVAILABLE, "{name}: a moved seal opened: {moved:?}");
        assert!(!moved.3.contains(&app.secret), "{name}: the moved secret leaked");
        assert_eq!(app.runs(), 2, "{name}: a moved seal ran the handler");
        // k1 itself is untouched.
        assert!(send(&router, &k1).await.1, "{name}");
    } else {
        env.report("no raw access: a sealed response moved onto another record is not checked");
    }
    // One byte flipped in place: 503, no run.
    if flip_last_byte(&env, id1).await {
        let flipped = send(&router, &k1).await;
        assert_eq!(flipped.0, StatusCode::SERVICE_UNAVAILABLE, "{name}: a flipped seal opened: {flipped:?}");
        assert_eq!(flipped.2, None, "{name}");
        assert_eq!(app.runs(), 2, "{name}: a flipped seal ran the handler");
    } else {
        env.report("no raw access: a flipped sealed byte is not checked");
    }
    // Without sealing the same handler's secret is in the stored bytes: the check above
    // can fail.
    let plain = App::new();
    let plain_router = plain.router(layer(env.dyn_store(), None));
    let k3 = format!("k3-{}", uuid::Uuid::new_v4().simple());
    assert_eq!(send(&plain_router, &k3).await.0, StatusCode::CREATED);
    if let Some(raw) = env.read_stored(record_id(&k3)).await {
        assert!(contains(&raw, &plain.secret), "{name}: unsealed bytes hold the plaintext");
    }
}

/// Rotation: the old key still opens, the new key seals, a record sealed by a removed key
/// gives 503 without a second run.
pub async fn rotation(env: HttpEnv) {
    let name = env.name;
    let app = App::new();
    let (old, new) =
        (format!("old-{}", uuid::Uuid::new_v4().simple()), format!("new-{}", uuid::Uuid::new_v4().simple()));
    let v1 = app.router(layer(env.dyn_store(), Some(keys_v1())));
    assert_eq!(send(&v1, &old).await.0, StatusCode::CREATED);

    let both = app.router(layer(env.dyn_store(), Some(keys_v1().with_key(2, [0x22; 32]))));
    let replay = send(&both, &old).await;
    assert!(replay.0 == StatusCode::CREATED && replay.1, "{name}: the old key no longer opens: {replay:?}");
    assert_eq!(send(&both, &new).await.0, StatusCode::CREATED);
    let stored = env.store.record(record_id(&new)).await.expect("record").response.expect("completed");
    assert_eq!(stored.header(SEALED_HEADER), Some(&b"v1;2"[..]), "{name}: the newest key seals");
    assert_eq!(app.runs(), 2);

    let v2_only = app.router(layer(env.dyn_store(), Some(SealingKeys::new(2, [0x22; 32]))));
    assert!(send(&v2_only, &new).await.1, "{name}: key 2 opens its own seal");
    let removed = send(&v2_only, &old).await;
    assert_eq!(removed.0, StatusCode::SERVICE_UNAVAILABLE, "{name}: {removed:?}");
    assert_eq!(app.runs(), 2, "{name}: a record sealed by a removed key ran the handler");
}

/// Unsealed records once sealing is on: refused by default (a writer could otherwise
/// swap a sealed response for a plain one), replayed during a migration when accepted.
pub async fn unsealed_records_are_refused_unless_accepted(env: HttpEnv) {
    let name = env.name;
    let app = App::new();
    let key = format!("plain-{}", uuid::Uuid::new_v4().simple());
    let plain = app.router(layer(env.dyn_store(), None));
    assert_eq!(send(&plain, &key).await.0, StatusCode::CREATED);

    let strict = app.router(layer(env.dyn_store(), Some(keys_v1())));
    assert_eq!(send(&strict, &key).await.0, StatusCode::SERVICE_UNAVAILABLE, "{name}");
    let migrating = IdempotencyLayer::new(env.dyn_store()).with_sealing(Sealing::new(keys_v1()).accept_unsealed(true));
    let migrating = app.router(migrating);
    let replay = send(&migrating, &key).await;
    assert!(replay.0 == StatusCode::CREATED && replay.1, "{name}: {replay:?}");
    assert_eq!(replay.2.as_deref(), Some(app.secret.as_str()));
    assert_eq!(app.runs(), 1, "{name}: an unsealed record ran the handler again");
}
