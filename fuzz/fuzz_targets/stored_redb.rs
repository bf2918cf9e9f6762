//! Fuzz target `stored_redb`: stored-record bytes as a hostile writer to the shared store
//! would leave them, through idem-redb's record decoder. The body is
//! `idem_redb::fuzzing::stored_record`, shared with the stable corpus replay in
//! `idem-redb/tests/fuzz_corpus.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| idem_redb::fuzzing::stored_record(data));
