//! The record: what a store keeps per (scope, key), and its stored response.

use serde::{Deserialize, Serialize};

use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::scope::{RecordId, Scope};
use crate::time::UnixMillis;

/// Where a record is in its life (`docs/state-machine.md`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub enum RecordState {
    /// Claimed; a handler holds the lease until `lease_expires_at`.
    InFlight,
    /// A terminal response is stored and replayed to every retry.
    Completed,
    /// The handler errored, panicked or answered 5xx; a retry with the same fingerprint
    /// may reclaim it.
    Failed,
}

impl RecordState {
    /// The state's name as SQL stores keep it in a text column: `in_flight`, `completed`,
    /// `failed`.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            RecordState::InFlight => "in_flight",
            RecordState::Completed => "completed",
            RecordState::Failed => "failed",
        }
    }

    /// The state named by [`RecordState::as_str`]; `None` for any other text.
    #[must_use]
    pub fn from_name(name: &str) -> Option<Self> {
        [RecordState::InFlight, RecordState::Completed, RecordState::Failed].into_iter().find(|s| s.as_str() == name)
    }
}

/// The fencing token: grows by one on every claim or reclaim of a record. Complete and
/// fail are compare-and-set on (record id, token), so the holder of an older token can
/// never overwrite a newer attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct FencingToken(pub u64);

impl FencingToken {
    /// The smallest token: what a claim at or before the epoch gets. Real claims start at
    /// [`FencingToken::first_at`].
    pub const FIRST: FencingToken = FencingToken(1);

    /// Bits of a token below the claim time: room for 65,536 reclaims per millisecond of
    /// the store's clock between two generations of one record id.
    pub const ATTEMPT_BITS: u32 = 16;

    /// The first token of a record created at `now`: the store's clock in ms, shifted left
    /// by [`FencingToken::ATTEMPT_BITS`] (at least [`FencingToken::FIRST`]).
    ///
    /// Why from the clock: a record that leaves the store (swept, expired natively,
    /// evicted, lost in a restart) takes its token with it, so a counter would start again
    /// at 1 and a late owner of an earlier generation would pass the fence on the new one.
    /// A token from the clock is larger than every token of every earlier generation of the
    /// same id, as long as the store's clock does not step back past the earlier
    /// generation's life and no generation was reclaimed 65,536 times per millisecond it
    /// lived. The one exception is a generation that lives zero ms (zero lease and zero
    /// retention) and leaves the store within that ms: the next claim in that ms repeats
    /// its first token. Fits in a signed 64-bit column (ms below 2^47, year 6429).
    #[must_use]
    pub fn first_at(now: UnixMillis) -> FencingToken {
        let ms = u64::try_from(now.0).unwrap_or(0).min((1 << (63 - Self::ATTEMPT_BITS)) - 1);
        FencingToken((ms << Self::ATTEMPT_BITS).max(Self::FIRST.0))
    }

    /// The token after this one.
    #[must_use]
    pub fn next(self) -> FencingToken {
        FencingToken(self.0.saturating_add(1))
    }
}

impl std::fmt::Display for FencingToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// How a stored body is encoded. The variants' order is part of the stored format
/// (postcard writes a variant's index), so a new one goes last.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub enum StoredBody {
    /// The body bytes as sent. Serialized as a byte string: the same postcard bytes as a
    /// sequence of `u8`, decoded in one copy instead of byte by byte.
    Identity(#[serde(with = "serde_bytes")] Vec<u8>),
    /// LZ4 block compression of a body of `len` bytes (bodies over the policy threshold).
    Lz4 {
        /// Length of the decompressed body, bytes.
        len: u64,
        /// The compressed block.
        #[serde(with = "serde_bytes")]
        data: Vec<u8>,
    },
    /// The body was larger than the policy's `max_stored_body` and was not kept. The
    /// record still completes, so a retry never runs the handler twice; the replay says
    /// the response was not retained.
    NotRetained {
        /// Length of the original body in bytes, when it was known.
        len: Option<u64>,
    },
}

/// The response replayed to every retry: status, headers (hop-by-hop and denied headers
/// already removed), body and trailers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "arbitrary", derive(arbitrary::Arbitrary))]
pub struct StoredResponse {
    /// HTTP status code.
    pub status: u16,
    /// `(lower-case name, raw value)` pairs in the order they were sent.
    pub headers: Vec<(String, Vec<u8>)>,
    /// The body.
    pub body: StoredBody,
    /// Trailer fields (RFC 9110 §6.5; gRPC sends its `grpc-status` there), kept like
    /// `headers`; empty when the response had none.
    pub trailers: Vec<(String, Vec<u8>)>,
}

/// Upper bound on a decompressed body, bytes: a corrupt or hostile record cannot make a
/// reader allocate more than this.
pub const MAX_DECODED_BODY: u64 = 1 << 30;

impl StoredResponse {
    /// A response whose body is kept as is.
    #[must_use]
    pub fn new(status: u16, headers: Vec<(String, Vec<u8>)>, body: Vec<u8>) -> Self {
        Self { status, headers, body: StoredBody::Identity(body), trailers: Vec::new() }
    }

    /// A response whose body is LZ4-compressed when it is longer than `threshold` bytes
    /// and compression actually saves space.
    #[must_use]
    pub fn compressed_over(status: u16, headers: Vec<(String, Vec<u8>)>, body: Vec<u8>, threshold: usize) -> Self {
        let body = if body.len() > threshold {
            let data = lz4_flex::block::compress(&body);
            if data.len() < body.len() {
                StoredBody::Lz4 { len: body.len() as u64, data }
            } else {
                StoredBody::Identity(body)
            }
        } else {
            StoredBody::Identity(body)
        };
        Self { status, headers, body, trailers: Vec::new() }
    }

    /// The same response with `trailers` after its body.
    #[must_use]
    pub fn with_trailers(self, trailers: Vec<(String, Vec<u8>)>) -> Self {
        Self { trailers, ..self }
    }

    /// The first value of header `name` (lower-case).
    #[must_use]
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_slice())
    }

    /// The body bytes, decompressed. `Ok(None)` when the body was not retained.
    ///
    /// # Errors
    /// [`crate::corrupt::CodecError`] when a compressed body is corrupt or claims more than
    /// [`MAX_DECODED_BODY`] bytes.
    pub fn body_bytes(&self) -> Result<Option<std::borrow::Cow<'_, [u8]>>, crate::corrupt::CodecError> {
        use std::borrow::Cow;
        match &self.body {
            StoredBody::Identity(b) => Ok(Some(Cow::Borrowed(b))),
            StoredBody::NotRetained { .. } => Ok(None),
            StoredBody::Lz4 { len, data } => {
                // LZ4 cannot expand more than ~255x; refuse claims beyond that before
                // allocating.
                let bound = (data.len() as u64).saturating_mul(255).saturating_add(16);
                if *len > MAX_DECODED_BODY || *len > bound {
                    return Err(crate::corrupt::CodecError::BodyTooLarge { len: *len });
                }
                let len = usize::try_from(*len).map_err(|_| crate::corrupt::CodecError::BodyTooLarge { len: *len })?;
                let out =
                    lz4_flex::block::decompress(data, len).map_err(|_| crate::corrupt::CodecError::BadCompression)?;
                if out.len() != len {
                    return Err(crate::corrupt::CodecError::BadCompression);
                }
                Ok(Some(Cow::Owned(out)))
            }
        }
    }

    /// [`Self::body_bytes`], moved out: a body stored as is is handed over without a copy
    /// and left empty here; a compressed one is decompressed (and stays as it was).
    ///
    /// # Errors
    /// As [`Self::body_bytes`].
    pub fn take_body_bytes(&mut self) -> Result<Option<Vec<u8>>, crate::corrupt::CodecError> {
        if let StoredBody::Identity(bytes) = &mut self.body {
            return Ok(Some(std::mem::take(bytes)));
        }
        Ok(self.body_bytes()?.map(std::borrow::Cow::into_owned))
    }
}

/// One idempotency record (`docs/contract.md#what-is-stored-and-when`). All times are UTC milliseconds
/// from the store's clock.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// Hash of (principal, endpoint, key); the store's primary key.
    pub id: RecordId,
    /// The scope the key lives in.
    pub scope: Scope,
    /// The client's key.
    pub key: IdempotencyKey,
    /// Fingerprint of the request that first claimed the record.
    pub fingerprint: Fingerprint,
    /// State.
    pub state: RecordState,
    /// Fencing token of the current (or last) claim.
    pub token: FencingToken,
    /// The stored response; `Some` exactly when `state` is `Completed`.
    pub response: Option<StoredResponse>,
    /// When the record was first claimed.
    pub created_at: UnixMillis,
    /// When the current claim (or reclaim) started.
    pub started_at: UnixMillis,
    /// End of the in-flight lease: the claim is fresh while `now < lease_expires_at`.
    /// Always finite, even for a zero lease (`docs/failures.md#zero-lease-means-no-deadline`).
    pub lease_expires_at: UnixMillis,
    /// End of the retention window: the record is gone once `now >= expires_at`.
    pub expires_at: UnixMillis,
}

impl Record {
    /// True once the retention window has passed: the record counts as absent.
    #[must_use]
    pub fn is_expired(&self, now: UnixMillis) -> bool {
        now >= self.expires_at
    }

    /// True while an in-flight claim's lease is still honoured.
    #[must_use]
    pub fn lease_is_fresh(&self, now: UnixMillis) -> bool {
        self.state == RecordState::InFlight && now < self.lease_expires_at
    }
}

#[cfg(feature = "arbitrary")]
impl<'a> arbitrary::Arbitrary<'a> for Record {
    fn arbitrary(u: &mut arbitrary::Unstructured<'a>) -> arbitrary::Result<Self> {
        Ok(Self {
            id: u.arbitrary()?,
            scope: u.arbitrary()?,
            key: u.arbitrary()?,
            fingerprint: u.arbitrary()?,
            state: u.arbitrary()?,
            token: u.arbitrary()?,
            response: u.arbitrary()?,
            created_at: u.arbitrary()?,
            started_at: u.arbitrary()?,
            lease_expires_at: u.arbitrary()?,
            expires_at: u.arbitrary()?,
        })
    }
}
