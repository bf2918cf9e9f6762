//! The demo's `GET /metrics` after the rig's retry storm, scraped over a real socket: the
//! Prometheus text shows one claim per logical operation and replays of the answers the
//! faults held back (docs/observability.md, "The demo").
//!
//! One test in this binary: the Prometheus recorder is global to the process, so a second
//! server here would add its requests to the same counters.

use std::collections::BTreeMap;
use std::time::Duration;

use idem_core::Policy;
use idem_harness::storm::{self, StormConfig, StormMode};
use leasebroker::app::{Config, Faults};
use leasebroker::server::{Server, StoreSpec, open};
use tokio::net::TcpListener;

const CREATE: &str = "POST /v1/workers";

/// One sample of the Prometheus text format: name, labels, value.
#[derive(Debug)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// Parses the sample lines of a Prometheus text exposition (comments skipped). Label
/// values here never contain `"` or `,`, so a plain split suffices.
fn parse(text: &str) -> Vec<Sample> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|line| {
            let (series, value) = line.rsplit_once(' ').expect("`series value`");
            let (name, labels) = match series.split_once('{') {
                Some((name, rest)) => {
                    let inner = rest.strip_suffix('}').expect("closing brace");
                    let labels = inner
                        .split("\",")
                        .filter(|p| !p.is_empty())
                        .map(|p| {
                            let (k, v) = p.split_once("=\"").expect("label=\"value\"");
                            (k.to_owned(), v.trim_end_matches('"').to_owned())
                        })
                        .collect();
                    (name.to_owned(), labels)
                }
                None => (series.to_owned(), BTreeMap::new()),
            };
            Sample { name, labels, value: value.parse().expect("a number") }
        })
        .collect()
}

fn value(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .filter(|s| s.name == name && labels.iter().all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v)))
        .map(|s| s.value)
        .sum()
}

async fn scrape(http: &reqwest::Client, base: &str) -> (String, Vec<Sample>) {
    let res = http.get(format!("{base}/metrics")).send().await.unwrap();
    assert_eq!(res.status(), 200);
    assert!(res.headers()["content-type"].to_str().unwrap().starts_with("text/plain"), "Prometheus text format");
    let text = res.text().await.unwrap();
    let samples = parse(&text);
    (text, samples)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_after_a_storm_show_one_claim_per_operation_and_replays() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("lb.redb");
    let (store, infra) = open(&StoreSpec::Redb(path.clone()), &path.with_extension("state")).await.unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    // Answers held back past the clients' attempt timeout: their retries find the record
    // in flight or completed. No failing boots, so no attempt fails and is reclaimed: each
    // operation is claimed exactly once.
    let faults = Faults { drop_rate: 0.3, hold_ms: 600, work_ms: 50, ..Faults::default() };
    let config = Config {
        policy: {
            let mut p = Policy::default();
            p.lease_ttl = Duration::from_secs(3);
            p
        },
        faults,
        ..Config::default()
    };
    let server = Server::start(listener, store, infra, &config).unwrap();
    let base = server.url();
    let http = reqwest::Client::new();

    let (_, before) = scrape(&http, &base).await;
    assert_eq!(value(&before, "idem_decisions_total", &[]), 0.0, "nothing counted before the storm");

    let operations = 40;
    let report = storm::run(StormConfig {
        target: base.clone(),
        mode: StormMode::Create,
        operations,
        principals: 3,
        concurrency: 8,
        attempt_timeout_ms: 300,
        budget_ms: 30_000,
        token_prefix: "metrics".into(),
    })
    .await
    .unwrap();
    assert_eq!(report.succeeded, operations, "{report:?}");

    let (text, samples) = scrape(&http, &base).await;
    let decided = |d: &str| value(&samples, "idem_decisions_total", &[("decision", d), ("endpoint", CREATE)]);
    assert_eq!(decided("claimed"), f64::from(operations), "one claim per logical operation\n{text}");
    assert_eq!(decided("reclaimed"), 0.0, "no attempt failed, so none was reclaimed\n{text}");
    assert!(decided("replayed") > 0.0, "the held-back answers were replayed\n{text}");
    assert!(
        decided("replayed") >= report.replays as f64,
        "every replay the clients saw was counted by the server ({} seen)\n{text}",
        report.replays
    );
    let outcome = |o: &str| value(&samples, "idem_outcomes_total", &[("outcome", o), ("endpoint", CREATE)]);
    assert_eq!(outcome("completed"), f64::from(operations), "{text}");
    // Store latency per operation and backend: a claim per request that decided anything.
    assert!(
        text.contains("idem_store_call_seconds") && text.contains("backend=\"redb\""),
        "store call latency of the redb backend\n{text}"
    );
    assert!(value(&samples, "idem_group_commit_batch_size_count", &[("backend", "redb")]) > 0.0, "{text}");
    // Regression: the histograms were rendered as Prometheus summaries (no buckets), which
    // cannot be aggregated across servers and contradicted docs/observability.md.
    for name in ["idem_store_call_seconds", "idem_group_commit_batch_size"] {
        assert!(text.contains(&format!("# TYPE {name} histogram")), "{name} is a histogram\n{text}");
        assert!(samples.iter().any(|s| s.name == format!("{name}_bucket") && s.labels.contains_key("le")), "{text}");
    }
    server.stop().await.unwrap();
}
