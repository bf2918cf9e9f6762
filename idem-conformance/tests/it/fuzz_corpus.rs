//! Fuzz corpora as regression tests: every file committed under `fuzz/corpus/<target>/`
//! runs through the same target body as under libFuzzer, on stable Rust, so an input that
//! once crashed a target (add it to the corpus) can never crash it again unnoticed.

use std::fs;
use std::path::{Path, PathBuf};

use arbitrary::{Arbitrary, Unstructured};
use idem_conformance::fuzz_targets::{self, TARGETS};
use idem_core::{
    Endpoint, FencingToken, Fingerprint, IdempotencyKey, Record, RecordState, Scope, StoredBody, StoredResponse,
    UnixMillis, codec,
};

fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join("fuzz").join("corpus").join(target)
}

fn replay(target: &str, data: &[u8]) {
    if target == "record_roundtrip" {
        // libfuzzer-sys builds the input the same way: `arbitrary_take_rest`.
        if let Ok(record) = Record::arbitrary_take_rest(Unstructured::new(data)) {
            fuzz_targets::record_roundtrip(&record);
        }
    } else {
        fuzz_targets::run(target, data);
    }
}

#[test]
fn every_committed_corpus_file_replays_cleanly() {
    let mut total = 0;
    for target in TARGETS {
        let files = fuzz_targets::corpus_files(target);
        for file in &files {
            let data = fs::read(file).expect("corpus file");
            if std::panic::catch_unwind(|| replay(target, &data)).is_err() {
                panic!("fuzz target {target} fails on corpus file {}", file.display());
            }
        }
        total += files.len();
    }
    eprintln!("replayed {total} corpus files over {} targets", TARGETS.len());
}

/// Deterministic pseudo-random bytes (xorshift), for seeds of structured targets.
fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

fn sample_record(state: RecordState, response: Option<StoredResponse>) -> Record {
    let scope = Scope::new("token:ml-eval/注文", Endpoint::new("POST", "/v1/workers/{id}/reboot")).expect("principal");
    let key = IdempotencyKey::parse(b"\"7c3f5d1e-91a4\"").expect("key");
    Record {
        id: scope.record_id(&key),
        scope,
        key,
        fingerprint: Fingerprint::of_bytes(b"{}"),
        state,
        token: FencingToken(3),
        response,
        created_at: UnixMillis(1_764_460_800_000),
        started_at: UnixMillis(1_764_460_801_000),
        lease_expires_at: UnixMillis(1_764_461_101_000),
        expires_at: UnixMillis(1_764_547_200_000),
    }
}

/// Regenerates the seed corpora under `fuzz/corpus/` (they are committed; run by hand with
/// `cargo test -p idem-conformance --test it fuzz_corpus -- --ignored`).
#[test]
#[ignore = "writes files into fuzz/corpus; run by hand to regenerate the seeds"]
fn write_seed_corpus() {
    let write = |target: &str, name: &str, data: &[u8]| {
        let dir = corpus_dir(target);
        fs::create_dir_all(&dir).expect("corpus dir");
        fs::write(dir.join(name), data).expect("seed file");
    };
    let keys: [(&str, &[u8]); 8] = [
        ("bare-uuid", b"7c3f5d1e-91a4-4b8c-9f02-1c4a8e5b6d10"),
        ("sf-string", b"\"7c3f5d1e-91a4\""),
        ("sf-escapes", b"\"a\\\"b\\\\c\""),
        ("ows", b" \tK \t"),
        ("inner-space", b"\" K\""),
        ("nfd", "e\u{301}".as_bytes()),
        ("empty-string", b"\"\""),
        ("max-len", &[b'k'; 255]),
    ];
    for (name, data) in keys {
        write("idempotency_key", name, data);
    }
    write("idempotency_key", "too-long-quoted", &[b"\"".as_slice(), &[b'\\'; 600], b"\""].concat());

    write("fingerprint", "ascii-request", b"POST\x00/v1/workers\x01q=1\x02content-type\x03application/json{}");
    for i in 0..4u64 {
        write("fingerprint", &format!("noise-{i}"), &noise(i + 1, 64 << i));
    }

    let full = StoredResponse::new(
        201,
        vec![("location".to_owned(), b"/tickets/42".to_vec()), ("x-bytes".to_owned(), vec![0, 0xff])],
        br#"{"id":"tkt_42"}"#.to_vec(),
    );
    let records = [
        ("in-flight", sample_record(RecordState::InFlight, None)),
        ("completed", sample_record(RecordState::Completed, Some(full))),
        (
            "compressed",
            sample_record(
                RecordState::Completed,
                Some(StoredResponse::compressed_over(200, vec![], b"abc".repeat(200), 16)),
            ),
        ),
        (
            "not-retained",
            sample_record(
                RecordState::Completed,
                Some(StoredResponse {
                    status: 201,
                    headers: vec![],
                    body: StoredBody::NotRetained { len: Some(1 << 40) },
                    trailers: vec![],
                }),
            ),
        ),
        ("failed", sample_record(RecordState::Failed, None)),
    ];
    for (name, record) in &records {
        write("record_decode", name, &codec::encode(record));
    }
    let mut bomb = codec::encode(&records[2].1);
    // A compressed body (600 bytes, varint d8 04) claiming 16383: more than its data can expand to.
    if let Some(pos) = bomb.windows(2).position(|w| w == [0xd8, 0x04]) {
        bomb[pos] = 0xff;
        bomb[pos + 1] = 0x7f;
    }
    write("record_decode", "length-bomb", &bomb);
    // `v1-grpc-trailers` is kept by hand: a format-1 record (trailers inside the body),
    // which the current encoder no longer writes.
    write("record_decode", "unknown-version", &[3, 0, 0, 0]);
    write("record_decode", "truncated", &codec::encode(&records[1].1)[..40]);

    for i in 0..4u64 {
        write("record_roundtrip", &format!("noise-{i}"), &noise(100 + i, 48 << i));
        write("model_vs_redb", &format!("noise-{i}"), &noise(200 + i, 96 << i));
    }
    write("model_vs_redb", "claim-complete-advance", &[0; 64]);
}

/// A record table with one planted bug: every write stores the first fencing token, as a
/// backend that never persisted its token column would. Everything else is the model.
struct ForgetsToken(idem_core::Model);

impl idem_core::RecordRead for ForgetsToken {
    fn read(&self, id: idem_core::RecordId) -> Result<Option<Record>, idem_core::StoreError> {
        self.0.read(id)
    }
    fn journal_read(&self, id: idem_core::RecordId, name: &str) -> Result<Option<Vec<u8>>, idem_core::StoreError> {
        self.0.journal_read(id, name)
    }
}

impl idem_core::RecordTable for ForgetsToken {
    fn write(&mut self, old: Option<&Record>, new: &Record) -> Result<(), idem_core::StoreError> {
        let forgotten = Record { token: FencingToken::FIRST, ..new.clone() };
        self.0.write(old, &forgotten)
    }
    fn expired(&mut self, now: UnixMillis, limit: usize) -> Result<Vec<idem_core::Expired>, idem_core::StoreError> {
        self.0.expired(now, limit)
    }
    fn remove(&mut self, expired: idem_core::Expired) -> Result<(), idem_core::StoreError> {
        self.0.remove(expired)
    }
    fn journal_write(
        &mut self,
        id: idem_core::RecordId,
        name: &str,
        value: &[u8],
    ) -> Result<(), idem_core::StoreError> {
        self.0.journal_write(id, name, value)
    }
    fn journal_clear(&mut self, id: idem_core::RecordId) -> Result<(), idem_core::StoreError> {
        self.0.journal_clear(id)
    }
}

/// The model fuzz target can catch a wrong rule: over the same deterministic inputs, a
/// correct store passes every one and a store that forgets the fencing token fails some.
#[test]
fn the_model_target_catches_a_store_that_forgets_the_fencing_token() {
    use std::sync::Arc;

    use idem_core::{ManualClock, MemoryStore, TableStore};

    let start = UnixMillis(1_764_460_800_000);
    let mut caught = 0;
    for seed in 0..64 {
        let data = noise(900 + seed, 2048);
        let clock = ManualClock::new(start);
        let good = MemoryStore::with_clock(Arc::new(clock.clone()));
        if let Err(e) = fuzz_targets::model_vs_store(&data, &good, &clock) {
            panic!("the correct store diverged from the model on seed {seed}: {e}");
        }
        let clock = ManualClock::new(start);
        let broken = TableStore::from_table(ForgetsToken(idem_core::Model::new()), Arc::new(clock.clone()));
        caught += usize::from(fuzz_targets::model_vs_store(&data, &broken, &clock).is_err());
    }
    assert!(caught > 0, "no input of 64 exposed the forgotten token");
    eprintln!("the planted bug was caught on {caught} of 64 inputs");
}
