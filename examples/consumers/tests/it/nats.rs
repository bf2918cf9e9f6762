//! JetStream: the glue in process against the real server, and the run setup the
//! killed-consumer test uses.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, consumer, stream};
use futures::StreamExt as _;
use idem_consumer::nats::{JetStream, KEY_HEADER, REASON_HEADER};
use idem_consumer::{Acked, Config, Consumer, Redeliver, Settle};

use super::killed::{Broker, postgres_url, run_id};

pub(crate) struct Nats {
    js: jetstream::Context,
}

impl Nats {
    pub(crate) async fn connect() -> Self {
        let url = std::env::var("IDEM_NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".to_owned());
        let client = async_nats::connect(&url)
            .await
            .unwrap_or_else(|e| panic!("NATS at {url}: {e} (run scripts/services, or set IDEM_NATS_URL)"));
        Self { js: jetstream::new(client) }
    }
}

/// A stream `<prefix>` of subject `<prefix>.jobs`, a dead-letter stream `<prefix>_DEAD` of
/// `<prefix>.dead`, and a durable pull consumer `workers`.
pub(crate) struct NatsRun {
    js: jetstream::Context,
    prefix: String,
    key_header: String,
}

impl NatsRun {
    pub(crate) async fn create(nats: &Nats, prefix: &str, key_header: &str) -> Self {
        let js = nats.js.clone();
        for (name, subject) in [(prefix.to_owned(), "jobs"), (format!("{prefix}_DEAD"), "dead")] {
            js.create_stream(stream::Config {
                name,
                subjects: vec![format!("{prefix}.{subject}")],
                ..Default::default()
            })
            .await
            .expect("create stream");
        }
        js.get_stream(prefix)
            .await
            .unwrap()
            .create_consumer(consumer::pull::Config {
                durable_name: Some("workers".to_owned()),
                ack_policy: consumer::AckPolicy::Explicit,
                ack_wait: Duration::from_secs(3),
                max_ack_pending: 64,
                ..Default::default()
            })
            .await
            .expect("create consumer");
        Self { js, prefix: prefix.to_owned(), key_header: key_header.to_owned() }
    }

    pub(crate) async fn publish(&self, messages: &[(String, Vec<u8>)]) {
        for (key, payload) in messages {
            let mut headers = HeaderMap::new();
            headers.insert(self.key_header.as_str(), key.as_str());
            self.js
                .publish_with_headers(format!("{}.jobs", self.prefix), headers, payload.clone().into())
                .await
                .unwrap()
                .await
                .expect("publish acked");
        }
    }

    pub(crate) async fn delete(&self) {
        let _ = self.js.delete_stream(&self.prefix).await;
        let _ = self.js.delete_stream(format!("{}_DEAD", self.prefix)).await;
    }

    fn glue(&self, consumer: Consumer) -> JetStream {
        JetStream::new(consumer, self.js.clone(), self.prefix.clone(), format!("{}.dead", self.prefix))
            .with_key_header(self.key_header.clone())
    }

    /// A second durable pull consumer, `capped`, with this `ack_wait` and `max_deliver`.
    async fn capped(&self, ack_wait: Duration, max_deliver: i64) -> consumer::PullConsumer {
        let stream = self.js.get_stream(&self.prefix).await.unwrap();
        let config = consumer::pull::Config {
            durable_name: Some("capped".to_owned()),
            ack_policy: consumer::AckPolicy::Explicit,
            ack_wait,
            max_deliver,
            ..Default::default()
        };
        stream.create_consumer(config).await.unwrap();
        self.pull("capped").await
    }

    /// Consumer `name` of the run's stream.
    async fn pull(&self, name: &str) -> consumer::PullConsumer {
        self.js.get_stream(&self.prefix).await.unwrap().get_consumer(name).await.unwrap()
    }

    async fn next(&self) -> jetstream::Message {
        fetch_one(&self.pull("workers").await, Duration::from_secs(5)).await.expect("a message within 5 s")
    }

    /// Whether consumer `name` holds nothing undelivered or unacknowledged.
    async fn settled(&self, name: &str) -> bool {
        let info = self.pull(name).await.info().await.unwrap().clone();
        info.num_pending == 0 && info.num_ack_pending == 0
    }
}

/// The next message `pull` delivers within `within`, if any.
async fn fetch_one(pull: &consumer::PullConsumer, within: Duration) -> Option<jetstream::Message> {
    let mut batch = pull.fetch().max_messages(1).expires(within).messages().await.unwrap();
    batch.next().await.map(Result::unwrap)
}

impl Broker for NatsRun {
    async fn publish_one(&self, key: &str, payload: &[u8]) {
        self.publish(&[(key.to_owned(), payload.to_vec())]).await;
    }

    fn worker(&self) -> (&'static str, Vec<String>) {
        let args = ["--stream", &self.prefix, "--consumer", "workers", "--key-header", &self.key_header]
            .into_iter()
            .map(str::to_owned)
            .chain(["--dead-letter".to_owned(), format!("{}.dead", self.prefix)])
            .collect();
        (env!("CARGO_BIN_EXE_nats-worker"), args)
    }

    fn source(&self) -> String {
        format!("{}/workers", self.prefix)
    }

    async fn drained(&self) -> bool {
        self.settled("workers").await
    }

    async fn dead_letters(&self) -> Vec<(String, String)> {
        let dead = self.js.get_stream(format!("{}_DEAD", self.prefix)).await.unwrap();
        let mut out = Vec::new();
        let last = dead.get_info().await.unwrap().state.last_sequence;
        for seq in 1..=last {
            let msg = dead.get_raw_message(seq).await.unwrap();
            let header = |name: &str| msg.headers.get(name).map(|v| v.as_str().to_owned()).unwrap_or_default();
            out.push((header(KEY_HEADER), header(REASON_HEADER)));
        }
        out
    }
}

async fn consumer(lease: Duration) -> Consumer {
    let store = idem_example_consumers::store(&postgres_url()).await.expect("store");
    Consumer::new(store, Config::default().with_lease_ttl(lease).with_retry_after(Duration::from_millis(100)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivered_and_a_republished_job_run_once_and_are_acked() {
    let nats = Nats::connect().await;
    let prefix = run_id();
    let run = NatsRun::create(&nats, &prefix, "Nats-Msg-Id").await;
    let glue = run.glue(consumer(Duration::from_secs(10)).await);
    let runs = AtomicUsize::new(0);
    let handler = |_| async {
        runs.fetch_add(1, Ordering::SeqCst);
        Ok::<(), String>(())
    };
    run.publish(&[("job-1".to_owned(), b"{\"job\":\"a\"}".to_vec())]).await;
    // The first delivery is not settled (its ack "lost"): nak it so it comes back at once.
    let first = run.next().await;
    first.ack_with(jetstream::AckKind::Nak(None)).await.unwrap();
    let again = run.next().await;
    assert_eq!(again.info().unwrap().delivered, 2);
    assert_eq!(glue.handle(&again, handler).await.unwrap(), Settle::Ack(Acked::Ran));
    assert_eq!(glue.handle(&first, handler).await.unwrap(), Settle::Ack(Acked::AlreadyDone));
    assert!(run.drained().await);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    run.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mismatch_and_a_keyless_job_are_dead_lettered_with_their_reason() {
    let nats = Nats::connect().await;
    let prefix = run_id();
    let run = NatsRun::create(&nats, &prefix, "Idem-Key").await;
    let glue = run.glue(consumer(Duration::from_secs(10)).await);
    let ok = |_| async { Ok::<(), String>(()) };
    run.publish(&[("k".to_owned(), b"one".to_vec()), ("k".to_owned(), b"two".to_vec())]).await;
    run.js.publish(format!("{prefix}.jobs"), "no key".into()).await.unwrap().await.unwrap();
    assert_eq!(glue.handle(&run.next().await, ok).await.unwrap(), Settle::Ack(Acked::Ran));
    for code in ["mismatch", "missing-key"] {
        let Settle::DeadLetter(reason) = glue.handle(&run.next().await, ok).await.unwrap() else { panic!() };
        assert_eq!(reason.code(), code);
    }
    assert!(run.drained().await, "the dead-lettered messages were terminated");
    let dead = run.dead_letters().await;
    assert_eq!(dead, vec![("k".to_owned(), "mismatch".to_owned()), (String::new(), "missing-key".to_owned())]);
    run.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_longer_than_ack_wait_is_kept_in_progress_and_its_duplicate_waits() {
    // Without the progress acks JetStream would redeliver the message after ack_wait (3 s)
    // to another consumer while the first still runs.
    let nats = Nats::connect().await;
    let prefix = run_id();
    let run = NatsRun::create(&nats, &prefix, "Idem-Key").await;
    let glue = Arc::new(run.glue(consumer(Duration::from_millis(1500)).await));
    run.publish(&[("long".to_owned(), b"p".to_vec())]).await;
    let msg = run.next().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let long = glue.handle(&msg, |_| async {
        runs.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_secs(5)).await;
        Ok::<(), String>(())
    });
    let redelivered = async { fetch_one(&run.pull("workers").await, Duration::from_secs(4)).await };
    let (settle, redelivered) = tokio::join!(long, redelivered);
    assert_eq!(settle.unwrap(), Settle::Ack(Acked::Ran));
    assert!(redelivered.is_none(), "JetStream redelivered a message still in progress");
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // A duplicate published while another delivery holds the key is naked, not run.
    run.publish(&[("held".to_owned(), b"p".to_vec()), ("held".to_owned(), b"p".to_vec())]).await;
    let (a, b) = (run.next().await, run.next().await);
    let slow = glue.handle(&a, |_| async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        Ok::<(), String>(())
    });
    let dup = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        glue.handle(&b, |_| async { Ok::<(), String>(()) }).await
    };
    let (slow, dup) = tokio::join!(slow, dup);
    assert_eq!(slow.unwrap(), Settle::Ack(Acked::Ran));
    assert!(matches!(dup.unwrap(), Settle::Redeliver { why: Redeliver::InFlight, .. }));
    let back = run.next().await;
    assert_eq!(glue.handle(&back, |_| async { Ok::<(), String>(()) }).await.unwrap(), Settle::Ack(Acked::AlreadyDone));
    run.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_consumers_of_one_stream_each_run_their_handler() {
    // With the stream alone as the scope's source, a second service reading the same
    // stream through its own durable consumer found the first one's completed record and
    // acked every message without running its handler.
    let nats = Nats::connect().await;
    let prefix = run_id();
    let run = NatsRun::create(&nats, &prefix, "Nats-Msg-Id").await;
    let stream = run.js.get_stream(&prefix).await.unwrap();
    let billing = consumer::pull::Config {
        durable_name: Some("billing".to_owned()),
        ack_policy: consumer::AckPolicy::Explicit,
        ..Default::default()
    };
    stream.create_consumer(billing).await.unwrap();
    run.publish(&[("order-1".to_owned(), b"{\"order\":1}".to_vec())]).await;
    let counted = |n: &'static AtomicUsize| {
        move |_| async move {
            n.fetch_add(1, Ordering::SeqCst);
            Ok::<(), String>(())
        }
    };
    static PROVISIONED: AtomicUsize = AtomicUsize::new(0);
    static BILLED: AtomicUsize = AtomicUsize::new(0);
    let provisioning = run.glue(consumer(Duration::from_secs(10)).await);
    let s1 = provisioning.handle(&run.next().await, counted(&PROVISIONED)).await.unwrap();
    let msg = fetch_one(&run.pull("billing").await, Duration::from_secs(5)).await.unwrap();
    let billing = run.glue(consumer(Duration::from_secs(10)).await);
    let s2 = billing.handle(&msg, counted(&BILLED)).await.unwrap();
    run.delete().await;
    assert_eq!((s1, s2), (Settle::Ack(Acked::Ran), Settle::Ack(Acked::Ran)));
    assert_eq!((PROVISIONED.load(Ordering::SeqCst), BILLED.load(Ordering::SeqCst)), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_delivery_max_deliver_allows_is_held_not_naked() {
    // A consumer died mid-handler; the redelivery found the key in flight and was NAKed;
    // with max_deliver reached JetStream never delivered it again: the job was lost.
    let nats = Nats::connect().await;
    let prefix = run_id();
    let run = NatsRun::create(&nats, &prefix, "Nats-Msg-Id").await;
    let pull = run.capped(Duration::from_secs(1), 2).await;
    let fetch = || fetch_one(&pull, Duration::from_secs(4));
    run.publish(&[("job-1".to_owned(), b"p".to_vec())]).await;
    let glue = run.glue(consumer(Duration::from_secs(3)).await).with_max_deliver(2);
    // A process killed mid-handler: nothing marks the record failed, the lease stands.
    let first = fetch().await.expect("delivery 1");
    let info = first.info().unwrap();
    let scope = idem_core::Scope::new(
        prefix.as_str(),
        idem_core::Endpoint::new(idem_consumer::METHOD, &format!("{}/{}", info.stream, info.consumer)),
    )
    .unwrap();
    let req = idem_core::ClaimRequest::new(
        scope,
        idem_core::IdempotencyKey::parse(b"job-1").unwrap(),
        idem_core::Fingerprint::of(&idem_core::RequestParts {
            method: idem_consumer::METHOD,
            path: &format!("{}/{}", info.stream, info.consumer),
            query: Some(first.subject.as_str()),
            headers: &[],
            body: b"p",
        }),
        Duration::from_secs(3),
        Duration::from_secs(60),
    );
    let store = idem_example_consumers::store(&postgres_url()).await.unwrap();
    assert!(matches!(store.claim(req).await.unwrap(), idem_core::ClaimOutcome::Claimed(_)));
    // Delivery 2 after ack_wait, the last allowed: the key is still in flight.
    let second = fetch().await.expect("delivery 2");
    assert_eq!(second.info().unwrap().delivered, 2);
    let s = glue.handle(&second, |_| async { Ok::<(), String>(()) }).await.unwrap();
    run.delete().await;
    assert_eq!(s, Settle::Ack(Acked::Ran), "held until the dead consumer's lease ran out, then run");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_too_large_for_the_server_is_stored_without_its_payload() {
    // A payload near max_payload plus the dead-letter headers was refused by the server,
    // and the message came back after every ack_wait, never dead-lettered.
    let nats = Nats::connect().await;
    let prefix = run_id();
    let run = NatsRun::create(&nats, &prefix, "Nats-Msg-Id").await;
    let max = run.js.client().server_info().max_payload;
    run.js.publish(format!("{prefix}.jobs"), vec![b'x'; max - 64].into()).await.unwrap().await.unwrap();
    let glue = run.glue(consumer(Duration::from_secs(10)).await);
    let settle = glue.handle(&run.next().await, |_| async { Ok::<(), String>(()) }).await.unwrap();
    let dead = run.js.get_stream(format!("{prefix}_DEAD")).await.unwrap().get_raw_message(1).await.unwrap();
    let drained = run.drained().await;
    run.delete().await;
    assert!(matches!(settle, Settle::DeadLetter(_)), "{settle:?}");
    assert!(drained);
    assert_eq!(
        dead.headers.get(idem_consumer::nats::OMITTED_HEADER).map(|v| v.as_str().to_owned()).as_deref(),
        Some("true")
    );
    assert!(dead.payload.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_that_fails_on_the_last_delivery_is_held_and_tried_again() {
    // On the last delivery max_deliver allows, a failed dead-letter publish NAKed the
    // message and JetStream never delivered it again: neither acked nor dead-lettered.
    let nats = Nats::connect().await;
    let prefix = run_id();
    let run = NatsRun::create(&nats, &prefix, "Nats-Msg-Id").await;
    let pull = run.capped(Duration::from_secs(2), 1).await;
    // Keyless, so dead-lettered; no stream captures the dead-letter subject yet.
    run.js.publish(format!("{prefix}.jobs"), "no key".into()).await.unwrap().await.unwrap();
    let msg = fetch_one(&pull, Duration::from_secs(4)).await.unwrap();
    let later = format!("{prefix}.later");
    let glue = JetStream::new(consumer(Duration::from_secs(3)).await, run.js.clone(), prefix.clone(), later.clone())
        .with_max_deliver(1);
    let settle = glue.handle(&msg, |_| async { Ok::<(), String>(()) });
    let comes_back = async {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let config =
            stream::Config { name: format!("{prefix}_LATER"), subjects: vec![later.clone()], ..Default::default() };
        run.js.create_stream(config).await.unwrap();
    };
    let (settle, ()) = tokio::join!(settle, comes_back);
    let stored = run.js.get_stream(format!("{prefix}_LATER")).await.unwrap().get_info().await.unwrap().state.messages;
    let drained = run.settled("capped").await;
    let _ = run.js.delete_stream(format!("{prefix}_LATER")).await;
    run.delete().await;
    assert!(matches!(settle, Ok(Settle::DeadLetter(_))), "{settle:?}");
    assert_eq!(stored, 1);
    assert!(drained, "the original was terminated");
}
