//! Fuzz corpus replay: every committed file under `fuzz/corpus/stored_redis/` runs through
//! the `stored_redis` target's body on stable Rust, so stored bytes that once broke the
//! decoder cannot break it again unnoticed. No server is needed: the body calls the decoder.
// The stored-record decoder's corpus (`fuzz/corpus/stored_redis/`).
mod stored_redis {
    use std::fs;
    use std::path::Path;

    use idem_conformance::fuzz_targets::corpus_files;
    use idem_core::{
        Endpoint, FencingToken, Fingerprint, IdempotencyKey, Record, RecordState, Scope, StoredBody, StoredResponse,
        UnixMillis,
    };
    use idem_redis::fuzzing::{seed, stored_record};

    const TARGET: &str = "stored_redis";

    #[test]
    fn every_committed_stored_record_corpus_file_decodes_or_is_refused() {
        let files = corpus_files(TARGET);
        for file in &files {
            let data = fs::read(file).expect("corpus file");
            if std::panic::catch_unwind(|| stored_record(&data)).is_err() {
                panic!("fuzz target {TARGET} fails on corpus file {}", file.display());
            }
        }
        eprintln!("replayed {} corpus files of {TARGET}", files.len());
    }

    fn record(principal: &str, state: RecordState, response: Option<StoredResponse>) -> Record {
        let scope = Scope::new(principal, Endpoint::new("POST", "/v1/workers/{id}/reboot")).expect("principal");
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

    /// The seed corpus: records as the store writes them, one compressed, one not retained,
    /// one completed record of tenant B placed at tenant A's id (a copy by a hostile writer).
    #[test]
    #[ignore = "writes files into fuzz/corpus; run by hand to regenerate the seeds"]
    fn write_seed_corpus() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus").join(TARGET);
        fs::create_dir_all(&dir).expect("corpus dir");
        let full = StoredResponse::new(201, vec![("location".into(), b"/t/42".to_vec())], br#"{"id":"t42"}"#.to_vec());
        let compressed = StoredResponse::compressed_over(200, vec![], b"abc".repeat(200), 16);
        let not_retained =
            StoredResponse { status: 201, headers: vec![], body: StoredBody::NotRetained { len: Some(9) } };
        let a_in_flight = record("tenant-a", RecordState::InFlight, None);
        let mut moved = seed(&record("tenant-b", RecordState::Completed, Some(full.clone())));
        let a_id = a_in_flight.id.0;
        if let Some(at) = moved.windows(32).position(|w| w == record("tenant-b", RecordState::Failed, None).id.0) {
            moved[at..at + 32].copy_from_slice(&a_id);
        }
        let seeds = [
            ("in-flight", seed(&a_in_flight)),
            ("completed", seed(&record("tenant-a", RecordState::Completed, Some(full)))),
            ("compressed", seed(&record("tenant-a", RecordState::Completed, Some(compressed)))),
            ("not-retained", seed(&record("tenant-a", RecordState::Completed, Some(not_retained)))),
            ("failed", seed(&record("tenant-a", RecordState::Failed, None))),
            ("moved-from-other-tenant", moved),
        ];
        for (name, data) in seeds {
            fs::write(dir.join(name), data).expect("seed file");
        }
    }
}
