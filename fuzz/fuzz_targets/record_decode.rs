//! Fuzz target `record_decode`: the body is `idem_conformance::fuzz_targets::record_decode`, shared with the
//! stable corpus replay in `idem-conformance/tests/fuzz_corpus.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| idem_conformance::fuzz_targets::record_decode(data));
