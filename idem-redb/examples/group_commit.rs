//! Group commit against the naive baseline: claim -> complete cycles per second at 1, 8
//! and 32 concurrent callers, for [`RedbStore`] and for a store that runs every operation in
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
use idem_redb::table::{EXPIRY, RECORDS};
use idem_redb::{Config, Linger, RedbStore};
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

fn request(column: usize, caller: usize, round: usize, n: u64) -> ClaimRequest {
    let scope = Scope::new(format!("bench-{column}-{caller}"), Endpoint::new("POST", "/v1/workers")).expect("scope");
    let key = IdempotencyKey::parse(format!("r{round}-k{n}").as_bytes()).expect("key");
    ClaimRequest::new(scope, key, Fingerprint::of_bytes(b"{}"), Duration::from_secs(300), Duration::from_secs(86_400))
}

fn response() -> StoredResponse {
    StoredResponse::new(201, vec![("location".into(), b"/v1/workers/w-1".to_vec())], vec![b'x'; 256])
}

/// One column of the table: a store kept open across the slices. All columns share one
/// database file, so that the file's layout and the disk's mood cannot favour one.
#[derive(Clone)]
enum Column {
    Group(RedbStore),
    Naive(NaiveStore),
}

impl Column {
    fn open(db: Arc<Database>, linger: Option<Linger>) -> Self {
        match linger {
            Some(linger) => {
                Column::Group(RedbStore::from_database(db, Config::default().with_linger(linger)).expect("store"))
            }
            None => Column::Naive(NaiveStore { db }),
        }
    }

    async fn cycle(&self, req: ClaimRequest) -> Result<(), StoreError> {
        let naive_err = |e| StoreError::unavailable("redb", "naive", false, e);
        match self {
            Column::Group(store) => {
                let ClaimOutcome::Claimed(r) = store.claim(req).await? else { panic!("keys are fresh") };
                store.complete(r.id, r.token, response()).await?;
            }
            Column::Naive(store) => {
                let ClaimOutcome::Claimed(r) = store.claim(req).await.map_err(naive_err)? else {
                    panic!("keys are fresh")
                };
                store.complete(r.id, r.token, response()).await.map_err(naive_err)?;
            }
        }
        Ok(())
    }
}

/// Runs `callers` loops of claim -> complete for `secs`; returns cycles per second and,
/// for the group-commit store, operations per batch in this slice.
async fn run(column: &Column, index: usize, callers: usize, secs: f64, round: usize) -> (f64, Option<f64>) {
    let stats_before = match column {
        Column::Group(store) => Some(store.batch_stats()),
        Column::Naive(_) => None,
    };
    let cycles = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let start = Instant::now();
    let mut tasks = Vec::new();
    for caller in 0..callers {
        let (column, cycles) = (column.clone(), Arc::clone(&cycles));
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            while Instant::now() < deadline {
                column.cycle(request(index, caller, round, n)).await?;
                n += 1;
                cycles.fetch_add(1, Ordering::Relaxed);
            }
            Ok::<(), StoreError>(())
        }));
    }
    for t in tasks {
        t.await.expect("task").expect("cycle");
    }
    let elapsed = start.elapsed().as_secs_f64();
    let per_batch = match (column, stats_before) {
        (Column::Group(store), Some(before)) => {
            let after = store.batch_stats();
            let batches = after.batches - before.batches;
            (batches > 0).then(|| (after.operations - before.operations) as f64 / batches as f64)
        }
        _ => None,
    };
    (cycles.load(Ordering::Relaxed) as f64 / elapsed, per_batch)
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let secs: f64 = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(2.0);
    let rounds = 4;
    let base = std::env::var_os("IDEM_BENCH_DIR").map(std::path::PathBuf::from).unwrap_or_else(std::env::temp_dir);
    let dir = tempfile::tempdir_in(base).expect("temporary directory");
    let adaptive = Config::default().linger();
    let lingers = [None, Some(Linger::None), Some(adaptive)];
    println!("claim -> complete cycles per second (2 durable writes per cycle), {secs} s per cell, run as {rounds}");
    println!("interleaved slices on one warmed-up file, so that a change in machine load hits every");
    println!("column alike. `default` is Config::default(): {adaptive:?}.");
    println!(
        "{:>8} {:>10} {:>18} {:>8} {:>10} {:>18} {:>8} {:>10}",
        "callers", "naive", "group, no linger", "ratio", "ops/batch", "group, default", "ratio", "ops/batch"
    );
    for callers in [1, 8, 32] {
        let db = Arc::new(Database::create(dir.path().join(format!("callers-{callers}.redb"))).expect("database"));
        let columns: Vec<Column> = lingers.iter().map(|linger| Column::open(Arc::clone(&db), *linger)).collect();
        for (i, column) in columns.iter().enumerate() {
            run(column, i, callers, 0.3, 0).await;
        }
        let mut rate = [0.0f64; 3];
        let mut per_batch: [Vec<f64>; 3] = Default::default();
        for round in 1..=rounds {
            for (i, column) in columns.iter().enumerate() {
                let (r, b) = run(column, i, callers, secs / rounds as f64, round).await;
                rate[i] += r / rounds as f64;
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
