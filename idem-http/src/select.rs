//! Where a request's key comes from ([`KeySource`]) and what of its body the fingerprint
//! covers ([`FingerprintBody`]): `docs/contract.md#where-the-key-comes-from`.

use std::sync::Arc;

use http::HeaderName;
use http::request::Parts;

use crate::headers::IDEMPOTENCY_KEY;

use crate::config::Callback;

type KeyFn = dyn Fn(&Parts, &[u8]) -> Option<String> + Send + Sync;
type BodyFn = dyn Fn(&Parts, &[u8]) -> Vec<u8> + Send + Sync;

/// Where the layer reads a request's idempotency key (default: the `Idempotency-Key`
/// header field).
///
/// Whatever the source, the key follows the header's rules (`docs/contract.md#idempotency-key`:
/// visible ASCII, the layer's length limit, an sf-string unquoted) and then the layer's key
/// rule, and no key at all is answered per [`crate::KeyRequirement`]. Only the configured
/// source is read: under a body source an `Idempotency-Key` header is ignored.
#[derive(Clone, Debug)]
pub struct KeySource(Source);

#[derive(Clone, Debug)]
enum Source {
    Header(HeaderName),
    JsonPointer(String),
    Custom(Callback<KeyFn>),
}

impl Default for KeySource {
    fn default() -> Self {
        Self(Source::Header(IDEMPOTENCY_KEY))
    }
}

impl KeySource {
    /// Another header field (`X-Request-Id`, `Nats-Msg-Id`); two fields of it are refused,
    /// as two `Idempotency-Key` fields are.
    #[must_use]
    pub fn header(name: HeaderName) -> Self {
        Self(Source::Header(name))
    }

    /// A field of a JSON request body, by JSON Pointer (RFC 6901): `/request_id`, or a
    /// GraphQL argument, `/variables/input/clientMutationId`. The field must hold a string
    /// or an integer; a body that is not JSON, or has no such field, has no key. The body
    /// is read (up to the layer's body limit) before the key, so a request over the limit
    /// gets 413 even without a key.
    #[must_use]
    pub fn json_field(pointer: impl Into<String>) -> Self {
        Self(Source::JsonPointer(pointer.into()))
    }

    /// A function of the request's head and whole body; `None` is no key.
    #[must_use]
    pub fn from_fn(f: impl Fn(&Parts, &[u8]) -> Option<String> + Send + Sync + 'static) -> Self {
        Self(Source::Custom(Callback(Arc::new(f))))
    }

    /// The header this source reads, or `None` when it needs the body.
    pub(crate) fn header_name(&self) -> Option<&HeaderName> {
        match &self.0 {
            Source::Header(name) => Some(name),
            _ => None,
        }
    }

    /// The key's raw value read from the body source, if any (a header source reads none).
    pub(crate) fn read_body(&self, parts: &Parts, body: &[u8]) -> Option<Vec<u8>> {
        match &self.0 {
            Source::Header(_) => None,
            Source::Custom(f) => (f.0)(parts, body).map(String::into_bytes),
            Source::JsonPointer(pointer) => {
                let value: serde_json::Value = serde_json::from_slice(body).ok()?;
                match value.pointer(pointer)? {
                    serde_json::Value::String(s) => Some(s.clone().into_bytes()),
                    serde_json::Value::Number(n) if n.is_i64() || n.is_u64() => Some(n.to_string().into_bytes()),
                    _ => None,
                }
            }
        }
    }

    /// Where the key was looked for, for the missing-key problem's detail; `None` for the
    /// default, which has its own.
    pub(crate) fn describe(&self) -> Option<String> {
        match &self.0 {
            Source::Header(name) if *name == IDEMPOTENCY_KEY => None,
            Source::Header(name) => Some(format!("a {name} header")),
            Source::JsonPointer(pointer) => Some(format!("the JSON body field {pointer}")),
            Source::Custom(_) => Some("an idempotency key".to_owned()),
        }
    }
}

/// What of the request body enters the fingerprint (default: the whole body, as
/// [`idem_core::FingerprintMode`] says). The method, path, query and fingerprinted header
/// fields always enter it; a retry that differs in what is left out replays the first
/// response, so leave out only what cannot change the operation (a timestamp, a trace id).
#[derive(Clone, Debug, Default)]
pub struct FingerprintBody(Option<Callback<BodyFn>>);

impl FingerprintBody {
    /// The bytes a function of the request's head and whole body returns, in place of
    /// the body.
    #[must_use]
    pub fn from_fn(f: impl Fn(&Parts, &[u8]) -> Vec<u8> + Send + Sync + 'static) -> Self {
        Self(Some(Callback(Arc::new(f))))
    }

    /// Only these fields of a JSON body, by JSON Pointer (RFC 6901), each with its
    /// pointer (a missing field is `null`), in canonical JSON (RFC 8785): key order and
    /// whitespace do not count. A body that is not JSON enters whole.
    #[cfg(feature = "canonical-json")]
    #[must_use]
    pub fn json_fields<I: IntoIterator<Item = S>, S: Into<String>>(pointers: I) -> Self {
        let pointers: Vec<String> = pointers.into_iter().map(Into::into).collect();
        Self::json(move |value| {
            let picked = pointers.iter().map(|p| (p.clone(), value.pointer(p).cloned().unwrap_or_default()));
            serde_json::Value::Object(picked.collect())
        })
    }

    /// A JSON body without these object members (JSON Pointers, RFC 6901), in canonical
    /// JSON (RFC 8785). A body that is not JSON enters whole.
    #[cfg(feature = "canonical-json")]
    #[must_use]
    pub fn json_without<I: IntoIterator<Item = S>, S: Into<String>>(pointers: I) -> Self {
        let pointers: Vec<String> = pointers.into_iter().map(Into::into).collect();
        Self::json(move |mut value| {
            for pointer in &pointers {
                let Some((parent, last)) = pointer.rsplit_once('/') else { continue };
                let last = last.replace("~1", "/").replace("~0", "~");
                if let Some(serde_json::Value::Object(map)) = value.pointer_mut(parent) {
                    map.remove(&last);
                }
            }
            value
        })
    }

    #[cfg(feature = "canonical-json")]
    fn json(select: impl Fn(serde_json::Value) -> serde_json::Value + Send + Sync + 'static) -> Self {
        Self::from_fn(move |_, body| {
            let selected = serde_json::from_slice(body).ok().map(&select);
            let canonical =
                selected.and_then(|v| idem_core::fingerprint::canonical_json(&serde_json::to_vec(&v).ok()?));
            canonical.unwrap_or_else(|| body.to_vec())
        })
    }

    /// The bytes that enter the fingerprint as the body: `None` for the body as it came.
    pub(crate) fn select(&self, parts: &Parts, body: &[u8]) -> Option<Vec<u8>> {
        self.0.as_ref().map(|f| (f.0)(parts, body))
    }
}
