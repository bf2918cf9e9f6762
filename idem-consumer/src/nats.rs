//! NATS JetStream: a [`Consumer`] for messages pulled or pushed from a JetStream consumer.
//!
//! ```no_run
//! # async fn demo(store: std::sync::Arc<dyn idem_core::Store>) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! use futures::StreamExt as _;
//! use idem_consumer::{nats::JetStream, Config, Consumer};
//!
//! let client = async_nats::connect("127.0.0.1:4222").await?;
//! let js = async_nats::jetstream::new(client);
//! let stream = js.get_stream("JOBS").await?;
//! let pull: async_nats::jetstream::consumer::PullConsumer = stream.get_consumer("workers").await?;
//! let glue = JetStream::new(Consumer::new(store, Config::default()), js, "tenant-a", "JOBS.dead");
//! let mut messages = pull.messages().await?;
//! while let Some(msg) = messages.next().await {
//!     let msg = msg?;
//!     glue.handle(&msg, |journal| async move {
//!         // side effects through journal.step / journal.intent
//!         Ok::<(), std::io::Error>(())
//!     })
//!     .await?;
//! }
//! # Ok(()) }
//! ```

use std::fmt;
use std::future::Future;

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, AckKind};
use bytes::Bytes;
use idem_core::Resumable;

use crate::{Consumer, DeadLetter, Delivery, Settle};

/// The header a JetStream message's key is read from unless [`JetStream::with_key_header`]
/// names another: the one JetStream's own publish deduplication uses.
pub const MSG_ID: &str = "Nats-Msg-Id";
/// The dead letter's header naming why ([`crate::DeadLetter::code`]).
pub const REASON_HEADER: &str = "Idem-Dead-Letter-Reason";
/// The dead letter's header with the reason in words.
pub const DETAIL_HEADER: &str = "Idem-Dead-Letter-Detail";
/// The dead letter's header carrying the original key (never `Nats-Msg-Id`, which the
/// dead-letter stream would deduplicate on).
pub const KEY_HEADER: &str = "Idem-Key";
/// The dead letter's header naming the stream and consumer the message came from
/// (`{stream}/{consumer}`).
pub const SOURCE_HEADER: &str = "Idem-Source";
/// The dead letter's header with the original's stream sequence (to fetch it from the
/// stream when the dead letter could not carry its payload).
pub const SEQUENCE_HEADER: &str = "Idem-Source-Sequence";
/// The dead letter's header present when its payload was left out (over the server's
/// `max_payload` with the headers added).
pub const OMITTED_HEADER: &str = "Idem-Payload-Omitted";

/// Why a JetStream message could not be settled; the message stays unacknowledged, so
/// JetStream delivers it again after the consumer's `ack_wait`.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The message has no JetStream metadata (it did not come from a JetStream consumer).
    #[error("not a JetStream message: {0}")]
    NotJetStream(async_nats::Error),
    /// An ack, nak or term could not be sent.
    #[error("settling the message failed: {0}")]
    Settle(async_nats::Error),
    /// The dead letter was not stored by a stream (no stream captures the subject, or the
    /// publish failed).
    #[error("publishing the dead letter to {subject} failed: {source}")]
    DeadLetter {
        /// The dead-letter subject.
        subject: String,
        /// Why.
        source: async_nats::Error,
    },
}

/// Runs JetStream messages through a [`Consumer`] and settles them.
pub struct JetStream {
    consumer: Consumer,
    context: jetstream::Context,
    principal: String,
    key_header: String,
    dead_letter_subject: String,
    max_deliver: Option<i64>,
}

impl fmt::Debug for JetStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JetStream")
            .field("consumer", &self.consumer)
            .field("principal", &self.principal)
            .field("key_header", &self.key_header)
            .field("dead_letter_subject", &self.dead_letter_subject)
            .field("max_deliver", &self.max_deliver)
            .finish_non_exhaustive()
    }
}

impl JetStream {
    /// Glue for messages sent by `principal`; dead letters are published through `context`
    /// to `dead_letter_subject`, which a stream must capture.
    #[must_use]
    pub fn new(
        consumer: Consumer,
        context: jetstream::Context,
        principal: impl Into<String>,
        dead_letter_subject: impl Into<String>,
    ) -> Self {
        Self {
            consumer,
            context,
            principal: principal.into(),
            key_header: MSG_ID.to_owned(),
            dead_letter_subject: dead_letter_subject.into(),
            max_deliver: None,
        }
    }

    /// The JetStream consumer's `max_deliver`, when it has one (the default, -1, has
    /// none). On the last delivery JetStream allows, a message that would be redelivered
    /// (its key in flight elsewhere, the store down, the handler failed below the limit) is
    /// held and processed again in place, with progress acks, instead of `NAK`ed: a `NAK`
    /// there would make JetStream drop it.
    #[must_use]
    pub fn with_max_deliver(mut self, max_deliver: i64) -> Self {
        self.max_deliver = (max_deliver > 0).then_some(max_deliver);
        self
    }

    /// Reads the key from header `name` instead of `Nats-Msg-Id`.
    #[must_use]
    pub fn with_key_header(mut self, name: impl Into<String>) -> Self {
        self.key_header = name.into();
        self
    }

    /// Processes `msg` with `handler` ([`Consumer::process`]) and settles it: a double
    /// ack (acknowledged by the server) for [`Settle::Ack`], `NAK` with the delay for
    /// [`Settle::Redeliver`], the dead letter published (and its publish acknowledged)
    /// then `+TERM` for [`Settle::DeadLetter`]. While the handler runs, each lease renewal
    /// also sends `+WPI`, resetting the consumer's `ack_wait`.
    ///
    /// The scope's source is `{stream}/{consumer}`, so two consumers of one stream (two
    /// services fanning out) keep separate records; the subject is fingerprinted with the
    /// payload. `handler` may be called more than once on the last delivery
    /// ([`JetStream::with_max_deliver`]), never concurrently and never for a completed key.
    ///
    /// # Errors
    /// [`Error`] when the message cannot be settled; it is then left unacknowledged and
    /// comes back after `ack_wait`, where the record decides again.
    pub async fn handle<F, Fut, E>(&self, msg: &jetstream::Message, handler: F) -> Result<Settle, Error>
    where
        F: Fn(Resumable) -> Fut,
        Fut: Future<Output = Result<(), E>>,
        E: fmt::Display,
    {
        let info = msg.info().map_err(Error::NotJetStream)?;
        let source = format!("{}/{}", info.stream, info.consumer);
        let key = msg.headers.as_ref().and_then(|h| h.get(self.key_header.as_str())).map(|v| v.as_str().as_bytes());
        let delivered = u32::try_from(info.delivered).unwrap_or(u32::MAX);
        let delivery = Delivery::new(&source, &self.principal, key, &msg.payload).with_subject(msg.subject.as_str());
        let progress = || async {
            // A lost progress ack only shortens the broker's deadline; the lease decides.
            let _ = msg.ack_with(AckKind::Progress).await;
        };
        let last = self.max_deliver.is_some_and(|max| info.delivered >= max);
        let mut round = 0;
        let settle = loop {
            // Each round in place counts as one more delivery (for a store without a journal).
            let delivery = delivery.with_attempt(delivered.saturating_add(round));
            round += 1;
            let settle = self.consumer.process(delivery, progress, &handler).await;
            match settle {
                Settle::Redeliver { after, why } if last => {
                    tracing::debug!(?why, ?after, "last delivery JetStream allows: held and processed again");
                    hold(after, &progress).await;
                }
                settle => break settle,
            }
        };
        match &settle {
            Settle::Ack(_) => msg.double_ack().await.map_err(Error::Settle)?,
            Settle::Redeliver { after, .. } => msg.ack_with(AckKind::Nak(Some(*after))).await.map_err(Error::Settle)?,
            Settle::DeadLetter(reason) => loop {
                match self.dead_letter(msg, &info, &source, reason).await {
                    Ok(()) => break msg.ack_with(AckKind::Term).await.map_err(Error::Settle)?,
                    // A `NAK` on the last delivery would make JetStream drop the message.
                    Err(e) if last => {
                        tracing::warn!(error = %e, "dead letter not stored on the last delivery; held and tried again");
                        hold(self.consumer.config().retry_after(), &progress).await;
                    }
                    // Back after the usual delay rather than after `ack_wait`.
                    Err(e) => {
                        let _ = msg.ack_with(AckKind::Nak(Some(self.consumer.config().retry_after()))).await;
                        return Err(e);
                    }
                }
            },
        }
        Ok(settle)
    }

    /// Publishes the dead letter, with the payload if it fits and without it otherwise.
    /// Its `Nats-Msg-Id` names the original message, so the dead-letter stream keeps one
    /// copy when a consumer dies between this publish and the `+TERM` and a redelivery
    /// publishes it again (within the stream's duplicate window).
    async fn dead_letter(
        &self,
        msg: &jetstream::Message,
        info: &jetstream::message::Info<'_>,
        source: &str,
        reason: &DeadLetter,
    ) -> Result<(), Error> {
        let mut headers = HeaderMap::new();
        headers.insert(MSG_ID, format!("idem-dead-letter:{source}:{}", info.stream_sequence).as_str());
        headers.insert(REASON_HEADER, reason.code());
        headers.insert(DETAIL_HEADER, reason.to_string().as_str());
        headers.insert(SOURCE_HEADER, source);
        headers.insert(SEQUENCE_HEADER, info.stream_sequence.to_string().as_str());
        if let Some(key) = msg.headers.as_ref().and_then(|h| h.get(self.key_header.as_str())) {
            headers.insert(KEY_HEADER, key.as_str());
        }
        let failed = |source| Error::DeadLetter { subject: self.dead_letter_subject.clone(), source };
        let with_payload = self.publish(headers.clone(), msg.payload.clone()).await;
        let Err(first) = with_payload else { return Ok(()) };
        tracing::warn!(error = %first, "dead letter with its payload not stored; trying without the payload");
        headers.insert(OMITTED_HEADER, "true");
        self.publish(headers, Bytes::new()).await.map_err(failed)
    }

    async fn publish(&self, headers: HeaderMap, payload: Bytes) -> Result<(), async_nats::Error> {
        let subject = self.dead_letter_subject.clone();
        self.context.publish_with_headers(subject, headers, payload).await?.await?;
        Ok(())
    }
}

/// Waits `after`, sending a progress ack at least every second so JetStream keeps the
/// message with this consumer.
async fn hold<K, KFut>(after: Duration, progress: &K)
where
    K: Fn() -> KFut,
    KFut: Future<Output = ()>,
{
    let until = tokio::time::Instant::now() + after.clamp(Duration::from_millis(50), Duration::from_secs(3600));
    loop {
        let now = tokio::time::Instant::now();
        if now >= until {
            return;
        }
        tokio::time::sleep((until - now).min(Duration::from_secs(1))).await;
        progress().await;
    }
}
