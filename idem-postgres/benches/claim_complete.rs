//! Claim + complete throughput of `PostgresStore` against the same two statements sent by
//! hand through sqlx on the same pool, at the same concurrency, in one run.
//!
//! ```text
//! cargo bench -p idem-postgres --bench claim_complete
//! IDEM_BENCH_SECS=3 IDEM_BENCH_ROUNDS=10 IDEM_BENCH_CALLERS=1,16,32 \
//!     cargo bench -p idem-postgres --bench claim_complete
//! ```
//!
//! Each caller loops: a fresh idempotency key, claim, complete with a 201 response. The
//! store builds a `ClaimRequest`, runs `Store::claim` then `Store::complete` (encoding the
//! response, decoding the returned rows into `Record`s). By hand: the store's own
//! `Statement::Claim` and `Statement::Complete` text (`PostgresStore::sql`), bound with
//! `sqlx::query` and sent with `fetch_one(&pool)` on the store's pool (a pooled connection
//! per statement, as the store takes, since the handler runs between the two), a
//! pre-encoded response, reading only the token. Modes alternate in paired rounds (which
//! goes first alternates too), so drift on the server and load on the machine hit both;
//! each round's ratio is store/by-hand throughput, and the line gives their median, the
//! lowest and the highest, then this process's CPU per pair for each mode (the client's
//! share: the store's own work, pool and driver). `IDEM_BENCH_SECS` (default 2) is one mode's turn in a round,
//! `IDEM_BENCH_ROUNDS` (default 8) the number of rounds, `IDEM_BENCH_CALLERS` (default
//! `1,32`) the concurrencies. Runs in its own `idem_bench_*` schema, dropped at the end.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use idem_core::codec::encode_response;
use idem_core::{
    ClaimOutcome, ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, RecordId, Scope, Store, StoredResponse,
};
use idem_postgres::sqlx::{self, Row as _};
use idem_postgres::{Config, PostgresStore, Statement};

const LEASE: Duration = Duration::from_secs(300);
const RETENTION: Duration = Duration::from_secs(86_400);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Store,
    ByHand,
}

struct Fixture {
    store: PostgresStore,
    run_id: String,
    counter: AtomicU64,
    fingerprint: Fingerprint,
    response: StoredResponse,
    response_bytes: Vec<u8>,
}

impl Fixture {
    fn next_key(&self) -> String {
        format!("{}-{}", self.run_id, self.counter.fetch_add(1, Ordering::Relaxed))
    }

    async fn store_once(&self, scope: &Scope) {
        let key = IdempotencyKey::parse(self.next_key().as_bytes()).expect("key");
        let req = ClaimRequest::new(scope.clone(), key, self.fingerprint, LEASE, RETENTION);
        let ClaimOutcome::Claimed(r) = self.store.claim(req).await.expect("claim") else {
            panic!("fresh key must be claimed");
        };
        self.store.complete(r.id, r.token, self.response.clone()).await.expect("complete");
    }

    async fn by_hand_once(&self, scope: &Scope) {
        let pool = self.store.pool();
        let key = self.next_key();
        let (principal, endpoint) = (scope.principal.as_str(), scope.endpoint.as_str());
        let id = RecordId::derive(principal, endpoint, &key);
        let row = sqlx::query(self.store.sql(Statement::Claim))
            .bind(&id.as_bytes()[..])
            .bind(principal.as_bytes())
            .bind(endpoint.as_bytes())
            .bind(&key)
            .bind(&self.fingerprint.as_bytes()[..])
            .bind(300_000i64)
            .bind(86_400_000i64)
            .bind(None::<i64>)
            .fetch_one(pool)
            .await
            .expect("claim");
        let token: i64 = row.try_get("token").expect("token");
        let done = sqlx::query(self.store.sql(Statement::Complete))
            .bind(&id.as_bytes()[..])
            .bind(token)
            .bind(&self.response_bytes)
            .bind(None::<i64>)
            .fetch_optional(pool)
            .await
            .expect("complete");
        assert!(done.is_some(), "complete applies");
    }
}

/// CPU time this process has used (user + system), from `/proc/self/stat` in 10 ms ticks;
/// zero off Linux.
fn process_cpu() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // utime and stime are fields 14 and 15, counted after the parenthesised command name.
    let fields: Vec<&str> = stat.rsplit_once(") ").map_or("", |(_, rest)| rest).split(' ').collect();
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok()).unwrap_or(0);
    Duration::from_millis((ticks(11) + ticks(12)) * 10)
}

/// Runs `callers` tasks in `mode` for `secs`; returns claim+complete pairs per second and
/// this process's CPU per pair (µs): the client's share, pool and driver included.
async fn run(fx: &Arc<Fixture>, mode: Mode, callers: usize, secs: f64) -> (f64, f64) {
    let cpu = process_cpu();
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let start = Instant::now();
    let tasks: Vec<_> = (0..callers)
        .map(|c| {
            let fx = Arc::clone(fx);
            tokio::spawn(async move {
                let scope = Scope::new(format!("bench-{c}"), Endpoint::new("POST", "/v1/workers")).expect("scope");
                let mut done = 0u64;
                while Instant::now() < deadline {
                    match mode {
                        Mode::Store => fx.store_once(&scope).await,
                        Mode::ByHand => fx.by_hand_once(&scope).await,
                    }
                    done += 1;
                }
                done
            })
        })
        .collect();
    let mut total = 0u64;
    for t in tasks {
        total += t.await.expect("caller");
    }
    let cpu_us = process_cpu().saturating_sub(cpu).as_secs_f64() * 1e6 / total.max(1) as f64;
    (total as f64 / start.elapsed().as_secs_f64(), cpu_us)
}

fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    // Plain TCP unless the URL says otherwise: TLS would add the same cost to both sides and
    // hide the store's own share.
    let url = env("IDEM_POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable".to_owned());
    let secs: f64 = env("IDEM_BENCH_SECS", 2.0);
    let rounds: usize = env("IDEM_BENCH_ROUNDS", 8usize).max(1);
    let callers: Vec<usize> =
        env("IDEM_BENCH_CALLERS", "1,32".to_owned()).split(',').filter_map(|c| c.trim().parse().ok()).collect();
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    let schema = format!("idem_bench_{}_{}", now.as_secs(), now.subsec_nanos());
    let max = callers.iter().copied().max().unwrap_or(1);
    let config = Config::default().with_schema(&schema).with_max_connections(max);
    let store = PostgresStore::connect(&url, config).await.unwrap_or_else(|e| {
        panic!(
            "PostgreSQL is not reachable at {url}: {e}. Start it with: \
             pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start"
        )
    });
    let response = StoredResponse::new(
        201,
        vec![("content-type".into(), b"application/json".to_vec()), ("location".into(), b"/v1/workers/42".to_vec())],
        br#"{"id":"wrk_42","state":"provisioning"}"#.to_vec(),
    );
    let fx = Arc::new(Fixture {
        store: store.clone(),
        run_id: format!("{}", now.as_nanos()),
        counter: AtomicU64::new(0),
        fingerprint: Fingerprint::of_bytes(b"{\"gpu\":\"h100\"}"),
        response_bytes: encode_response(&response),
        response,
    });

    println!("idem-postgres claim+complete, store vs the same statements by hand through sqlx on the same pool");
    println!("({rounds} paired rounds of {secs} s per mode, schema {schema})");
    println!(
        "{:>7} {:>9} {:>9} {:>7} {:>7} {:>7} {:>11}  per-round ratios",
        "callers", "store/s", "hand/s", "median", "min", "max", "CPU us s/h"
    );
    for &n in &callers {
        // Warm up: opens the pool's connections and prepares the statements on each.
        run(&fx, Mode::Store, n, 0.5).await;
        run(&fx, Mode::ByHand, n, 0.5).await;
        let (mut store_sum, mut hand_sum, mut ratios) = (0.0, 0.0, Vec::new());
        let (mut store_cpu, mut hand_cpu) = (0.0, 0.0);
        for round in 0..rounds {
            let (ours, hand) = if round % 2 == 0 {
                let ours = run(&fx, Mode::Store, n, secs).await;
                (ours, run(&fx, Mode::ByHand, n, secs).await)
            } else {
                let hand = run(&fx, Mode::ByHand, n, secs).await;
                (run(&fx, Mode::Store, n, secs).await, hand)
            };
            store_sum += ours.0;
            hand_sum += hand.0;
            store_cpu += ours.1;
            hand_cpu += hand.1;
            ratios.push(ours.0 / hand.0);
        }
        let listed = ratios.iter().map(|r| format!("{r:.3}")).collect::<Vec<_>>().join(" ");
        let mut sorted = ratios.clone();
        sorted.sort_by(f64::total_cmp);
        let median = (sorted[(rounds - 1) / 2] + sorted[rounds / 2]) / 2.0;
        let r = rounds as f64;
        println!(
            "{n:>7} {:>9.0} {:>9.0} {median:>6.3}x {:>6.3}x {:>6.3}x {:>5.0}/{:<5.0}  {listed}",
            store_sum / r,
            hand_sum / r,
            sorted[0],
            sorted[rounds - 1],
            store_cpu / r,
            hand_cpu / r
        );
    }
    sqlx::raw_sql(&format!("DROP SCHEMA \"{schema}\" CASCADE")).execute(store.pool()).await.expect("drop bench schema");
}
