//! Group commit against the naive baseline: claim -> complete cycles per second at 1 and
//! 32 concurrent callers, for [`RedbStore`] and for a store that runs every operation in
//! its own durable write transaction (one fsync per claim and per completion).
//!
//! ```text
//! cargo run --release -p idem-redb --example group_commit [seconds per row, default 2]
//! ```
//!
//! The database files live in a temporary directory under `$IDEM_BENCH_DIR` (default: the
//! system temporary directory); put it on the disk you want to measure.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem_core::codec;
use idem_core::transition;
use idem_core::{
    ClaimOutcome, ClaimRequest, Clock, Endpoint, FencingToken, Fingerprint, IdempotencyKey, RecordId, Scope, Store,
    StoreError, StoredResponse, SystemClock,
};
use idem_redb::store::{EXPIRY, RECORDS};
use idem_redb::{Linger, RedbConfig, RedbStore};
use redb::{Database, ReadableTable};

/// The baseline: every operation is one durable write transaction, run on the blocking
/// pool, with the same tables, encoding and rules as `RedbStore`.
#[derive(Clone)]
struct NaiveStore {
    db: Arc<Database>,
}

impl NaiveStore {
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, redb::Error> {
        let db = Arc::clone(&self.db);
        tokio::task::spawn_blocking(move || {
            // Read, decide and write in one write transaction, as an atomic claim must.
            let txn = db.begin_write()?;
            let outcome = {
                let mut records = txn.open_table(RECORDS)?;
                let mut expiry = txn.open_table(EXPIRY)?;
                let current = records.get(&req.id.0)?.and_then(|v| codec::decode(v.value()).ok());
                let (write, outcome) = transition::claim(current.as_ref(), &req, SystemClock.now());
                if let Some(new) = write {
                    records.insert(&new.id.0, codec::encode(&new).as_slice())?;
                    expiry.insert((new.expires_at.0, new.id.0), ())?;
                }
                outcome
            };
            txn.commit()?;
            Ok(outcome)
        })
        .await
        .expect("blocking task")
    }

    async fn complete(&self, id: RecordId, token: FencingToken, response: StoredResponse) -> Result<(), redb::Error> {
        let db = Arc::clone(&self.db);
        tokio::task::spawn_blocking(move || {
            let txn = db.begin_write()?;
            {
                let mut records = txn.open_table(RECORDS)?;
                let current = records.get(&id.0)?.and_then(|v| codec::decode(v.value()).ok());
                // Completion keeps expires_at, so the expiry index does not change.
                if let Ok(new) = transition::complete(current.as_ref(), id, token, response, SystemClock.now()) {
                    records.insert(&new.id.0, codec::encode(&new).as_slice())?;
                }
            }
            txn.commit()?;
            Ok(())
        })
        .await
        .expect("blocking task")
    }
}

fn request(caller: usize, n: u64) -> ClaimRequest {
    let scope = Scope::new(format!("bench-{caller}"), Endpoint::new("POST", "/v1/workers")).expect("scope");
    let key = IdempotencyKey::parse(format!("k-{n}").as_bytes()).expect("key");
    ClaimRequest::new(scope, key, Fingerprint::of_bytes(b"{}"), Duration::from_secs(300), Duration::from_secs(86_400))
}

fn response() -> StoredResponse {
    StoredResponse::new(201, vec![("location".into(), b"/v1/workers/w-1".to_vec())], vec![b'x'; 256])
}

#[derive(Clone, Copy)]
enum Which {
    /// `RedbStore` with this linger.
    Group(Linger),
    Naive,
}

/// Runs `callers` loops of claim -> complete for `secs`; returns cycles per second.
async fn run(which: Which, callers: usize, secs: f64, dir: &std::path::Path, tag: &str) -> (f64, Option<f64>) {
    let path = dir.join(format!("{tag}.redb"));
    let db = Arc::new(Database::create(&path).expect("database"));
    let linger = match which {
        Which::Group(linger) => linger,
        Which::Naive => Linger::None,
    };
    let group = RedbStore::open_with(Arc::clone(&db), RedbConfig::default().with_linger(linger)).expect("store");
    let naive = NaiveStore { db };
    let cycles = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let start = Instant::now();
    let mut tasks = Vec::new();
    for caller in 0..callers {
        let (group, naive, cycles) = (group.clone(), naive.clone(), Arc::clone(&cycles));
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            while Instant::now() < deadline {
                let req = request(caller, n);
                n += 1;
                match which {
                    Which::Group(_) => {
                        let ClaimOutcome::Claimed(r) = group.claim(req).await? else { continue };
                        group.complete(r.id, r.token, response()).await?;
                    }
                    Which::Naive => {
                        let ClaimOutcome::Claimed(r) =
                            naive.claim(req).await.map_err(|e| StoreError::unavailable("redb", "naive", false, e))?
                        else {
                            continue;
                        };
                        naive
                            .complete(r.id, r.token, response())
                            .await
                            .map_err(|e| StoreError::unavailable("redb", "naive", false, e))?;
                    }
                }
                cycles.fetch_add(1, Ordering::Relaxed);
            }
            Ok::<(), StoreError>(())
        }));
    }
    for t in tasks {
        t.await.expect("task").expect("cycle");
    }
    let elapsed = start.elapsed().as_secs_f64();
    let stats = group.batch_stats();
    let per_batch = (stats.batches > 0).then(|| stats.operations as f64 / stats.batches as f64);
    (cycles.load(Ordering::Relaxed) as f64 / elapsed, per_batch)
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let secs: f64 = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(2.0);
    let rounds = 4;
    let base = std::env::var_os("IDEM_BENCH_DIR").map(std::path::PathBuf::from).unwrap_or_else(std::env::temp_dir);
    let dir = tempfile::tempdir_in(base).expect("temporary directory");
    let adaptive = RedbConfig::default().linger;
    let columns = [
        ("naive", Which::Naive),
        ("group, no linger", Which::Group(Linger::None)),
        ("group, default", Which::Group(adaptive)),
    ];
    println!("claim -> complete cycles per second (2 durable writes per cycle), {secs} s per cell, run as {rounds}");
    println!("interleaved slices so that a change in machine load hits every column alike.");
    println!("`default` is RedbConfig::default(): {adaptive:?}.");
    println!(
        "{:>8} {:>10} {:>18} {:>8} {:>10} {:>18} {:>8} {:>10}",
        "callers", "naive", "group, no linger", "ratio", "ops/batch", "group, default", "ratio", "ops/batch"
    );
    for callers in [1, 32] {
        let mut rate = [0.0f64; 3];
        let mut per_batch: [Vec<f64>; 3] = Default::default();
        for round in 0..rounds {
            for (i, (name, which)) in columns.iter().enumerate() {
                let tag = format!("{}-{callers}-{round}", name.replace([' ', ','], ""));
                let (r, b) = run(*which, callers, secs / f64::from(rounds), dir.path(), &tag).await;
                rate[i] += r / f64::from(rounds);
                per_batch[i].extend(b);
            }
        }
        let mean = |v: &Vec<f64>| v.iter().sum::<f64>() / v.len().max(1) as f64;
        println!(
            "{callers:>8} {:>10.0} {:>18.0} {:>7.1}x {:>10.1} {:>18.0} {:>7.1}x {:>10.1}",
            rate[0],
            rate[1],
            rate[1] / rate[0],
            mean(&per_batch[1]),
            rate[2],
            rate[2] / rate[0],
            mean(&per_batch[2]),
        );
    }
}
