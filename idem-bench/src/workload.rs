//! The shared workload (scope, keys, fingerprint, response) and the driver that runs
//! cycles from N concurrent callers and collects their latencies.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem_core::{BoxError, ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, Scope, StoredResponse};

/// Lease of every benchmark claim. Long enough that no cycle ever sees its own lease run out.
pub(crate) const LEASE: Duration = Duration::from_secs(60);
/// Retention of every benchmark record: Redis keys vanish on their own 10 minutes later;
/// the embedded files are temporary; Postgres rows are deleted by principal at the end.
pub(crate) const RETENTION: Duration = Duration::from_secs(600);

/// The request every cycle claims: one principal per run, one endpoint, a fresh key per
/// cycle, and the fingerprint of a small JSON body.
#[derive(Clone, Debug)]
pub(crate) struct Workload {
    /// The principal (one per run, so runs never share records).
    pub(crate) principal: String,
    scope: Scope,
    fingerprint: Fingerprint,
    response: StoredResponse,
}

impl Workload {
    /// A workload for run `run` whose stored responses carry a `body_bytes`-byte body.
    pub(crate) fn new(run: &str, body_bytes: usize) -> Self {
        let principal = format!("bench-{run}");
        let scope = Scope::new(principal.clone(), Endpoint::new("POST", "/v1/workers")).expect("valid scope");
        let response = StoredResponse::new(
            201,
            vec![
                ("content-type".into(), b"application/json".to_vec()),
                ("location".into(), b"/v1/workers/7c3f5d1e-91a4".to_vec()),
            ],
            pseudo_random_bytes(body_bytes, 7),
        );
        Self { principal, scope, fingerprint: Fingerprint::of_bytes(br#"{"gpus":8,"zone":"eu-west-4b"}"#), response }
    }

    /// The claim of cycle `i` of the runner tagged `tag` (`lib`, `base`, ...).
    pub(crate) fn request(&self, tag: &str, i: u64) -> ClaimRequest {
        let key = IdempotencyKey::parse(format!("{tag}-{i}").as_bytes()).expect("valid key");
        ClaimRequest::new(self.scope.clone(), key, self.fingerprint, LEASE, RETENTION)
    }

    /// The response every cycle stores.
    pub(crate) fn response(&self) -> StoredResponse {
        self.response.clone()
    }
}

/// `len` bytes that neither LZ4 nor Postgres' TOAST compression can shrink much, so stored
/// sizes are not flattered by a body of zeros.
pub(crate) fn pseudo_random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            // xorshift64
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// What one measured run did.
#[derive(Clone, Debug, Default)]
pub(crate) struct Summary {
    /// Cycles completed.
    pub(crate) cycles: u64,
    /// Wall-clock seconds from the first cycle's start to the last one's end.
    pub(crate) seconds: f64,
    /// Every cycle's latency, sorted.
    pub(crate) latencies: Vec<Duration>,
}

impl Summary {
    /// Cycles per second.
    pub(crate) fn rate(&self) -> f64 {
        if self.seconds > 0.0 { self.cycles as f64 / self.seconds } else { 0.0 }
    }

    /// The `q` quantile (0..=1) of cycle latency, in milliseconds.
    pub(crate) fn quantile_ms(&self, q: f64) -> f64 {
        if self.latencies.is_empty() {
            return 0.0;
        }
        let idx = ((self.latencies.len() as f64 - 1.0) * q).round() as usize;
        self.latencies[idx.min(self.latencies.len() - 1)].as_secs_f64() * 1e3
    }

    /// Adds another run's cycles (alternating slices of one measurement).
    pub(crate) fn merge(&mut self, other: Summary) {
        self.cycles += other.cycles;
        self.seconds += other.seconds;
        self.latencies.extend(other.latencies);
        self.latencies.sort_unstable();
    }
}

/// Runs cycles `first..first + count` of `cycle` from `callers` concurrent tasks (each takes
/// the next index until none are left) and returns the summary. The first error stops the
/// run and is returned.
pub(crate) async fn drive<F, Fut>(cycle: Arc<F>, callers: usize, first: u64, count: u64) -> Result<Summary, BoxError>
where
    F: Fn(u64) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), BoxError>> + Send + 'static,
{
    let next = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let tasks: Vec<_> = (0..callers.max(1))
        .map(|_| {
            let (cycle, next) = (Arc::clone(&cycle), Arc::clone(&next));
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= count {
                        return Ok::<_, BoxError>(latencies);
                    }
                    let t = Instant::now();
                    cycle(first + i).await?;
                    latencies.push(t.elapsed());
                }
            })
        })
        .collect();
    let mut summary = Summary::default();
    for task in tasks {
        summary.latencies.extend(task.await??);
    }
    summary.seconds = started.elapsed().as_secs_f64();
    summary.cycles = summary.latencies.len() as u64;
    summary.latencies.sort_unstable();
    Ok(summary)
}
