//! Fuzz target `idempotency_key`: the body is `idem_conformance::fuzz_targets::idempotency_key`, shared with the
//! stable corpus replays in `idem-conformance/tests/it/fuzz_corpus.rs` and `tests/corpus.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| idem_conformance::fuzz_targets::idempotency_key(data));
