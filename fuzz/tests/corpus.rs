//! Fuzz corpora as regression tests: every file committed under `corpus/<target>/` runs
//! through the same body as under libFuzzer (`idem_fuzz::run`), on stable Rust, so an input
//! that once broke a target (copy it from `artifacts/<target>/` into `corpus/<target>/`)
//! cannot break it again unnoticed. `stored_redis` and `stored_postgres` need the live
//! servers (`scripts/services`); they fail, never skip, without them.
//!
//! Run: `cargo test --manifest-path fuzz/Cargo.toml --no-default-features`.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

use idem_fuzz::TARGETS;

fn fuzz_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The committed corpus of `target`, sorted; every target ships at least 3 seeds.
fn corpus_files(target: &str) -> Vec<PathBuf> {
    let dir = fuzz_dir().join("corpus").join(target);
    let entries = fs::read_dir(&dir).unwrap_or_else(|e| panic!("corpus directory {} is missing: {e}", dir.display()));
    let mut files: Vec<_> = entries.map(|e| e.expect("directory entry").path()).filter(|p| p.is_file()).collect();
    files.sort();
    assert!(files.len() >= 3, "{target}: expected a seed corpus of at least 3 files, found {}", files.len());
    files
}

fn replay(target: &str) {
    let files = corpus_files(target);
    for file in &files {
        let data = fs::read(file).expect("corpus file");
        if std::panic::catch_unwind(|| idem_fuzz::run(target, &data)).is_err() {
            panic!("fuzz target {target} fails on corpus file {}", file.display());
        }
    }
    eprintln!("replayed {} corpus files of {target}", files.len());
}

macro_rules! corpus_tests {
    ($($target:ident),+ $(,)?) => {
        $(
            #[test]
            fn $target() {
                replay(stringify!($target));
            }
        )+

        /// The tests above cover every target there is.
        const TESTED: &[&str] = &[$(stringify!($target)),+];
    };
}

corpus_tests!(
    idempotency_key,
    fingerprint,
    record_decode,
    record_roundtrip,
    model_vs_redb,
    layer,
    stored_redb,
    stored_sqlite,
    stored_redis,
    stored_postgres,
);

/// Every binary in `fuzz_targets/`, every corpus directory and every replay test name the
/// same targets, so no corpus goes unreplayed.
#[test]
fn every_target_has_a_binary_a_corpus_and_a_replay() {
    let names = |dir: &str, strip: &str| -> BTreeSet<String> {
        fs::read_dir(fuzz_dir().join(dir))
            .expect(dir)
            .map(|e| e.expect("entry").file_name().to_string_lossy().trim_end_matches(strip).to_owned())
            .collect()
    };
    let targets: BTreeSet<String> = TARGETS.iter().map(|t| (*t).to_owned()).collect();
    assert_eq!(names("fuzz_targets", ".rs"), targets, "fuzz_targets/ and idem_fuzz::TARGETS");
    assert_eq!(names("corpus", ""), targets, "corpus/ and idem_fuzz::TARGETS");
    assert_eq!(TESTED.iter().map(|t| (*t).to_owned()).collect::<BTreeSet<_>>(), targets, "replay tests");
}

/// Seed corpora of the stored-record targets: records as each store writes them (see
/// `idem_conformance::fuzz_targets::write_stored_seeds`).
#[test]
#[ignore = "writes files into fuzz/corpus; run by hand to regenerate the seeds"]
fn write_stored_seed_corpus() {
    use idem_conformance::fuzz_targets::write_stored_seeds;
    write_stored_seeds("stored_redb", idem_fuzz::stored_redb::seed);
    write_stored_seeds("stored_sqlite", idem_fuzz::stored_sqlite::seed);
    write_stored_seeds("stored_redis", idem_fuzz::stored_redis::seed);
    write_stored_seeds("stored_postgres", idem_fuzz::stored_postgres::seed);
}

/// Deterministic pseudo-random bytes (xorshift).
fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// The `layer` seed corpus: hand-made sequences (a keyed POST replayed; a key claimed by
/// another process; a mismatch; a blank tenant) and pseudo-random ones.
#[test]
#[ignore = "writes files into fuzz/corpus; run by hand to regenerate the seeds"]
fn write_layer_seed_corpus() {
    let dir = fuzz_dir().join("corpus").join("layer");
    fs::create_dir_all(&dir).expect("corpus dir");
    // Setup: key required, reject, max key 30, max body 40, 409, content-type only, lease
    // 5 s, at most 2 fingerprint fields of 108 bytes.
    let setup = [0u8, 1, 29, 40, 0, 0, 4, 1, 100];
    // A request op (2), status pick, method pick (not custom), POST, path 0, 3 headers:
    // idempotency-key k1, x-tenant tenant-a, content-type json; body "{}".
    let keyed = |status: u8, tenant: u8, body: &[u8]| {
        let mut op = vec![2, status, 1, 0, 0, 3, 0, 2, 0, 2, 2, tenant, 3, 2, 4];
        op.push(u8::try_from(body.len()).expect("short"));
        op.extend_from_slice(body);
        op
    };
    let seq = |ops: &[Vec<u8>]| [setup.to_vec(), ops.concat()].concat();
    let seeds = [
        ("replay", seq(&[keyed(1, 2, b"{}"), keyed(1, 2, b"{}")])),
        ("mismatch", seq(&[keyed(1, 2, b"{}"), keyed(1, 2, b"{\"a\":1}")])),
        ("two-tenants", seq(&[keyed(1, 2, b"{}"), keyed(1, 3, b"{}"), keyed(1, 3, b"{}")])),
        ("failed-then-retried", seq(&[keyed(6, 2, b"{}"), keyed(1, 2, b"{}")])),
        ("blank-tenant", seq(&[keyed(1, 6, b"{}")])),
        ("in-flight-elsewhere", seq(&[vec![1, 0, 0, 0], keyed(1, 2, b"x"), vec![0, 100], keyed(1, 2, b"x")])),
    ];
    for (name, data) in seeds {
        fs::write(dir.join(name), data).expect("seed");
    }
    for i in 0..4u64 {
        fs::write(dir.join(format!("noise-{i}")), noise(300 + i, 128 << i)).expect("seed");
    }
}
