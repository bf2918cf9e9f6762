//! Fuzz target `stored_redis`: stored-record bytes as a hostile writer to the shared store
//! would leave them, through idem-redis's record decoder. The body is
//! `idem_redis::fuzzing::stored_record`, shared with the stable corpus replay in
//! `idem-redis/tests/fuzz_corpus.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| idem_redis::fuzzing::stored_record(data));
