//! `idem-bench consumer`: messages per second through `idem-consumer`'s broker glue
//! against the same consumer without it, on NATS JetStream or RabbitMQ.
//!
//! Each run gets a destination of its own, so no run consumes another's leftovers: a
//! JetStream stream (file storage) with a pull consumer (explicit acks, `max_ack_pending`
//! = `--in-flight`), or a durable RabbitMQ queue read with that prefetch. `--messages`
//! persistent messages, each with its own key (`Nats-Msg-Id`, `message_id`) and a
//! `--payload`-byte body, are published and confirmed by the broker before the clock
//! starts, so the rate is the consumer's alone. The clock stops when the last one is
//! settled, `--in-flight` handled at once. The raw side settles each message as the glue
//! settles `Settle::Ack` (a double ack on JetStream, `basic.ack` on RabbitMQ), so the two
//! sides differ only by the engine: a claim and a complete per message, on Redis or (with
//! `--store memory`) in process. Runs alternate raw, adapter, adapter, raw, ...; the row
//! reports the median of each side and their ratio.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, consumer::pull};
use bytes::Bytes;
use futures::{StreamExt as _, TryStreamExt as _};
use idem_consumer::{Acked, Config, Consumer, Settle, amqp::Amqp, nats::JetStream};
use idem_core::{BoxError, MemoryStore, Store};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Confirmation, Connection, ConnectionProperties};
use tokio::time::Instant;

use crate::Endpoints;
use crate::seal::median;

/// Settings of one `consumer` row.
#[derive(Debug, clap::Args)]
pub(crate) struct ConsumerArgs {
    /// The broker.
    #[arg(long, value_enum)]
    broker: Broker,
    /// The adapter's idem store (`memory` leaves the engine's own cost).
    #[arg(long, value_enum, default_value = "redis")]
    store: StoreKind,
    /// Messages per run.
    #[arg(long, default_value_t = 20_000)]
    messages: usize,
    /// Runs per side, interleaved.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Messages handled at once (and the broker's bound on unacknowledged deliveries).
    #[arg(long, default_value_t = 32)]
    in_flight: u16,
    /// Payload, bytes.
    #[arg(long, default_value_t = 200)]
    payload: usize,
    /// NATS server.
    #[arg(long, default_value = "127.0.0.1:4222")]
    nats_url: String,
    /// RabbitMQ URL.
    #[arg(long, default_value = "amqp://guest:guest@127.0.0.1:5672/%2f")]
    amqp_url: String,
    #[command(flatten)]
    endpoints: Endpoints,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Broker {
    Nats,
    Amqp,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum StoreKind {
    Memory,
    Redis,
}

/// Publishes are sent this many at a time before their confirmations are awaited: the
/// clients bound unconfirmed publishes, and awaiting each before the next would fill the
/// destination one round trip at a time.
const PUBLISH_WINDOW: usize = 1000;

/// What one run needs, whichever broker.
struct Run<'a> {
    name: String,
    engine: Option<&'a Consumer>,
    args: &'a ConsumerArgs,
    payload: &'a Bytes,
}

/// A message the glue did not run and ack is an error: the adapter side would otherwise
/// count messages that skipped the engine's work.
fn ran(settle: &Settle) -> Result<(), BoxError> {
    match settle {
        Settle::Ack(Acked::Ran) => Ok(()),
        other => Err(format!("the adapter settled a fresh message as {other:?}").into()),
    }
}

/// One run on a fresh JetStream stream: messages per second.
async fn nats_run(js: &jetstream::Context, run: Run<'_>) -> Result<f64, BoxError> {
    let (n, subject) = (run.args.messages, format!("idem-bench.consumer.{}", run.name));
    let config =
        jetstream::stream::Config { name: run.name.clone(), subjects: vec![subject.clone()], ..Default::default() };
    let stream = js.create_stream(config).await?;
    let rate = async {
        let config = pull::Config {
            durable_name: Some("bench".to_owned()),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            max_ack_pending: i64::from(run.args.in_flight),
            ..Default::default()
        };
        let consumer: jetstream::consumer::PullConsumer = stream.create_consumer(config).await?;
        let mut acks = Vec::with_capacity(PUBLISH_WINDOW);
        for i in 0..n {
            let mut headers = HeaderMap::new();
            headers.insert(idem_consumer::nats::MSG_ID, format!("{}-{i}", run.name).as_str());
            acks.push(js.publish_with_headers(subject.clone(), headers, run.payload.clone()).await?);
            if acks.len() == PUBLISH_WINDOW || i + 1 == n {
                for ack in acks.drain(..) {
                    ack.await?;
                }
            }
        }
        // Never used: every message has a key and a fresh one. A dead letter would fail
        // its publish (no stream captures this subject) and so stop the run.
        let glue = run.engine.map(|c| JetStream::new(c.clone(), js.clone(), "bench", format!("{subject}.dead")));
        let start = Instant::now();
        let messages = consumer.messages().await?.take(n).map_err(BoxError::from);
        messages
            .try_for_each_concurrent(usize::from(run.args.in_flight), |msg| {
                let glue = glue.as_ref();
                async move {
                    match glue {
                        None => msg.double_ack().await?,
                        Some(glue) => ran(&glue.handle(&msg, |_| async { Ok::<(), Infallible>(()) }).await?)?,
                    }
                    Ok(())
                }
            })
            .await?;
        Ok::<_, BoxError>(n as f64 / start.elapsed().as_secs_f64())
    }
    .await;
    js.delete_stream(&run.name).await?;
    rate
}

/// One run on a fresh RabbitMQ queue: messages per second.
async fn amqp_run(conn: &Connection, run: Run<'_>) -> Result<f64, BoxError> {
    let (n, queue, dead) = (run.args.messages, run.name.as_str(), format!("{}.dead", run.name));
    let publisher = conn.create_channel().await?;
    publisher.confirm_select(ConfirmSelectOptions::default()).await?;
    publisher.queue_declare(queue.into(), QueueDeclareOptions::durable(), FieldTable::default()).await?;
    let rate = async {
        let mut confirms = Vec::with_capacity(PUBLISH_WINDOW);
        for i in 0..n {
            let properties =
                BasicProperties::default().with_message_id(format!("{queue}-{i}").into()).with_delivery_mode(2);
            let options = BasicPublishOptions::default();
            confirms.push(publisher.basic_publish("".into(), queue.into(), options, run.payload, properties).await?);
            if confirms.len() == PUBLISH_WINDOW || i + 1 == n {
                for confirm in confirms.drain(..) {
                    if !matches!(confirm.await?, Confirmation::Ack(_)) {
                        return Err("the broker refused a publish".into());
                    }
                }
            }
        }
        let channel = conn.create_channel().await?;
        channel.basic_qos(run.args.in_flight, BasicQosOptions::default()).await?;
        let glue = match run.engine {
            Some(c) => Some(Amqp::new(c.clone(), channel.clone(), "bench", dead.as_str()).await?),
            None => None,
        };
        let start = Instant::now();
        let options = BasicConsumeOptions::default();
        let deliveries = channel.basic_consume(queue.into(), "bench".into(), options, FieldTable::default()).await?;
        deliveries
            .take(n)
            .map_err(BoxError::from)
            .try_for_each_concurrent(usize::from(run.args.in_flight), |delivery| {
                let glue = glue.as_ref();
                async move {
                    match glue {
                        None => {
                            delivery.ack(BasicAckOptions::default()).await?;
                        }
                        Some(glue) => {
                            ran(&glue.handle(queue, &delivery, |_| async { Ok::<(), Infallible>(()) }).await?)?;
                        }
                    }
                    Ok(())
                }
            })
            .await?;
        let rate = n as f64 / start.elapsed().as_secs_f64();
        channel.close(200, "done".into()).await?;
        Ok::<_, BoxError>(rate)
    }
    .await;
    // RabbitMQ answers a delete of a queue that was never declared (the raw side's
    // dead-letter queue) with success.
    for name in [queue, dead.as_str()] {
        publisher.queue_delete(name.into(), QueueDeleteOptions::default()).await?;
    }
    publisher.close(200, "done".into()).await?;
    rate
}

/// The one-minute load average, as `uptime` prints it.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".to_owned())
}

/// The broker the runs go through.
enum Client {
    Nats(jetstream::Context),
    Amqp(Connection),
}

/// Runs one row and prints it.
pub(crate) async fn run(args: ConsumerArgs) -> Result<(), BoxError> {
    let id = crate::run_id();
    let store: Arc<dyn Store> = match args.store {
        StoreKind::Memory => Arc::new(MemoryStore::new()),
        StoreKind::Redis => {
            let config = idem_redis::Config::default().with_prefix(format!("idem-bench:{id}:consumer:"));
            Arc::new(idem_redis::RedisStore::connect(&args.endpoints.redis_url, config).await?)
        }
    };
    // Short retention: Redis expires the bench's records natively within minutes.
    let engine = Consumer::new(store, Config::default().with_retention(Duration::from_secs(120)));
    let client = match args.broker {
        Broker::Nats => Client::Nats(jetstream::new(async_nats::connect(&args.nats_url).await?)),
        Broker::Amqp => Client::Amqp(Connection::connect(&args.amqp_url, ConnectionProperties::default()).await?),
    };
    let payload = Bytes::from(vec![b'x'; args.payload]);
    let load_before = load_average();
    let runs = args.runs.max(1);
    let (mut raw, mut adapter) = (Vec::new(), Vec::new());
    for r in 0..runs * 2 {
        let adapter_turn = matches!(r % 4, 1 | 2);
        let engine = adapter_turn.then_some(&engine);
        let run = Run { name: format!("idem_bench_{id}_{r}"), engine, args: &args, payload: &payload };
        let rate = match &client {
            Client::Nats(js) => nats_run(js, run).await?,
            Client::Amqp(conn) => amqp_run(conn, run).await?,
        };
        println!("run {r}: {:<7} {rate:>8.0} msg/s", if adapter_turn { "adapter" } else { "raw" });
        if adapter_turn { adapter.push(rate) } else { raw.push(rate) }
    }
    let (rm, am) = (median(raw.clone()), median(adapter.clone()));
    let broker = match args.broker {
        Broker::Nats => "nats",
        Broker::Amqp => "amqp",
    };
    let store = match args.store {
        StoreKind::Memory => "memory",
        StoreKind::Redis => "redis",
    };
    println!("{:<6} {:<7} {:>10} {:>14} {:>7}", "broker", "store", "raw msg/s", "adapter msg/s", "ratio");
    println!("{broker:<6} {store:<7} {rm:>10.0} {am:>14.0} {:>6.2}x", am / rm);
    println!(
        "(median of {runs} interleaved runs per side, {} messages of {} B each, {} in flight; load average {load_before} -> {})",
        args.messages,
        args.payload,
        args.in_flight,
        load_average(),
    );
    if let Client::Amqp(conn) = client {
        conn.close(200, "done".into()).await?;
    }
    Ok(())
}
