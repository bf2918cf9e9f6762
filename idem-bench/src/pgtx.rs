//! `pgtx`: completion inside the handler's own transaction on a `sqlx::PgPool`, against the
//! same statements sent by hand through the same pool.
//!
//! One cycle is what a handler with transactional completion does: the claim (its own
//! statement, outside any transaction), then `BEGIN`, the handler's `INSERT` of a worker
//! row, the record's completion, `COMMIT`.
//! - library: `store.claim`, then `store.complete_in(&mut tx, ..)` between the insert and
//!   the commit;
//! - by hand: the store's own claim and complete statements
//!   (`PostgresStore::sql`), bound and sent with sqlx, with the same insert, `BEGIN` and
//!   `COMMIT`.
//!
//! `--via direct`: straight to PostgreSQL, named prepared statements (sqlx's statement
//! cache) on both sides. `--via pgbouncer`: through PgBouncer in transaction mode
//! (`scripts/pgbouncer`), where named statements break: the store runs with
//! `Config::with_prepared_statements(false)` and the by-hand side sends the same statements
//! the same way (the simple query protocol, values as hex and decimal literals).

use std::fmt::Write as _;
use std::sync::Arc;

use clap::ValueEnum;
use idem_core::{BoxError, ClaimOutcome, Store as _};
use idem_postgres::sqlx::postgres::PgPoolOptions;
use idem_postgres::sqlx::{self, Row as _};
use idem_postgres::{PostgresStore, Statement};

use crate::workload::{Summary, Workload, drive};

/// How the pool reaches PostgreSQL.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Via {
    /// Straight to PostgreSQL.
    Direct,
    /// Through PgBouncer in transaction mode.
    Pgbouncer,
}

/// `idem-bench pgtx`.
#[derive(Debug, clap::Args)]
pub(crate) struct PgTxArgs {
    /// Where the pool connects.
    #[arg(long, value_enum, default_value = "direct")]
    via: Via,
    /// PostgreSQL URL (`--via direct`).
    #[arg(long, default_value = "postgres://postgres@127.0.0.1:5432/test")]
    postgres_url: String,
    /// PgBouncer URL (`--via pgbouncer`; scripts/pgbouncer listens on 6401).
    #[arg(long, default_value = "postgres://postgres@127.0.0.1:6401/test")]
    pgbouncer_url: String,
    /// Pool size (library and by-hand share the pool).
    #[arg(long, default_value_t = 16)]
    pool: u32,
    /// Concurrent callers.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Cycles measured for each side.
    #[arg(long, default_value_t = 4000)]
    count: u64,
    /// Alternating slices (by hand, library, library, by hand, ...).
    #[arg(long, default_value_t = 4)]
    rounds: u64,
    /// Stored response body size, bytes.
    #[arg(long, default_value_t = 256)]
    body_bytes: usize,
}

/// The literal form of the by-hand statements behind PgBouncer (what the store does with
/// prepared statements off).
enum Lit<'a> {
    Bytes(&'a [u8]),
    Text(&'a str),
    I64(i64),
    Null,
}

fn inline(sql: &str, params: &[Lit<'_>]) -> String {
    let hex = |b: &[u8]| {
        let mut s = String::with_capacity(b.len() * 2);
        for byte in b {
            let _ = write!(s, "{byte:02x}");
        }
        s
    };
    let mut out = sql.to_owned();
    // Highest first, so that `$1` never eats the start of `$10`.
    for (i, p) in params.iter().enumerate().rev() {
        let lit = match p {
            Lit::Bytes(b) => format!("decode('{}', 'hex')", hex(b)),
            Lit::Text(t) => format!("convert_from(decode('{}', 'hex'), 'UTF8')", hex(t.as_bytes())),
            Lit::I64(v) => format!("({v})"),
            Lit::Null => "NULL".to_owned(),
        };
        out = out.replace(&format!("${}", i + 1), &lit);
    }
    out
}

struct Bench {
    pool: sqlx::PgPool,
    store: PostgresStore,
    work: Workload,
    insert: String,
    prepared: bool,
}

impl Bench {
    async fn library(&self, i: u64) -> Result<(), BoxError> {
        let req = self.work.request("lib", i);
        let ClaimOutcome::Claimed(r) = self.store.claim(req.clone()).await? else {
            return Err("pgtx: a fresh key was not claimed".into());
        };
        let mut tx = self.pool.begin().await?;
        self.insert(&mut tx, req.key().as_str()).await?;
        self.store.complete_in(&mut tx, r.id, r.token, self.work.response()).await?;
        tx.commit().await?;
        Ok(())
    }

    async fn insert(&self, tx: &mut sqlx::PgConnection, op: &str) -> Result<(), BoxError> {
        if self.prepared {
            sqlx::Executor::execute(&mut *tx, sqlx::query(&self.insert).bind(op)).await?;
        } else {
            sqlx::Executor::execute(&mut *tx, sqlx::raw_sql(&inline(&self.insert, &[Lit::Text(op)]))).await?;
        }
        Ok(())
    }

    async fn by_hand(&self, i: u64) -> Result<(), BoxError> {
        let req = self.work.request("hand", i);
        let (claim, complete) = (self.store.sql(Statement::Claim), self.store.sql(Statement::Complete));
        let (id, fingerprint) = (req.id(), req.fingerprint());
        let (principal, endpoint) =
            (req.scope().principal.as_str().as_bytes(), req.scope().endpoint.as_str().as_bytes());
        let row = if self.prepared {
            let q = sqlx::query(claim)
                .bind(&id.as_bytes()[..])
                .bind(principal)
                .bind(endpoint)
                .bind(req.key().as_str())
                .bind(&fingerprint.as_bytes()[..])
                .bind(req.lease_ms())
                .bind(req.retention_ms())
                .bind(None::<i64>);
            sqlx::Executor::fetch_one(&self.pool, q).await?
        } else {
            let text = inline(
                claim,
                &[
                    Lit::Bytes(id.as_bytes()),
                    Lit::Bytes(principal),
                    Lit::Bytes(endpoint),
                    Lit::Text(req.key().as_str()),
                    Lit::Bytes(fingerprint.as_bytes()),
                    Lit::I64(req.lease_ms()),
                    Lit::I64(req.retention_ms()),
                    Lit::Null,
                ],
            );
            sqlx::Executor::fetch_one(&self.pool, sqlx::raw_sql(&text)).await?
        };
        if !row.try_get::<bool, _>("claimed")? {
            return Err("pgtx by hand: a fresh key was not claimed".into());
        }
        let token: i64 = row.try_get("token")?;
        let encoded = idem_core::codec::encode_response(&self.work.response());
        let mut tx = self.pool.begin().await?;
        self.insert(&mut tx, req.key().as_str()).await?;
        let done = if self.prepared {
            let q = sqlx::query(complete).bind(&id.as_bytes()[..]).bind(token).bind(&encoded).bind(None::<i64>);
            sqlx::Executor::fetch_optional(&mut *tx, q).await?
        } else {
            let text = inline(complete, &[Lit::Bytes(id.as_bytes()), Lit::I64(token), Lit::Bytes(&encoded), Lit::Null]);
            sqlx::Executor::fetch_optional(&mut *tx, sqlx::raw_sql(&text)).await?
        };
        if done.is_none() {
            return Err("pgtx by hand: lease lost".into());
        }
        tx.commit().await?;
        Ok(())
    }
}

pub(crate) async fn run(args: PgTxArgs) -> Result<(), BoxError> {
    let url = match args.via {
        Via::Direct => &args.postgres_url,
        Via::Pgbouncer => &args.pgbouncer_url,
    };
    let prepared = args.via == Via::Direct;
    let pool = PgPoolOptions::new().max_connections(args.pool).connect(url).await?;
    let config = idem_postgres::Config::default().with_schema(crate::PG_SCHEMA).with_prepared_statements(prepared);
    let store = PostgresStore::from_pool(pool.clone(), config).await?;
    let table = format!("{}.pgtx_workers", crate::PG_SCHEMA);
    sqlx::raw_sql(&format!("CREATE TABLE IF NOT EXISTS {table} (id bigserial PRIMARY KEY, op text NOT NULL)"))
        .execute(&pool)
        .await?;
    let run = crate::run_id();
    let work = Workload::new(&run, args.body_bytes);
    let insert = format!("INSERT INTO {table} (op) VALUES ($1::text)");
    let bench = Arc::new(Bench { pool: pool.clone(), store, work, insert, prepared });
    let lib = {
        let bench = Arc::clone(&bench);
        Arc::new(move |i| {
            let bench = Arc::clone(&bench);
            async move { bench.library(i).await }
        })
    };
    let hand = {
        let bench = Arc::clone(&bench);
        Arc::new(move |i| {
            let bench = Arc::clone(&bench);
            async move { bench.by_hand(i).await }
        })
    };
    let warm = (args.count / 20).clamp(16, 500);
    drive(Arc::clone(&lib), args.concurrency, 0, warm).await?;
    drive(Arc::clone(&hand), args.concurrency, 0, warm).await?;
    let rounds = args.rounds.max(1);
    let slice = (args.count / rounds).max(1);
    let (mut lib_sum, mut hand_sum) = (Summary::default(), Summary::default());
    for r in 0..rounds {
        let first = warm + r * slice;
        if r % 2 == 0 {
            hand_sum.merge(drive(Arc::clone(&hand), args.concurrency, first, slice).await?);
        }
        lib_sum.merge(drive(Arc::clone(&lib), args.concurrency, first, slice).await?);
        if r % 2 == 1 {
            hand_sum.merge(drive(Arc::clone(&hand), args.concurrency, first, slice).await?);
        }
    }
    // Leave nothing behind: this run's records and every worker row.
    sqlx::query(&format!("DELETE FROM {}.records WHERE principal = $1", crate::PG_SCHEMA))
        .bind(bench.work.principal.as_bytes())
        .persistent(false)
        .execute(&pool)
        .await?;
    sqlx::raw_sql(&format!("TRUNCATE {table}")).execute(&pool).await?;
    let ratio = if hand_sum.rate() > 0.0 { lib_sum.rate() / hand_sum.rate() } else { f64::NAN };
    println!(
        "{:<10} {:>5} {:>7} {:>12} {:>9} {:>9} {:>12} {:>9} {:>9} {:>7}",
        "via", "conc", "cycles", "lib cyc/s", "p50 ms", "p99 ms", "hand cyc/s", "p50 ms", "p99 ms", "ratio"
    );
    println!(
        "{:<10} {:>5} {:>7} {:>12.0} {:>9.3} {:>9.3} {:>12.0} {:>9.3} {:>9.3} {:>6.2}x",
        match args.via {
            Via::Direct => "direct",
            Via::Pgbouncer => "pgbouncer",
        },
        args.concurrency,
        lib_sum.cycles,
        lib_sum.rate(),
        lib_sum.quantile_ms(0.5),
        lib_sum.quantile_ms(0.99),
        hand_sum.rate(),
        hand_sum.quantile_ms(0.5),
        hand_sum.quantile_ms(0.99),
        ratio,
    );
    println!("(one cycle = claim, then BEGIN + INSERT worker row + complete + COMMIT)");
    Ok(())
}
