//! The bodies of the fuzz targets in `fuzz/` (a cargo-fuzz package outside the workspace).
//!
//! Each body takes the fuzzer's raw bytes and panics only when it finds a bug. They live
//! here, in an ordinary crate, so the same code runs twice: under libFuzzer in `fuzz/`, and
//! on stable Rust in this crate's `tests/fuzz_corpus.rs`, which replays every committed
//! file of `fuzz/corpus/<target>/` as a regression test.

use arbitrary::{Arbitrary, Unstructured};
use idem_core::codec;
use idem_core::key::DEFAULT_MAX_KEY_LEN;
use idem_core::{
    Endpoint, FencingToken, Fingerprint, IdempotencyKey, ManualClock, Record, RecordId, RecordState, RequestParts,
    Scope, Store, StoredBody, StoredResponse, UnixMillis,
};

use crate::model_test::{self, Op};

/// Target names, as directories under `fuzz/corpus/` and binaries under `fuzz/fuzz_targets/`.
pub const TARGETS: [&str; 4] = ["idempotency_key", "fingerprint", "record_decode", "record_roundtrip"];

/// The target that runs operation sequences on a real store against the model
/// ([`model_vs_store`]); its corpus (`fuzz/corpus/model_vs_redb/`) replays in idem-redb's
/// tests, on a redb file.
pub const MODEL_TARGET: &str = "model_vs_redb";

/// The committed corpus of fuzz target `target` (`fuzz/corpus/<target>/`), sorted: what
/// the stable replay tests run.
///
/// # Panics
/// When the directory is missing or holds fewer than 3 files (every target ships a seed
/// corpus).
#[must_use]
pub fn corpus_files(target: &str) -> Vec<std::path::PathBuf> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join("fuzz").join("corpus").join(target);
    let entries =
        std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("corpus directory {} is missing: {e}", dir.display()));
    let mut files: Vec<_> = entries.map(|e| e.expect("directory entry").path()).filter(|p| p.is_file()).collect();
    files.sort();
    assert!(files.len() >= 3, "{target}: expected a seed corpus of at least 3 files, found {}", files.len());
    files
}

/// Runs the body of byte-level target `name` on `data`. `record_roundtrip` takes a record
/// built by idem-core's derived `Arbitrary` (feature `arbitrary`), so its replay builds
/// that record first and calls [`record_roundtrip`]. Unknown names panic.
pub fn run(name: &str, data: &[u8]) {
    match name {
        "idempotency_key" => idempotency_key(data),
        "fingerprint" => fingerprint(data),
        "record_decode" => record_decode(data),
        other => panic!("unknown fuzz target {other}"),
    }
}

/// The `Idempotency-Key` parser: never panics; an accepted key is 1..=limit bytes of
/// visible ASCII, parsing is deterministic, and the key's sf-string form (and its bare
/// form, when that is not itself a quoted string) parse back to the same key.
pub fn idempotency_key(data: &[u8]) {
    let limit = if data.len().is_multiple_of(3) { DEFAULT_MAX_KEY_LEN } else { data.len() % 300 };
    for (max, parsed) in
        [(DEFAULT_MAX_KEY_LEN, IdempotencyKey::parse(data)), (limit, IdempotencyKey::parse_with_limit(data, limit))]
    {
        assert_eq!(parsed, IdempotencyKey::parse_with_limit(data, max), "parsing is deterministic");
        let Ok(key) = parsed else { continue };
        let bytes = key.as_bytes();
        assert!(!bytes.is_empty() && bytes.len() <= max, "length {} outside 1..={max}", bytes.len());
        assert!(bytes.iter().all(|b| (0x21..=0x7e).contains(b)), "non-visible byte in {key:?}");
        assert_eq!(key.to_string(), key.as_str());
        let mut quoted = vec![b'"'];
        for &b in bytes {
            if b == b'"' || b == b'\\' {
                quoted.push(b'\\');
            }
            quoted.push(b);
        }
        quoted.push(b'"');
        assert_eq!(IdempotencyKey::parse_with_limit(&quoted, max).as_ref(), Ok(&key), "sf-string form of {key:?}");
        if bytes[0] != b'"' {
            assert_eq!(IdempotencyKey::parse_with_limit(bytes, max).as_ref(), Ok(&key), "bare form of {key:?}");
        }
    }
}

/// Owned request parts, for generating and comparing.
#[derive(Clone, Debug, PartialEq, Eq, Arbitrary)]
struct Parts {
    method: String,
    path: String,
    query: Option<String>,
    headers: Vec<(String, Vec<u8>)>,
    body: Vec<u8>,
}

impl Parts {
    fn fingerprint(&self) -> Fingerprint {
        let headers: Vec<(&str, &[u8])> = self.headers.iter().map(|(n, v)| (n.as_str(), v.as_slice())).collect();
        Fingerprint::of(&RequestParts {
            method: &self.method,
            path: &self.path,
            query: self.query.as_deref(),
            headers: &headers,
            body: &self.body,
        })
    }

    /// Moves the first byte (char) of one field to the end of the previous one: the
    /// same bytes, split differently. Length prefixes must tell them apart.
    fn shifted(&self, which: u8) -> Parts {
        let mut p = self.clone();
        let take_first = |s: &mut String| if s.is_empty() { None } else { Some(s.remove(0)) };
        match which % 3 {
            0 => {
                if let Some(c) = take_first(&mut p.path) {
                    p.method.push(c);
                }
            }
            1 => {
                if let Some(c) = p.query.as_mut().and_then(take_first) {
                    p.path.push(c);
                }
            }
            _ => {
                if !p.body.is_empty() {
                    let b = p.body.remove(0);
                    if let Some((_, v)) = p.headers.last_mut() {
                        v.push(b);
                    } else {
                        p.body.insert(0, b);
                    }
                }
            }
        }
        p
    }
}

/// Fingerprints and record ids: deterministic, and equal only for equal inputs, including
/// inputs that hold the same bytes split differently between fields (length prefixes).
/// `Fingerprint::of_bytes(b)` equals the fingerprint of parts with only that body.
pub fn fingerprint(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let Ok(a) = Parts::arbitrary(&mut u) else { return };
    let b = match u.arbitrary::<u8>() {
        Ok(w) if w % 2 == 0 => a.shifted(w / 2),
        _ => Parts::arbitrary(&mut u).unwrap_or_else(|_| a.clone()),
    };
    let (fa, fb) = (a.fingerprint(), b.fingerprint());
    assert_eq!(fa, a.fingerprint(), "fingerprints are deterministic");
    assert_eq!(fa == fb, a == b, "fingerprint equality must follow request equality:\n{a:?}\n{b:?}");
    let body_only =
        Parts { method: String::new(), path: String::new(), query: None, headers: vec![], body: a.body.clone() };
    assert_eq!(Fingerprint::of_bytes(&a.body), body_only.fingerprint());

    let ids = |p: &Parts| (p.method.clone(), p.path.clone(), p.query.clone().unwrap_or_default());
    let (ia, ib) = (ids(&a), ids(&b));
    let (ra, rb) = (RecordId::derive(&ia.0, &ia.1, &ia.2), RecordId::derive(&ib.0, &ib.1, &ib.2));
    assert_eq!(ra == rb, ia == ib, "record id equality must follow (principal, endpoint, key) equality");
    assert_eq!(RecordId::from_hex(&ra.to_hex()), Some(ra));
    if let (Ok(scope), Ok(key)) =
        (Scope::new(ia.0.clone(), Endpoint::from(ia.1.clone())), IdempotencyKey::parse(ia.2.as_bytes()))
    {
        assert_eq!(scope.record_id(&key), RecordId::derive(&ia.0, &ia.1, key.as_str()));
    }
}

/// Builds a record from fuzzer bytes (any field values, including ones no store writes).
fn arbitrary_record(u: &mut Unstructured<'_>) -> arbitrary::Result<Record> {
    let principal = String::arbitrary(u)?;
    let endpoint = String::arbitrary(u)?;
    let key = IdempotencyKey::parse(<&[u8]>::arbitrary(u)?).unwrap_or_else(|_| IdempotencyKey::parse(b"k").expect("k"));
    let scope = Scope::new(if principal.is_empty() { "p".to_owned() } else { principal }, Endpoint::from(endpoint))
        .map_err(|_| arbitrary::Error::IncorrectFormat)?;
    let state = *u.choose(&[RecordState::InFlight, RecordState::Completed, RecordState::Failed])?;
    let response = if bool::arbitrary(u)? {
        let status = u16::arbitrary(u)?;
        let headers = Vec::<(String, Vec<u8>)>::arbitrary(u)?;
        let body = Vec::<u8>::arbitrary(u)?;
        Some(match u.int_in_range(0..=2u8)? {
            0 => StoredResponse::new(status, headers, body),
            1 => StoredResponse::compressed_over(status, headers, body, 0),
            _ => StoredResponse {
                status,
                headers,
                body: StoredBody::NotRetained { len: Option::<u64>::arbitrary(u)? },
                trailers: vec![],
            },
        })
    } else {
        None
    };
    Ok(Record {
        id: RecordId::from_bytes(<[u8; 32]>::arbitrary(u)?),
        key,
        scope,
        fingerprint: Fingerprint::from_bytes(<[u8; 32]>::arbitrary(u)?),
        state,
        token: FencingToken(u64::arbitrary(u)?),
        response,
        created_at: UnixMillis(i64::arbitrary(u)?),
        started_at: UnixMillis(i64::arbitrary(u)?),
        lease_expires_at: UnixMillis(i64::arbitrary(u)?),
        expires_at: UnixMillis(i64::arbitrary(u)?),
    })
}

/// The record decoder: arbitrary bytes decode to a record or a typed error, never a panic
/// or a huge allocation; a decoded record re-encodes to bytes that decode to it; a record
/// built from the same bytes round-trips, and its truncations and extensions are refused.
pub fn record_decode(data: &[u8]) {
    if let Ok(r) = codec::decode(data) {
        assert_eq!(codec::decode(&codec::encode(&r)).ok().as_ref(), Some(&r), "decode . encode . decode");
        if let Some(resp) = &r.response {
            // A hostile compressed body gives a typed error, bounded by MAX_DECODED_BODY.
            let _ = resp.body_bytes();
        }
    }
    let mut u = Unstructured::new(data);
    let Ok(record) = arbitrary_record(&mut u) else { return };
    let bytes = codec::encode(&record);
    assert_eq!(codec::decode(&bytes).ok().as_ref(), Some(&record), "encode then decode round-trips");
    if let Some(resp @ StoredResponse { body: StoredBody::Lz4 { .. }, .. }) = &record.response {
        assert!(resp.body_bytes().is_ok(), "a body compressed by compressed_over decompresses");
    }
    let step = (bytes.len() / 16).max(1);
    for cut in (0..bytes.len()).step_by(step) {
        assert!(codec::decode(&bytes[..cut]).is_err(), "a record truncated to {cut} of {} bytes decoded", bytes.len());
    }
    let mut longer = bytes.clone();
    longer.push(0);
    assert!(matches!(codec::decode(&longer), Err(codec::CodecError::Trailing(1))), "a trailing byte is refused");
}

/// Operation sequences decoded from `data` (up to 256 [`Op`]s) run on `store` and on
/// [`crate::Spec`] through the model test's runner ([`model_test::run_ops`]), which
/// compares every outcome and checks record invariants. `store` must be fresh and timed by
/// `clock`. Runs its own current-thread Tokio runtime, so call it outside one. `Err`
/// describes the first divergence; the fuzz target panics on it.
///
/// # Errors
/// The first outcome where the store and the model disagree.
pub fn model_vs_store(data: &[u8], store: &dyn Store, clock: &ManualClock) -> Result<(), String> {
    let mut u = Unstructured::new(data);
    let mut ops: Vec<Op> = Vec::new();
    while ops.len() < 256 {
        match Op::arbitrary(&mut u) {
            Ok(op) => ops.push(op),
            Err(_) => break,
        }
    }
    // A runtime, not a bare executor: stores may hand blocking reads to Tokio's pool.
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    runtime
        .block_on(model_test::run_ops(store, clock, "fuzz", &ops))
        .map(drop)
        .map_err(|e| format!("{e}\nops: {ops:#?}"))
}

/// Records from idem-core's derived `Arbitrary` (the `record_roundtrip` target): encode then
/// decode gives the same record, and the bytes carry the current format version.
pub fn record_roundtrip(record: &Record) {
    let bytes = codec::encode(record);
    assert_eq!(bytes.first(), Some(&codec::FORMAT_VERSION));
    assert_eq!(codec::decode(&bytes).ok().as_ref(), Some(record), "encode then decode round-trips");
    if let Some(resp) = &record.response {
        // Arbitrary compressed bodies are hostile: a typed error, never a panic or a bomb.
        let _ = resp.body_bytes();
    }
}

/// A record of `principal` in `state` as the stored-record seeds use it.
fn seed_record(principal: &str, state: RecordState, response: Option<StoredResponse>) -> Record {
    let scope = Scope::new(principal, Endpoint::new("POST", "/v1/workers/{id}/reboot")).expect("principal");
    let key = IdempotencyKey::parse(b"\"7c3f5d1e-91a4\"").expect("key");
    Record {
        id: scope.record_id(&key),
        scope,
        key,
        fingerprint: Fingerprint::of_bytes(b"{}"),
        state,
        token: FencingToken(3),
        response,
        created_at: UnixMillis(1_764_460_800_000),
        started_at: UnixMillis(1_764_460_801_000),
        lease_expires_at: UnixMillis(1_764_461_101_000),
        expires_at: UnixMillis(1_764_547_200_000),
    }
}

/// Writes the seed corpus of a stored-record target into `fuzz/corpus/<target>/`, each
/// seed encoded by `seed` (the store's own encoding): an in-flight, a completed, a
/// compressed, a not-retained and a failed record, and one completed record of tenant B
/// placed at tenant A's id (a copy by a hostile writer).
///
/// # Panics
/// When the corpus directory cannot be written.
pub fn write_stored_seeds(target: &str, seed: fn(&Record) -> Vec<u8>) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus").join(target);
    std::fs::create_dir_all(&dir).expect("corpus dir");
    let full = StoredResponse::new(201, vec![("location".into(), b"/t/42".to_vec())], br#"{"id":"t42"}"#.to_vec());
    let compressed = StoredResponse::compressed_over(200, vec![], b"abc".repeat(200), 16);
    let not_retained = StoredResponse {
        status: 201,
        headers: vec![],
        body: StoredBody::NotRetained { len: Some(9) },
        trailers: vec![],
    };
    let a_in_flight = seed_record("tenant-a", RecordState::InFlight, None);
    let mut moved = seed(&seed_record("tenant-b", RecordState::Completed, Some(full.clone())));
    let b_id = *seed_record("tenant-b", RecordState::Failed, None).id.as_bytes();
    if let Some(at) = moved.windows(32).position(|w| w == b_id) {
        moved[at..at + 32].copy_from_slice(a_in_flight.id.as_bytes());
    }
    let seeds = [
        ("in-flight", seed(&a_in_flight)),
        ("completed", seed(&seed_record("tenant-a", RecordState::Completed, Some(full)))),
        ("compressed", seed(&seed_record("tenant-a", RecordState::Completed, Some(compressed)))),
        ("not-retained", seed(&seed_record("tenant-a", RecordState::Completed, Some(not_retained)))),
        ("failed", seed(&seed_record("tenant-a", RecordState::Failed, None))),
        ("moved-from-other-tenant", moved),
    ];
    for (name, data) in seeds {
        std::fs::write(dir.join(name), data).expect("seed file");
    }
}
