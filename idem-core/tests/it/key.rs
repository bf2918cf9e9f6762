//! `Idempotency-Key` parsing: bare tokens, RFC 8941 sf-strings, limits, stored forms.

use idem_core::key::{DEFAULT_MAX_KEY_LEN, IdempotencyKey, KeyError};
use proptest::prelude::*;

#[test]
fn stored_keys_rebuild_byte_exact() {
    // Keys that start with or contain a quote or a backslash are kept as stored, not
    // read as a quoted sf-string.
    for k in ["abc", "\"quoted\"", "a\\b", "~!#", "\"abc", "a\"b", "\"", "\\", "~!@#$%^&*()"] {
        assert_eq!(IdempotencyKey::from_stored(k).map(|k| k.as_str().to_owned()), Some(k.to_owned()));
    }
    for bad in ["", "a b", "caf\u{e9}", "tab\t"] {
        assert_eq!(IdempotencyKey::from_stored(bad), None, "{bad:?}");
    }
}

#[test]
fn bare_and_quoted_forms_name_the_same_key() {
    let a = IdempotencyKey::parse(b"abc-123").unwrap();
    let b = IdempotencyKey::parse(b"\"abc-123\"").unwrap();
    assert_eq!(a, b);
    assert_eq!(a.as_str(), "abc-123");
}

#[test]
fn empty_and_blank_values_are_rejected() {
    for v in [&b""[..], b"   ", b"\t", b"\"\""] {
        assert_eq!(IdempotencyKey::parse(v), Err(KeyError::Empty), "{v:?}");
    }
}

#[test]
fn inner_whitespace_is_rejected_not_trimmed() {
    assert!(matches!(IdempotencyKey::parse(b"a b"), Err(KeyError::InvalidByte { byte: b' ', .. })));
    assert!(matches!(IdempotencyKey::parse(b"\" K\""), Err(KeyError::InvalidByte { byte: b' ', .. })));
    // Field-level OWS is not part of the value (RFC 9110 §5.5).
    assert_eq!(IdempotencyKey::parse(b" K ").unwrap().as_str(), "K");
}

#[test]
fn length_limit_is_inclusive_at_255() {
    let ok = vec![b'k'; 255];
    assert_eq!(IdempotencyKey::parse(&ok).unwrap().as_bytes().len(), 255);
    let long = vec![b'k'; 256];
    assert_eq!(IdempotencyKey::parse(&long), Err(KeyError::TooLong { len: 256, max: 255 }));
    let mut quoted = vec![b'"'];
    quoted.extend_from_slice(&ok);
    quoted.push(b'"');
    assert!(IdempotencyKey::parse(&quoted).is_ok());
    assert!(IdempotencyKey::parse_with_limit(b"abcd", 3).is_err());
}

#[test]
fn non_ascii_keys_are_rejected() {
    assert!(matches!(IdempotencyKey::parse("注文-🙂".as_bytes()), Err(KeyError::InvalidByte { offset: 0, .. })));
    // NFC "é" and NFD "e\u{301}" are both rejected, so they can never merge.
    assert!(IdempotencyKey::parse("\u{e9}".as_bytes()).is_err());
    assert!(IdempotencyKey::parse("e\u{301}".as_bytes()).is_err());
    assert!(IdempotencyKey::parse(b"a\x00b").is_err());
    assert!(IdempotencyKey::parse(b"a\x7fb").is_err());
}

#[test]
fn malformed_sf_strings_are_rejected() {
    for v in [&b"\"abc"[..], b"\"", b"\"a\"b\"", b"\"a\\x\"", b"\"a\\\"", b"\"a\"\"b\""] {
        assert!(IdempotencyKey::parse(v).is_err(), "{:?}", String::from_utf8_lossy(v));
    }
    assert_eq!(IdempotencyKey::parse(b"\"a\\\"b\\\\c\"").unwrap().as_str(), "a\"b\\c");
    // A bare token may contain a quote after the first byte (visible ASCII).
    assert_eq!(IdempotencyKey::parse(b"a\"b").unwrap().as_str(), "a\"b");
}

proptest! {
    #[test]
    fn every_visible_ascii_token_round_trips(s in "[!-~]{1,255}") {
        prop_assume!(!s.starts_with('"'));
        let k = IdempotencyKey::parse(s.as_bytes()).unwrap();
        prop_assert_eq!(k.as_str(), s.as_str());
    }

    #[test]
    fn parser_never_panics_and_output_obeys_rules(v in proptest::collection::vec(any::<u8>(), 0..600)) {
        if let Ok(k) = IdempotencyKey::parse(&v) {
            prop_assert!(!k.as_bytes().is_empty());
            prop_assert!(k.as_bytes().len() <= DEFAULT_MAX_KEY_LEN);
            prop_assert!(k.as_bytes().iter().all(|b| (0x21..=0x7e).contains(b)));
        }
    }
}
