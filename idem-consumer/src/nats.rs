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

use async_nats::HeaderMap;
use async_nats::jetstream::{self, AckKind};
use idem_core::Resumable;

use crate::{Consumer, Delivery, Settle};

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
/// The dead letter's header naming the stream the message came from.
pub const SOURCE_HEADER: &str = "Idem-Source";

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
}

impl fmt::Debug for JetStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JetStream")
            .field("consumer", &self.consumer)
            .field("principal", &self.principal)
            .field("key_header", &self.key_header)
            .field("dead_letter_subject", &self.dead_letter_subject)
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
        }
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
    /// # Errors
    /// [`Error`] when the message cannot be settled; it is then left unacknowledged and
    /// comes back after `ack_wait`, where the record decides again.
    pub async fn handle<F, Fut, E>(&self, msg: &jetstream::Message, handler: F) -> Result<Settle, Error>
    where
        F: FnOnce(Resumable) -> Fut,
        Fut: Future<Output = Result<(), E>>,
        E: fmt::Display,
    {
        let info = msg.info().map_err(Error::NotJetStream)?;
        let key = msg.headers.as_ref().and_then(|h| h.get(self.key_header.as_str())).map(|v| v.as_str().as_bytes());
        let delivery = Delivery::new(info.stream, &self.principal, key, &msg.payload)
            .with_attempt(u32::try_from(info.delivered).unwrap_or(u32::MAX));
        let keep_alive = || async {
            // A lost progress ack only shortens the broker's deadline; the lease decides.
            let _ = msg.ack_with(AckKind::Progress).await;
        };
        let settle = self.consumer.process(delivery, keep_alive, handler).await;
        match &settle {
            Settle::Ack(_) => msg.double_ack().await.map_err(Error::Settle)?,
            Settle::Redeliver { after, .. } => msg.ack_with(AckKind::Nak(Some(*after))).await.map_err(Error::Settle)?,
            Settle::DeadLetter(reason) => {
                let mut headers = HeaderMap::new();
                headers.insert(REASON_HEADER, reason.code());
                headers.insert(DETAIL_HEADER, reason.to_string().as_str());
                headers.insert(SOURCE_HEADER, info.stream);
                if let Some(key) = msg.headers.as_ref().and_then(|h| h.get(self.key_header.as_str())) {
                    headers.insert(KEY_HEADER, key.as_str());
                }
                let failed = |source| Error::DeadLetter { subject: self.dead_letter_subject.clone(), source };
                self.context
                    .publish_with_headers(self.dead_letter_subject.clone(), headers, msg.payload.clone())
                    .await
                    .map_err(|e| failed(e.into()))?
                    .await
                    .map_err(|e| failed(e.into()))?;
                msg.ack_with(AckKind::Term).await.map_err(Error::Settle)?;
            }
        }
        Ok(settle)
    }
}
