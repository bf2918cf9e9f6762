//! Fuzz corpus replay: every committed file under `fuzz/corpus/layer/` runs through the
//! `layer` target's body (`idem_http::fuzzing::layer`) on stable Rust, so an input that
//! once made the layer panic, run a handler without its claim, or stray from the decision
//! table cannot do it again unnoticed.

use std::fs;
use std::path::Path;

use idem_http::fuzzing::layer;

const TARGET: &str = "layer";

fn corpus_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus").join(TARGET)
}

#[test]
fn every_committed_layer_corpus_file_keeps_the_layer_rules() {
    let mut files: Vec<_> = fs::read_dir(corpus_dir()).expect("corpus dir").map(|e| e.expect("entry").path()).collect();
    files.sort();
    assert!(files.len() >= 3, "a seed corpus of at least 3 files");
    for file in &files {
        let data = fs::read(file).expect("corpus file");
        if std::panic::catch_unwind(|| layer(&data)).is_err() {
            panic!("fuzz target {TARGET} fails on corpus file {}", file.display());
        }
    }
    eprintln!("replayed {} corpus files of {TARGET}", files.len());
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

/// The seed corpus: hand-made sequences (a keyed POST replayed; a key claimed by another
/// process; a mismatch; a blank tenant) and pseudo-random ones.
#[test]
#[ignore = "writes files into fuzz/corpus; run by hand to regenerate the seeds"]
fn write_seed_corpus() {
    let dir = corpus_dir();
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
