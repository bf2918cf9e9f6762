//! Fuzz target `stored_postgres`: stored-record bytes as a hostile writer to the shared store
//! would leave them (written as an idem-postgres row on the live PostgreSQL), read back through the store's
//! public API. The body is `idem_fuzz::stored_postgres::stored_record` (`src/stored_postgres.rs`),
//! shared with the stable corpus replay in `tests/corpus.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| idem_fuzz::stored_postgres::stored_record(data));
