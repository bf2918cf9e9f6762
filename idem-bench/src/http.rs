//! `idem-bench http`: the HTTP overhead of `idem_http::IdempotencyLayer`.
//!
//! Two axum servers in this process on loopback, one trivial handler (201, a `Location`
//! and 8 bytes of JSON), bare and behind the layer. `wrk` loads them in alternating slices
//! with a Lua script that gives every request its own `Idempotency-Key` (mode `first`:
//! every request is a first-time claim, complete and response) or cycles through a pool
//! of keys completed during the warm-up (mode `replay`: every request is a replay).
//!
//! Besides the request rates, each row gives the CPU time the process spent per request
//! served, bare and layered (`clock_gettime(CLOCK_PROCESS_CPUTIME_ID)` around each slice;
//! wrk runs in a process of its own), and their difference: the CPU the layer adds to a
//! request. Other processes on the machine move it less than the rates (they take cores,
//! not this process's CPU time), though not to nothing (they share its caches).

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use idem_core::{BoxError, MemoryStore, Store};
use idem_http::{HandlerExecution, IdempotencyLayer, Policy, Sealing, SealingKeys};
use idem_redb::RedbStore;

/// Settings of one `http` row.
#[derive(Debug, clap::Args)]
pub(crate) struct HttpArgs {
    /// The store behind the layer.
    #[arg(long, value_enum, default_value = "memory")]
    store: HttpStore,
    /// First-time requests (a distinct key each) or replays of completed keys.
    #[arg(long, value_enum, default_value = "first")]
    mode: Mode,
    /// Seconds of load per server, split into alternating slices.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Alternating slices (bare, layered, layered, bare, ...).
    #[arg(long, default_value_t = 4)]
    rounds: u64,
    /// wrk connections.
    #[arg(long, default_value_t = 32)]
    connections: u32,
    /// wrk threads.
    #[arg(long, default_value_t = 1)]
    threads: u32,
    /// Where the layer runs the handler after a claim: `detached` (the default: a spawned
    /// task, so a client disconnect cannot cancel it) or `inline` (in the response future).
    #[arg(long, value_enum, default_value = "detached")]
    execution: Execution,
    /// Only serve for this many seconds, printing both addresses (to look at the responses
    /// with curl, or to load them with another generator); no wrk.
    #[arg(long)]
    serve_for: Option<u64>,
    /// Keys in the replay pool (mode `replay`), per wrk thread.
    #[arg(long, default_value_t = 1000)]
    pool: u32,
    /// The handler's response body: this many incompressible bytes instead of 8 bytes of
    /// JSON (the sealing rows use 1024).
    #[arg(long)]
    body: Option<usize>,
    /// Compare sealing instead of the layer: the baseline server is the layer over its
    /// own store, unsealed, and the measured one the same layer with
    /// `with_sealing` (same backend, another store); the ratio is sealed / unsealed.
    #[arg(long)]
    sealed: bool,
    /// Install, for the whole process, a `tracing` subscriber at INFO that writes
    /// nothing (registry, INFO filter, a layer that keeps nothing) and, when this binary
    /// was built with the `metrics` feature, a Prometheus recorder (not serving, upkeep
    /// every 5 s as an exporter does). Compare this build's ratio with a plain build's.
    #[arg(long)]
    observe: bool,
    /// With `--observe` and the `metrics` feature: `none` installs no recorder, so the
    /// layer's metric calls reach the facade's no-op recorder (what the feature costs an
    /// application that exports nothing); `prometheus` (the default) the exporter.
    #[arg(long, value_enum, default_value = "prometheus")]
    recorder: Recorder,
    /// Retention of every record, seconds.
    #[arg(long, default_value_t = 60)]
    retention_secs: u64,
    /// Run the store's sweeper at this period, ms (a store without native expiry): the
    /// table then holds about rate x retention records, the steady state a production
    /// store with its sweeper reaches, instead of growing for the whole run.
    #[arg(long)]
    sweep_ms: Option<u64>,
    #[command(flatten)]
    endpoints: crate::Endpoints,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Recorder {
    Prometheus,
    None,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum HttpStore {
    Memory,
    Redb,
    /// One SQLite file per server.
    Sqlite,
    Redis,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Execution {
    Detached,
    Inline,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Mode {
    First,
    Replay,
}

/// Every request a fresh key (`first`), or keys from a per-thread pool (`replay`). The
/// run id makes keys unique across runs and slices; the thread id across wrk threads.
const SCRIPT: &str = r#"
local threads = {}
function setup(thread)
  table.insert(threads, thread)
  thread:set("tid", #threads)
end
local counter = 0
local prefix = "k"
local mode = "first"
local pool = 1000
function init(args)
  mode = args[1] or "first"
  prefix = (args[2] or "run") .. "-" .. tid .. "-"
  pool = tonumber(args[3] or "1000")
end
function request()
  counter = counter + 1
  local n = counter
  if mode == "replay" then n = counter % pool end
  return wrk.format("POST", "/v1/workers", {
    ["Authorization"] = "Bearer bench-token",
    ["Content-Type"] = "application/json",
    ["Idempotency-Key"] = prefix .. n,
  }, '{"gpus":8}')
end
"#;

fn router(response: axum::body::Bytes) -> Router {
    Router::new().route(
        "/v1/workers",
        post(move |body: axum::body::Bytes| async move {
            // Reads the request body, as any real POST handler does (a bare handler that
            // ignores it would skip hyper's body channel, which the layer must always read).
            let _ = body;
            (StatusCode::CREATED, [("location", "/v1/workers/7")], response)
        }),
    )
}

/// The handler's body: 8 bytes of JSON, or `n` incompressible bytes.
fn response_body(n: Option<usize>) -> axum::body::Bytes {
    match n {
        None => axum::body::Bytes::from_static(br#"{"id":7}"#),
        Some(n) => {
            (0..n.div_ceil(16)).flat_map(|_| uuid::Uuid::new_v4().into_bytes()).take(n).collect::<Vec<u8>>().into()
        }
    }
}

/// A layer without (`role` unsealed) or with sealing, over a fresh store of the backend.
async fn layer_for(args: &HttpArgs, dir: &Path, role: &str) -> Result<IdempotencyLayer, BoxError> {
    let store: Arc<dyn Store> = match args.store {
        HttpStore::Memory => Arc::new(MemoryStore::new()),
        HttpStore::Redb => {
            Arc::new(RedbStore::open(dir.join(format!("http-{role}.redb")), idem_redb::Config::default())?)
        }
        HttpStore::Sqlite => {
            let path = dir.join(format!("http-{role}.sqlite"));
            Arc::new(idem_sqlite::SqliteStore::open(path, idem_sqlite::Config::default())?)
        }
        HttpStore::Redis => {
            let config =
                idem_redis::Config::default().with_prefix(format!("idem-bench-http-{}-{role}:", crate::run_id()));
            Arc::new(idem_redis::RedisStore::connect(&args.endpoints.redis_url, config).await?)
        }
    };
    let execution = match args.execution {
        Execution::Detached => HandlerExecution::Detached,
        Execution::Inline => HandlerExecution::Inline,
    };
    if let Some(ms) = args.sweep_ms {
        let config = idem_core::SweepConfig::default().with_period(std::time::Duration::from_millis(ms));
        // Runs for the rest of the process.
        std::mem::forget(idem_core::Sweeper::start(Arc::clone(&store), config));
    }
    // Short retention: Redis expires the bench's keys natively within a minute.
    let mut policy = Policy::default();
    policy.retention = std::time::Duration::from_secs(args.retention_secs);
    let layer = IdempotencyLayer::new(store).with_handler_execution(execution).with_policy(policy);
    Ok(if role == "sealed" {
        layer.with_sealing(Sealing::new(SealingKeys::new(1, *b"idem-bench sealing key, 32 bytes")))
    } else {
        layer
    })
}

/// `--observe`: a process-wide INFO subscriber that writes nothing and (with the
/// `metrics` feature) a process-wide Prometheus recorder.
fn observe(recorder: Recorder) -> Result<(), BoxError> {
    use tracing_subscriber::layer::SubscriberExt;
    struct Sink;
    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Sink {}
    let subscriber = tracing_subscriber::registry().with(tracing_subscriber::filter::LevelFilter::INFO).with(Sink);
    tracing::subscriber::set_global_default(subscriber)?;
    #[cfg(not(feature = "metrics"))]
    let _ = recorder;
    #[cfg(feature = "metrics")]
    if recorder == Recorder::Prometheus {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        metrics::set_global_recorder(recorder).map_err(|e| e.to_string())?;
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(std::time::Duration::from_secs(5)).await;
                handle.run_upkeep();
            }
        });
    }
    Ok(())
}

async fn serve(app: Router) -> Result<SocketAddr, BoxError> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(addr)
}

/// What one wrk run reported, and the CPU time this process (both servers) spent
/// meanwhile.
#[derive(Clone, Copy, Debug, Default)]
struct WrkResult {
    requests: u64,
    seconds: f64,
    p50_ms: f64,
    p99_ms: f64,
    bad: u64,
    /// CPU time of this process (user + system, every thread) during the run. wrk is a
    /// process of its own, so this is what the servers spent; the other server is idle.
    cpu: std::time::Duration,
}

/// CPU time this process has run so far, every thread: the servers run in it.
pub(crate) fn process_cpu() -> std::time::Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    std::time::Duration::new(u64::try_from(t.tv_sec).unwrap_or(0), u32::try_from(t.tv_nsec).unwrap_or(0))
}

fn parse_ms(s: &str) -> Option<f64> {
    let s = s.trim();
    let (num, mult) = if let Some(v) = s.strip_suffix("us") {
        (v, 1e-3)
    } else if let Some(v) = s.strip_suffix("ms") {
        (v, 1.0)
    } else if let Some(v) = s.strip_suffix('s') {
        (v, 1e3)
    } else {
        (s, 1.0)
    };
    num.parse::<f64>().ok().map(|v| v * mult)
}

fn wrk(
    args: &HttpArgs,
    script: &Path,
    addr: SocketAddr,
    seconds: u64,
    mode: &str,
    run: &str,
) -> Result<WrkResult, BoxError> {
    let cpu = process_cpu();
    let out = Command::new("wrk")
        .arg(format!("-t{}", args.threads))
        .arg(format!("-c{}", args.connections))
        .arg(format!("-d{seconds}s"))
        .arg("--latency")
        .arg("-s")
        .arg(script)
        .arg(format!("http://{addr}/v1/workers"))
        .arg("--")
        .arg(mode)
        .arg(run)
        .arg(args.pool.to_string())
        .output()
        .map_err(|e| format!("running wrk (apt-get install -y wrk): {e}"))?;
    let cpu = process_cpu().saturating_sub(cpu);
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!("wrk failed: {text}{}", String::from_utf8_lossy(&out.stderr)).into());
    }
    let mut r = WrkResult { cpu, ..WrkResult::default() };
    for line in text.lines() {
        let t = line.trim();
        if let Some(v) = t.strip_prefix("50%") {
            r.p50_ms = parse_ms(v).unwrap_or(0.0);
        } else if let Some(v) = t.strip_prefix("99%") {
            r.p99_ms = parse_ms(v).unwrap_or(0.0);
        } else if let Some(v) = t.strip_prefix("Non-2xx or 3xx responses:") {
            r.bad = v.trim().parse().unwrap_or(0);
        } else if t.contains("requests in") {
            // "123456 requests in 10.00s, 12.34MB read"
            let mut parts = t.split_whitespace();
            r.requests = parts.next().and_then(|n| n.parse().ok()).unwrap_or(0);
            r.seconds = parts.nth(2).and_then(|s| parse_ms(s.trim_end_matches(','))).unwrap_or(0.0) / 1e3;
        }
    }
    Ok(r)
}

/// Runs one row and prints it.
pub(crate) async fn run(args: HttpArgs) -> Result<(), BoxError> {
    let dir = crate::bench_dir()?;
    if args.observe {
        observe(args.recorder)?;
    }
    let response = response_body(args.body);
    let bare = if args.sealed {
        serve(router(response.clone()).layer(layer_for(&args, dir.path(), "unsealed").await?)).await?
    } else {
        serve(router(response.clone())).await?
    };
    let role = if args.sealed { "sealed" } else { "layered" };
    let layered = serve(router(response).layer(layer_for(&args, dir.path(), role).await?)).await?;
    if let Some(secs) = args.serve_for {
        println!("bare http://{bare}/v1/workers layered http://{layered}/v1/workers");
        tokio::time::sleep(std::time::Duration::from_secs(secs)).await;
        return Ok(());
    }
    let script = dir.path().join("keys.lua");
    std::fs::write(&script, SCRIPT)?;
    let mode = match args.mode {
        Mode::First => "first",
        Mode::Replay => "replay",
    };
    let replay_run = crate::run_id();
    let args = Arc::new(args);
    let script: Arc<Path> = Arc::from(script.as_path());
    let call = |addr: SocketAddr, seconds: u64, run: String| {
        let (args, script) = (Arc::clone(&args), Arc::clone(&script));
        tokio::task::spawn_blocking(move || wrk(&args, &script, addr, seconds, mode, &run))
    };
    let key_run = |_: u64| if args.mode == Mode::Replay { replay_run.clone() } else { crate::run_id() };

    // Warm-up: both servers, and in replay mode it completes the pool's keys.
    call(bare, 1, key_run(0)).await??;
    let warm = call(layered, 2, key_run(0)).await??;
    if warm.requests < u64::from(args.pool * args.threads) && args.mode == Mode::Replay {
        return Err("warm-up did not complete every key of the replay pool; raise its length".into());
    }

    let rounds = args.rounds.max(1);
    let slice = (args.seconds / rounds).max(1);
    let (mut b, mut l) = (Vec::new(), Vec::new());
    for r in 0..rounds {
        if r % 2 == 0 {
            b.push(call(bare, slice, key_run(r)).await??);
            l.push(call(layered, slice, key_run(r)).await??);
        } else {
            l.push(call(layered, slice, key_run(r)).await??);
            b.push(call(bare, slice, key_run(r)).await??);
        }
    }
    let rate =
        |v: &[WrkResult]| v.iter().map(|r| r.requests).sum::<u64>() as f64 / v.iter().map(|r| r.seconds).sum::<f64>();
    let median = |v: &[WrkResult], f: fn(&WrkResult) -> f64| {
        let mut xs: Vec<f64> = v.iter().map(f).collect();
        xs.sort_by(f64::total_cmp);
        xs[xs.len() / 2]
    };
    let (br, lr) = (rate(&b), rate(&l));
    let (bp50, lp50) = (median(&b, |r| r.p50_ms), median(&l, |r| r.p50_ms));
    let (bp99, lp99) = (median(&b, |r| r.p99_ms), median(&l, |r| r.p99_ms));
    let bad: u64 = l.iter().chain(&b).map(|r| r.bad).sum();
    // Server CPU per request, µs, over all slices of a server; the layer's own share is
    // the difference (both servers run the same handler on the same runtime).
    let cpu_us = |v: &[WrkResult]| {
        v.iter().map(|r| r.cpu.as_secs_f64()).sum::<f64>() * 1e6 / v.iter().map(|r| r.requests).sum::<u64>() as f64
    };
    let (bcpu, lcpu) = (cpu_us(&b), cpu_us(&l));
    let (base_label, measured_label) =
        if args.sealed { ("unseal req/s", "sealed req/s") } else { ("bare req/s", "layer req/s") };
    let (base_cpu, measured_cpu) = if args.sealed { ("unseal µs", "sealed µs") } else { ("bare µs", "layer µs") };
    println!(
        "{:<7} {:<7} {:>11} {:>8} {:>8} {:>11} {:>8} {:>8} {:>7} {:>13} {:>9} {:>9} {:>9} {:>6}",
        "store",
        "mode",
        base_label,
        "p50 ms",
        "p99 ms",
        measured_label,
        "p50 ms",
        "p99 ms",
        "ratio",
        "p50 added ms",
        base_cpu,
        measured_cpu,
        "added µs",
        "non2xx"
    );
    println!(
        "{:<7} {:<7} {:>11.0} {:>8.3} {:>8.3} {:>11.0} {:>8.3} {:>8.3} {:>6.2}x {:>13.3} {:>9.2} {:>9.2} {:>9.2} {:>6}",
        match args.store {
            HttpStore::Memory => "memory",
            HttpStore::Redb => "redb",
            HttpStore::Sqlite => "sqlite",
            HttpStore::Redis => "redis",
        },
        mode,
        br,
        bp50,
        bp99,
        lr,
        lp50,
        lp99,
        lr / br,
        lp50 - bp50,
        bcpu,
        lcpu,
        lcpu - bcpu,
        bad,
    );
    println!(
        "(wrk -t{} -c{}, {} x {slice} s per server, loopback, handler {:?}, body {}, observe {}{}; p50/p99 are the median over \
         slices; µs: this process's CPU time per request served, {base}, {measured}, and the difference)",
        args.threads,
        args.connections,
        rounds,
        args.execution,
        args.body.map_or_else(|| "8 B JSON".to_owned(), |n| format!("{n} B")),
        args.observe,
        match (cfg!(feature = "metrics"), args.recorder) {
            (false, _) => "",
            (true, Recorder::Prometheus) => " (metrics compiled in, Prometheus recorder)",
            (true, Recorder::None) => " (metrics compiled in, no recorder)",
        },
        base = if args.sealed { "unsealed" } else { "bare" },
        measured = if args.sealed { "sealed" } else { "layered" },
    );
    Ok(())
}
