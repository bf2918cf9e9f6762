//! Fuzz target `record_roundtrip`: records built by idem-core's derived `Arbitrary` (feature
//! `arbitrary`) survive encode then decode; the body is
//! `idem_conformance::fuzz_targets::record_roundtrip`, shared with the stable corpus replay.
#![no_main]

libfuzzer_sys::fuzz_target!(|record: idem_core::Record| idem_conformance::fuzz_targets::record_roundtrip(&record));
