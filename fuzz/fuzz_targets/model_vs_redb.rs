//! Fuzz target `model_vs_redb`: operation sequences on a real redb store (a fresh file per
//! input) against the reference model. The body is
//! `idem_conformance::fuzz_targets::model_vs_store`, shared with the stable corpus replay in
//! `idem-redb/tests/fuzz_corpus.rs`.
#![no_main]

use std::sync::Arc;

use idem_core::{ManualClock, UnixMillis};
use idem_redb::{Config, RedbStore};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let dir = tempfile::tempdir().expect("temp dir");
    let clock = ManualClock::new(UnixMillis(1_764_460_800_000));
    let store = RedbStore::open(dir.path().join("fuzz.redb"), Config::default().with_clock(Arc::new(clock.clone())))
        .expect("redb opens");
    if let Err(divergence) = idem_conformance::fuzz_targets::model_vs_store(data, &store, &clock) {
        panic!("{divergence}");
    }
});
