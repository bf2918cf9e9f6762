//! Target `model_vs_redb`: operation sequences from several owners on a real redb store (a
//! fresh file per input) against the reference model, through
//! [`idem_conformance::fuzz_targets::model_vs_store`], which compares every outcome and
//! checks record invariants.

use std::sync::Arc;

use idem_conformance::fuzz_targets::model_vs_store;
use idem_core::{ManualClock, UnixMillis};
use idem_redb::{Config, RedbStore};

/// Panics on the first outcome where redb and the model disagree.
pub fn model_vs_redb(data: &[u8]) {
    let dir = tempfile::tempdir().expect("temp dir");
    let clock = ManualClock::new(UnixMillis(1_764_460_800_000));
    let config = Config::default().with_clock(Arc::new(clock.clone()));
    let store = RedbStore::open(dir.path().join("fuzz.redb"), config).expect("redb opens");
    if let Err(divergence) = model_vs_store(data, &store, &clock) {
        panic!("redb diverges from the model: {divergence}");
    }
}
