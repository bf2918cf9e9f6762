//! The `model_vs_redb` fuzz target's committed corpus as regression tests: every file under
//! `fuzz/corpus/model_vs_redb/` runs its operation sequence on a fresh redb file and on the
//! reference model, on stable Rust, so an input that once made them disagree cannot do it
//! again unnoticed.

use std::fs;
use std::sync::Arc;

use idem_conformance::fuzz_targets::{MODEL_TARGET, corpus_files, model_vs_store};
use idem_core::{ManualClock, UnixMillis};
use idem_redb::{Config, RedbStore};

#[test]
fn every_committed_model_corpus_file_agrees_with_the_model_on_redb() {
    for file in &corpus_files(MODEL_TARGET) {
        let data = fs::read(file).expect("corpus file");
        let temp = tempfile::tempdir().expect("temp dir");
        let clock = ManualClock::new(UnixMillis(1_764_460_800_000));
        let config = Config::default().with_clock(Arc::new(clock.clone()));
        let store = RedbStore::open(temp.path().join("fuzz.redb"), config).expect("redb opens");
        if let Err(divergence) = model_vs_store(&data, &store, &clock) {
            panic!("{} diverges from the model on redb: {divergence}", file.display());
        }
    }
}

// The stored-record decoder's corpus (`fuzz/corpus/stored_redb/`).
mod stored_redb {
    use std::fs;
    use std::path::Path;

    use idem_conformance::fuzz_targets::corpus_files;
    use idem_core::{
        Endpoint, FencingToken, Fingerprint, IdempotencyKey, Record, RecordState, Scope, StoredBody, StoredResponse,
        UnixMillis,
    };
    use idem_redb::fuzzing::{seed, stored_record};

    const TARGET: &str = "stored_redb";

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
