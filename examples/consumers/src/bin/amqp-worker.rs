//! Consumes provisioning jobs from a RabbitMQ queue through idem-consumer.
//!
//! `amqp-worker --queue jobs --dead-letter jobs.dead`

use clap::Parser;
use futures::StreamExt as _;
use idem_consumer::amqp::Amqp;
use idem_example_consumers::{Common, init_tracing, provision, provision_bare};
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions};
use lapin::types::FieldTable;

#[derive(Debug, Parser)]
struct Args {
    /// The broker.
    #[arg(long, env = "IDEM_AMQP_URL", default_value = "amqp://guest:guest@127.0.0.1:5672/%2f")]
    amqp: String,
    /// The queue the jobs are in (declared durable if missing).
    #[arg(long)]
    queue: String,
    /// The queue dead letters go to (declared durable if missing).
    #[arg(long)]
    dead_letter: String,
    #[command(flatten)]
    common: Common,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    init_tracing();
    let args = Args::parse();
    let c = &args.common;
    let (cloud, consumer) = c.connect().await?;
    let conn = lapin::Connection::connect(&args.amqp, lapin::ConnectionProperties::default()).await?;
    let channel = conn.create_channel().await?;
    channel.queue_declare(args.queue.as_str().into(), QueueDeclareOptions::durable(), FieldTable::default()).await?;
    // Prefetch bounds what one worker holds, including deliveries waiting out a redelivery delay.
    channel.basic_qos(u16::try_from(c.concurrency).unwrap_or(u16::MAX), BasicQosOptions::default()).await?;
    let glue = Amqp::new(consumer, channel.clone(), c.principal.clone(), args.dead_letter.clone()).await?;
    let deliveries = channel
        .basic_consume(args.queue.as_str().into(), "".into(), BasicConsumeOptions::default(), FieldTable::default())
        .await?;
    let (glue, cloud, queue) = (&glue, &cloud, args.queue.as_str());
    eprintln!("amqp-worker: consuming {queue}");
    deliveries
        .for_each_concurrent(c.concurrency, |delivery| async move {
            let delivery = match delivery {
                Ok(delivery) => delivery,
                Err(e) => return tracing::warn!(error = %e, "consume failed"),
            };
            if c.no_idem {
                match provision_bare(cloud, &delivery.data, c.hold_ms).await {
                    Ok(()) => drop(delivery.ack(BasicAckOptions::default()).await),
                    Err(e) => tracing::warn!(error = %e, "job failed; left unacked"),
                }
                return;
            }
            match glue.handle(queue, &delivery, |journal| provision(journal, cloud, &delivery.data, c.hold_ms)).await {
                Ok(settle) => tracing::debug!(?settle, "settled"),
                Err(e) => tracing::warn!(error = %e, "not settled; redelivered when the channel closes"),
            }
        })
        .await;
    Ok(())
}
