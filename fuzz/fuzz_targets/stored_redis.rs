//! Fuzz target `stored_redis`: stored-record bytes as a hostile writer to the shared store
//! would leave them (written as an idem-redis hash on the live Redis), read back through the store's
//! public API. The body is `idem_fuzz::stored_redis::stored_record` (`src/stored_redis.rs`),
//! shared with the stable corpus replay in `tests/corpus.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| idem_fuzz::stored_redis::stored_record(data));
