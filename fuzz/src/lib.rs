//! The bodies of the fuzz targets in `fuzz_targets/`: each takes the fuzzer's raw bytes and
//! panics only when it finds a bug. They live in this package, outside every library
//! crate, so the same code runs twice: under libFuzzer (`cargo fuzz run <target>`, the
//! binaries in `fuzz_targets/`), and on stable Rust in `tests/corpus.rs`, which replays
//! every committed file of `corpus/<target>/` as a regression test
//! (`cargo test --manifest-path fuzz/Cargo.toml --no-default-features`).
//!
//! The stored-record bodies are black-box: they plant hostile bytes where a hostile writer
//! with access to the storage would (a redb table, an SQLite row, a Redis hash, a
//! PostgreSQL row, in the storage format each crate documents), then read them through the
//! store's public [`idem_core::Store`] API. `stored_redis` and `stored_postgres` need the
//! live servers of `scripts/services` (`IDEM_REDIS_URL`, `IDEM_POSTGRES_URL`).
//!
//! # Layout
//! - `src/layer.rs`: `layer`, hostile requests through `idem_http::IdempotencyLayer`.
//! - `src/model.rs`: `model_vs_redb`, operation sequences on redb against the model.
//! - `src/stored_redb.rs`, `src/stored_sqlite.rs`, `src/stored_redis.rs`,
//!   `src/stored_postgres.rs`: hostile stored records, one backend each.
//! - The four core targets (`idempotency_key`, `fingerprint`, `record_decode`,
//!   `record_roundtrip`) keep their bodies in `idem_conformance::fuzz_targets`; [`run`]
//!   dispatches to them too.

use arbitrary::{Arbitrary, Unstructured};
use idem_conformance::fuzz_targets;
use idem_core::{Record, StoreError, UnixMillis};

pub mod layer;
pub mod model;
pub mod stored_postgres;
pub mod stored_redb;
pub mod stored_redis;
pub mod stored_sqlite;

/// Every target: a binary in `fuzz_targets/`, a corpus directory under `corpus/`.
pub const TARGETS: [&str; 10] = [
    "idempotency_key",
    "fingerprint",
    "record_decode",
    "record_roundtrip",
    "model_vs_redb",
    "layer",
    "stored_redb",
    "stored_sqlite",
    "stored_redis",
    "stored_postgres",
];

/// Runs the body of target `target` on `data`, as its binary in `fuzz_targets/` does.
///
/// # Panics
/// When the body finds a bug, or `target` is not one of [`TARGETS`].
pub fn run(target: &str, data: &[u8]) {
    match target {
        "idempotency_key" | "fingerprint" | "record_decode" => fuzz_targets::run(target, data),
        // libfuzzer-sys builds a typed input the same way: `arbitrary_take_rest`.
        "record_roundtrip" => {
            if let Ok(record) = Record::arbitrary_take_rest(Unstructured::new(data)) {
                fuzz_targets::record_roundtrip(&record);
            }
        }
        "model_vs_redb" => model::model_vs_redb(data),
        "layer" => layer::layer(data),
        "stored_redb" => stored_redb::stored_record(data),
        "stored_sqlite" => stored_sqlite::stored_record(data),
        "stored_redis" => stored_redis::stored_record(data),
        "stored_postgres" => stored_postgres::stored_record(data),
        other => panic!("unknown fuzz target {other}"),
    }
}

/// The stores' clock in the stored-record bodies: the Unix epoch, so that every planted
/// record with a positive `expires_at` is live and goes through the decoder (an expired
/// one reads as absent, decoded or not).
pub(crate) const NOW: UnixMillis = UnixMillis(0);

/// A current-thread runtime, as the bodies run their async stores outside of any runtime.
pub(crate) fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a Tokio runtime")
}

/// Checks that a stored-record read is deterministic (`again` is the same read once more)
/// and returns the first.
pub(crate) fn same_read(
    first: Result<Option<Record>, StoreError>,
    again: &Result<Option<Record>, StoreError>,
) -> Result<Option<Record>, StoreError> {
    assert_eq!(format!("{first:?}"), format!("{again:?}"), "reading a stored record is deterministic");
    first
}

/// Reads the fuzzer's bytes; zeros once they run out.
pub(crate) struct Input<'a>(pub(crate) &'a [u8]);

impl<'a> Input<'a> {
    pub(crate) fn byte(&mut self) -> u8 {
        let Some((&b, rest)) = self.0.split_first() else { return 0 };
        self.0 = rest;
        b
    }

    /// A little-endian u16 length, then that many bytes (fewer when the input runs out).
    pub(crate) fn field(&mut self) -> &'a [u8] {
        let len = usize::from(u16::from_le_bytes([self.byte(), self.byte()])).min(self.0.len());
        let (field, rest) = self.0.split_at(len);
        self.0 = rest;
        field
    }
}

/// Appends `bytes` as [`Input::field`] reads them back.
pub(crate) fn push_field(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&u16::try_from(bytes.len()).unwrap_or(u16::MAX).to_le_bytes());
    out.extend_from_slice(bytes);
}
