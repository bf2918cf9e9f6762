//! `peer-server`: one axum server on loopback, for `bench/peer-rs.sh`.
//!
//! The handler is `idem-bench http`'s: `POST /v1/workers` reads the request body and answers
//! 201 with a `Location` and 8 bytes of JSON. It is served bare, behind idem's layer
//! (`idem_http::IdempotencyLayer`), or behind the `idempotent` crate's layer
//! (`idempotent::middleware::IdempotencyLayer`), over a memory or a Redis store:
//!
//! ```text
//! peer-server --impl idem|peer|bare --store memory|redis --port N [--run ID]
//!             [--redis-url redis://127.0.0.1:6379] [--retention-secs 60]
//!             [--peer-scope auth|none] [--workers 2]
//! ```
//!
//! It prints `ready` once it listens, then serves until killed. The runtime is tokio's
//! multi-threaded one with 2 worker threads, what `idem-bench http` runs on this 2-core
//! machine (`Builder::new_multi_thread()` without `worker_threads`: one per core).

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::http::StatusCode;
use axum::routing::post;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Impl {
    Idem,
    Peer,
    Bare,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum StoreKind {
    Memory,
    Redis,
}

#[derive(Debug)]
struct Args {
    imp: Impl,
    store: StoreKind,
    port: u16,
    run: String,
    redis_url: String,
    retention: Duration,
    peer_scope: bool,
    workers: usize,
}

const USAGE: &str = "usage: peer-server --impl idem|peer|bare --store memory|redis --port N \
[--run ID] [--redis-url URL] [--retention-secs S] [--peer-scope auth|none] [--workers N]";

fn parse_args() -> Result<Args, BoxError> {
    let mut args = Args {
        imp: Impl::Bare,
        store: StoreKind::Memory,
        port: 0,
        run: format!("{}", std::process::id()),
        redis_url: "redis://127.0.0.1:6379".to_owned(),
        retention: Duration::from_secs(60),
        peer_scope: true,
        workers: 2,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "-h" || flag == "--help" {
            println!("{USAGE}");
            std::process::exit(0);
        }
        let value = it.next().ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
        match flag.as_str() {
            "--impl" => {
                args.imp = match value.as_str() {
                    "idem" => Impl::Idem,
                    "peer" => Impl::Peer,
                    "bare" => Impl::Bare,
                    other => return Err(format!("--impl {other}: idem, peer or bare").into()),
                }
            }
            "--store" => {
                args.store = match value.as_str() {
                    "memory" => StoreKind::Memory,
                    "redis" => StoreKind::Redis,
                    other => return Err(format!("--store {other}: memory or redis").into()),
                }
            }
            "--port" => args.port = value.parse()?,
            "--run" => args.run = value,
            "--redis-url" => args.redis_url = value,
            "--retention-secs" => args.retention = Duration::from_secs(value.parse()?),
            "--peer-scope" => {
                args.peer_scope = match value.as_str() {
                    "auth" => true,
                    "none" => false,
                    other => return Err(format!("--peer-scope {other}: auth or none").into()),
                }
            }
            "--workers" => args.workers = value.parse()?,
            other => return Err(format!("unknown flag {other}\n{USAGE}").into()),
        }
    }
    // The run id goes into Redis key prefixes: keep it to characters both stores accept.
    if args.run.is_empty() || !args.run.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
        return Err("--run: letters, digits, '-' and '_' only".into());
    }
    Ok(args)
}

/// `idem-bench http`'s handler, on the same route.
fn router() -> Router {
    Router::new().route(
        "/v1/workers",
        post(|body: Bytes| async move {
            // Reads the request body, as a real POST handler does.
            let _ = body;
            (StatusCode::CREATED, [("location", "/v1/workers/7")], Bytes::from_static(br#"{"id":7}"#))
        }),
    )
}

/// idem's layer with `idem-bench http`'s settings: every default (key required, principal
/// from `Authorization: Bearer`, endpoint from the matched route, detached handler, lease
/// renewal every lease / 3) except the retention, 60 s there and here.
async fn idem_app(args: &Args) -> Result<Router, BoxError> {
    let store: Arc<dyn idem_core::Store> = match args.store {
        StoreKind::Memory => Arc::new(idem_core::MemoryStore::new()),
        StoreKind::Redis => {
            let config = idem_redis::Config::default().with_prefix(format!("peer-rs-{}-idem:", args.run));
            Arc::new(idem_redis::RedisStore::connect(&args.redis_url, config).await?)
        }
    };
    let mut policy = idem_http::Policy::default();
    policy.retention = args.retention;
    Ok(router().layer(idem_http::IdempotencyLayer::new(store).with_policy(policy)))
}

/// The peer's layer for the same semantics: a POST without a key is refused (400) rather
/// than passed through (`require_key(true)`), keys are scoped by the caller (the
/// `Authorization` value, as its docs ask of a service with more than one client) unless
/// `--peer-scope none`, responses replay for the same retention as idem's. Everything else
/// is its default (60 s processing lease renewed while the handler runs, handler in its own
/// task, xxh3 fingerprint of method, path, query and body, 1 MiB body cap, 5 s store timeout).
async fn peer_app(args: &Args) -> Result<Router, BoxError> {
    use idempotent::middleware::IdempotencyLayer;
    fn configure<S>(layer: IdempotencyLayer<S>, args: &Args) -> IdempotencyLayer<S> {
        let layer = layer.require_key(true).completed_ttl(args.retention);
        if args.peer_scope {
            layer.scope(|parts| {
                parts.headers.get(axum::http::header::AUTHORIZATION).and_then(|v| v.to_str().ok()).map(String::from)
            })
        } else {
            layer
        }
    }
    Ok(match args.store {
        StoreKind::Memory => {
            let store = idempotent::memory::MemoryStore::builder().try_build()?;
            router().layer(configure(IdempotencyLayer::new(store), args))
        }
        StoreKind::Redis => {
            // The peer's prefix may not contain ':' or '/'; it adds the ':' itself.
            let store = idempotent::valkey::ValkeyStore::with_url(args.redis_url.clone())
                .prefix(format!("peer-rs-{}-peer", args.run))
                .try_build()
                .await?;
            store.ping().await?;
            router().layer(configure(IdempotencyLayer::new(store), args))
        }
    })
}

async fn serve(args: Args) -> Result<(), BoxError> {
    let app = match args.imp {
        Impl::Bare => router(),
        Impl::Idem => idem_app(&args).await?,
        Impl::Peer => peer_app(&args).await?,
    };
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", args.port)).await?;
    println!("ready {:?} {:?} http://{}/v1/workers", args.imp, args.store, listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}

fn main() -> Result<(), BoxError> {
    let args = parse_args()?;
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(args.workers).enable_all().build()?;
    runtime.block_on(serve(args))
}
