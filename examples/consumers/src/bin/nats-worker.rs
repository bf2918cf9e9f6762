//! Consumes provisioning jobs from a JetStream pull consumer through idem-consumer.
//!
//! `nats-worker --stream JOBS --consumer workers --dead-letter JOBS.dead`

use clap::Parser;
use futures::StreamExt as _;
use idem_consumer::nats::JetStream;
use idem_example_consumers::{Common, init_tracing, provision, provision_bare};

#[derive(Debug, Parser)]
struct Args {
    /// The NATS server.
    #[arg(long, env = "IDEM_NATS_URL", default_value = "127.0.0.1:4222")]
    nats: String,
    /// The stream the jobs are in.
    #[arg(long)]
    stream: String,
    /// The durable pull consumer to read them with (it must exist).
    #[arg(long)]
    consumer: String,
    /// Where dead letters go (a subject a stream captures).
    #[arg(long)]
    dead_letter: String,
    /// The header holding each job's idempotency key.
    #[arg(long, default_value = idem_consumer::nats::MSG_ID)]
    key_header: String,
    #[command(flatten)]
    common: Common,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    init_tracing();
    let args = Args::parse();
    let c = &args.common;
    let (cloud, consumer) = c.connect().await?;
    let js = async_nats::jetstream::new(async_nats::connect(&args.nats).await?);
    let pull: async_nats::jetstream::consumer::PullConsumer =
        js.get_stream(&args.stream).await?.get_consumer(&args.consumer).await.map_err(|e| e.to_string())?;
    let glue = JetStream::new(consumer, js.clone(), c.principal.clone(), args.dead_letter.clone())
        .with_key_header(args.key_header.clone());
    let (glue, cloud) = (&glue, &cloud);
    eprintln!("nats-worker: consuming {} / {}", args.stream, args.consumer);
    pull.messages()
        .await?
        .for_each_concurrent(c.concurrency, |msg| async move {
            let msg = match msg {
                Ok(msg) => msg,
                Err(e) => return tracing::warn!(error = %e, "pull failed"),
            };
            if c.no_idem {
                match provision_bare(cloud, &msg.payload, c.hold_ms).await {
                    Ok(()) => drop(msg.double_ack().await),
                    Err(e) => tracing::warn!(error = %e, "job failed; left to ack_wait"),
                }
                return;
            }
            match glue.handle(&msg, |journal| provision(journal, cloud, &msg.payload, c.hold_ms)).await {
                Ok(settle) => tracing::debug!(?settle, "settled"),
                Err(e) => tracing::warn!(error = %e, "not settled; JetStream redelivers after ack_wait"),
            }
        })
        .await;
    Ok(())
}
