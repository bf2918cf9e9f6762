//! Fuzz target `layer`: hostile requests (methods, header sets, keys, principals, bodies)
//! and clock moves through the idempotency layer on a memory store, each request checked
//! against the decision table, and no handler ever run without its claim. The body is
//! `idem_fuzz::layer::layer` (`src/layer.rs`), shared with the stable corpus replay in
//! `tests/corpus.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| idem_fuzz::layer::layer(data));
