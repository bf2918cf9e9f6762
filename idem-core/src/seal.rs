//! Sealed responses: stored status, headers and body encrypted and authenticated with an
//! application key, so a reader of the store (a backup, a replica, `MONITOR` output, a
//! service that shares the Redis) learns nothing of them and a writer cannot alter them
//! or move them to another record without the replay failing.
//!
//! [`Sealed`] wraps any [`Store`]: it seals the response in [`Store::complete`] and opens
//! it in every call that returns a record (`claim`, `reclaim`, `complete`, `fail`,
//! `extend`, `get`). Backends store the sealed form like any other response, so sealing
//! works on every backend, including custom ones, without a schema change.
//!
//! # The sealed form
//! A sealed response is itself a [`StoredResponse`], so every backend's codec keeps it:
//! - status `0` (no HTTP response has it, so a sealed response never passes for a plain
//!   one);
//! - one header, [`SEALED_HEADER`], whose value is `v1;<key id>` (ASCII decimal);
//! - an `Identity` body: a 24-byte random nonce (from the operating system), then the
//!   XChaCha20-Poly1305 ciphertext of [`crate::codec::encode_response`] of the real
//!   response (16-byte tag included).
//!
//! XChaCha20-Poly1305 is built as draft-irtf-cfrg-xchacha-03 §2.3 defines it: HChaCha20
//! (the `chacha20` crate) derives a subkey from the key and the nonce's first 16 bytes, and
//! ring's ChaCha20-Poly1305 (RFC 8439) seals under it with the nonce's last 8 bytes. The
//! bytes are the same as RustCrypto's `XChaCha20Poly1305` (tested both ways); ring's
//! assembly seals a 1 KiB response about three times faster. A 24-byte random nonce
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
//! [`Sealed::accept_unsealed`] is off.
//!
//! # Unsealed records
//! A record completed before sealing was turned on holds a plain response. By default it
//! is refused like a corrupt record: otherwise anyone who can write to the store could
//! replace a sealed response with a plain one of their choosing (a downgrade), and the
//! seal would protect nothing. During a migration, [`Sealed::accept_unsealed`] lets plain
//! responses through for one retention window; turn it off once every record written
//! before the switch has expired.
//!
//! # Key rotation
//! [`SealingKeys`] holds several 32-byte keys by id. The key with the highest id seals;
//! every key opens what it sealed. To rotate, add a key with a higher id everywhere,
//! then remove the old one once one retention window has passed (records it sealed
//! are gone by then). A record sealed by a removed key gives 503.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chacha20::cipher::consts::U10;
use ring::aead::{Aad, CHACHA20_POLY1305, LessSafeKey, Nonce, UnboundKey};
use ring::rand::{SecureRandom, SystemRandom};

#[cfg(test)]
use crate::codec::{decode_response, encode_response};
use crate::codec::{decode_response_reusing, encode_response_into};
use crate::corrupt::CodecError;
use crate::list::{ListFilter, Listing};
use crate::record::{FencingToken, Record, StoredBody, StoredResponse};
use crate::scope::RecordId;
use crate::store::{Capabilities, JournalWrite, Store, StoreError, SweepOutcome};
use crate::transition::{ClaimOutcome, ClaimRequest, ReclaimOutcome, ReclaimRequest};

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
/// assert_eq!(keys.sealing_key_id(), 2);
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
    #[must_use]
    pub fn sealing_key_id(&self) -> u32 {
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
    #[must_use]
    pub fn seal(&self, id: RecordId, token: FencingToken, response: &StoredResponse) -> StoredResponse {
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
        }
    }

    /// Opens a sealed response of record `id` at `token`.
    ///
    /// # Errors
    /// [`Unsealed::Plain`] when `stored` is not sealed; [`Unsealed::Broken`] when it is
    /// sealed but does not open (altered, moved, unknown key id, malformed).
    pub fn open(&self, id: RecordId, token: FencingToken, stored: &StoredResponse) -> Result<StoredResponse, Unsealed> {
        self.open_owned(id, token, stored.clone())
    }

    /// [`Self::open`] on an owned response: decrypts the body in place, without a copy.
    fn open_owned(
        &self,
        id: RecordId,
        token: FencingToken,
        stored: StoredResponse,
    ) -> Result<StoredResponse, Unsealed> {
        let key_id = sealed_key_id(&stored)?.ok_or(Unsealed::Plain)?;
        let key = self.key(key_id).ok_or(Unsealed::Broken("sealed by a key id that is not configured"))?;
        let StoredBody::Identity(mut body) = stored.body else {
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
    fn body_len(body: &StoredBody) -> usize {
        match body {
            StoredBody::Identity(b) | StoredBody::Lz4 { data: b, .. } => b.len(),
            StoredBody::NotRetained { .. } => 0,
            StoredBody::WithTrailers { body, trailers } => {
                body_len(body) + trailers.iter().map(|(n, v)| n.len() + v.len() + 4).sum::<usize>()
            }
        }
    }
    16 + body_len(&response.body) + response.headers.iter().map(|(n, v)| n.len() + v.len() + 4).sum::<usize>()
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
#[non_exhaustive]
pub enum Unsealed {
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
    rest[..32].copy_from_slice(&id.0);
    rest[32..40].copy_from_slice(&token.0.to_be_bytes());
    rest[40..].copy_from_slice(&key_id.to_be_bytes());
    aad
}

/// A [`Store`] whose stored responses are sealed ([module docs](self)).
///
/// ```
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// use std::time::Duration;
/// use idem_core::seal::{Sealed, SealingKeys};
/// use idem_core::{ClaimOutcome, ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, MemoryStore,
///     RequestParts, Scope, Store, StoredResponse};
///
/// let store = Sealed::new(MemoryStore::new(), SealingKeys::new(1, [42; 32]));
/// let scope = Scope::new("token:a", Endpoint::new("POST", "/v1/workers")).unwrap();
/// let fp = Fingerprint::of(&RequestParts { method: "POST", path: "/v1/workers", query: None, headers: &[], body: b"" });
/// let req = ClaimRequest::new(scope, IdempotencyKey::parse(b"k1").unwrap(), fp,
///     Duration::from_secs(60), Duration::from_secs(3600));
/// let ClaimOutcome::Claimed(r) = store.claim(req).await.unwrap() else { unreachable!() };
/// let secret = StoredResponse::new(201, vec![], b"bootstrap-token".to_vec());
/// store.complete(r.id, r.token, secret.clone()).await.unwrap();
/// // The inner store keeps only the sealed form; reads through `Sealed` open it.
/// assert_eq!(store.inner().get(r.id).await.unwrap().unwrap().response.unwrap().status, 0);
/// assert_eq!(store.get(r.id).await.unwrap().unwrap().response, Some(secret));
/// # });
/// ```
#[derive(Debug)]
pub struct Sealed<S> {
    inner: S,
    sealer: Sealer,
}

impl<S: Store> Sealed<S> {
    /// Seals every response `inner` stores with `keys`; refuses unsealed responses.
    pub fn new(inner: S, keys: SealingKeys) -> Self {
        Self { inner, sealer: Sealer::new(keys) }
    }

    /// Whether a plain (unsealed) stored response is replayed as is (`true`, for the
    /// migration window after turning sealing on) or refused as corrupt (`false`, the
    /// default; see the module docs for why).
    #[must_use]
    pub fn accept_unsealed(mut self, accept: bool) -> Self {
        self.sealer = self.sealer.accept_unsealed(accept);
        self
    }

    /// The wrapped store (which holds only sealed responses).
    pub fn inner(&self) -> &S {
        &self.inner
    }
}

/// What [`Sealed`] does to the responses that pass through it, for a store wrapper of
/// one's own: seal a response before `complete`, open every record a call returns. The
/// HTTP layer's own store wrapper (deadlines and completion retries) seals with it, so a
/// request pays no second wrapper around each store call.
#[derive(Clone, Debug)]
pub struct Sealer {
    keys: SealingKeys,
    accept_unsealed: bool,
}

impl Sealer {
    /// Seals with `keys`; refuses unsealed responses.
    #[must_use]
    pub fn new(keys: SealingKeys) -> Self {
        Self { keys, accept_unsealed: false }
    }

    /// As [`Sealed::accept_unsealed`].
    #[must_use]
    pub fn accept_unsealed(mut self, accept: bool) -> Self {
        self.accept_unsealed = accept;
        self
    }

    /// `response` sealed for record `id` at `token` ([`SealingKeys::seal`]).
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
        match self.keys.open_owned(record.id, record.token, stored) {
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

    /// [`Self::open`] of an optional record.
    ///
    /// # Errors
    /// As [`Self::open`].
    pub fn open_opt(&self, record: Option<Record>) -> Result<Option<Record>, StoreError> {
        record.map(|r| self.open(r)).transpose()
    }

    /// A claim's outcome with its record opened.
    ///
    /// # Errors
    /// As [`Self::open`].
    pub fn open_claim(&self, outcome: ClaimOutcome) -> Result<ClaimOutcome, StoreError> {
        Ok(match outcome {
            ClaimOutcome::Claimed(record) => ClaimOutcome::Claimed(self.open(record)?),
            ClaimOutcome::Existing { record, now } => ClaimOutcome::Existing { record: self.open(record)?, now },
        })
    }

    /// A reclaim's outcome with its record opened.
    ///
    /// # Errors
    /// As [`Self::open`].
    pub fn open_reclaim(&self, outcome: ReclaimOutcome) -> Result<ReclaimOutcome, StoreError> {
        Ok(match outcome {
            ReclaimOutcome::Reclaimed(record) => ReclaimOutcome::Reclaimed(self.open(record)?),
            ReclaimOutcome::Conflict { current, now } => {
                ReclaimOutcome::Conflict { current: self.open_opt(current)?, now }
            }
        })
    }
}

#[async_trait]
impl<S: Store> Store for Sealed<S> {
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        self.sealer.open_claim(self.inner.claim(req).await?)
    }

    async fn reclaim(&self, req: ReclaimRequest) -> Result<ReclaimOutcome, StoreError> {
        self.sealer.open_reclaim(self.inner.reclaim(req).await?)
    }

    async fn complete(
        &self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Record, StoreError> {
        let sealed = self.sealer.seal(id, token, &response);
        let mut record = self.inner.complete(id, token, sealed).await?;
        // The caller's own response, not a decryption of what was just written.
        record.response = Some(response);
        Ok(record)
    }

    async fn fail(&self, id: RecordId, token: FencingToken) -> Result<Record, StoreError> {
        self.sealer.open(self.inner.fail(id, token).await?)
    }

    async fn extend(&self, id: RecordId, token: FencingToken, lease_ttl: Duration) -> Result<Record, StoreError> {
        self.sealer.open(self.inner.extend(id, token, lease_ttl).await?)
    }

    async fn get(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        self.sealer.open_opt(self.inner.get(id).await?)
    }

    async fn sweep(&self, limit: usize) -> Result<SweepOutcome, StoreError> {
        self.inner.sweep(limit).await
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn journal_put(
        &self,
        id: RecordId,
        token: FencingToken,
        name: &str,
        value: Vec<u8>,
        overwrite: bool,
    ) -> Result<JournalWrite, StoreError> {
        self.inner.journal_put(id, token, name, value, overwrite).await
    }

    async fn journal_get(&self, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.inner.journal_get(id, name).await
    }

    /// Lists the records as stored: a sealed response stays sealed (status 0 and the
    /// `idem-sealed` header), so an operator's listing needs no key and one record that
    /// does not open cannot hide the others.
    async fn list(&self, filter: ListFilter) -> Result<Listing, StoreError> {
        self.inner.list(filter).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn response() -> StoredResponse {
        StoredResponse::new(201, vec![("location".into(), b"/w/1".to_vec())], b"{\"token\":\"s3cret\"}".to_vec())
    }

    const A: RecordId = RecordId([1; 32]);
    const B: RecordId = RecordId([2; 32]);

    #[test]
    fn seals_round_trip_and_hide_the_plaintext() {
        let keys = SealingKeys::new(1, [7; 32]);
        let sealed = keys.seal(A, FencingToken(5), &response());
        assert_eq!(sealed.status, SEALED_STATUS);
        assert_eq!(sealed.header(SEALED_HEADER), Some(&b"v1;1"[..]));
        let bytes = encode_response(&sealed);
        assert!(!bytes.windows(6).any(|w| w == b"s3cret"), "plaintext in the sealed bytes");
        assert!(!bytes.windows(4).any(|w| w == b"/w/1"), "a header value in the sealed bytes");
        assert_eq!(keys.open(A, FencingToken(5), &decode_response(&bytes).unwrap()), Ok(response()));
    }

    /// A sealed response moved to another record or to another claim of the same record
    /// opened (and was replayed) when the associated data did not bind id and token.
    #[test]
    fn a_moved_or_altered_seal_does_not_open() {
        let keys = SealingKeys::new(1, [7; 32]);
        let sealed = keys.seal(A, FencingToken(5), &response());
        assert!(matches!(keys.open(B, FencingToken(5), &sealed), Err(Unsealed::Broken(_))));
        assert!(matches!(keys.open(A, FencingToken(6), &sealed), Err(Unsealed::Broken(_))));
        let StoredBody::Identity(body) = &sealed.body else { unreachable!() };
        for at in [0, NONCE_LEN, body.len() - 1] {
            let mut flipped = sealed.clone();
            let StoredBody::Identity(b) = &mut flipped.body else { unreachable!() };
            b[at] ^= 1;
            assert!(matches!(keys.open(A, FencingToken(5), &flipped), Err(Unsealed::Broken(_))), "byte {at}");
        }
        // A relabelled key id is authenticated too.
        let mut relabelled = sealed.clone();
        relabelled.headers[0].1 = b"v1;2".to_vec();
        let both = keys.clone().with_key(2, [7; 32]);
        assert!(matches!(both.open(A, FencingToken(5), &relabelled), Err(Unsealed::Broken(_))));
        let mut half = sealed.clone();
        half.status = 200;
        assert!(matches!(keys.open(A, FencingToken(5), &half), Err(Unsealed::Broken(_))));
        assert_eq!(keys.open(A, FencingToken(5), &response()), Err(Unsealed::Plain));
    }

    /// The sealed bytes are XChaCha20-Poly1305's as `chacha20poly1305` computes them, both
    /// ways, so the HChaCha20 + ring construction is the standard one and a record sealed
    /// by either implementation opens with the other.
    #[test]
    fn the_construction_is_xchacha20_poly1305() {
        use chacha20poly1305::aead::{Aead, KeyInit, Payload};
        use chacha20poly1305::{XChaCha20Poly1305, XNonce};
        let key = [0x42; 32];
        let keys = SealingKeys::new(3, key);
        let reference = XChaCha20Poly1305::new(&key.into());
        for len in [0usize, 1, 63, 64, 65, 1024, 4099] {
            let r = StoredResponse::new(200, vec![("etag".into(), b"x".to_vec())], (0..len).map(|i| i as u8).collect());
            let sealed = keys.seal(A, FencingToken(9), &r);
            let StoredBody::Identity(body) = &sealed.body else { unreachable!() };
            let (nonce, ct) = body.split_at(NONCE_LEN);
            let aad = associated_data(A, FencingToken(9), 3);
            let plain = reference.decrypt(XNonce::from_slice(nonce), Payload { msg: ct, aad: &aad }).expect("opens");
            assert_eq!(plain, encode_response(&r), "len {len}");
            let again = reference.encrypt(XNonce::from_slice(nonce), Payload { msg: &plain, aad: &aad }).unwrap();
            assert_eq!(again, ct, "len {len}");
        }
        // And the other way: a response sealed by the reference opens here.
        let r = response();
        let nonce = [7u8; NONCE_LEN];
        let aad = associated_data(B, FencingToken(2), 3);
        let ct =
            reference.encrypt(XNonce::from_slice(&nonce), Payload { msg: &encode_response(&r), aad: &aad }).unwrap();
        let sealed = StoredResponse {
            status: SEALED_STATUS,
            headers: vec![(SEALED_HEADER.into(), b"v1;3".to_vec())],
            body: StoredBody::Identity([&nonce[..], &ct].concat()),
        };
        assert_eq!(keys.open(B, FencingToken(2), &sealed), Ok(r));
    }

    #[test]
    fn two_seals_of_one_response_differ() {
        let keys = SealingKeys::new(1, [7; 32]);
        assert_ne!(keys.seal(A, FencingToken(1), &response()), keys.seal(A, FencingToken(1), &response()));
    }

    #[test]
    fn the_highest_key_seals_every_configured_key_opens_a_removed_one_does_not() {
        let old = SealingKeys::new(1, [1; 32]);
        let by_old = old.seal(A, FencingToken(1), &response());
        let rotated = SealingKeys::new(1, [1; 32]).with_key(2, [2; 32]);
        let by_new = rotated.seal(A, FencingToken(1), &response());
        assert_eq!(by_new.header(SEALED_HEADER), Some(&b"v1;2"[..]));
        assert_eq!(rotated.open(A, FencingToken(1), &by_old), Ok(response()));
        let removed = SealingKeys::new(2, [2; 32]);
        assert_eq!(removed.open(A, FencingToken(1), &by_new), Ok(response()));
        assert!(matches!(removed.open(A, FencingToken(1), &by_old), Err(Unsealed::Broken(_))));
    }

    // Pins: the sealing wrapper fell back to the trait's default `list` (Unsupported), so
    // the ops CLI could not list a sealed store.
    #[tokio::test]
    async fn list_reaches_the_inner_store() {
        let sealed = Sealed::new(crate::MemoryStore::new(), SealingKeys::new(1, [1; 32]));
        assert!(sealed.capabilities().list);
        let listing = sealed.list(ListFilter::new(10)).await.expect("list forwarded");
        assert!(listing.records.is_empty());
    }

    #[test]
    fn debug_never_prints_key_bytes() {
        let keys = SealingKeys::new(3, [0xab; 32]);
        let shown = format!("{keys:?} {:?}", Sealed::new(crate::MemoryStore::new(), keys.clone()));
        assert!(!shown.contains("171") && !shown.to_lowercase().contains("ab, "), "{shown}");
        assert!(shown.contains("ids: [3]"));
    }
}
