//! `idem-bench memory`: peak resident memory of N concurrent large streamed responses,
//! through `idem_http::IdempotencyLayer` against the same handler without it.
//!
//! The handler streams `--mib` MiB in fresh 64 KiB chunks (as a handler producing an
//! export piece by piece would), yielding to the runtime before each, so all N responses
//! are under way at once; N clients read every response to its end in the same
//! process, keeping nothing. Each side runs in a child process of its own (this binary,
//! `memory --side bare|layer`), so one side's allocations cannot lower or raise the
//! other's peak. Peak RSS is the kernel's high-water mark (`VmHWM`). The layer keeps at
//! most `max_stored_body` bytes plus one chunk per response before it completes the record
//! as not retained and streams the rest, so the target is: layer peak within
//! N x `max_stored_body` + 50 MiB of the bare peak.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use bytes::Bytes;
use idem_core::{BoxError, MemoryStore};
use idem_http::IdempotencyLayer;
use tower::ServiceExt;

const MIB: u64 = 1 << 20;
const CHUNK: usize = 64 << 10;

/// Settings of the `memory` row.
#[derive(Debug, clap::Args)]
pub(crate) struct MemoryArgs {
    /// Concurrent responses.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Size of each response, MiB.
    #[arg(long, default_value_t = 100)]
    mib: u64,
    /// The layer's `max_stored_body`, KiB.
    #[arg(long, default_value_t = 1024)]
    max_stored_body_kib: usize,
    /// Run one side only (used by the parent run; prints `peak_kib seconds`).
    #[arg(long, value_parser = ["bare", "layer"])]
    side: Option<String>,
}

/// Runs the row (two child processes) and prints it, or runs one side.
pub(crate) async fn run(args: MemoryArgs) -> Result<(), BoxError> {
    if let Some(side) = &args.side {
        let (peak, secs) = one_side(&args, side == "layer").await?;
        println!("{peak} {secs:.3}");
        return Ok(());
    }
    let side = |name: &str| -> Result<(u64, f64), BoxError> {
        let out = std::process::Command::new(std::env::current_exe()?)
            .args(["memory", "--side", name])
            .args(["--concurrency", &args.concurrency.to_string(), "--mib", &args.mib.to_string()])
            .args(["--max-stored-body-kib", &args.max_stored_body_kib.to_string()])
            .output()?;
        if !out.status.success() {
            return Err(format!("{name} side failed: {}", String::from_utf8_lossy(&out.stderr)).into());
        }
        let text = String::from_utf8(out.stdout)?;
        let mut parts = text.split_whitespace();
        let peak = parts.next().ok_or("no peak")?.parse()?;
        let secs = parts.next().ok_or("no time")?.parse()?;
        Ok((peak, secs))
    };
    let (bare, bare_secs) = side("bare")?;
    let (layer, layer_secs) = side("layer")?;
    let limit_kib = args.max_stored_body_kib as u64;
    let target_kib = args.concurrency as u64 * limit_kib + 50 * 1024;
    let added = layer.saturating_sub(bare);
    println!(
        "{:>11} {:>9} {:>17} {:>14} {:>15} {:>15} {:>15} {:>10} {:>10}",
        "concurrency",
        "MiB each",
        "max_stored_body",
        "bare peak MiB",
        "layer peak MiB",
        "added MiB",
        "target MiB",
        "bare s",
        "layer s"
    );
    println!(
        "{:>11} {:>9} {:>13} KiB {:>14.1} {:>15.1} {:>15.1} {:>15.1} {:>10.2} {:>10.2}",
        args.concurrency,
        args.mib,
        limit_kib,
        bare as f64 / 1024.0,
        layer as f64 / 1024.0,
        added as f64 / 1024.0,
        target_kib as f64 / 1024.0,
        bare_secs,
        layer_secs
    );
    println!("within target: {}", if added <= target_kib { "yes" } else { "NO" });
    Ok(())
}

/// Serves `concurrency` responses of `mib` MiB at once; returns peak RSS (KiB) and seconds.
async fn one_side(args: &MemoryArgs, with_layer: bool) -> Result<(u64, f64), BoxError> {
    let total = args.mib * MIB;
    let handler = post(move || async move {
        // Each chunk is allocated when it is produced and yields to the runtime first, so
        // all N responses are in progress at once (the worst case for the layer's buffers)
        // instead of running one after another on two worker threads.
        let chunks = futures::StreamExt::then(futures::stream::iter(0..total / CHUNK as u64), |i| async move {
            tokio::task::yield_now().await;
            Ok::<_, Infallible>(Bytes::from(vec![(i % 251) as u8; CHUNK]))
        });
        ([("content-type", "application/octet-stream")], Body::from_stream(chunks))
    });
    let mut app = Router::new().route("/v1/exports", handler);
    if with_layer {
        let mut policy = idem_http::Policy::default();
        policy.max_stored_body = args.max_stored_body_kib * 1024;
        let layer = IdempotencyLayer::new(Arc::new(MemoryStore::new())).with_policy(policy);
        app = app.layer(layer);
    }
    let started = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..args.concurrency {
        let app = app.clone();
        tasks.push(tokio::spawn(async move { export(app, &format!("export-{i}")).await }));
    }
    for t in tasks {
        let len = t.await??;
        if len != total {
            return Err(format!("a response had {len} bytes, not {total}").into());
        }
    }
    let secs = started.elapsed().as_secs_f64();
    let status = std::fs::read_to_string("/proc/self/status")?;
    let peak = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .ok_or("no VmHWM in /proc/self/status")?;
    Ok((peak, secs))
}

async fn export(app: Router, key: &str) -> Result<u64, BoxError> {
    use http_body_util::BodyExt;
    let req = http::Request::post("/v1/exports")
        .header("authorization", "Bearer bench")
        .header("idempotency-key", key)
        .body(Body::empty())?;
    let res = app.oneshot(req).await?;
    if res.status() != 200 {
        return Err(format!("status {}", res.status()).into());
    }
    let mut body = res.into_body();
    let mut len = 0u64;
    while let Some(frame) = body.frame().await {
        len += frame?.into_data().map_or(0, |d| d.len() as u64);
    }
    Ok(len)
}
