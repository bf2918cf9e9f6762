//! RabbitMQ: a [`Consumer`] for lapin deliveries.
//!
//! ```no_run
//! # async fn demo(store: std::sync::Arc<dyn idem_core::Store>) -> Result<(), Box<dyn std::error::Error>> {
//! use futures::StreamExt as _;
//! use idem_consumer::{amqp::Amqp, Config, Consumer};
//! use lapin::{options::BasicConsumeOptions, types::FieldTable, Connection, ConnectionProperties};
//!
//! let conn = Connection::connect("amqp://127.0.0.1:5672/%2f", ConnectionProperties::default()).await?;
//! let channel = conn.create_channel().await?;
//! let glue = Amqp::new(Consumer::new(store, Config::default()), channel.clone(), "tenant-a", "jobs.dead").await?;
//! let mut deliveries =
//!     channel.basic_consume("jobs".into(), "worker".into(), BasicConsumeOptions::default(), FieldTable::default()).await?;
//! while let Some(delivery) = deliveries.next().await {
//!     glue.handle("jobs", &delivery?, |journal| async move {
//!         // side effects through journal.step / journal.intent
//!         Ok::<(), std::io::Error>(())
//!     })
//!     .await?;
//! }
//! # Ok(()) }
//! ```

use std::fmt;
use std::future::Future;

use idem_core::Resumable;
use lapin::message::Delivery as AmqpDelivery;
use lapin::options::{
    BasicAckOptions, BasicNackOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{Channel, Confirmation};

use crate::{Consumer, DeadLetter, Delivery, Settle};

/// The dead letter's header naming why ([`crate::DeadLetter::code`]).
pub const REASON_HEADER: &str = "x-idem-dead-letter-reason";
/// The dead letter's header with the reason in words.
pub const DETAIL_HEADER: &str = "x-idem-dead-letter-detail";
/// The dead letter's header naming the queue the message came from.
pub const SOURCE_HEADER: &str = "x-idem-source";
/// Quorum queues count earlier deliveries of a message in this header.
const DELIVERY_COUNT: &str = "x-delivery-count";

/// Why a delivery could not be settled; the message stays unacknowledged, so RabbitMQ
/// delivers it again when the channel closes.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A channel operation failed (ack, nack, declare, confirm mode).
    #[error("AMQP channel: {0}")]
    Channel(#[from] lapin::Error),
    /// The broker refused the dead letter (`basic.nack` on the publish), or it reached no
    /// queue (returned as unroutable).
    #[error("the broker did not store the dead letter in queue {0}")]
    DeadLetterRefused(String),
}

/// Runs RabbitMQ deliveries through a [`Consumer`] and settles them.
pub struct Amqp {
    consumer: Consumer,
    channel: Channel,
    principal: String,
    dead_letter_queue: String,
}

impl fmt::Debug for Amqp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Amqp")
            .field("consumer", &self.consumer)
            .field("principal", &self.principal)
            .field("dead_letter_queue", &self.dead_letter_queue)
            .finish_non_exhaustive()
    }
}

impl Amqp {
    /// Glue for deliveries sent by `principal`. Puts `channel` (the one dead letters are
    /// published on) in confirm mode and declares `dead_letter_queue` (durable).
    ///
    /// # Errors
    /// [`Error::Channel`] when either fails.
    pub async fn new(
        consumer: Consumer,
        channel: Channel,
        principal: impl Into<String>,
        dead_letter_queue: impl Into<String>,
    ) -> Result<Self, Error> {
        let dead_letter_queue = dead_letter_queue.into();
        channel.confirm_select(ConfirmSelectOptions::default()).await?;
        channel
            .queue_declare(dead_letter_queue.as_str().into(), QueueDeclareOptions::durable(), FieldTable::default())
            .await?;
        Ok(Self { consumer, channel, principal: principal.into(), dead_letter_queue })
    }

    /// Processes `delivery`, taken from `queue`, with `handler` ([`Consumer::process`])
    /// and settles it: `basic.ack` for [`Settle::Ack`]; for [`Settle::Redeliver`] the
    /// delivery is held for the delay, then `basic.nack` with requeue (AMQP has no delayed
    /// nack); for [`Settle::DeadLetter`] the message is published to the dead-letter queue
    /// with the reason headers and acked once the broker confirmed that publish.
    ///
    /// The key is the `message_id` property; the delivery count is `x-delivery-count`
    /// (quorum queues) plus one, else 2 for a redelivered message and 1 otherwise.
    ///
    /// # Errors
    /// [`Error`] when the delivery cannot be settled; it is then left unacknowledged.
    pub async fn handle<F, Fut, E>(&self, queue: &str, delivery: &AmqpDelivery, handler: F) -> Result<Settle, Error>
    where
        F: FnOnce(Resumable) -> Fut,
        Fut: Future<Output = Result<(), E>>,
        E: fmt::Display,
    {
        let key = delivery.properties.message_id().as_ref().map(|id| id.as_str().as_bytes());
        let d = Delivery::new(queue, &self.principal, key, &delivery.data)
            .with_subject(delivery.routing_key.as_str())
            .with_attempt(attempt(delivery));
        // RabbitMQ has no "in progress" signal: its consumer timeout is documented instead.
        let settle = self.consumer.process(d, || async {}, handler).await;
        match &settle {
            Settle::Ack(_) => {
                delivery.ack(BasicAckOptions::default()).await?;
            }
            Settle::Redeliver { after, .. } => {
                tokio::time::sleep(*after).await;
                delivery.nack(BasicNackOptions { requeue: true, ..BasicNackOptions::default() }).await?;
            }
            Settle::DeadLetter(reason) => {
                if let Err(e) = self.dead_letter(queue, delivery, reason).await {
                    // Not left unacked on a live channel (it would hold a prefetch slot
                    // for good): back to the queue after the usual delay.
                    tokio::time::sleep(self.consumer.config().retry_after()).await;
                    delivery.nack(BasicNackOptions { requeue: true, ..BasicNackOptions::default() }).await?;
                    return Err(e);
                }
                delivery.ack(BasicAckOptions::default()).await?;
            }
        }
        Ok(settle)
    }

    /// Publishes the dead letter, mandatory and confirmed: only a publish the broker
    /// stored in a queue counts (an unroutable one comes back with the confirm).
    async fn dead_letter(&self, queue: &str, delivery: &AmqpDelivery, reason: &DeadLetter) -> Result<(), Error> {
        let mut headers = delivery.properties.headers().clone().unwrap_or_default();
        let text = |s: &str| AMQPValue::LongString(LongString::from(s.as_bytes().to_vec()));
        headers.insert(ShortString::from(REASON_HEADER), text(reason.code()));
        headers.insert(ShortString::from(DETAIL_HEADER), text(&reason.to_string()));
        headers.insert(ShortString::from(SOURCE_HEADER), text(queue));
        let properties = delivery.properties.clone().with_headers(headers).with_delivery_mode(2);
        let confirm = self
            .channel
            .basic_publish(
                ShortString::from(""),
                self.dead_letter_queue.as_str().into(),
                BasicPublishOptions { mandatory: true, ..BasicPublishOptions::default() },
                &delivery.data,
                properties,
            )
            .await?
            .await?;
        match confirm {
            Confirmation::Ack(None) => Ok(()),
            _ => Err(Error::DeadLetterRefused(self.dead_letter_queue.clone())),
        }
    }
}

/// The delivery's number, this one included.
fn attempt(delivery: &AmqpDelivery) -> u32 {
    let count =
        delivery.properties.headers().as_ref().and_then(|h| h.inner().get(DELIVERY_COUNT)).and_then(|v| match *v {
            AMQPValue::LongLongInt(n) => u32::try_from(n).ok(),
            AMQPValue::LongInt(n) => u32::try_from(n).ok(),
            AMQPValue::LongUInt(n) => Some(n),
            AMQPValue::ShortInt(n) => u32::try_from(n).ok(),
            _ => None,
        });
    match count {
        Some(n) => n.saturating_add(1),
        None if delivery.redelivered => 2,
        None => 1,
    }
}
