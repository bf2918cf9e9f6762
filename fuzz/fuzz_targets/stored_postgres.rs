//! Fuzz target `stored_postgres`: stored-record bytes as a hostile writer to the shared store
//! would leave them, through idem-postgres's record decoder. The body is
//! `idem_postgres::fuzzing::stored_record`, shared with the stable corpus replay in
//! `idem-postgres/tests/fuzz_corpus.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| idem_postgres::fuzzing::stored_record(data));
