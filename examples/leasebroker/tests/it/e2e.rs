//! leasebroker end to end over real sockets with a real HTTP client (reqwest), on a redb
//! file, including a server restart between an attempt and its retry. The retry storms
//! against this server are the rig's (`harness/tests/it/storm.rs`).

use std::path::Path;
use std::time::Duration;

use idem_core::Policy;
use leasebroker::app::{Config, Faults};
use leasebroker::server::{Server, StoreSpec, open};
use leasebroker::state::Stats;
use tokio::net::TcpListener;

const SPEC: &str = r#"{"image":"worker-base:2025.11","cpu":16,"memory_gb":64,"labels":{"team":"ml-eval"}}"#;

async fn start(path: &Path, faults: Faults) -> Server {
    let (store, infra) = open(&StoreSpec::Redb(path.to_path_buf()), &path.with_extension("state")).await.unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let config = Config {
        policy: {
            let mut p = Policy::default();
            p.lease_ttl = Duration::from_secs(3);
            p
        },
        faults,
        ..Config::default()
    };
    Server::start(listener, store, infra, &config).unwrap()
}

async fn stats(http: &reqwest::Client, base: &str) -> Stats {
    http.get(format!("{base}/admin/stats")).send().await.unwrap().json().await.unwrap()
}

async fn create(http: &reqwest::Client, base: &str, token: &str, key: Option<&str>, body: &str) -> reqwest::Response {
    let mut r = http
        .post(format!("{base}/v1/workers"))
        .bearer_auth(token)
        .header("content-type", "application/json")
        .body(body.to_string());
    if let Some(k) = key {
        r = r.header("idempotency-key", k);
    }
    r.send().await.unwrap()
}

fn header(r: &reqwest::Response, name: &str) -> Option<String> {
    r.headers().get(name).map(|v| v.to_str().unwrap().to_string())
}

#[tokio::test]
async fn create_replay_mismatch_other_principal_and_missing_key() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&dir.path().join("lb.redb"), Faults::default()).await;
    let base = server.url();
    let http = reqwest::Client::new();

    let first = create(&http, &base, "token-a", Some("op-1"), SPEC).await;
    assert_eq!(first.status(), 201);
    let location = header(&first, "location").unwrap();
    assert!(header(&first, "idempotent-replayed").is_none());
    let body1 = first.text().await.unwrap();

    let again = create(&http, &base, "token-a", Some("op-1"), SPEC).await;
    assert_eq!(again.status(), 201);
    assert_eq!(header(&again, "location").unwrap(), location);
    assert_eq!(header(&again, "idempotent-replayed").as_deref(), Some("true"));
    assert_eq!(again.text().await.unwrap(), body1);

    let other_body = create(&http, &base, "token-a", Some("op-1"), &SPEC.replace("16", "32")).await;
    assert_eq!(other_body.status(), 409);
    assert_eq!(header(&other_body, "content-type").as_deref(), Some("application/problem+json"));

    let other_token = create(&http, &base, "token-b", Some("op-1"), SPEC).await;
    assert_eq!(other_token.status(), 201);
    assert_ne!(header(&other_token, "location").unwrap(), location);

    let no_key = create(&http, &base, "token-a", None, SPEC).await;
    assert_eq!(no_key.status(), 400);
    assert_eq!(header(&no_key, "content-type").as_deref(), Some("application/problem+json"));

    let s = stats(&http, &base).await;
    assert_eq!((s.workers, s.allocations, s.boots), (2, 2, 2));
    server.stop().await.unwrap();
}

#[tokio::test]
async fn retried_delete_replays_204_and_reboot_happens_once() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(&dir.path().join("lb.redb"), Faults::default()).await;
    let base = server.url();
    let http = reqwest::Client::new();
    let created = create(&http, &base, "t", Some("mk"), SPEC).await;
    let location = header(&created, "location").unwrap();

    for _ in 0..3 {
        let r = http
            .post(format!("{base}{location}/reboot"))
            .bearer_auth("t")
            .header("idempotency-key", "reboot-1")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 202);
    }
    assert_eq!(stats(&http, &base).await.reboots, 1);

    for attempt in 0..2 {
        let r = http
            .delete(format!("{base}{location}"))
            .bearer_auth("t")
            .header("idempotency-key", "del-1")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 204, "attempt {attempt}: a retried DELETE must replay 204, never 404");
    }
    // Without a key the second DELETE is a new request and finds nothing.
    let r = http.delete(format!("{base}{location}")).bearer_auth("t").send().await.unwrap();
    assert_eq!(r.status(), 404);
    let s = stats(&http, &base).await;
    assert_eq!((s.deletes, s.workers), (1, 0));
    server.stop().await.unwrap();
}

#[tokio::test]
async fn retry_after_a_server_restart_replays_from_the_redb_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("lb.redb");
    let http = reqwest::Client::new();

    let server = start(&path, Faults::default()).await;
    let first = create(&http, &server.url(), "t", Some("restart-1"), SPEC).await;
    assert_eq!(first.status(), 201);
    let location = header(&first, "location").unwrap();
    let body = first.text().await.unwrap();
    server.stop().await.unwrap();

    let server = start(&path, Faults::default()).await;
    let retry = create(&http, &server.url(), "t", Some("restart-1"), SPEC).await;
    assert_eq!(retry.status(), 201);
    assert_eq!(header(&retry, "idempotent-replayed").as_deref(), Some("true"));
    assert_eq!(header(&retry, "location").unwrap(), location);
    assert_eq!(retry.text().await.unwrap(), body);
    assert_eq!(stats(&http, &server.url()).await.workers, 1);
    server.stop().await.unwrap();
}

#[tokio::test]
async fn every_store_flag_serves_create_replay_and_mismatch() {
    // The same curl-level contract on each backend the `--store` flag accepts; with
    // `live-tests`, against the real Redis and PostgreSQL on loopback too.
    let dir = tempfile::tempdir().unwrap();
    let mut specs = vec![
        format!("sqlite:{}", dir.path().join("lb.sqlite").display()),
        "memory".to_string(),
        format!("redb:{}", dir.path().join("lb.redb").display()),
    ];
    if cfg!(feature = "live-tests") {
        specs.push(std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into()));
        specs.push(
            std::env::var("IDEM_POSTGRES_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into()),
        );
    }
    let http = reqwest::Client::new();
    for (i, spec) in specs.iter().enumerate() {
        let store_spec: StoreSpec = spec.parse().unwrap();
        let (store, infra) = open(&store_spec, &dir.path().join(format!("state-{i}.redb")))
            .await
            .unwrap_or_else(|e| panic!("{spec}: {e} (scripts/services starts Redis and PostgreSQL)"));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let server = Server::start(listener, store, infra, &Config::default()).unwrap();
        let base = server.url();
        // Fresh principal per run: the shared servers keep records for 24 h.
        let token = uuid::Uuid::new_v4().to_string();
        let first = create(&http, &base, &token, Some("k-1"), SPEC).await;
        assert_eq!(first.status(), 201, "{spec}");
        let location = header(&first, "location");
        let again = create(&http, &base, &token, Some("k-1"), SPEC).await;
        assert_eq!(again.status(), 201, "{spec}");
        assert_eq!(header(&again, "location"), location, "{spec}");
        assert_eq!(header(&again, "idempotent-replayed").as_deref(), Some("true"), "{spec}");
        let mismatch = create(&http, &base, &token, Some("k-1"), &SPEC.replace("16", "8")).await;
        assert_eq!(mismatch.status(), 409, "{spec}");
        assert_eq!(stats(&http, &base).await.workers, 1, "{spec}");
        server.stop().await.unwrap();
    }
}

#[test]
fn the_cluster_store_form_parses() {
    let spec: StoreSpec = "redis-cluster://127.0.0.1:7000,127.0.0.1:7001?wait=1".parse().expect("cluster form");
    match spec {
        StoreSpec::RedisCluster { nodes, wait, degrade } => {
            assert_eq!(nodes, ["redis://127.0.0.1:7000", "redis://127.0.0.1:7001"]);
            assert_eq!((wait, degrade), (Some(1), false));
        }
        other => panic!("{other:?}"),
    }
    let one: StoreSpec = "redis-cluster://10.0.0.5:6379".parse().expect("one node");
    assert!(matches!(one, StoreSpec::RedisCluster { ref nodes, wait: None, .. } if nodes.len() == 1));
    let degrade: StoreSpec = "redis-cluster://h:1?wait=1&shortfall=degrade".parse().expect("degrade");
    assert!(matches!(degrade, StoreSpec::RedisCluster { wait: Some(1), degrade: true, .. }));
    for bad in [
        "redis-cluster://",
        "redis-cluster://host",
        "redis-cluster://h:1?wait=x",
        "redis-cluster://h:1?x=1",
        "redis-cluster://h:1?shortfall=x",
    ] {
        assert!(bad.parse::<StoreSpec>().is_err(), "{bad}");
    }
}
