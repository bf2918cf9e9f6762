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
