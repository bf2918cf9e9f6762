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

// The stored-record decoder's corpus (`fuzz/corpus/stored_redb/`), replayed through the
// `stored_redb` target's body on stable Rust: stored bytes that once broke the decoder cannot
// break it again unnoticed. No server is needed: the body calls the decoder.
mod stored_redb {
    use idem_conformance::fuzz_targets::{replay_stored_corpus, write_stored_seeds};
    use idem_redb::fuzzing::{seed, stored_record};

    const TARGET: &str = "stored_redb";

    #[test]
    fn every_committed_stored_record_corpus_file_decodes_or_is_refused() {
        let n = replay_stored_corpus(TARGET, stored_record);
        eprintln!("replayed {n} corpus files of {TARGET}");
    }

    /// The seed corpus: records as the store writes them (see `write_stored_seeds`).
    #[test]
    #[ignore = "writes files into fuzz/corpus; run by hand to regenerate the seeds"]
    fn write_seed_corpus() {
        write_stored_seeds(TARGET, seed);
    }
}
