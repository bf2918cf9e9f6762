//! The retry-storm driver: many logical operations from several principals, each with
//! one idempotency key kept across its retries, against a server that loses responses
//! after doing the work. It counts what the server really did.
//!
//! Two modes ([`StormMode`]): `create` makes workers and counts phantoms (workers beyond
//! one per operation); `firmware` flashes workers and counts double flashes (flashes
//! beyond one per operation) and bricked nodes. A flash outlives the lease many times over,
//! so the storm's short attempt timeouts and lost responses send retries all through it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_client::{ClientError, IdempotentClient, OperationKey, RetryPolicy};
use leasebroker::state::Stats;
use tokio::sync::Semaphore;

use crate::bmc::BmcStats;

/// What every operation of a storm does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StormMode {
    /// `POST /v1/workers`: one worker per operation.
    #[default]
    Create,
    /// Creates a worker (not counted in the report), then `POST /v1/workers/{id}/firmware`
    /// under a key of its own: one flash per operation, each of a different node.
    Firmware,
}

/// The body of every flash the storm asks for.
pub const FIRMWARE_BODY: &str = r#"{"image":"bmc-firmware","version":"2.4.1"}"#;

/// Storm settings.
#[derive(Clone, Debug)]
pub struct StormConfig {
    /// Base URL of the server, e.g. `http://127.0.0.1:8080`.
    pub target: String,
    /// What each operation does.
    pub mode: StormMode,
    /// Logical operations.
    pub operations: u32,
    /// Distinct principals (bearer tokens) the operations are spread over.
    pub principals: u32,
    /// Operations in flight at once.
    pub concurrency: usize,
    /// Timeout of one attempt, ms: a response held longer counts as lost.
    pub attempt_timeout_ms: u64,
    /// Total budget per operation, ms.
    pub budget_ms: u64,
    /// A prefix for the bearer tokens, so two storms against one server do not share
    /// principals.
    pub token_prefix: String,
}

/// The server's counts: the infra's (`GET /admin/stats`) and the BMCs' (`GET /admin/bmc`,
/// served by the rig's firmware route only; zero when not read).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// Workers, allocations, leases, boots, reboots and deletes.
    pub infra: Stats,
    /// Flashes started and nodes bricked.
    pub bmc: BmcStats,
}

impl Counts {
    /// What happened between `before` and `self`.
    #[must_use]
    pub fn since(&self, before: &Counts) -> Counts {
        let (a, b) = (&self.infra, &before.infra);
        Counts {
            infra: Stats {
                workers: a.workers.saturating_sub(b.workers),
                allocations: a.allocations.saturating_sub(b.allocations),
                leases: a.leases.saturating_sub(b.leases),
                boots: a.boots.saturating_sub(b.boots),
                reboots: a.reboots.saturating_sub(b.reboots),
                deletes: a.deletes.saturating_sub(b.deletes),
            },
            bmc: BmcStats {
                flashes: self.bmc.flashes.saturating_sub(before.bmc.flashes),
                bricked: self.bmc.bricked.saturating_sub(before.bmc.bricked),
            },
        }
    }
}

/// Reads the server's counts; the BMCs' only when `bmc` (the rig's server serves them).
///
/// # Errors
/// When an endpoint does not answer with its JSON.
pub async fn counts(http: &reqwest::Client, target: &str, bmc: bool) -> Result<Counts, reqwest::Error> {
    let infra = http.get(format!("{target}/admin/stats")).send().await?.error_for_status()?.json().await?;
    let bmc = if bmc {
        http.get(format!("{target}/admin/bmc")).send().await?.error_for_status()?.json().await?
    } else {
        BmcStats::default()
    };
    Ok(Counts { infra, bmc })
}

/// What the storm saw.
#[derive(Clone, Debug, Default)]
pub struct StormReport {
    /// What each operation did.
    pub mode: StormMode,
    /// Logical operations started.
    pub operations: u32,
    /// Operations that ended with 201 (create) or 200 (firmware).
    pub succeeded: u32,
    /// Operations that gave up or ended on another status.
    pub failed: u32,
    /// HTTP attempts sent in total.
    pub attempts: u64,
    /// Final answers that were replays.
    pub replays: u64,
    /// In-flight 409 answers seen.
    pub busy_409: u64,
    /// Attempts lost to timeouts or connection errors.
    pub transport_errors: u64,
    /// 5xx answers seen.
    pub server_errors: u64,
    /// Distinct worker ids the clients received (create).
    pub distinct_ids: u64,
    /// The server's counts after the storm (its delta over the storm).
    pub server: Counts,
    /// Wall time, ms.
    pub elapsed_ms: u128,
}

impl StormReport {
    /// Workers the server created beyond one per logical operation.
    #[must_use]
    pub fn phantoms(&self) -> u64 {
        match self.mode {
            StormMode::Create => self.server.infra.workers.saturating_sub(u64::from(self.operations)),
            // The firmware storm creates one worker per operation before it flashes.
            StormMode::Firmware => 0,
        }
    }

    /// VMs the hypervisor booted beyond one per logical operation (both modes create one
    /// worker, so boot one VM, per operation): a retry that lost the record (a store that
    /// forgot it on restart, a lease reclaimed while the first boot still ran) and booted
    /// again. Each one is a leaked VM someone pays for, so the table flags it like a
    /// phantom worker. A failed boot boots nothing and is not counted.
    #[must_use]
    pub fn extra_vms(&self) -> u64 {
        self.server.infra.boots.saturating_sub(u64::from(self.operations))
    }

    /// Flashes the BMCs started beyond one per operation: each one ran while the first
    /// flash of its node was still running, so it bricked that node.
    #[must_use]
    pub fn double_flashes(&self) -> u64 {
        self.server.bmc.flashes.saturating_sub(u64::from(self.operations))
    }

    /// Renders the table.
    #[must_use]
    pub fn table(&self) -> String {
        let common = [
            ("operations", self.operations.to_string()),
            (
                match self.mode {
                    StormMode::Create => "succeeded (201)",
                    StormMode::Firmware => "succeeded (200)",
                },
                self.succeeded.to_string(),
            ),
            ("failed", self.failed.to_string()),
            ("attempts", self.attempts.to_string()),
            ("replays", self.replays.to_string()),
            ("409 in flight", self.busy_409.to_string()),
            ("lost responses / timeouts", self.transport_errors.to_string()),
            ("5xx", self.server_errors.to_string()),
        ];
        let outcome = match self.mode {
            StormMode::Create => vec![
                ("distinct worker ids seen", self.distinct_ids.to_string()),
                ("workers that exist", self.server.infra.workers.to_string()),
                ("nodes allocated", self.server.infra.allocations.to_string()),
                ("VMs booted", self.server.infra.boots.to_string()),
                ("phantom workers", self.phantoms().to_string()),
                ("extra VMs", self.extra_vms().to_string()),
            ],
            StormMode::Firmware => vec![
                ("VMs booted", self.server.infra.boots.to_string()),
                ("extra VMs", self.extra_vms().to_string()),
                ("flashes started", self.server.bmc.flashes.to_string()),
                ("double flashes", self.double_flashes().to_string()),
                ("bricked nodes", self.server.bmc.bricked.to_string()),
            ],
        };
        let elapsed = [("elapsed", format!("{} ms", self.elapsed_ms))];
        let rows = common.into_iter().chain(outcome).chain(elapsed);
        let mut out = String::from("+-----------------------------+-----------+\n");
        for (k, v) in rows {
            out.push_str(&format!("| {k:<27} | {v:>9} |\n"));
        }
        out.push_str("+-----------------------------+-----------+\n");
        out
    }
}

/// Why the storm could not run.
#[derive(Debug, thiserror::Error)]
pub enum StormError {
    /// The stats endpoints did not answer.
    #[error("cannot read the counts of {0}: {1}")]
    Stats(String, String),
}

async fn stats(http: &reqwest::Client, target: &str, mode: StormMode) -> Result<Counts, StormError> {
    let err = |e: reqwest::Error| StormError::Stats(target.to_string(), e.to_string());
    counts(http, target, mode == StormMode::Firmware).await.map_err(err)
}

/// Runs the storm and returns its report.
///
/// # Errors
/// [`StormError`] when the server's counters cannot be read.
pub async fn run(cfg: StormConfig) -> Result<StormReport, StormError> {
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(cfg.concurrency)
        .build()
        .map_err(|e| StormError::Stats(cfg.target.clone(), e.to_string()))?;
    let before = stats(&http, &cfg.target, cfg.mode).await?;
    let policy = RetryPolicy::default()
        .with_attempt_timeout(Duration::from_millis(cfg.attempt_timeout_ms))
        .with_budget(Duration::from_millis(cfg.budget_ms))
        .with_backoff(Duration::from_millis(20), Duration::from_millis(500))
        .with_max_attempts(50);
    let client = Arc::new(IdempotentClient::new(http.clone(), policy));
    let gate = Arc::new(Semaphore::new(cfg.concurrency.max(1)));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for op in 0..cfg.operations {
        let client = Arc::clone(&client);
        let gate = Arc::clone(&gate);
        let (target, mode) = (cfg.target.clone(), cfg.mode);
        let token = format!("{}-{}", cfg.token_prefix, op % cfg.principals.max(1));
        tasks.push(tokio::spawn(async move {
            let _permit = gate.acquire_owned().await;
            // One key per logical operation, made before the first attempt.
            let key = OperationKey::generate();
            let body = format!(
                r#"{{"image":"worker-base:2025.11","cpu":16,"memory_gb":64,"labels":{{"team":"ml-eval","op":"{op}"}}}}"#
            );
            let created = client
                .request(reqwest::Method::POST, format!("{target}/v1/workers"), &key)
                .header("authorization", &format!("Bearer {token}"))
                .json_body(body)
                .send()
                .await;
            if mode == StormMode::Create {
                return Some(created);
            }
            // The flash needs a worker; an operation whose worker was not created counts
            // as failed without a flash.
            let location = match created {
                Ok(reply) if reply.status == 201 => reply.headers.get("location")?.to_str().ok()?.to_owned(),
                _ => return None,
            };
            let key = OperationKey::generate();
            Some(
                client
                    .request(reqwest::Method::POST, format!("{target}{location}/firmware"), &key)
                    .header("authorization", &format!("Bearer {token}"))
                    .json_body(FIRMWARE_BODY)
                    .send()
                    .await,
            )
        }));
    }
    let expected: u16 = match cfg.mode {
        StormMode::Create => 201,
        StormMode::Firmware => 200,
    };
    let mut report = StormReport { mode: cfg.mode, operations: cfg.operations, ..StormReport::default() };
    let mut ids = std::collections::HashSet::new();
    for t in tasks {
        match t.await {
            Ok(Some(Ok(reply))) => {
                report.attempts += u64::from(reply.stats.attempts);
                report.busy_409 += u64::from(reply.stats.busy);
                report.transport_errors += u64::from(reply.stats.transport_errors);
                report.server_errors += u64::from(reply.stats.server_errors);
                report.replays += u64::from(reply.replayed);
                if reply.status == expected {
                    report.succeeded += 1;
                    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&reply.body)
                        && let Some(id) = v.get("id").and_then(|i| i.as_str())
                    {
                        ids.insert(id.to_string());
                    }
                } else {
                    report.failed += 1;
                }
            }
            Ok(Some(Err(ClientError::GaveUp { stats, .. }))) => {
                report.failed += 1;
                report.attempts += u64::from(stats.attempts);
                report.busy_409 += u64::from(stats.busy);
                report.transport_errors += u64::from(stats.transport_errors);
                report.server_errors += u64::from(stats.server_errors);
            }
            Ok(Some(Err(_)) | None) | Err(_) => report.failed += 1,
        }
    }
    report.elapsed_ms = started.elapsed().as_millis();
    report.distinct_ids = ids.len() as u64;
    let after = stats(&http, &cfg.target, cfg.mode).await?;
    report.server = after.since(&before);
    Ok(report)
}
