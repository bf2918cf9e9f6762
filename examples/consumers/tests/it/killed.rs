//! Killed consumers: two worker processes consume provisioning jobs while a producer
//! publishes them, re-publishes some (a publisher retry) and re-uses some keys with
//! another payload, and the test SIGKILLs a worker at random and starts it again, over
//! and over. Every job must end with exactly one worker in the cloud, every message
//! acked or dead-lettered with a reason, and nothing left pending at the broker.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use idem_core::{Endpoint, IdempotencyKey, RecordState, Scope, Store};
use idem_example_consumers::Cloud;
use rand::Rng as _;

use super::nats::{Nats, NatsRun};

pub(crate) const JOBS: usize = 200;
pub(crate) const REPUBLISHED: usize = 40;
pub(crate) const MISMATCHED: usize = 10;
const KILLS: usize = 15;
const LEASE_MS: &str = "1000";
const HOLD_MS: &str = "150";
const WITHIN: Duration = Duration::from_secs(150);

pub(crate) fn postgres_url() -> String {
    std::env::var("IDEM_POSTGRES_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// A run's names: one prefix for its stream or queue, principal and job names.
pub(crate) fn run_id() -> String {
    format!("k{}", &uuid::Uuid::new_v4().simple().to_string()[..10])
}

pub(crate) fn job_key(i: usize) -> String {
    format!("job-{i}")
}

/// The payload of job `i`; `variant` 1 is the same key's other payload (a mismatch).
pub(crate) fn payload(prefix: &str, i: usize, variant: u8) -> Vec<u8> {
    format!("{{\"job\":\"{prefix}-job-{i:04}\",\"variant\":{variant}}}").into_bytes()
}

/// Every message a run publishes: each job once, the first `REPUBLISHED` again with the
/// same key and payload, and the last `MISMATCHED` again with the same key and another
/// payload; `(key, payload)`.
pub(crate) fn messages(prefix: &str) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<_> = (0..JOBS).map(|i| (job_key(i), payload(prefix, i, 0))).collect();
    out.extend((0..REPUBLISHED).map(|i| (job_key(i), payload(prefix, i, 0))));
    out.extend((JOBS - MISMATCHED..JOBS).map(|i| (job_key(i), payload(prefix, i, 1))));
    out
}

/// A worker process, killed with SIGKILL when dropped.
pub(crate) struct Worker(Child);

impl Worker {
    pub(crate) fn spawn(bin: &str, args: &[String]) -> Self {
        let child = Command::new(bin)
            .args(args)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn the worker");
        Self(child)
    }

    pub(crate) fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The common worker arguments.
pub(crate) fn worker_args(prefix: &str, bare: bool) -> Vec<String> {
    let mut args: Vec<String> =
        ["--principal", prefix, "--lease-ms", LEASE_MS, "--hold-ms", HOLD_MS, "--concurrency", "8"]
            .into_iter()
            .map(str::to_owned)
            .collect();
    args.extend(["--postgres".to_owned(), postgres_url()]);
    if bare {
        args.push("--no-idem".to_owned());
    }
    args
}

/// What a broker gives the run.
pub(crate) trait Broker {
    /// The worker binary and its broker arguments.
    fn worker(&self) -> (&'static str, Vec<String>);
    /// The scope's source (the stream or queue).
    fn source(&self) -> String;
    /// Publishes one message, confirmed by the broker.
    async fn publish_one(&self, key: &str, payload: &[u8]);
    /// Whether the broker holds nothing undelivered or unacknowledged.
    async fn drained(&self) -> bool;
    /// The dead letters: `(key, reason code)`.
    async fn dead_letters(&self) -> Vec<(String, String)>;
}

/// Publishes the run's messages (one every 20 ms) while it kills and restarts workers,
/// then checks every count.
pub(crate) async fn killed_consumers(broker: &impl Broker, prefix: &str) {
    let (bin, mut args) = broker.worker();
    args.extend(worker_args(prefix, false));
    let mut workers = [Worker::spawn(bin, &args), Worker::spawn(bin, &args)];
    let store = idem_example_consumers::store(&postgres_url()).await.expect("store");
    let cloud = Cloud::connect(&postgres_url()).await.expect("cloud");
    let started = Instant::now();
    let publish = async {
        for (key, payload) in messages(prefix) {
            broker.publish_one(&key, &payload).await;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let kill = async {
        for _ in 0..KILLS {
            let pause = rand::rng().random_range(200..700);
            tokio::time::sleep(Duration::from_millis(pause)).await;
            let w = rand::rng().random_range(0..workers.len());
            workers[w].kill();
            workers[w] = Worker::spawn(bin, &args);
        }
    };
    tokio::join!(publish, kill);
    // Every job's record completed and the broker drained, three times in a row a lease
    // apart (a delivery waiting out another's lease is not lost, only late).
    let scope = Scope::new(prefix, Endpoint::new(idem_consumer::METHOD, &broker.source())).unwrap();
    let (mut quiet, mut taken_over) = (0, 0);
    while quiet < 3 {
        assert!(started.elapsed() < WITHIN, "not settled within {WITHIN:?}");
        tokio::time::sleep(Duration::from_millis(700)).await;
        let mut done = broker.drained().await;
        taken_over = 0;
        for i in 0..JOBS {
            let key = IdempotencyKey::parse(job_key(i).as_bytes()).unwrap();
            let record = store.get(scope.record_id(&key)).await.expect("get");
            // A reclaim starts a new attempt (`started_at`) on the same record.
            taken_over += usize::from(record.as_ref().is_some_and(|r| r.started_at > r.created_at));
            done &= record.is_some_and(|r| r.state == RecordState::Completed);
        }
        quiet = if done { quiet + 1 } else { 0 };
    }
    // Otherwise the kills all missed the handlers and the run proved nothing.
    assert!(taken_over > 0, "no job was taken over after a kill");
    for w in &mut workers {
        w.kill();
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(broker.drained().await, "a message went back to the broker when the workers stopped");

    let per_job = cloud.workers_per_job(prefix).await.expect("count");
    let twice: Vec<_> = per_job.iter().filter(|(_, n)| *n != 1).collect();
    assert!(twice.is_empty(), "jobs whose worker was created more than once: {twice:?}");
    assert_eq!(per_job.len(), JOBS, "every job created its worker");
    // A dead letter is published before its original is acked, so a kill in between
    // publishes it again on the next delivery: at least once, one key per mismatch.
    let dead = broker.dead_letters().await;
    let keys: std::collections::BTreeSet<_> = dead.iter().map(|(key, _)| key.clone()).collect();
    assert_eq!(keys.len(), MISMATCHED, "{dead:?}");
    assert!(dead.iter().all(|(key, reason)| reason == "mismatch" && key.starts_with("job-")), "{dead:?}");
    eprintln!(
        "killed consumers: {} messages, {JOBS} jobs, {KILLS} kills, settled in {:.1} s: {taken_over} jobs taken \
         over after a kill, {} workers created, {} dead letters (mismatch)",
        messages(prefix).len(),
        started.elapsed().as_secs_f64(),
        per_job.iter().map(|(_, n)| n).sum::<i64>(),
        dead.len()
    );
}

/// The same messages through the bare handler (no idem), without kills: the re-published
/// jobs alone create a second worker each.
pub(crate) async fn without_idem(broker: &impl Broker, prefix: &str) -> i64 {
    let (bin, mut args) = broker.worker();
    args.extend(worker_args(prefix, true));
    let _workers = [Worker::spawn(bin, &args), Worker::spawn(bin, &args)];
    let cloud = Cloud::connect(&postgres_url()).await.expect("cloud");
    let started = Instant::now();
    let mut quiet = 0;
    while quiet < 2 {
        assert!(started.elapsed() < WITHIN, "not drained within {WITHIN:?}");
        tokio::time::sleep(Duration::from_millis(500)).await;
        quiet = if broker.drained().await { quiet + 1 } else { 0 };
    }
    let per_job = cloud.workers_per_job(prefix).await.expect("count");
    let phantoms = per_job.iter().map(|(_, n)| n).sum::<i64>() - i64::try_from(per_job.len()).unwrap();
    eprintln!(
        "without idem: {} messages, {} jobs, no kills: {phantoms} phantom workers",
        messages(prefix).len(),
        per_job.len()
    );
    phantoms
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_nats_consumers_create_each_worker_once_and_lose_nothing() {
    let nats = Nats::connect().await;
    let prefix = run_id();
    let run = NatsRun::create(&nats, &prefix, "Idem-Key").await;
    killed_consumers(&run, &prefix).await;
    run.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_idem_republished_nats_jobs_create_phantom_workers() {
    let nats = Nats::connect().await;
    let prefix = run_id();
    let run = NatsRun::create(&nats, &prefix, "Idem-Key").await;
    run.publish(&messages(&prefix)).await;
    let phantoms = without_idem(&run, &prefix).await;
    run.delete().await;
    // Each re-published job, and each mismatched payload, made a second worker.
    assert!(phantoms >= i64::try_from(REPUBLISHED + MISMATCHED).unwrap(), "{phantoms} phantom workers");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_amqp_consumers_create_each_worker_once_and_lose_nothing() {
    let prefix = run_id();
    let run = super::amqp::AmqpRun::create(&prefix).await;
    killed_consumers(&run, &prefix).await;
    run.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_idem_republished_amqp_jobs_create_phantom_workers() {
    let prefix = run_id();
    let run = super::amqp::AmqpRun::create(&prefix).await;
    run.publish(&messages(&prefix)).await;
    let phantoms = without_idem(&run, &prefix).await;
    run.delete().await;
    assert!(phantoms >= i64::try_from(REPUBLISHED + MISMATCHED).unwrap(), "{phantoms} phantom workers");
}
