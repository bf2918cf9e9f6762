//! Fuzz target `model_vs_redb`: operation sequences on a real redb store (a fresh file per
//! input) against the reference model. The body is `idem_fuzz::model::model_vs_redb`
//! (`src/model.rs`), shared with the stable corpus replay in `tests/corpus.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| idem_fuzz::model::model_vs_redb(data));
