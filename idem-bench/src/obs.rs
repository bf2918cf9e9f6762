//! `idem-bench obs`: what observability costs the layer per request.
//!
//! No sockets (a load generator on this machine would measure itself): one axum handler
//! (201, a `Location`, 8 bytes of JSON) called through `tower::ServiceExt::oneshot` on a
//! current-thread runtime, bare and behind `idem_http::IdempotencyLayer` with a
//! `MemoryStore`, in alternating slices. Every layered request is a first-time claim and
//! completion (mode `first`) or a replay (mode `replay`).
//!
//! With `--observe`, the slices run with a `tracing` subscriber at INFO that writes
//! nothing (`--subscriber registry`: the span registry and a layer that keeps nothing;
//! `--subscriber fmt`: the fmt layer writing to `io::sink()`, so every span's fields are
//! formatted and dropped), and,
//! when this binary was built with the `metrics` feature, a Prometheus recorder
//! (`metrics-exporter-prometheus`, not serving; `--recorder none` leaves the facade's
//! no-op recorder). Both are installed for this thread only.
//!
//! The comparison the observability budget is about (BENCHMARKS.md, "Observability
//! overhead") runs two builds, interleaved: `--features metrics` with `--observe` against
//! the default build without it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use idem_core::{BoxError, MemoryStore};
use idem_http::IdempotencyLayer;
use tower::ServiceExt;
use tracing_subscriber::layer::SubscriberExt;

/// Settings of one `obs` run.
#[derive(Debug, clap::Args)]
pub(crate) struct ObsArgs {
    /// Requests per slice.
    #[arg(long, default_value_t = 20_000)]
    requests: u64,
    /// Slices per server (bare, layered, layered, bare, ...); the medians are reported.
    #[arg(long, default_value_t = 5)]
    rounds: u32,
    /// Install a silent INFO subscriber and (with the `metrics` feature) the recorder.
    #[arg(long)]
    observe: bool,
    /// The subscriber `--observe` installs: `registry` (the span registry with an INFO
    /// filter and a layer that keeps nothing), `fmt` (tracing-subscriber's fmt layer
    /// writing to `io::sink()`: every span's fields are formatted, nothing is written) or
    /// `none` (no subscriber: only the metrics are measured).
    #[arg(long, value_enum, default_value = "registry")]
    subscriber: SubscriberKind,
    /// With `--observe` and the `metrics` feature: `prometheus` installs a Prometheus
    /// recorder (not serving); `none` leaves the facade's no-op recorder, so what is
    /// measured is the layer's metric calls without an exporter's recording.
    #[arg(long, value_enum, default_value = "prometheus")]
    recorder: RecorderKind,
    /// Replays instead of first-time requests.
    #[arg(long)]
    replay: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum RecorderKind {
    Prometheus,
    None,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum SubscriberKind {
    /// No subscriber: the span is disabled, only the metrics are measured.
    None,
    Registry,
    Fmt,
}

/// A layer that keeps nothing: what a subscriber costs before it writes anything.
struct Sink;

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Sink {}

fn router() -> Router {
    Router::new().route(
        "/v1/workers",
        post(|body: axum::body::Bytes| async move {
            let _ = body;
            (StatusCode::CREATED, [("location", "/v1/workers/7")], r#"{"id":7}"#)
        }),
    )
}

fn request(key: u64) -> Request<Body> {
    Request::post("/v1/workers")
        .header("authorization", "Bearer bench-token")
        .header("content-type", "application/json")
        .header("idempotency-key", format!("k-{key}"))
        .body(Body::from(r#"{"gpus":8}"#))
        .expect("request")
}

/// Wall and CPU time of one slice, mean ns per request.
#[derive(Clone, Copy)]
struct Took {
    wall: f64,
    cpu: f64,
}

/// CPU time this thread has run so far. The slices run on this one thread (a
/// current-thread runtime, an in-memory store), so its CPU time is the work measured, and
/// unlike wall time it does not move when other processes take the machine's cores.
fn thread_cpu() -> std::time::Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    std::time::Duration::new(u64::try_from(t.tv_sec).unwrap_or(0), u32::try_from(t.tv_nsec).unwrap_or(0))
}

/// Wall and CPU time per request over one slice of `n` requests.
async fn slice(app: &Router, n: u64, next: &AtomicU64, replay: bool) -> Took {
    let (started, cpu) = (Instant::now(), thread_cpu());
    for _ in 0..n {
        let key = if replay { next.load(Ordering::Relaxed) % 1_000 } else { next.fetch_add(1, Ordering::Relaxed) };
        let res = app.clone().oneshot(request(key)).await.expect("infallible");
        let body = axum::body::to_bytes(res.into_body(), 1 << 20).await.expect("body");
        std::hint::black_box(body);
        if replay {
            next.fetch_add(1, Ordering::Relaxed);
        }
    }
    let per = |d: std::time::Duration| d.as_nanos() as f64 / n as f64;
    Took { wall: per(started.elapsed()), cpu: per(thread_cpu().saturating_sub(cpu)) }
}

/// The medians of wall and CPU time per request.
fn median(v: &[Took]) -> Took {
    let mid = |f: fn(&Took) -> f64| {
        let mut x: Vec<f64> = v.iter().map(f).collect();
        x.sort_by(f64::total_cmp);
        x[x.len() / 2]
    };
    Took { wall: mid(|t| t.wall), cpu: mid(|t| t.cpu) }
}

fn measure(args: &ObsArgs) -> Result<(Took, Took), BoxError> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        // `with_state(())` turns the handlers into services once, as `axum::serve` does;
        // without it axum converts them, and so runs `Layer::layer`, on every `oneshot`.
        let bare = router().with_state(());
        let layered = router().layer(IdempotencyLayer::new(Arc::new(MemoryStore::new()))).with_state(());
        let next = AtomicU64::new(0);
        // Warm-up, and the replay pool (keys 0..1000 completed).
        for key in 0..1_000 {
            let res = layered.clone().oneshot(request(key)).await.expect("infallible");
            let _ = axum::body::to_bytes(res.into_body(), 1 << 20).await;
        }
        next.store(if args.replay { 0 } else { 1_000 }, Ordering::Relaxed);
        slice(&bare, args.requests / 4, &AtomicU64::new(0), true).await;
        let (mut b, mut l) = (Vec::new(), Vec::new());
        for round in 0..args.rounds {
            if round % 2 == 0 {
                b.push(slice(&bare, args.requests, &AtomicU64::new(0), true).await);
                l.push(slice(&layered, args.requests, &next, args.replay).await);
            } else {
                l.push(slice(&layered, args.requests, &next, args.replay).await);
                b.push(slice(&bare, args.requests, &AtomicU64::new(0), true).await);
            }
        }
        Ok((median(&b), median(&l)))
    })
}

fn run_here(args: &ObsArgs) -> Result<(Took, Took), BoxError> {
    if !args.observe {
        return measure(args);
    }
    let with_recorder = || {
        #[cfg(feature = "metrics")]
        if args.recorder == RecorderKind::Prometheus {
            let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
            return metrics::with_local_recorder(&recorder, || measure(args));
        }
        measure(args)
    };
    let registry = tracing_subscriber::registry().with(tracing_subscriber::filter::LevelFilter::INFO);
    let subscriber: Box<dyn tracing::Subscriber + Send + Sync> = match args.subscriber {
        SubscriberKind::None => return with_recorder(),
        SubscriberKind::Registry => Box::new(registry.with(Sink)),
        SubscriberKind::Fmt => Box::new(registry.with(tracing_subscriber::fmt::layer().with_writer(std::io::sink))),
    };
    tracing::subscriber::with_default(subscriber, with_recorder)
}

/// Runs the slices on a thread of their own (a current-thread runtime, with the
/// subscriber and recorder installed for that thread) and prints one line.
pub(crate) async fn run(args: ObsArgs) -> Result<(), BoxError> {
    let worker = std::thread::spawn(move || run_here(&args).map(|r| (r, args)).map_err(|e| e.to_string()));
    let ((bare, layered), args) =
        tokio::task::spawn_blocking(move || worker.join()).await?.map_err(|_| "the measuring thread panicked")??;
    println!(
        "obs mode={} observe={} subscriber={:?} metrics_feature={} recorder={:?} requests={} rounds={} \
         bare_ns={:.0} layered_ns={:.0} bare_cpu_ns={:.0} layered_cpu_ns={:.0}",
        if args.replay { "replay" } else { "first" },
        args.observe,
        args.subscriber,
        cfg!(feature = "metrics"),
        args.recorder,
        args.requests,
        args.rounds,
        bare.wall,
        layered.wall,
        bare.cpu,
        layered.cpu,
    );
    Ok(())
}
