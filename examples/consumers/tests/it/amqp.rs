//! RabbitMQ: the glue in process against the real broker, and the run setup the
//! killed-consumer test uses.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem_consumer::amqp::{Amqp, REASON_HEADER};
use idem_consumer::{Acked, Config, Consumer, Settle};
use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicNackOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

use super::killed::{Broker, postgres_url, run_id};

fn url() -> String {
    std::env::var("IDEM_AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

/// Queue `<prefix>` and dead-letter queue `<prefix>.dead`.
pub(crate) struct AmqpRun {
    _conn: Connection,
    channel: Channel,
    prefix: String,
}

impl AmqpRun {
    pub(crate) async fn create(prefix: &str) -> Self {
        let conn = Connection::connect(&url(), ConnectionProperties::default())
            .await
            .unwrap_or_else(|e| panic!("RabbitMQ at {}: {e} (run scripts/services, or set IDEM_AMQP_URL)", url()));
        let channel = conn.create_channel().await.unwrap();
        channel.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
        for q in [prefix.to_owned(), format!("{prefix}.dead")] {
            channel
                .queue_declare(q.as_str().into(), QueueDeclareOptions::durable(), FieldTable::default())
                .await
                .unwrap();
        }
        Self { _conn: conn, channel, prefix: prefix.to_owned() }
    }

    pub(crate) async fn publish(&self, messages: &[(String, Vec<u8>)]) {
        for (key, payload) in messages {
            let props = BasicProperties::default().with_message_id(key.as_str().into()).with_delivery_mode(2);
            self.publish_with(payload, props).await;
        }
    }

    async fn publish_with(&self, payload: &[u8], props: BasicProperties) {
        let confirm = self
            .channel
            .basic_publish("".into(), self.prefix.as_str().into(), BasicPublishOptions::default(), payload, props)
            .await
            .unwrap()
            .await
            .unwrap();
        assert!(matches!(confirm, lapin::Confirmation::Ack(_)));
    }

    pub(crate) async fn delete(&self) {
        for q in [self.prefix.clone(), format!("{}.dead", self.prefix)] {
            let _ = self.channel.queue_delete(q.as_str().into(), QueueDeleteOptions::default()).await;
        }
    }

    async fn ready(&self, queue: &str) -> u32 {
        let passive = QueueDeclareOptions { passive: true, ..QueueDeclareOptions::default() };
        self.channel.queue_declare(queue.into(), passive, FieldTable::default()).await.unwrap().message_count()
    }

    /// The ready count once it reaches `expected`, or as it stands after 3 s: a requeue
    /// (`basic.nack`) reaches the queue after the channel's next answer may have been sent.
    async fn ready_reaching(&self, queue: &str, expected: u32) -> u32 {
        let mut ready = self.ready(queue).await;
        for _ in 0..30 {
            if ready == expected {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            ready = self.ready(queue).await;
        }
        ready
    }

    async fn next(&self) -> lapin::message::BasicGetMessage {
        for _ in 0..50 {
            if let Some(m) =
                self.channel.basic_get(self.prefix.as_str().into(), BasicGetOptions::default()).await.unwrap()
            {
                return m;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("no message within 5 s");
    }

    async fn glue(&self, lease: Duration) -> Amqp {
        let store = idem_example_consumers::store(&postgres_url()).await.expect("store");
        let consumer =
            Consumer::new(store, Config::default().with_lease_ttl(lease).with_retry_after(Duration::from_millis(50)));
        Amqp::new(consumer, self.channel.clone(), self.prefix.clone(), format!("{}.dead", self.prefix)).await.unwrap()
    }
}

impl Broker for AmqpRun {
    async fn publish_one(&self, key: &str, payload: &[u8]) {
        self.publish(&[(key.to_owned(), payload.to_vec())]).await;
    }

    fn worker(&self) -> (&'static str, Vec<String>) {
        let args = vec![
            "--queue".to_owned(),
            self.prefix.clone(),
            "--dead-letter".to_owned(),
            format!("{}.dead", self.prefix),
        ];
        (env!("CARGO_BIN_EXE_amqp-worker"), args)
    }

    fn source(&self) -> String {
        self.prefix.clone()
    }

    async fn drained(&self) -> bool {
        // Ready messages only: AMQP does not report unacknowledged ones. The killed-consumer
        // test stops the workers and asks again, when every unacked message is back.
        self.ready(&self.prefix).await == 0
    }

    async fn dead_letters(&self) -> Vec<(String, String)> {
        let dead = format!("{}.dead", self.prefix);
        let mut out = Vec::new();
        while let Some(m) = self.channel.basic_get(dead.as_str().into(), BasicGetOptions::default()).await.unwrap() {
            let props = &m.delivery.properties;
            let reason = props.headers().as_ref().and_then(|h| h.inner().get(REASON_HEADER).cloned());
            let reason = match reason {
                Some(AMQPValue::LongString(s)) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
                other => format!("{other:?}"),
            };
            let key = props.message_id().as_ref().map(|k| k.as_str().to_owned()).unwrap_or_default();
            out.push((key, reason));
            m.delivery.ack(BasicAckOptions::default()).await.unwrap();
        }
        out
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivered_and_a_republished_job_run_once_and_are_acked() {
    let prefix = run_id();
    let run = AmqpRun::create(&prefix).await;
    let glue = run.glue(Duration::from_secs(10)).await;
    let runs = AtomicUsize::new(0);
    let handler = |_| async {
        runs.fetch_add(1, Ordering::SeqCst);
        Ok::<(), String>(())
    };
    run.publish(&[
        ("job-1".to_owned(), b"{\"job\":\"a\"}".to_vec()),
        ("job-1".to_owned(), b"{\"job\":\"a\"}".to_vec()),
    ])
    .await;
    // The first delivery's ack is "lost": it goes back to the queue and comes again.
    let first = run.next().await;
    first.delivery.nack(BasicNackOptions { requeue: true, ..Default::default() }).await.unwrap();
    for expected in [Acked::Ran, Acked::AlreadyDone] {
        let m = run.next().await;
        assert_eq!(glue.handle(&prefix, &m.delivery, handler).await.unwrap(), Settle::Ack(expected));
    }
    assert_eq!(run.ready(&prefix).await, 0);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    run.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mismatch_and_a_keyless_job_are_dead_lettered_with_their_reason() {
    let prefix = run_id();
    let run = AmqpRun::create(&prefix).await;
    let glue = run.glue(Duration::from_secs(10)).await;
    let ok = |_| async { Ok::<(), String>(()) };
    run.publish(&[("k".to_owned(), b"one".to_vec()), ("k".to_owned(), b"two".to_vec())]).await;
    run.publish_with(b"no key", BasicProperties::default()).await;
    let m = run.next().await;
    assert_eq!(glue.handle(&prefix, &m.delivery, ok).await.unwrap(), Settle::Ack(Acked::Ran));
    for code in ["mismatch", "missing-key"] {
        let m = run.next().await;
        let Settle::DeadLetter(reason) = glue.handle(&prefix, &m.delivery, ok).await.unwrap() else { panic!() };
        assert_eq!(reason.code(), code);
    }
    assert_eq!(run.ready(&prefix).await, 0);
    let dead = run.dead_letters().await;
    assert_eq!(dead, vec![("k".to_owned(), "mismatch".to_owned()), (String::new(), "missing-key".to_owned())]);
    run.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_that_reaches_no_queue_does_not_ack_the_original() {
    // With the dead-letter queue gone, the publish was unroutable, RabbitMQ confirmed it
    // anyway, and the original was acked: the message existed nowhere.
    let prefix = run_id();
    let run = AmqpRun::create(&prefix).await;
    let glue = run.glue(Duration::from_secs(10)).await;
    run.channel.queue_delete(format!("{prefix}.dead").as_str().into(), QueueDeleteOptions::default()).await.unwrap();
    run.publish_with(b"no key", BasicProperties::default()).await;
    let m = run.next().await;
    let r = glue.handle(&prefix, &m.delivery, |_| async { Ok::<(), String>(()) }).await;
    let left = run.ready_reaching(&prefix, 1).await;
    run.delete().await;
    assert!(r.is_err(), "{r:?}");
    assert_eq!(left, 1, "the message went back to its queue");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_dead_letter_goes_back_to_the_queue() {
    // A refused dead letter (the dead-letter queue full, overflow reject-publish) left the
    // delivery unacked on a live channel: never redelivered, holding a prefetch slot.
    let prefix = run_id();
    let run = AmqpRun::create(&prefix).await;
    let glue = run.glue(Duration::from_secs(10)).await;
    let dead = format!("{prefix}.dead");
    run.channel.queue_delete(dead.as_str().into(), QueueDeleteOptions::default()).await.unwrap();
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongInt(0));
    args.insert("x-overflow".into(), AMQPValue::LongString("reject-publish".into()));
    run.channel.queue_declare(dead.as_str().into(), QueueDeclareOptions::durable(), args).await.unwrap();
    run.publish_with(b"no key", BasicProperties::default()).await;
    let m = run.next().await;
    let r = glue.handle(&prefix, &m.delivery, |_| async { Ok::<(), String>(()) }).await;
    let ready = run.ready_reaching(&prefix, 1).await;
    run.delete().await;
    assert!(r.is_err(), "{r:?}");
    assert_eq!(ready, 1, "the message went back to its queue");
}
