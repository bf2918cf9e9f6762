//! `Idempotency-Key` handling at the HTTP level: every malformed key is a 400 problem body
//! (`application/problem+json`), the handler never runs for it and nothing is stored.

use crate::common;

use common::{Counter, Env, Script, app, post, send};
use idem_http::{IdempotencyLayer, KeyRequirement};

fn strict(env: &Env, n: &Counter) -> axum::Router {
    app(IdempotencyLayer::new(env.dyn_store()), n, &Script::default())
}

fn optional(env: &Env, n: &Counter) -> axum::Router {
    app(IdempotencyLayer::new(env.dyn_store()).with_key_requirement(KeyRequirement::Optional), n, &Script::default())
}

#[tokio::test]
async fn missing_key_is_400_when_required() {
    let env = Env::new();
    let n = Counter::default();
    let got = send(&strict(&env, &n), &post("/v1/orders").body("{}")).await;
    let p = got.problem(400, "missing-idempotency-key");
    assert!(p["detail"].as_str().unwrap().contains("Idempotency-Key"));
    assert_eq!(n.get(), 0);
}

#[tokio::test]
async fn malformed_keys_are_400_under_both_requirements() {
    let long = "k".repeat(256);
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("empty", b"".to_vec()),
        ("spaces only", b"   ".to_vec()),
        ("tab only", b"\t".to_vec()),
        ("empty sf-string", b"\"\"".to_vec()),
        ("blank sf-string", b"\"   \"".to_vec()),
        ("leading space inside quotes", b"\" K\"".to_vec()),
        ("inner space", b"a b".to_vec()),
        ("256 bytes", long.into_bytes()),
        ("non-ASCII", "注文-🙂".as_bytes().to_vec()),
        ("NFC e-acute", "\u{e9}".as_bytes().to_vec()),
        ("NFD e + combining acute", "e\u{301}".as_bytes().to_vec()),
        ("unterminated sf-string", b"\"abc".to_vec()),
        ("bad escape", b"\"a\\x\"".to_vec()),
    ];
    let env = Env::new();
    let n = Counter::default();
    for app in [strict(&env, &n), optional(&env, &n)] {
        for (what, key) in &cases {
            let got = send(&app, &post("/v1/orders").key_bytes(key).body("{}")).await;
            assert_eq!(got.status, 400, "{what}");
            got.problem(400, "invalid-idempotency-key");
        }
    }
    assert_eq!(n.get(), 0, "no malformed key reached the handler");
}

#[tokio::test]
async fn duplicate_key_fields_are_400_whether_or_not_they_agree() {
    let env = Env::new();
    let n = Counter::default();
    for app in [strict(&env, &n), optional(&env, &n)] {
        for (a, b) in [("k1", "k2"), ("k1", "k1")] {
            send(&app, &post("/v1/orders").key(a).key(b).body("{}")).await.problem(400, "duplicate-idempotency-key");
        }
    }
    assert_eq!(n.get(), 0);
    assert!(env.record("tok-p", "POST /v1/orders", "k1").await.is_none());
}

#[tokio::test]
async fn a_key_of_exactly_255_bytes_is_accepted() {
    let env = Env::new();
    let n = Counter::default();
    let app = strict(&env, &n);
    let key = "k".repeat(255);
    assert_eq!(send(&app, &post("/v1/orders").key(&key).body("{}")).await.status, 201);
    assert!(send(&app, &post("/v1/orders").key(&key).body("{}")).await.replayed());
    assert_eq!(n.get(), 1);
}

#[tokio::test]
async fn the_length_limit_follows_the_layer_setting() {
    let env = Env::new();
    let n = Counter::default();
    let app = app(IdempotencyLayer::new(env.dyn_store()).with_max_key_len(8), &n, &Script::default());
    assert_eq!(send(&app, &post("/v1/orders").key("12345678")).await.status, 201);
    send(&app, &post("/v1/orders").key("123456789")).await.problem(400, "invalid-idempotency-key");
}

#[tokio::test]
async fn quoted_and_bare_forms_name_the_same_key() {
    let env = Env::new();
    let n = Counter::default();
    let app = strict(&env, &n);
    send(&app, &post("/v1/orders").key("abc-123").body("{}")).await;
    let quoted = send(&app, &post("/v1/orders").key("\"abc-123\"").body("{}")).await;
    assert!(quoted.replayed());
    assert_eq!(n.get(), 1);
}

#[tokio::test]
async fn the_header_name_is_case_insensitive() {
    let env = Env::new();
    let n = Counter::default();
    let app = strict(&env, &n);
    let req = http::Request::post("/v1/orders")
        .header("authorization", "Bearer tok-p")
        .header("IDEMPOTENCY-KEY", "k1")
        .body(axum::body::Body::from("{}"))
        .unwrap();
    let got = common::Got::read(tower::ServiceExt::oneshot(app.clone(), req).await.unwrap()).await;
    assert_eq!(got.status, 201);
    let retry = http::Request::post("/v1/orders")
        .header("authorization", "Bearer tok-p")
        .header("Idempotency-Key", "k1")
        .body(axum::body::Body::from("{}"))
        .unwrap();
    let got = common::Got::read(tower::ServiceExt::oneshot(app, retry).await.unwrap()).await;
    assert!(got.replayed());
    assert_eq!(n.get(), 1);
}

#[tokio::test]
async fn keys_are_case_sensitive_and_never_trimmed_into_each_other() {
    let env = Env::new();
    let n = Counter::default();
    let app = strict(&env, &n);
    for key in ["K", "k", "K.", "\"K\\\\\""] {
        let got = send(&app, &post("/v1/orders").key(key).body("{}")).await;
        assert_eq!(got.status, 201, "{key}");
        assert!(!got.replayed(), "{key} must be a key of its own");
    }
    assert_eq!(n.get(), 4);
}

/// An API standard's key rule (16 to 255 characters of `[A-Za-z0-9-]`) could only be
/// checked in the handler, after the claim: a refused key still took a record.
#[tokio::test]
async fn the_applications_key_rule_refuses_before_any_store_call() {
    let env = Env::new();
    let n = Counter::default();
    let rule = |key: &str| {
        if key.len() < 16 {
            return Err(format!("an idempotency key has at least 16 characters; this one has {}", key.len()));
        }
        match key.bytes().find(|b| !(b.is_ascii_alphanumeric() || *b == b'-')) {
            Some(b) => Err(format!("an idempotency key is letters, digits and '-'; {:?} is not", char::from(b))),
            None => Ok(()),
        }
    };
    let app = app(IdempotencyLayer::new(env.dyn_store()).with_key_rule(rule), &n, &Script::default());
    // The store is down: a key that reached it would get 503, not 400.
    env.store.fail_all.store(true, std::sync::atomic::Ordering::SeqCst);
    for (key, detail) in [("short-key", "at least 16"), ("\"underscores_are_not_allowed\"", "'_' is not")] {
        let got = send(&app, &post("/v1/orders").key(key).body("{}")).await;
        let p = got.problem(400, "invalid-idempotency-key");
        assert!(p["detail"].as_str().unwrap().contains(detail), "{key}: {p}");
    }
    let got = send(&app, &post("/v1/orders").key("a-valid-key-0123456789").body("{}")).await;
    assert_eq!(got.status, 503, "a key the rule accepts goes on to the store");
    env.store.fail_all.store(false, std::sync::atomic::Ordering::SeqCst);
    let got = send(&app, &post("/v1/orders").key("a-valid-key-0123456789").body("{}")).await;
    assert!(got.status.is_success(), "{}", got.status);
    assert_eq!(n.get(), 1);
}
