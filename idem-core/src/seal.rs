//! Sealed responses: stored status, headers and body encrypted and authenticated with an
//! application key, so a reader of the store (a backup, a replica, `MONITOR` output, a
//! service that shares the Redis) learns nothing of them and a writer cannot alter them
//! or move them to another record without the replay failing.
//!
//! [`Sealing`] is what a store wrapper does with it: [`Sealing::seal`] a response before
//! `complete`, [`Sealing::open`] every record a call returns (`claim`, `reclaim`,
//! `complete`, `fail`, `extend`, `get`). The HTTP layer's own store wrapper does so
//! (`IdempotencyLayer::with_sealing`). Backends store the sealed form like any other
//! response, so sealing works on every backend, including custom ones, without a schema
//! change.
//!
//! # The sealed form
//! A sealed response is itself a [`StoredResponse`], so every backend's codec keeps it:
//! - status `0` (no HTTP response has it, so a sealed response never passes for a plain
//!   one);
//! - one header, [`SEALED_HEADER`], whose value is `v1;<key id>` (ASCII decimal);
//! - an `Identity` body: a 24-byte random nonce (from the operating system), then the
//!   XChaCha20-Poly1305 ciphertext of [`crate::codec::encode_response`] of the real
//!   response, trailers included (16-byte tag included);
//! - no trailers.
//!
//! XChaCha20-Poly1305 is built as draft-irtf-cfrg-xchacha-03 §2.3 defines it: HChaCha20
//! (the `chacha20` crate) derives a subkey from the key and the nonce's first 16 bytes, and
//! ring's ChaCha20-Poly1305 (RFC 8439) seals under it with the nonce's last 8 bytes. The
//! bytes are the same as RustCrypto's `XChaCha20Poly1305` (tested both ways); ring does
//! the sealing in assembly (BENCHMARKS.md, "Sealed responses"). A 24-byte random nonce
//! never needs a counter: collisions stay negligible past 2^64 responses per key.
//!
//! The associated data binds the ciphertext to where it belongs: the format tag
//! `idem-seal/v1`, the 32-byte record id, the record's fencing token (8 bytes, big
//! endian) and the key id (4 bytes, big endian). A sealed response copied onto another
//! record (another id), onto a later claim of the same record (another token), or with any
//! byte changed fails to open. Compression happens before sealing (ciphertext does not
//! compress), so sealing adds 24 + 16 bytes and one short header per response.
//!
//! The record's other fields (scope, key, fingerprint, state, token, times) stay readable:
//! the decision table needs them before any response is opened, and the ops CLI shows
//! them. Journal entries (steps, intents) are not sealed.
//!
//! # What a reader sees when a response does not open
//! [`StoreError::Corrupt`] with [`CodecError::BadField`] on field `response`, exactly as for a
//! record whose bytes do not decode: the HTTP layer answers 503 with `x-should-retry:
//! false` and never runs the handler again (the record may stand for a completed
//! operation). Causes: the bytes were altered or moved, the key id is no longer in
//! [`SealingKeys`] (a removed key), or an unsealed response was found while
//! [`Sealing::accept_unsealed`] is off.
//!
//! # Unsealed records and key rotation
//! Why a plain response is refused unless [`Sealing::accept_unsealed`] (a downgrade), and
//! how to rotate [`SealingKeys`]: `docs/contract.md#sealed-responses`.

use std::fmt;
use std::sync::Arc;

use chacha20::cipher::consts::U10;
use ring::aead::{Aad, CHACHA20_POLY1305, LessSafeKey, Nonce, UnboundKey};
use ring::rand::{SecureRandom, SystemRandom};

use crate::codec::{decode_response_reusing, encode_response_into};
use crate::corrupt::CodecError;
use crate::record::{FencingToken, Record, StoredBody, StoredResponse};
use crate::scope::RecordId;
use crate::store::StoreError;

/// The one header of a sealed response: `v1;<key id>`.
pub const SEALED_HEADER: &str = "idem-sealed";

/// The status a sealed response is stored with: never a real HTTP status.
pub const SEALED_STATUS: u16 = 0;

/// Bytes of the random nonce in front of the ciphertext.
pub const NONCE_LEN: usize = 24;

/// Bytes of the authentication tag at the end of the ciphertext.
pub const TAG_LEN: usize = 16;

/// Format tag at the start of the associated data.
const FORMAT_TAG: &[u8] = b"idem-seal/v1";

/// Bytes of associated data: format tag, record id, token, key id.
const AAD_LEN: usize = FORMAT_TAG.len() + 32 + 8 + 4;

/// The application's sealing keys: 32-byte XChaCha20-Poly1305 keys by id. The highest id
/// seals; all open.
///
/// `Debug` prints the key ids only, never key bytes.
///
/// ```
/// use idem_core::seal::SealingKeys;
/// let keys = SealingKeys::new(1, [7; 32]).with_key(2, [9; 32]);
/// assert_eq!(format!("{keys:?}"), "SealingKeys { ids: [1, 2], seals_with: 2 }");
/// ```
#[derive(Clone)]
pub struct SealingKeys {
    /// Sorted by id, ids unique. Shared: the layer hands every request's context a clone.
    keys: Arc<Vec<(u32, [u8; 32])>>,
    /// The operating system's generator (`getrandom`), read once per seal: a user-space
    /// generator would be faster but repeats its output in both halves of a `fork`, and a
    /// repeated nonce under one key breaks XChaCha20-Poly1305.
    rng: SystemRandom,
}

impl SealingKeys {
    /// One key, id `id`. Keep keys in a secret store, never in source; 32 random bytes
    /// (e.g. `openssl rand 32`).
    #[must_use]
    pub fn new(id: u32, key: [u8; 32]) -> Self {
        Self { keys: Arc::new(Vec::new()), rng: SystemRandom::new() }.with_key(id, key)
    }

    /// Adds a key (replacing one with the same id). A key with a higher id than every
    /// other becomes the sealing key.
    #[must_use]
    pub fn with_key(mut self, id: u32, key: [u8; 32]) -> Self {
        let keys = Arc::make_mut(&mut self.keys);
        match keys.binary_search_by_key(&id, |(i, _)| *i) {
            Ok(at) => keys[at].1 = key,
            Err(at) => keys.insert(at, (id, key)),
        }
        self
    }

    /// The id of the key that seals new responses: the highest.
    fn sealing_key_id(&self) -> u32 {
        self.keys.last().map_or(0, |(id, _)| *id)
    }

    fn key(&self, id: u32) -> Option<&[u8; 32]> {
        self.keys.binary_search_by_key(&id, |(i, _)| *i).ok().map(|at| &self.keys[at].1)
    }

    /// Seals `response` for record `id` at `token` with the sealing key.
    ///
    /// # Panics
    /// Only if the operating system's random generator fails, which `getrandom` reports
    /// for a kernel without it: sealing with a guessed nonce would be worse than stopping.
    fn seal(&self, id: RecordId, token: FencingToken, response: &StoredResponse) -> StoredResponse {
        // `keys` is never empty: the only constructor adds one.
        let (key_id, key) = self.keys.last().map(|(i, k)| (*i, k)).expect("SealingKeys holds at least one key");
        // One buffer for the whole sealed body: nonce, then the encoded response encrypted
        // in place, then the tag (no copy of the plaintext or the ciphertext).
        let mut body = Vec::with_capacity(NONCE_LEN + encoded_len_hint(response) + TAG_LEN);
        body.resize(NONCE_LEN, 0);
        let mut body = encode_response_into(response, body);
        self.rng.fill(&mut body[..NONCE_LEN]).expect("the operating system's random generator works");
        let nonce: [u8; NONCE_LEN] = body[..NONCE_LEN].try_into().expect("NONCE_LEN bytes");
        let tag = xchacha_key(key, &nonce)
            .seal_in_place_separate_tag(
                ietf_nonce(&nonce),
                Aad::from(associated_data(id, token, key_id)),
                &mut body[NONCE_LEN..],
            )
            // ring refuses only messages longer than ChaCha20's 256 GiB counter space; a
            // stored response is bounded by the layer's `max_stored_body`, far below.
            .expect("a stored response fits the AEAD");
        body.extend_from_slice(tag.as_ref());
        StoredResponse {
            status: SEALED_STATUS,
            headers: vec![(SEALED_HEADER.to_owned(), format!("v1;{key_id}").into_bytes())],
            body: StoredBody::Identity(body),
            trailers: Vec::new(),
        }
    }

    /// Opens a sealed response of record `id` at `token`, decrypting the body in place
    /// (no copy). [`Unsealed::Plain`] when `stored` is not sealed; [`Unsealed::Broken`]
    /// when it is sealed but does not open (altered, moved, unknown key id, malformed).
    fn open(&self, id: RecordId, token: FencingToken, stored: StoredResponse) -> Result<StoredResponse, Unsealed> {
        let key_id = sealed_key_id(&stored)?.ok_or(Unsealed::Plain)?;
        let key = self.key(key_id).ok_or(Unsealed::Broken("sealed by a key id that is not configured"))?;
        // Trailers belong inside the seal; ones outside it were added by someone else.
        let (StoredBody::Identity(mut body), true) = (stored.body, stored.trailers.is_empty()) else {
            return Err(Unsealed::Broken("a sealed body is not stored as is"));
        };
        if body.len() < NONCE_LEN + TAG_LEN {
            return Err(Unsealed::Broken("a sealed body is shorter than nonce and tag"));
        }
        let (nonce, sealed) = body.split_at_mut(NONCE_LEN);
        let Ok(nonce) = <[u8; NONCE_LEN]>::try_from(&*nonce) else {
            return Err(Unsealed::Broken("a sealed body is shorter than nonce and tag"));
        };
        let plain_len = xchacha_key(key, &nonce)
            .open_in_place(ietf_nonce(&nonce), Aad::from(associated_data(id, token, key_id)), sealed)
            .map_err(|_| Unsealed::Broken("does not authenticate for this record, token and key"))?
            .len();
        // The opened body becomes the response's body buffer: no copy of it.
        decode_response_reusing(body, NONCE_LEN..NONCE_LEN + plain_len)
            .map_err(|_| Unsealed::Broken("opens but does not decode"))
    }
}

/// Bytes the encoded response is likely to need: body, header and trailer bytes plus a
/// little for lengths and the status. A guess only: the buffer grows if it is short.
fn encoded_len_hint(response: &StoredResponse) -> usize {
    let fields = |f: &[(String, Vec<u8>)]| f.iter().map(|(n, v)| n.len() + v.len() + 4).sum::<usize>();
    let body = match &response.body {
        StoredBody::Identity(b) | StoredBody::Lz4 { data: b, .. } => b.len(),
        StoredBody::NotRetained { .. } => 0,
    };
    16 + body + fields(&response.headers) + fields(&response.trailers)
}

/// The XChaCha20-Poly1305 construction (draft-irtf-cfrg-xchacha-03 §2.3): HChaCha20 of
/// the key and the nonce's first 16 bytes is the subkey of an IETF ChaCha20-Poly1305
/// (RFC 8439) whose 12-byte nonce is four zero bytes and the nonce's last 8. The bytes
/// are those of `chacha20poly1305::XChaCha20Poly1305` (a test compares them); ring does
/// the ChaCha20-Poly1305 with its assembly.
fn xchacha_key(key: &[u8; 32], nonce: &[u8; NONCE_LEN]) -> LessSafeKey {
    let subkey = chacha20::hchacha::<U10>(key.into(), nonce[..16].into());
    // ring refuses only a key of the wrong length; HChaCha20 gives 32 bytes.
    LessSafeKey::new(UnboundKey::new(&CHACHA20_POLY1305, &subkey).expect("a 32-byte ChaCha20 key"))
}

fn ietf_nonce(nonce: &[u8; NONCE_LEN]) -> Nonce {
    let mut ietf = [0; 12];
    ietf[4..].copy_from_slice(&nonce[16..]);
    // Unique per key: the subkey is fresh for every random 16-byte prefix.
    Nonce::assume_unique_for_key(ietf)
}

impl fmt::Debug for SealingKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ids: Vec<u32> = self.keys.iter().map(|(id, _)| *id).collect();
        f.debug_struct("SealingKeys").field("ids", &ids).field("seals_with", &self.sealing_key_id()).finish()
    }
}

/// Why a stored response was not opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
enum Unsealed {
    /// The response is not sealed (written without sealing).
    #[error("the stored response is not sealed")]
    Plain,
    /// The response is sealed but does not open.
    #[error("the sealed response {0}")]
    Broken(&'static str),
}

/// `Some(key id)` when `stored` is in the sealed form, `None` when it is plain.
fn sealed_key_id(stored: &StoredResponse) -> Result<Option<u32>, Unsealed> {
    let marked = stored.headers.iter().any(|(n, _)| n == SEALED_HEADER);
    if stored.status != SEALED_STATUS && !marked {
        return Ok(None);
    }
    // Half a seal (status 0 without the header, or the header on a real status) is
    // something no writer of ours leaves: refuse it rather than replay it.
    let [(name, value)] = stored.headers.as_slice() else {
        return Err(Unsealed::Broken("has the wrong headers"));
    };
    if stored.status != SEALED_STATUS || name != SEALED_HEADER {
        return Err(Unsealed::Broken("is only half sealed"));
    }
    let id = value
        .strip_prefix(b"v1;")
        .and_then(|d| std::str::from_utf8(d).ok())
        .filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|d| d.parse::<u32>().ok())
        .ok_or(Unsealed::Broken("has an unknown version or key id"))?;
    Ok(Some(id))
}

fn associated_data(id: RecordId, token: FencingToken, key_id: u32) -> [u8; AAD_LEN] {
    let mut aad = [0; AAD_LEN];
    let (tag, rest) = aad.split_at_mut(FORMAT_TAG.len());
    tag.copy_from_slice(FORMAT_TAG);
    rest[..32].copy_from_slice(id.as_bytes());
    rest[32..40].copy_from_slice(&token.0.to_be_bytes());
    rest[40..].copy_from_slice(&key_id.to_be_bytes());
    aad
}

/// Sealing as one setting: the keys, and whether plain responses stored before sealing
/// was turned on are still replayed. What a store wrapper needs: [`Self::seal`] a
/// response before `complete`, [`Self::open`] every record a call returns.
///
/// ```
/// use idem_core::seal::{Sealing, SealingKeys};
/// use idem_core::{FencingToken, RecordId, StoredResponse};
///
/// let sealing = Sealing::new(SealingKeys::new(1, [42; 32]));
/// let secret = StoredResponse::new(201, vec![], b"bootstrap-token".to_vec());
/// let sealed = sealing.seal(RecordId::from_bytes([7; 32]), FencingToken(1), &secret);
/// assert_eq!(sealed.status, 0, "a reader of the store sees no status, header or body");
/// ```
#[derive(Clone, Debug)]
pub struct Sealing {
    keys: SealingKeys,
    accept_unsealed: bool,
}

impl Sealing {
    /// Seals with `keys`; refuses unsealed responses.
    #[must_use]
    pub fn new(keys: SealingKeys) -> Self {
        Self { keys, accept_unsealed: false }
    }

    /// Whether a plain (unsealed) stored response is replayed as is (`true`, for the
    /// migration window after turning sealing on) or refused as corrupt (`false`, the
    /// default; why: `docs/contract.md#sealed-responses`).
    #[must_use]
    pub fn accept_unsealed(mut self, accept: bool) -> Self {
        self.accept_unsealed = accept;
        self
    }

    /// `response` sealed for record `id` at `token` with the newest key.
    ///
    /// # Panics
    /// Only if the operating system's random generator fails, which `getrandom` reports
    /// for a kernel without it: sealing with a guessed nonce would be worse than stopping.
    #[must_use]
    pub fn seal(&self, id: RecordId, token: FencingToken, response: &StoredResponse) -> StoredResponse {
        self.keys.seal(id, token, response)
    }

    /// `record` with its response opened.
    ///
    /// # Errors
    /// [`StoreError::Corrupt`] (field `response`) when the response does not open, or is
    /// plain while unsealed responses are refused.
    pub fn open(&self, mut record: Record) -> Result<Record, StoreError> {
        let Some(stored) = record.response.take() else {
            return Ok(record);
        };
        if self.accept_unsealed && matches!(sealed_key_id(&stored), Ok(None)) {
            record.response = Some(stored);
            return Ok(record);
        }
        match self.keys.open(record.id, record.token, stored) {
            Ok(plain) => record.response = Some(plain),
            Err(why) => {
                return Err(StoreError::Corrupt {
                    id: Some(record.id),
                    source: CodecError::BadField { field: "response", reason: why.to_string() },
                });
            }
        }
        Ok(record)
    }
}

#[cfg(test)]
mod tests {
    //! The rest of sealing is tested through the public API in `tests/it/seal.rs`.
    use super::*;

    /// Sealed before version 2: the plaintext is a version-1 response with its trailers
    /// in the body. It opens into the current shape.
    #[test]
    fn a_response_sealed_by_version_1_opens_into_the_current_shape() {
        use crate::codec::tests::{V1_GRPC, v1_grpc_decoded};
        use chacha20poly1305::aead::{Aead, KeyInit, Payload};
        let (key, nonce, id) = ([0x42; 32], [7u8; NONCE_LEN], RecordId::from_bytes([2; 32]));
        let reference = chacha20poly1305::XChaCha20Poly1305::new(&key.into());
        let payload = Payload { msg: V1_GRPC, aad: &associated_data(id, FencingToken(2), 3) };
        let ct = reference.encrypt(chacha20poly1305::XNonce::from_slice(&nonce), payload).expect("seals");
        let old = StoredResponse::new(
            SEALED_STATUS,
            vec![(SEALED_HEADER.into(), b"v1;3".to_vec())],
            [&nonce[..], &ct].concat(),
        );
        assert_eq!(SealingKeys::new(3, key).open(id, FencingToken(2), old), Ok(v1_grpc_decoded()));
    }
}
