//! Who a request runs as: the first half of a record's scope.
//!
//! A key only means something inside its scope = (principal, endpoint): the same key sent
//! by two principals names two records, so one tenant can neither read another's stored
//! response nor block its key. The layer asks a [`PrincipalResolver`] for the principal of
//! every keyed request. A request without one is never put in a shared bucket: the layer
//! rejects it with 401 or skips idempotency for it, as chosen with
//! [`crate::MissingPrincipal`].
//!
//! Resolvers are synchronous and read only the request head. Authentication usually runs
//! earlier (a tower layer or an axum extractor middleware that validates the token); it can
//! leave the identity in the request extensions for a closure resolver to read:
//!
//! ```
//! use idem_http::{IdempotencyLayer, PrincipalResolver};
//! # #[derive(Clone)] struct Account(String);
//! let resolver = |req: &http::request::Parts| req.extensions.get::<Account>().map(|a| a.0.clone());
//! # let store: std::sync::Arc<dyn idem_core::Store> = std::sync::Arc::new(idem_core::MemoryStore::new());
//! let layer = IdempotencyLayer::new(store).with_principal_resolver(resolver);
//! ```

use std::sync::OnceLock;

use blake3::hazmat::HasherExt;
use http::request::Parts;
use http::{HeaderValue, header};

/// Finds the principal of a request.
///
/// Returning `None` means "no identity"; see [`crate::MissingPrincipal`] for what the
/// layer then does. A blank principal (empty or whitespace only, refused by
/// [`idem_core::Principal::new`]) is answered 401 in every configuration, because every
/// request that resolves to it would otherwise share one scope. The layer calls `resolve`
/// exactly once per keyed request and uses that one answer everywhere (record id, claim,
/// handler context), so a resolver cannot give one request two principals. Implemented
/// for closures `Fn(&http::request::Parts) -> Option<String>`.
pub trait PrincipalResolver: Send + Sync + 'static {
    /// The principal `request` runs as, or `None`.
    fn resolve(&self, request: &Parts) -> Option<String>;

    /// The `WWW-Authenticate` challenge sent with the layer's 401 (RFC 9110 §11.6.1 says a
    /// 401 carries one). Default `None`: closures do not know the scheme, and the app's own
    /// authentication normally answers unauthenticated requests before this layer does.
    fn challenge(&self) -> Option<HeaderValue> {
        None
    }
}

/// Shows only that it is a resolver: a closure has nothing else to show.
impl std::fmt::Debug for dyn PrincipalResolver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PrincipalResolver")
    }
}

impl<F> PrincipalResolver for F
where
    F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
{
    fn resolve(&self, request: &Parts) -> Option<String> {
        self(request)
    }
}

/// BLAKE3 `derive_key` context for [`BearerToken`] principals.
const BEARER_CONTEXT: &str = "idem-http 2026-11-30 bearer principal v1";

/// The principal is the bearer token of `Authorization: Bearer <token>` (RFC 6750 §2.1),
/// stored as `bearer:` plus the hex BLAKE3 hash of the token, never the token itself, so a
/// leaked store does not leak credentials.
///
/// The layer's default resolver. The scheme name is matched case-insensitively (RFC 9110
/// §11.1). No `Authorization` field, another scheme, an empty token, or more than one
/// `Authorization` field resolve to no principal. Each token is its own principal: when
/// several tokens act for one account and should share records, resolve the account
/// instead with a closure.
///
/// This resolver does not check that the token is valid; authentication is the job of
/// whatever runs before the handler.
#[derive(Clone, Copy, Debug, Default)]
pub struct BearerToken;

impl BearerToken {
    /// The principal string for `token`: `bearer:<64 hex>`.
    #[must_use]
    pub fn principal_for(token: &[u8]) -> String {
        // Every keyed request resolves its principal: the context's key is derived once
        // per process (`blake3::derive_key` would hash the context string each time).
        static CONTEXT_KEY: OnceLock<blake3::hazmat::ContextKey> = OnceLock::new();
        let context_key = CONTEXT_KEY.get_or_init(|| blake3::hazmat::hash_derive_key_context(BEARER_CONTEXT));
        let mut hasher = blake3::Hasher::new_from_context_key(context_key);
        hasher.update(token);
        let mut out = *b"bearer:0000000000000000000000000000000000000000000000000000000000000000";
        for (pair, b) in out[7..].chunks_exact_mut(2).zip(hasher.finalize().as_bytes()) {
            pair[0] = b"0123456789abcdef"[usize::from(b >> 4)];
            pair[1] = b"0123456789abcdef"[usize::from(b & 0xf)];
        }
        // `bearer:` and hex digits are ASCII.
        String::from_utf8(out.to_vec()).unwrap_or_default()
    }
}

impl PrincipalResolver for BearerToken {
    fn resolve(&self, request: &Parts) -> Option<String> {
        let mut values = request.headers.get_all(header::AUTHORIZATION).iter();
        let value = values.next()?;
        if values.next().is_some() {
            return None;
        }
        let value = value.as_bytes();
        let scheme_len = b"bearer ".len();
        if value.len() <= scheme_len || !value[..scheme_len].eq_ignore_ascii_case(b"bearer ") {
            return None;
        }
        let token = value[scheme_len..].trim_ascii();
        if token.is_empty() {
            return None;
        }
        Some(Self::principal_for(token))
    }

    /// `Bearer` (RFC 6750 §3).
    fn challenge(&self) -> Option<HeaderValue> {
        Some(HeaderValue::from_static("Bearer"))
    }
}
