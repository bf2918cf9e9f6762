//! Fuzz target `model_vs_memory`: the body is `idem_conformance::fuzz_targets::model_vs_memory`, shared with the
//! stable corpus replay in `idem-conformance/tests/fuzz_corpus.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| idem_conformance::fuzz_targets::model_vs_memory(data));
