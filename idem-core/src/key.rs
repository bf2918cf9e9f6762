//! The `Idempotency-Key` header value.
//!
//! Two wire forms are accepted:
//! - a bare token, as Stripe sends it: `Idempotency-Key: 7c3f5d1e-91a4-4b8c-9f02-1c4a8e5b6d10`;
//! - an RFC 8941 §3.3.3 sf-string, as draft-ietf-httpapi-idempotency-key-header §2.1
//!   defines it: `Idempotency-Key: "7c3f5d1e-91a4"`. The quotes are removed and `\"` / `\\`
//!   unescaped; `"abc"` and `abc` name the same key.
//!
//! Rules (`docs/contract.md#idempotency-key`): the key is non-empty, at most `max_len` bytes
//! after unquoting (default [`DEFAULT_MAX_KEY_LEN`] = 255), and made only of visible ASCII
//! (0x21..=0x7E). Whitespace anywhere inside the key, control bytes and non-ASCII bytes are
//! rejected rather than trimmed or normalised, so `" K"` and `"K"` can never silently merge
//! into one record and Unicode normalisation forms never collide
//! (`docs/failures.md#missing-or-blank-key-shares-a-record`).
//! The surrounding optional whitespace of an HTTP field (RFC 9110 §5.5) is not part of the
//! field value and is ignored.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Default upper bound on a key's length in bytes.
pub const DEFAULT_MAX_KEY_LEN: usize = 255;

/// A validated idempotency key: 1..=max_len bytes of visible ASCII.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct IdempotencyKey(String);

/// Why a header value is not a usable idempotency key. Each maps to HTTP 400.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The value is empty, or only whitespace, or `""`.
    #[error("the idempotency key is empty")]
    Empty,
    /// Longer than the configured maximum (bytes, after unquoting).
    #[error("the idempotency key is {len} bytes long; at most {max} are allowed")]
    TooLong {
        /// Length seen, in bytes (of the raw value if it was too long to parse).
        len: usize,
        /// The configured limit, in bytes.
        max: usize,
    },
    /// A byte outside visible ASCII (0x21..=0x7E) inside the key.
    #[error(
        "the idempotency key contains byte 0x{byte:02x} at offset {offset}; only visible ASCII (0x21-0x7E) is allowed"
    )]
    InvalidByte {
        /// The offending byte.
        byte: u8,
        /// Its offset in the header value.
        offset: usize,
    },
    /// A value starting with `"` that is not a well-formed RFC 8941 sf-string.
    #[error("the idempotency key is not a well-formed structured-field string (RFC 8941 §3.3.3)")]
    MalformedString,
}

impl IdempotencyKey {
    /// Parses a header value with the default length limit.
    ///
    /// # Errors
    /// [`KeyError`] when the value breaks a rule in the module docs.
    pub fn parse(value: &[u8]) -> Result<Self, KeyError> {
        Self::parse_with_limit(value, DEFAULT_MAX_KEY_LEN)
    }

    /// Parses a header value, allowing keys of up to `max_len` bytes.
    ///
    /// # Errors
    /// [`KeyError`] when the value breaks a rule in the module docs.
    pub fn parse_with_limit(value: &[u8], max_len: usize) -> Result<Self, KeyError> {
        let value = trim_ows(value);
        // Bound the work before looking at the bytes: a quoted form is at most two quotes
        // plus one escape per byte longer than the key it carries.
        if value.len() > max_len.saturating_mul(2).saturating_add(2) {
            return Err(KeyError::TooLong { len: value.len(), max: max_len });
        }
        let key = match value.first() {
            None => return Err(KeyError::Empty),
            Some(b'"') => unquote(value)?,
            Some(_) => {
                check_visible(value, 0)?;
                value.to_vec()
            }
        };
        if key.is_empty() {
            return Err(KeyError::Empty);
        }
        if key.len() > max_len {
            return Err(KeyError::TooLong { len: key.len(), max: max_len });
        }
        // Every byte was checked to be visible ASCII, so this cannot fail; map it anyway
        // rather than unwrap.
        String::from_utf8(key).map(Self).map_err(|_| KeyError::MalformedString)
    }

    /// Rebuilds a key from the unquoted form a store kept (a text column, a hash field).
    /// `None` when `stored` is not a key (empty, a byte outside visible ASCII): the store
    /// reports that record as corrupt. No length limit applies: the key was checked
    /// against the limit in force when it was first parsed.
    #[must_use]
    pub fn from_stored(stored: &str) -> Option<Self> {
        let bytes = stored.as_bytes();
        // The same byte rule as `parse`, without the sf-string unquoting: a stored key may
        // itself start with `"`.
        (!bytes.is_empty() && check_visible(bytes, 0).is_ok()).then(|| Self(stored.to_owned()))
    }

    /// The key as a string (visible ASCII).
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The key's bytes.
    #[must_use]
    pub fn as_bytes(&self) -> &[u8] {
        self.0.as_bytes()
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("IdempotencyKey").field(&self.0).finish()
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::str::FromStr for IdempotencyKey {
    type Err = KeyError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s.as_bytes())
    }
}

#[cfg(feature = "arbitrary")]
impl<'a> arbitrary::Arbitrary<'a> for IdempotencyKey {
    fn arbitrary(u: &mut arbitrary::Unstructured<'a>) -> arbitrary::Result<Self> {
        let len = u.int_in_range(1..=64usize)?;
        let mut s = String::with_capacity(len);
        for _ in 0..len {
            s.push(char::from(u.int_in_range(0x21u8..=0x7e)?));
        }
        Ok(Self(s))
    }
}

fn trim_ows(mut v: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = v {
        v = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = v {
        v = rest;
    }
    v
}

fn check_visible(v: &[u8], base: usize) -> Result<(), KeyError> {
    match v.iter().position(|b| !(0x21..=0x7e).contains(b)) {
        Some(i) => Err(KeyError::InvalidByte { byte: v[i], offset: base + i }),
        None => Ok(()),
    }
}

/// RFC 8941 §4.2.5 string parsing, then the key rule (visible ASCII: no spaces).
fn unquote(v: &[u8]) -> Result<Vec<u8>, KeyError> {
    let [b'"', inner @ .., b'"'] = v else {
        return Err(KeyError::MalformedString);
    };
    let mut out = Vec::with_capacity(inner.len());
    let mut i = 0;
    while i < inner.len() {
        let b = inner[i];
        match b {
            b'\\' => {
                match inner.get(i + 1) {
                    Some(&e @ (b'"' | b'\\')) => out.push(e),
                    _ => return Err(KeyError::MalformedString),
                }
                i += 2;
            }
            // An unescaped quote inside means trailing garbage after the string ends.
            b'"' => return Err(KeyError::MalformedString),
            0x21..=0x7e => {
                out.push(b);
                i += 1;
            }
            _ => return Err(KeyError::InvalidByte { byte: b, offset: i + 1 }),
        }
    }
    Ok(out)
}
