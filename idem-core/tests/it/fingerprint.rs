//! Request fingerprints: which parts of a request count, raw and canonical-JSON modes.

#[cfg(feature = "canonical-json")]
use idem_core::FingerprintMode;
#[cfg(feature = "canonical-json")]
use idem_core::fingerprint::canonical_json;
use idem_core::{Fingerprint, RequestParts};

fn fp(body: &[u8]) -> Fingerprint {
    Fingerprint::of(&RequestParts {
        method: "POST",
        path: "/v1/workers",
        query: None,
        headers: &[("content-type", b"application/json")],
        body,
    })
}

#[test]
fn raw_mode_distinguishes_reordered_json() {
    assert_eq!(fp(br#"{"a":1,"b":2}"#), fp(br#"{"a":1,"b":2}"#));
    assert_ne!(fp(br#"{"a":1,"b":2}"#), fp(br#"{"b":2, "a":1}"#));
    assert_ne!(fp(b""), fp(b"{}"));
    assert_ne!(fp(b"{}"), fp(b"null"));
}

#[cfg(feature = "canonical-json")]
fn canon(body: &[u8]) -> Fingerprint {
    Fingerprint::of_mode(
        &RequestParts { method: "POST", path: "/v1/workers", query: None, headers: &[], body },
        FingerprintMode::CanonicalJson,
    )
}

#[test]
#[cfg(feature = "canonical-json")]
fn canonical_mode_merges_formatting_but_keeps_real_differences() {
    // Reordered keys and whitespace are one request in canonical mode...
    let a = canon(br#"{"a":1,"b":2}"#);
    assert_eq!(a, canon(br#"{"b":2, "a":1}"#));
    assert_eq!(a, canon(b"{\n  \"a\": 1,\n  \"b\": 2\n}"));
    // ...but array order, null versus absent and empty versus {} still differ.
    assert_ne!(canon(br#"{"x":[1,2]}"#), canon(br#"{"x":[2,1]}"#));
    assert_ne!(canon(br#"{"a":null}"#), canon(br#"{}"#));
    assert_ne!(canon(b""), canon(b"{}"));
    assert_ne!(canon(b"{}"), canon(b"null"));
    assert_ne!(canon(br#"{"labels":{}}"#), canon(br#"{}"#));
    // Invalid JSON falls back to raw bytes.
    assert_eq!(canon(b"{nope"), canon(b"{nope"));
    assert_ne!(canon(b"{nope"), canon(b"{nope "));
    // Integers past 2^53 are never merged by double rounding.
    assert_ne!(canon(br#"{"id":9007199254740993}"#), canon(br#"{"id":9007199254740992}"#));
    assert_ne!(canon(br#"{"id":18446744073709551616}"#), canon(br#"{"id":18446744073709552000}"#));
    // Raw mode still tells reordered keys apart.
    assert_ne!(fp(br#"{"a":1,"b":2}"#), fp(br#"{"b":2,"a":1}"#));
}

#[test]
#[cfg(feature = "canonical-json")]
fn canonical_and_raw_hashes_do_not_collide() {
    // An already-canonical body hashes differently in the two modes: tags differ.
    assert_ne!(
        canon(br#"{"a":1}"#),
        Fingerprint::of(&RequestParts {
            method: "POST",
            path: "/v1/workers",
            query: None,
            headers: &[],
            body: br#"{"a":1}"#
        })
    );
    assert_eq!(canonical_json(br#"{"b":1,"a":[true,null]}"#).unwrap(), br#"{"a":[true,null],"b":1}"#.to_vec());
}

#[test]
fn method_path_query_and_headers_count() {
    let base = RequestParts { method: "POST", path: "/a", query: None, headers: &[], body: b"x" };
    let f = Fingerprint::of(&base);
    assert_ne!(f, Fingerprint::of(&RequestParts { method: "PUT", ..base }));
    assert_ne!(f, Fingerprint::of(&RequestParts { path: "/b", ..base }));
    assert_ne!(f, Fingerprint::of(&RequestParts { query: Some(""), ..base }));
    assert_ne!(f, Fingerprint::of(&RequestParts { headers: &[("content-type", b"text/plain")], ..base }));
    // Moving bytes between fields changes the hash.
    assert_ne!(
        Fingerprint::of(&RequestParts { path: "/ab", body: b"", ..base }),
        Fingerprint::of(&RequestParts { path: "/a", body: b"b", ..base })
    );
}
