//! Scope and record id.
//!
//! A key is only meaningful inside its scope = (principal, endpoint). The record id is a
//! fixed-length BLAKE3 `derive_key` hash over the length-prefixed principal, endpoint and
//! key, so that:
//! - the same key under another principal or endpoint is another record (tenants never see
//!   each other's records: `docs/failures.md#key-shared-across-endpoints`,
//!   `docs/failures.md#key-shared-across-principals`);
//! - no split of the same bytes between fields collides: `("ab","c")` and `("a","bc")`
//!   hash different length prefixes;
//! - every backend indexes one 32-byte value whatever the key length.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::key::IdempotencyKey;

/// BLAKE3 `derive_key` context for record ids. Changing it orphans every stored record.
pub const RECORD_ID_CONTEXT: &str = "idem 2026-11-30 record id v1";

/// The authenticated identity a request runs as (an API token's subject, an account).
///
/// Any non-empty string. An empty principal is refused when building a [`Scope`]: a
/// missing identity must never become one shared bucket
/// (`docs/failures.md#key-shared-across-principals`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct Principal(pub(crate) String);

impl Principal {
    /// A principal: any string that is not blank.
    ///
    /// # Errors
    /// [`ScopeError::BlankPrincipal`] for an empty or whitespace-only string: a missing
    /// identity must never become one shared bucket.
    pub fn new(principal: impl Into<String>) -> Result<Self, ScopeError> {
        let principal = principal.into();
        if principal.trim().is_empty() {
            return Err(ScopeError::BlankPrincipal);
        }
        Ok(Self(principal))
    }

    /// The principal as given.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Method plus route template, e.g. `POST /v1/workers/{id}/reboot`; the concrete path
/// when no template is known.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct Endpoint(pub(crate) String);

impl Endpoint {
    /// `"{METHOD} {route}"`, the canonical endpoint spelling.
    #[must_use]
    pub fn new(method: &str, route: &str) -> Self {
        // Every keyed request makes one: built by hand, without the formatting machinery.
        let mut endpoint = String::with_capacity(method.len() + 1 + route.len());
        endpoint.push_str(method);
        endpoint.push(' ');
        endpoint.push_str(route);
        Self(endpoint)
    }

    /// The endpoint as stored, e.g. `POST /v1/workers`.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// An endpoint spelled out in full (`"{METHOD} {route}"`), e.g. read back from a store.
impl From<String> for Endpoint {
    fn from(endpoint: String) -> Self {
        Self(endpoint)
    }
}

/// An endpoint spelled out in full (`"{METHOD} {route}"`).
impl From<&str> for Endpoint {
    fn from(endpoint: &str) -> Self {
        Self(endpoint.to_owned())
    }
}

/// (principal, endpoint): the namespace a key lives in.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct Scope {
    /// Who sends the request.
    pub principal: Principal,
    /// What the request targets.
    pub endpoint: Endpoint,
}

/// Why a scope cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ScopeError {
    /// The principal is empty or whitespace only.
    #[error("the principal is blank; an anonymous request cannot own idempotency records")]
    BlankPrincipal,
}

impl Scope {
    /// Builds a scope.
    ///
    /// # Errors
    /// [`ScopeError::BlankPrincipal`] for a blank principal ([`Principal::new`]).
    pub fn new(principal: impl Into<String>, endpoint: Endpoint) -> Result<Self, ScopeError> {
        Ok(Self { principal: Principal::new(principal)?, endpoint })
    }

    /// The record id of `key` in this scope.
    #[must_use]
    pub fn record_id(&self, key: &IdempotencyKey) -> RecordId {
        RecordId::derive(&self.principal.0, &self.endpoint.0, key.as_str())
    }
}

/// 32-byte record id: BLAKE3 `derive_key(RECORD_ID_CONTEXT, len‖principal‖len‖endpoint‖len‖key)`
/// with each length a little-endian u64.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct RecordId(pub(crate) [u8; 32]);

impl RecordId {
    /// Derives the id from raw parts. Prefer [`Scope::record_id`].
    #[must_use]
    pub fn derive(principal: &str, endpoint: &str, key: &str) -> Self {
        let mut h = crate::hash::Fields::new(&crate::hash::RECORD_ID_HASHER, RECORD_ID_CONTEXT);
        for part in [principal.as_bytes(), endpoint.as_bytes(), key.as_bytes()] {
            h.prefixed(part);
        }
        Self(h.finalize())
    }

    /// An id from its 32 bytes, e.g. read back from a store's key.
    #[must_use]
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The 32 bytes.
    #[must_use]
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Lower-case hex, 64 characters.
    #[must_use]
    pub fn to_hex(&self) -> String {
        to_hex(&self.0)
    }

    /// Parses 64 hex characters.
    #[must_use]
    pub fn from_hex(s: &str) -> Option<Self> {
        from_hex32(s).map(Self)
    }
}

impl fmt::Debug for RecordId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RecordId({})", &self.to_hex()[..16])
    }
}

impl fmt::Display for RecordId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

pub(crate) fn to_hex(bytes: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(char::from(HEX[usize::from(b >> 4)]));
        s.push(char::from(HEX[usize::from(b & 0xf)]));
    }
    s
}

pub(crate) fn from_hex32(s: &str) -> Option<[u8; 32]> {
    let b = s.as_bytes();
    if b.len() != 64 {
        return None;
    }
    let nib = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    };
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = (nib(b[2 * i])? << 4) | nib(b[2 * i + 1])?;
    }
    Some(out)
}
