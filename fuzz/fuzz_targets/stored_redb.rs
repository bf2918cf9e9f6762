//! Fuzz target `stored_redb`: stored-record bytes as a hostile writer to the shared store
//! would leave them (written into idem-redb's records table), read back through the store's
//! public API. The body is `idem_fuzz::stored_redb::stored_record` (`src/stored_redb.rs`),
//! shared with the stable corpus replay in `tests/corpus.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| idem_fuzz::stored_redb::stored_record(data));
