//! Fuzz target `fingerprint`: the body is `idem_conformance::fuzz_targets::fingerprint`, shared with the
//! stable corpus replays in `idem-conformance/tests/it/fuzz_corpus.rs` and `tests/corpus.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| idem_conformance::fuzz_targets::fingerprint(data));
