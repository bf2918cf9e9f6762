//! `idem-bench seal`: what sealing stored responses costs.
//!
//! Two layers over two stores of the same backend, one with
//! `IdempotencyLayer::with_sealing`, one without, in front of the same handler (201, a
//! `Location` and a body of `--body` incompressible bytes, 1 KiB by default). Requests go
//! through `tower::ServiceExt::oneshot` (no sockets: the cost measured is the layer's and
//! the store's, not the kernel's), `--concurrency` at a time. Runs alternate between the
//! two layers (unsealed, sealed, sealed, unsealed, ...); each run's throughput is
//! recorded, and the row reports the median of each side and the ratio of the medians.
//!
//! Mode `first`: every request has a fresh key (claim, seal, complete). Mode `replay`:
//! every request replays a key completed during the warm-up (claim finds it, opens it).

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::http::StatusCode;
use axum::routing::post;
use futures::StreamExt;
use idem_core::{BoxError, MemoryStore, Store};
use idem_http::{IdempotencyLayer, Policy, Sealing, SealingKeys};
use tower::ServiceExt;

use crate::Endpoints;

/// Settings of one `seal` row.
#[derive(Debug, clap::Args)]
pub(crate) struct SealArgs {
    /// The store behind both layers: `memory` or `redis`.
    #[arg(long, value_enum, default_value = "memory")]
    store: SealStore,
    /// First-time requests or replays.
    #[arg(long, value_enum, default_value = "first")]
    mode: Mode,
    /// Response body, bytes.
    #[arg(long, default_value_t = 1024)]
    body: usize,
    /// Requests per run.
    #[arg(long, default_value_t = 20_000)]
    requests: usize,
    /// Runs per side (at least 5), interleaved.
    #[arg(long, default_value_t = 7)]
    runs: usize,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Keys in the replay pool.
    #[arg(long, default_value_t = 1000)]
    pool: usize,
    /// Also time 20,000 seals and opens of the response alone (no layer, no store).
    #[arg(long)]
    micro: bool,
    #[command(flatten)]
    endpoints: Endpoints,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum SealStore {
    Memory,
    Redis,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Mode {
    First,
    Replay,
}

pub(crate) fn router(body: Arc<Vec<u8>>, layer: IdempotencyLayer) -> Router {
    Router::new()
        .route(
            "/v1/workers",
            post(move |req: axum::body::Bytes| {
                let body = body.clone();
                async move {
                    let _ = req;
                    (StatusCode::CREATED, [("location", "/v1/workers/7")], body.as_ref().clone())
                }
            }),
        )
        .layer(layer)
        // Handlers become services (and the layer wraps them) here, once; without it axum
        // converts the handler, and so calls `Layer::layer`, on every `oneshot`.
        .with_state(())
}

async fn store(args: &SealArgs, side: &str) -> Result<Arc<dyn Store>, BoxError> {
    Ok(match args.store {
        SealStore::Memory => Arc::new(MemoryStore::new()),
        SealStore::Redis => {
            let prefix = format!("idem-bench:seal:{side}:{}:", crate::run_id());
            let config = idem_redis::Config::default().with_prefix(prefix);
            Arc::new(idem_redis::RedisStore::connect(&args.endpoints.redis_url, config).await?)
        }
    })
}

/// Sends `n` keyed POSTs, `concurrency` at a time; returns requests per second.
pub(crate) async fn load(
    app: &Router,
    keys: impl Iterator<Item = String>,
    concurrency: usize,
) -> Result<f64, BoxError> {
    let start = Instant::now();
    let mut sent = 0usize;
    let mut answers = futures::stream::iter(keys)
        .map(|key| {
            let app = app.clone();
            async move {
                let req = axum::http::Request::post("/v1/workers")
                    .header("authorization", "Bearer bench-token")
                    .header("content-type", "application/json")
                    .header("idempotency-key", key)
                    .body(Body::from(r#"{"gpus":8}"#))?;
                let res = app.oneshot(req).await?;
                let status = res.status();
                let _ = http_body_util::BodyExt::collect(res.into_body()).await?;
                Ok::<_, BoxError>(status)
            }
        })
        .buffer_unordered(concurrency);
    while let Some(status) = answers.next().await {
        let status = status?;
        if status != StatusCode::CREATED {
            return Err(format!("unexpected status {status}").into());
        }
        sent += 1;
    }
    Ok(sent as f64 / start.elapsed().as_secs_f64())
}

pub(crate) fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// Runs one row and prints it.
pub(crate) async fn run(args: SealArgs) -> Result<(), BoxError> {
    // Incompressible bytes (an LCG), so compression does not hide the body size.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let body: Vec<u8> = (0..args.body)
        .map(|_| {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            b'a' + ((x >> 33) % 26) as u8
        })
        .collect();
    let body = Arc::new(body);
    if args.micro {
        // The AEAD alone: one seal and one open of the response, no layer, no store (the
        // open of a record's clone, as a store read hands the layer an owned record).
        let k = Sealing::new(SealingKeys::new(1, [1; 32]));
        let r = idem_core::StoredResponse::new(201, vec![], body.as_ref().clone());
        let t = Instant::now();
        for i in 0..20_000u64 {
            let s = k.seal(idem_core::RecordId::from_bytes([1; 32]), idem_core::FencingToken(i), &r);
            std::hint::black_box(s);
        }
        println!("seal alone: {:?} per response", t.elapsed() / 20_000);
        let mut record = completed_record();
        record.response = Some(k.seal(record.id, record.token, &r));
        let t = Instant::now();
        for _ in 0..20_000u64 {
            std::hint::black_box(k.open(record.clone()).ok());
        }
        println!("open alone: {:?} per response", t.elapsed() / 20_000);
    }
    // Short retention: Redis expires the bench's keys natively within a minute.
    let mut policy = Policy::default();
    policy.retention = Duration::from_secs(60);
    let plain = router(body.clone(), IdempotencyLayer::new(store(&args, "plain").await?).with_policy(policy.clone()));
    let sealing = Sealing::new(SealingKeys::new(1, *b"idem-bench sealing key, 32 bytes"));
    let sealed = router(
        body.clone(),
        IdempotencyLayer::new(store(&args, "sealed").await?).with_policy(policy).with_sealing(sealing),
    );
    let run = crate::run_id();
    let pool: Vec<String> = (0..args.pool).map(|i| format!("{run}-pool-{i}")).collect();
    // Warm-up: both sides, and the replay pool completed on each.
    for app in [&plain, &sealed] {
        load(app, pool.iter().cloned(), args.concurrency).await?;
    }
    let runs = args.runs.max(5);
    let (mut p, mut s) = (Vec::new(), Vec::new());
    for r in 0..runs * 2 {
        // Order: plain, sealed, sealed, plain, plain, sealed, ...
        let sealed_turn = matches!(r % 4, 1 | 2);
        let app = if sealed_turn { &sealed } else { &plain };
        let keys: Box<dyn Iterator<Item = String> + Send> = match args.mode {
            Mode::First => {
                let run = run.clone();
                Box::new((0..args.requests).map(move |i| format!("{run}-{r}-{i}")))
            }
            Mode::Replay => {
                let pool = pool.clone();
                Box::new((0..args.requests).map(move |i| pool[i % pool.len()].clone()))
            }
        };
        let rate = load(app, keys, args.concurrency).await?;
        if sealed_turn { s.push(rate) } else { p.push(rate) }
    }
    let (pm, sm) = (median(p.clone()), median(s.clone()));
    println!(
        "{:<7} {:<7} {:>6} {:>15} {:>15} {:>7}",
        "store", "mode", "body", "unsealed req/s", "sealed req/s", "ratio"
    );
    println!(
        "{:<7} {:<7} {:>6} {:>15.0} {:>15.0} {:>6.3}x",
        match args.store {
            SealStore::Memory => "memory",
            SealStore::Redis => "redis",
        },
        match args.mode {
            Mode::First => "first",
            Mode::Replay => "replay",
        },
        args.body,
        pm,
        sm,
        sm / pm
    );
    println!(
        "(median of {runs} interleaved runs per side, {} requests each, {} in flight; runs: unsealed {:?}, sealed {:?})",
        args.requests,
        args.concurrency,
        p.iter().map(|v| v.round() as u64).collect::<Vec<_>>(),
        s.iter().map(|v| v.round() as u64).collect::<Vec<_>>(),
    );
    Ok(())
}

/// A claimed record to seal a response into, for the micro-benchmark's opens.
fn completed_record() -> idem_core::Record {
    use idem_core::{ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, Scope, UnixMillis};
    let scope = Scope::new("bench", Endpoint::new("POST", "/v1/workers")).expect("a principal");
    let key = IdempotencyKey::parse(b"k").expect("a key");
    let req =
        ClaimRequest::new(scope, key, Fingerprint::of_bytes(b""), Duration::from_secs(60), Duration::from_secs(60));
    let (Some(record), _) = idem_core::transition::claim(None, &req, UnixMillis(1)) else { unreachable!("claims") };
    record
}
