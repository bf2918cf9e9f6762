//! Fuzz target `record_decode`: the body is `idem_conformance::fuzz_targets::record_decode`, shared with the
//! stable corpus replays in `idem-conformance/tests/it/fuzz_corpus.rs` and `tests/corpus.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| idem_conformance::fuzz_targets::record_decode(data));
