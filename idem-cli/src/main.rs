//! # idem (the `idem-cli` package)
//!
//! The operator's tool for idempotency records: look at a record a client is stuck on,
//! list records by state and age, release a stuck claim with a fenced `fail`, run one
//! sweep, count records; and `idem check URL`, which runs the decision table against a
//! live server from the outside. Works on every backend through a store URL; human output by
//! default, `--json` on every command. `docs/operations.md` is the full manual (commands,
//! URL forms, exit codes, JSON shapes, and why `release` of a live claim needs `--force`).
//!
//! ```text
//! idem --store redis://127.0.0.1:6379 inspect --principal acct_42 \
//!     --endpoint 'POST /v1/workers/{id}/reboot' --key 7c3f5d1e
//! ```
//!
//! # Layout
//! - `url`: store URLs and opening a store without creating or migrating it.
//! - `report`: records, listings and counts as text and as JSON.
//! - `check`: `idem check`, its rules, the requests each sends and their judgement.
//! - this file: arguments (clap), the commands, exit codes.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::{Parser, Subcommand, ValueEnum};
use idem_core::{Endpoint, IdempotencyKey, ListFilter, Record, RecordId, RecordState, Store, StoreError, UnixMillis};

mod check;
mod replicas;
mod report;
mod url;

use report::Output;
use url::StoreUrl;

/// Inspect, list, release, sweep and count idempotency records; check a live server against
/// the Idempotency-Key rules.
#[derive(Debug, Parser)]
#[command(name = "idem", version)]
struct Cli {
    /// The store URL (`docs/operations.md#store-urls`).
    #[arg(
        long,
        env = "IDEM_STORE",
        global = true,
        help = "Where the records are: redb:///PATH, sqlite:///PATH, redis://HOST:PORT[/DB][?prefix=P], \
                redis-cluster://HOST:PORT[,HOST:PORT...][?prefix=P], postgres://USER@HOST/DB[?schema=S], \
                mysql://USER@HOST/DB[?prefix=P], dynamodb://TABLE[?endpoint=URL&region=R]"
    )]
    store: Option<String>,
    /// Print one JSON document on stdout instead of text (errors too).
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the decision table against a live server, from the outside: one row per rule,
    /// pass or fail with what came back; exit 5 when a rule failed. Needs no store.
    Check(Box<check::CheckArgs>),
    #[command(flatten)]
    Store(StoreCommand),
}

/// The commands that read or change records in a store (`--store`).
#[derive(Debug, Subcommand)]
enum StoreCommand {
    /// Show one record: state, fencing token, lease, fingerprint, times, stored response.
    Inspect(Target),
    /// List live records, filtered by state, age and principal (one page).
    List(ListArgs),
    /// Free a stuck in-flight claim: a fenced `fail` with the record's current token, so
    /// the next request with the key reclaims it and runs.
    Release {
        #[command(flatten)]
        target: Target,
        /// Release even while the lease is live (its owner may still be running; its later
        /// writes are then refused as lease lost).
        #[arg(long)]
        force: bool,
    },
    /// Run one sweep: remove up to --limit records past their retention.
    Sweep {
        /// Most records removed by this call.
        #[arg(long, default_value_t = 1_000)]
        limit: usize,
    },
    /// Count live records by state and show the oldest in-flight claim.
    Stats {
        /// Only this principal's records.
        #[arg(long)]
        principal: Option<String>,
    },
}

/// Which record: by scope and key, or by record id.
#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("which").required(true).args(["record_id", "endpoint"])))]
#[command(group(clap::ArgGroup::new("who").args(["principal", "bearer"])))]
struct Target {
    /// The record id (64 hex digits), as `list` and logs show it.
    #[arg(long, conflicts_with_all = ["principal", "bearer", "endpoint", "key"])]
    record_id: Option<String>,
    /// The principal the request ran as (what the application's principal resolver
    /// returned, e.g. `bearer:<64 hex>` for the default `BearerToken`).
    #[arg(long, requires_all = ["endpoint", "key"])]
    principal: Option<String>,
    /// The bearer token the request sent (`Authorization: Bearer TOKEN`): the CLI derives
    /// the principal the default `BearerToken` resolver stores (`bearer:` + BLAKE3 hash).
    #[arg(long, requires_all = ["endpoint", "key"])]
    bearer: Option<String>,
    /// Method and route as the layer forms it: `POST /v1/workers/{id}/reboot` (the route
    /// template under axum, the concrete path otherwise).
    #[arg(long, requires_all = ["who", "key"])]
    endpoint: Option<String>,
    /// The Idempotency-Key header value (bare, or quoted as a structured-field string).
    #[arg(long, requires_all = ["who", "endpoint"])]
    key: Option<String>,
}

#[derive(Debug, clap::Args)]
struct ListArgs {
    /// Only records in this state.
    #[arg(long, value_enum)]
    state: Option<StateArg>,
    /// Only records whose current attempt started at least this long ago (`90s`, `5m`, `2h`).
    #[arg(long, value_parser = humantime::parse_duration)]
    min_age: Option<Duration>,
    /// Only this principal's records.
    #[arg(long)]
    principal: Option<String>,
    /// Most records shown.
    #[arg(long, default_value_t = 100)]
    limit: usize,
    /// Start after this record id (the `next_after` of the previous page).
    #[arg(long)]
    after: Option<String>,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
#[value(rename_all = "snake_case")]
enum StateArg {
    InFlight,
    Completed,
    Failed,
}

impl From<StateArg> for RecordState {
    fn from(s: StateArg) -> Self {
        match s {
            StateArg::InFlight => RecordState::InFlight,
            StateArg::Completed => RecordState::Completed,
            StateArg::Failed => RecordState::Failed,
        }
    }
}

/// A command's failure and its exit code (`docs/operations.md#exit-codes`).
#[derive(Debug, thiserror::Error)]
enum Failure {
    /// 1: the record does not exist (never claimed, or past its retention).
    #[error("{0}")]
    NotFound(String),
    /// 2: the arguments or the store URL are wrong.
    #[error("{0}")]
    Usage(String),
    /// 3: the store failed (unreachable, refused, corrupt record).
    #[error("{0}")]
    Store(String),
    /// 4: `release` refused: live lease without `--force`, completed record, or the
    /// record changed while releasing.
    #[error("{0}")]
    Refused(String),
}

impl Failure {
    fn code(&self) -> u8 {
        match self {
            Failure::NotFound(_) => 1,
            Failure::Usage(_) => 2,
            Failure::Store(_) => 3,
            Failure::Refused(_) => 4,
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            Failure::NotFound(_) => "not_found",
            Failure::Usage(_) => "usage",
            Failure::Store(_) => "store",
            Failure::Refused(_) => "refused",
        }
    }
}

/// The store error with its causes, on one line.
fn store_failure(what: &str, e: &StoreError) -> Failure {
    Failure::Store(format!("{what}: {}", chain(e)))
}

fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let next = c.to_string();
        if !text.contains(&next) {
            text.push_str(": ");
            text.push_str(&next);
        }
        cause = c.source();
    }
    text
}

/// This machine's clock, ms: leases and ages in `inspect` and `release` are measured
/// from it (the store's own clock is reported by `list` and `stats`).
fn local_now() -> UnixMillis {
    let ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis());
    UnixMillis(i64::try_from(ms).unwrap_or(i64::MAX))
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // A usage error under `--json` is still one JSON document (`docs/operations.md`);
        // `--help` and `--version` (not errors) print as clap prints them.
        Err(e) if e.use_stderr() && std::env::args().any(|a| a == "--json") => {
            let text = e.to_string();
            let line = text.lines().next().unwrap_or_default().trim_start_matches("error: ");
            return Output { json: true }.fail(&Failure::Usage(line.to_owned()), 2);
        }
        Err(e) => e.exit(),
    };
    let out = Output { json: cli.json };
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => return out.fail(&Failure::Store(format!("cannot start the async runtime: {e}")), 3),
    };
    let result = match cli.command {
        Command::Check(args) => runtime.block_on(check::check(*args, cli.json)),
        Command::Store(command) => runtime.block_on(run(cli.store, command, &out)).map(|()| true),
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        // The report said which rules failed.
        Ok(false) => ExitCode::from(5),
        Err(f) => out.fail(&f, f.code()),
    }
}

async fn run(store: Option<String>, command: StoreCommand, out: &Output) -> Result<(), Failure> {
    let Some(url) = store.as_deref() else {
        return Err(Failure::Usage("no store given: pass --store URL or set IDEM_STORE".into()));
    };
    let (url, wait) = replicas::take_wait(url).map_err(Failure::Usage)?;
    let url: StoreUrl = url.parse().map_err(|e: url::UrlError| Failure::Usage(e.to_string()))?;
    // Arguments are checked before connecting: a typo never costs a connection.
    let command = Checked::from(command)?;
    let store = url.connect().await.map_err(|e| match e {
        url::OpenError::NoFile(_) | url::OpenError::Unsupported(_) => Failure::Usage(e.to_string()),
        url::OpenError::Backend { .. } => Failure::Store(chain(&e)),
    })?;
    match command {
        Checked::Inspect(id) => inspect(&store, id, out).await,
        Checked::List(filter) => list(&store, filter, out).await,
        Checked::Release { id, force } => release(&store, id, force, out).await,
        Checked::Sweep { limit } => sweep(&store, limit, out).await,
        Checked::Stats { principal } => {
            let replicas = replicas::read(&url, wait).await.map_err(Failure::Store)?;
            stats(&store, principal, replicas, out).await
        }
    }
}

/// A command whose arguments parsed: record ids derived, durations turned into bounds.
enum Checked {
    Inspect(RecordId),
    List(ListFilter),
    Release { id: RecordId, force: bool },
    Sweep { limit: usize },
    Stats { principal: Option<String> },
}

impl Checked {
    fn from(command: StoreCommand) -> Result<Self, Failure> {
        Ok(match command {
            StoreCommand::Inspect(target) => Checked::Inspect(target.record_id()?),
            StoreCommand::Release { target, force } => Checked::Release { id: target.record_id()?, force },
            StoreCommand::Sweep { limit } => Checked::Sweep { limit },
            StoreCommand::Stats { principal } => Checked::Stats { principal },
            StoreCommand::List(args) => {
                let mut filter = ListFilter::new(args.limit);
                if let Some(state) = args.state {
                    filter = filter.with_state(state.into());
                }
                if let Some(age) = args.min_age {
                    let age_ms = i64::try_from(age.as_millis()).unwrap_or(i64::MAX);
                    filter = filter.with_started_before(UnixMillis(local_now().0.saturating_sub(age_ms)));
                }
                if let Some(principal) = args.principal {
                    filter = filter.with_principal(principal);
                }
                if let Some(after) = args.after {
                    filter = filter.with_after(parse_record_id(&after)?);
                }
                Checked::List(filter)
            }
        })
    }
}

fn parse_record_id(s: &str) -> Result<RecordId, Failure> {
    RecordId::from_hex(s.trim()).ok_or_else(|| Failure::Usage(format!("record id {s:?} is not 64 hex digits")))
}

impl Target {
    /// The record id exactly as the HTTP layer derives it: the scope (principal, endpoint)
    /// and the parsed key (`Scope::record_id`).
    fn record_id(&self) -> Result<RecordId, Failure> {
        if let Some(id) = &self.record_id {
            return parse_record_id(id);
        }
        let principal = match (&self.principal, &self.bearer) {
            (Some(p), _) => Some(p.clone()),
            (None, Some(token)) => Some(idem_http::BearerToken::principal_for(token.as_bytes())),
            (None, None) => None,
        };
        let (Some(principal), Some(endpoint), Some(key)) = (principal, &self.endpoint, &self.key) else {
            return Err(Failure::Usage("give --record-id, or --principal (or --bearer), --endpoint and --key".into()));
        };
        let key = IdempotencyKey::parse(key.as_bytes())
            .map_err(|e| Failure::Usage(format!("--key {key:?} is not a valid Idempotency-Key: {e}")))?;
        let endpoint = endpoint_arg(endpoint)?;
        let scope = idem_core::Scope::new(principal, endpoint).map_err(|e| Failure::Usage(e.to_string()))?;
        Ok(scope.record_id(&key))
    }
}

/// `METHOD ROUTE`, normalised to the layer's spelling (`Endpoint::new`: one space).
fn endpoint_arg(s: &str) -> Result<Endpoint, Failure> {
    let (method, route) = s
        .trim()
        .split_once(char::is_whitespace)
        .map(|(m, r)| (m, r.trim()))
        .filter(|(m, r)| !m.is_empty() && r.starts_with('/'))
        .ok_or_else(|| Failure::Usage(format!("--endpoint {s:?} is not `METHOD /route` (e.g. `POST /v1/workers`)")))?;
    Ok(Endpoint::new(method, route))
}

async fn fetch(store: &Arc<dyn Store>, id: RecordId) -> Result<Record, Failure> {
    match store.get(id).await {
        Ok(Some(record)) => Ok(record),
        Ok(None) => Err(Failure::NotFound(format!(
            "no record {id}: never claimed, or past its retention window (check principal, endpoint and key)"
        ))),
        Err(e) => Err(store_failure("reading the record", &e)),
    }
}

async fn inspect(store: &Arc<dyn Store>, id: RecordId, out: &Output) -> Result<(), Failure> {
    let record = fetch(store, id).await?;
    out.record(&record, local_now());
    Ok(())
}

async fn list(store: &Arc<dyn Store>, filter: ListFilter, out: &Output) -> Result<(), Failure> {
    let listing = store.list(filter).await.map_err(|e| store_failure("listing records", &e))?;
    out.listing(&listing);
    Ok(())
}

/// The `--force` rule: a live lease means the owner may still be running. Releasing it
/// lets a retry run the handler while the first attempt is still going; the fence keeps
/// the first attempt from overwriting the retry's result, but not from repeating a side
/// effect it has not made yet. So the operator must say so.
async fn release(store: &Arc<dyn Store>, id: RecordId, force: bool, out: &Output) -> Result<(), Failure> {
    let record = fetch(store, id).await?;
    let now = local_now();
    match record.state {
        RecordState::Completed => {
            return Err(Failure::Refused(format!(
                "record {id} is completed: its stored response is replayed to every retry until its retention \
                 ends; there is no claim to release"
            )));
        }
        RecordState::Failed => {
            out.released(&record, now, false, "already released (failed): the next request reclaims it and runs");
            return Ok(());
        }
        RecordState::InFlight => {}
    }
    let live = record.lease_is_fresh(now);
    if live && !force {
        return Err(Failure::Refused(format!(
            "the lease of record {id} (token {}) is live for another {} ms: its owner may still be running. \
             Wait for it to expire, or pass --force (the owner's later writes are then refused as lease lost)",
            record.token.0,
            now.millis_until(record.lease_expires_at)
        )));
    }
    match store.fail(id, record.token).await {
        Ok(receipt) => {
            // The record as the fail wrote it: failed, with the receipt's times.
            let released = Record {
                state: RecordState::Failed,
                lease_expires_at: receipt.lease_expires_at,
                expires_at: receipt.expires_at,
                ..record
            };
            let note = if live {
                "released a LIVE claim (--force): the owner's later writes will be refused as lease lost"
            } else {
                "released an expired claim: the next request reclaims it and runs"
            };
            out.released(&released, now, live, note);
            Ok(())
        }
        Err(StoreError::LeaseLost { current, .. }) => Err(Failure::Refused(format!(
            "record {id} changed while releasing (token {} is no longer its in-flight claim; current: {}): \
             nothing was changed, inspect it again",
            record.token.0,
            current.map_or_else(|| "gone".to_owned(), |t| t.0.to_string())
        ))),
        Err(e) => Err(store_failure("releasing the claim", &e)),
    }
}

async fn sweep(store: &Arc<dyn Store>, limit: usize, out: &Output) -> Result<(), Failure> {
    let outcome = store.sweep(limit).await.map_err(|e| store_failure("sweeping", &e))?;
    out.sweep(outcome, store.capabilities().native_expiry);
    Ok(())
}

/// Pages through every live record (1 000 per call) and counts.
async fn stats(
    store: &Arc<dyn Store>,
    principal: Option<String>,
    replicas: Option<replicas::Replicas>,
    out: &Output,
) -> Result<(), Failure> {
    let mut counts = report::Counts::default();
    let mut filter = ListFilter::new(1_000);
    if let Some(p) = principal {
        filter = filter.with_principal(p);
    }
    loop {
        let page = store.list(filter.clone()).await.map_err(|e| store_failure("listing records", &e))?;
        counts.add(&page);
        match (page.more, page.records.last()) {
            (true, Some(last)) => filter = filter.with_after(last.id),
            _ => break,
        }
    }
    out.stats(&counts, replicas.as_ref());
    Ok(())
}
