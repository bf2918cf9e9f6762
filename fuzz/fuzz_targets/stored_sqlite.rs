//! Fuzz target `stored_sqlite`: stored-record bytes as a hostile writer to the shared store
//! would leave them, through idem-sqlite's record decoder. The body is
//! `idem_sqlite::fuzzing::stored_record`, shared with the stable corpus replay in
//! `idem-sqlite/tests/fuzz_corpus.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| idem_sqlite::fuzzing::stored_record(data));
