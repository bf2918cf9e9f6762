//! The `model_vs_redb` fuzz target's committed corpus as regression tests: every file under
//! `fuzz/corpus/model_vs_redb/` runs its operation sequence on a fresh redb file and on the
//! reference model, on stable Rust, so an input that once made them disagree cannot do it
//! again unnoticed.

use std::fs;
use std::path::Path;
use std::sync::Arc;

use idem_conformance::fuzz_targets::{MODEL_TARGET, model_vs_store};
use idem_core::{ManualClock, UnixMillis};
use idem_redb::{Config, RedbStore};

#[test]
fn every_committed_model_corpus_file_agrees_with_the_model_on_redb() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join("fuzz").join("corpus").join(MODEL_TARGET);
    let mut files: Vec<_> = fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("corpus directory {} is missing: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    assert!(files.len() >= 3, "expected a seed corpus of at least 3 files, found {}", files.len());
    for file in &files {
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
