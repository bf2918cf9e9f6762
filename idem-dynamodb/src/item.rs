//! The item layout: how a [`Record`] and its journal entries are kept as DynamoDB items,
//! and how they are read back.
//!
//! One partition per record id (`pk`, the id in hex). In it:
//! - the record item, sort key `r`;
//! - one item per journal entry, sort key `j#<name in hex>`, plus `j#<name in hex>#<i>`
//!   for the further parts of an entry over [`PART_BYTES`].
//!
//! The record item keeps the fields a condition expression compares as attributes of their
//! own (state, token, times, fingerprint) and the fields no write changes within a
//! generation (scope, key, fingerprint, `created_at`) as the record's codec bytes in `i_h`
//! ([`idem_core::codec::encode`], written with no response; its state and times are
//! ignored on reading, the attributes win). The response is `i_resp` (the bytes of
//! [`idem_core::codec::encode_response`]) or, when those would not fit in an item,
//! `i_rz` (the same bytes LZ4-compressed). Attribute names carry an `i_` prefix so that
//! none is one of DynamoDB's reserved words.

use std::collections::HashMap;

use aws_sdk_dynamodb::primitives::Blob;
use aws_sdk_dynamodb::types::AttributeValue;
use idem_core::codec::{self, CodecError};
use idem_core::{FencingToken, Record, RecordId, RecordState, StoreError, StoredBody, StoredResponse, UnixMillis};

/// An item as the SDK hands it over.
pub(crate) type Item = HashMap<String, AttributeValue>;

/// Partition key: the record id in lower-case hex.
pub(crate) const PK: &str = "pk";
/// Sort key: [`SK_RECORD`] or a journal entry's key.
pub(crate) const SK: &str = "sk";
/// The sort key of the record item.
pub(crate) const SK_RECORD: &str = "r";
/// The codec bytes of the record's fixed fields.
pub(crate) const HEAD: &str = "i_h";
/// State name ([`RecordState::as_str`]).
pub(crate) const STATE: &str = "i_st";
/// Fencing token.
pub(crate) const TOKEN: &str = "i_tok";
/// The generation: the first token of the claim that created this record's generation.
pub(crate) const GEN: &str = "i_gen";
/// The request fingerprint (32 bytes), compared by reclaim.
pub(crate) const FINGERPRINT: &str = "i_fp";
/// `started_at`, ms.
pub(crate) const STARTED: &str = "i_sa";
/// `lease_expires_at`, ms.
pub(crate) const LEASE: &str = "i_le";
/// `expires_at`, ms.
pub(crate) const EXPIRES: &str = "i_ex";
/// DynamoDB's TTL attribute: whole seconds since the epoch.
pub(crate) const TTL: &str = "i_ttl";
/// The nonce of the last write, so a write the SDK sent twice recognises its own result.
pub(crate) const WRITE: &str = "i_w";
/// The encoded response.
pub(crate) const RESPONSE: &str = "i_resp";
/// The encoded response, LZ4-compressed (size prepended).
pub(crate) const RESPONSE_LZ4: &str = "i_rz";
/// How many part items hold the response (responses too large for the record item).
pub(crate) const RESPONSE_PARTS: &str = "i_rp";
/// The nonce naming a parted response's items.
pub(crate) const RESPONSE_PARTS_ID: &str = "i_rw";
/// Whether a parted response's bytes are LZ4-compressed (`lz4`) or not (`raw`).
pub(crate) const RESPONSE_PARTS_KIND: &str = "i_rk";
/// A journal entry's value (or one part of it).
pub(crate) const VALUE: &str = "i_v";
/// How many parts a journal entry has (the first item included).
pub(crate) const PARTS: &str = "i_n";

/// Largest item DynamoDB accepts, bytes (400 KB, names included).
pub(crate) const ITEM_LIMIT: usize = 400 * 1024;
/// Room kept in a record item for everything but the response: the scope, key and fixed
/// attributes (a principal and endpoint of several KB still fit).
pub(crate) const RECORD_OVERHEAD: usize = 24 * 1024;
/// Most response bytes kept inline in a record item.
pub(crate) const RESPONSE_INLINE: usize = ITEM_LIMIT - RECORD_OVERHEAD;
/// Bytes of a journal value per item.
pub(crate) const PART_BYTES: usize = 350 * 1024;
/// Largest response kept in part items; a larger one is completed as not retained.
pub(crate) const MAX_PARTED_RESPONSE: usize = 64 * 1024 * 1024;
/// Largest journal value: a put is one transaction, which DynamoDB caps at 4 MB in all.
pub const MAX_JOURNAL_VALUE: usize = 3 * 1024 * 1024;

/// The partition key of record `id`.
pub(crate) fn pk(id: RecordId) -> AttributeValue {
    AttributeValue::S(id.to_hex())
}

/// The key of record `id`'s item.
pub(crate) fn record_key(id: RecordId) -> Item {
    HashMap::from([(PK.to_owned(), pk(id)), (SK.to_owned(), AttributeValue::S(SK_RECORD.to_owned()))])
}

/// The sort key of journal entry `name` (part 0), and of its part `i`.
pub(crate) fn journal_sk(name: &str, part: usize) -> String {
    let mut s = String::with_capacity(2 + name.len() * 2 + 4);
    s.push_str("j#");
    for b in name.as_bytes() {
        s.push_str(&format!("{b:02x}"));
    }
    if part > 0 {
        s.push_str(&format!("#{part}"));
    }
    s
}

/// The key of journal entry `name`'s part `part` of record `id`.
pub(crate) fn journal_key(id: RecordId, name: &str, part: usize) -> Item {
    HashMap::from([(PK.to_owned(), pk(id)), (SK.to_owned(), AttributeValue::S(journal_sk(name, part)))])
}

pub(crate) fn n(v: impl std::fmt::Display) -> AttributeValue {
    AttributeValue::N(v.to_string())
}

pub(crate) fn s(v: impl Into<String>) -> AttributeValue {
    AttributeValue::S(v.into())
}

pub(crate) fn b(v: impl Into<Vec<u8>>) -> AttributeValue {
    AttributeValue::B(Blob::new(v))
}

/// `Corrupt` naming `field`.
pub(crate) fn corrupt(id: Option<RecordId>, field: &'static str, reason: impl Into<String>) -> StoreError {
    StoreError::Corrupt { id, source: CodecError::BadField { field, reason: reason.into() } }
}

/// The TTL attribute's value for a record that is gone at `expires_at`: the whole second
/// after it, plus `grace_secs`.
pub(crate) fn ttl_secs(expires_at: UnixMillis, grace_secs: i64) -> i64 {
    expires_at.0.div_euclid(1000).saturating_add(1).saturating_add(grace_secs)
}

/// The record item for `r` (whose response, if any, is `response_attr`), written by
/// nonce `w`.
pub(crate) fn record_item(r: &Record, gen_token: FencingToken, w: &str, grace_secs: i64) -> Item {
    let mut head = r.clone();
    head.response = None;
    let mut item = record_key(r.id);
    item.insert(HEAD.to_owned(), b(codec::encode(&head)));
    item.insert(STATE.to_owned(), s(r.state.as_str()));
    item.insert(TOKEN.to_owned(), n(r.token.0));
    item.insert(GEN.to_owned(), n(gen_token.0));
    item.insert(FINGERPRINT.to_owned(), b(r.fingerprint.as_bytes().to_vec()));
    item.insert(STARTED.to_owned(), n(r.started_at.0));
    item.insert(LEASE.to_owned(), n(r.lease_expires_at.0));
    item.insert(EXPIRES.to_owned(), n(r.expires_at.0));
    item.insert(TTL.to_owned(), n(ttl_secs(r.expires_at, grace_secs)));
    item.insert(WRITE.to_owned(), s(w));
    item
}

/// How a response is kept.
pub(crate) enum StoredForm {
    /// In the record item, under this attribute (`i_resp`, or `i_rz` compressed).
    Inline(&'static str, Vec<u8>),
    /// In part items beside the record (`p#<token>#<nonce>#<i>`), compressed or not.
    Parts {
        /// Whether `bytes` are LZ4-compressed.
        lz4: bool,
        /// The encoded (and maybe compressed) response.
        bytes: Vec<u8>,
    },
}

/// A response as the store keeps it: inline when its encoding fits in the record item,
/// else LZ4-compressed inline when that fits, else in part items beside the record (the
/// smaller of compressed and raw), and only beyond [`MAX_PARTED_RESPONSE`] completed as
/// not retained (status, headers and trailers kept), so a completion never fails because
/// of its size.
pub(crate) fn stored_form(response: &StoredResponse) -> StoredForm {
    let bytes = codec::encode_response(response);
    if bytes.len() <= RESPONSE_INLINE {
        return StoredForm::Inline(RESPONSE, bytes);
    }
    let packed = lz4_flex::block::compress_prepend_size(&bytes);
    if packed.len() <= RESPONSE_INLINE {
        return StoredForm::Inline(RESPONSE_LZ4, packed);
    }
    let (lz4, smaller) = if packed.len() < bytes.len() { (true, packed) } else { (false, bytes) };
    if smaller.len() <= MAX_PARTED_RESPONSE {
        return StoredForm::Parts { lz4, bytes: smaller };
    }
    tracing::warn!(
        encoded = smaller.len(),
        "idem-dynamodb: a response is over the parted-response limit; completed as not retained"
    );
    StoredForm::Inline(RESPONSE, codec::encode_response(&not_retained(response, true)))
}

/// `response` with its body not retained; `keep_fields`: headers and trailers kept.
pub(crate) fn not_retained(response: &StoredResponse, keep_fields: bool) -> StoredResponse {
    let len = match &response.body {
        StoredBody::Identity(b) => Some(b.len() as u64),
        StoredBody::Lz4 { len, .. } => Some(*len),
        StoredBody::NotRetained { len } => *len,
    };
    let mut kept = StoredResponse {
        status: response.status,
        headers: response.headers.clone(),
        body: StoredBody::NotRetained { len },
        trailers: response.trailers.clone(),
    };
    if !keep_fields || codec::encode_response(&kept).len() > RESPONSE_INLINE {
        kept.headers.clear();
        kept.trailers.clear();
    }
    kept
}

/// The key of part `i` of a parted response written by token `token` under nonce `w`.
pub(crate) fn response_part_key(id: RecordId, token: FencingToken, w: &str, i: usize) -> Item {
    HashMap::from([(PK.to_owned(), pk(id)), (SK.to_owned(), AttributeValue::S(format!("p#{}#{w}#{i}", token.0)))])
}

fn attr<'a>(item: &'a Item, id: Option<RecordId>, name: &'static str) -> Result<&'a AttributeValue, StoreError> {
    item.get(name).ok_or_else(|| corrupt(id, name, "missing"))
}

/// A number attribute.
pub(crate) fn get_i64(item: &Item, id: Option<RecordId>, name: &'static str) -> Result<i64, StoreError> {
    match attr(item, id, name)? {
        AttributeValue::N(v) => v.parse().map_err(|_| corrupt(id, name, format!("not an integer: {v:?}"))),
        _ => Err(corrupt(id, name, "not a number")),
    }
}

/// A number attribute holding a token.
pub(crate) fn get_token(item: &Item, id: Option<RecordId>, name: &'static str) -> Result<FencingToken, StoreError> {
    match attr(item, id, name)? {
        AttributeValue::N(v) => {
            v.parse().map(FencingToken).map_err(|_| corrupt(id, name, format!("not a token: {v:?}")))
        }
        _ => Err(corrupt(id, name, "not a number")),
    }
}

/// A string attribute.
pub(crate) fn get_str<'a>(item: &'a Item, id: Option<RecordId>, name: &'static str) -> Result<&'a str, StoreError> {
    match attr(item, id, name)? {
        AttributeValue::S(v) => Ok(v),
        _ => Err(corrupt(id, name, "not a string")),
    }
}

/// A binary attribute, if present.
pub(crate) fn get_bytes<'a>(
    item: &'a Item,
    id: Option<RecordId>,
    name: &'static str,
) -> Result<Option<&'a [u8]>, StoreError> {
    match item.get(name) {
        None => Ok(None),
        Some(AttributeValue::B(v)) => Ok(Some(v.as_ref())),
        Some(_) => Err(corrupt(id, name, "not binary")),
    }
}

/// The nonce of the write that left `item` as it is.
pub(crate) fn write_nonce(item: &Item) -> Option<&str> {
    match item.get(WRITE) {
        Some(AttributeValue::S(v)) => Some(v),
        _ => None,
    }
}

/// What the conditions look at, without decoding the record.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Head {
    pub(crate) state: RecordState,
    pub(crate) token: FencingToken,
    pub(crate) generation: FencingToken,
    pub(crate) lease_expires_at: UnixMillis,
    pub(crate) expires_at: UnixMillis,
}

impl Head {
    pub(crate) fn of(item: &Item, id: RecordId) -> Result<Self, StoreError> {
        let id = Some(id);
        let state = get_str(item, id, STATE)?;
        let state =
            RecordState::from_name(state).ok_or_else(|| corrupt(id, STATE, format!("unknown state {state:?}")))?;
        Ok(Self {
            state,
            token: get_token(item, id, TOKEN)?,
            generation: get_token(item, id, GEN)?,
            lease_expires_at: UnixMillis(get_i64(item, id, LEASE)?),
            expires_at: UnixMillis(get_i64(item, id, EXPIRES)?),
        })
    }

    pub(crate) fn is_live(&self, now: UnixMillis) -> bool {
        now < self.expires_at
    }

    pub(crate) fn owned_by(&self, token: FencingToken, now: UnixMillis) -> bool {
        self.is_live(now) && self.state == RecordState::InFlight && self.token == token
    }
}

/// Decodes a record item.
pub(crate) fn decode_record(item: &Item, id: RecordId) -> Result<Record, StoreError> {
    let head = Head::of(item, id)?;
    let sid = Some(id);
    let bytes = get_bytes(item, sid, HEAD)?.ok_or_else(|| corrupt(sid, HEAD, "missing"))?;
    let mut r = codec::decode(bytes).map_err(|source| StoreError::Corrupt { id: sid, source })?;
    if r.id != id {
        return Err(corrupt(sid, HEAD, "holds another record's id"));
    }
    r.state = head.state;
    r.token = head.token;
    r.started_at = UnixMillis(get_i64(item, sid, STARTED)?);
    r.lease_expires_at = head.lease_expires_at;
    r.expires_at = head.expires_at;
    r.response = match (get_bytes(item, sid, RESPONSE)?, get_bytes(item, sid, RESPONSE_LZ4)?) {
        (Some(bytes), _) => {
            Some(codec::decode_response(bytes).map_err(|source| StoreError::Corrupt { id: sid, source })?)
        }
        (None, Some(packed)) => {
            let bytes = lz4_flex::block::decompress_size_prepended(packed)
                .map_err(|_| StoreError::Corrupt { id: sid, source: CodecError::BadCompression })?;
            Some(codec::decode_response(&bytes).map_err(|source| StoreError::Corrupt { id: sid, source })?)
        }
        (None, None) => None,
    };
    if (r.state == RecordState::Completed) != r.response.is_some() {
        return Err(corrupt(sid, RESPONSE, "a response is kept exactly when the record completed"));
    }
    Ok(r)
}

/// The record id of a record item's partition key.
pub(crate) fn item_id(item: &Item) -> Result<RecordId, StoreError> {
    let hex = get_str(item, None, PK)?;
    RecordId::from_hex(hex).ok_or_else(|| corrupt(None, PK, format!("not a record id: {hex:?}")))
}

/// Decodes an expired record item for the token a claim replacing it needs, without its
/// response's part items (a sweep may be deleting them): a parted response reads as not
/// retained.
pub(crate) fn decode_expired(item: &Item, id: RecordId) -> Result<Record, StoreError> {
    if !item.contains_key(RESPONSE_PARTS) {
        return decode_record(item, id);
    }
    let mut head = item.clone();
    head.remove(RESPONSE_PARTS);
    let stub =
        StoredResponse { status: 0, headers: vec![], body: StoredBody::NotRetained { len: None }, trailers: vec![] };
    head.insert(RESPONSE.to_owned(), b(codec::encode_response(&stub)));
    decode_record(&head, id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn journal_sort_keys_are_hex_and_distinct_per_part() {
        assert_eq!(journal_sk("a", 0), "j#61");
        assert_eq!(journal_sk("a", 2), "j#61#2");
        assert_eq!(journal_sk("\u{0}#", 0), "j#0023");
        assert_ne!(journal_sk("A", 0), journal_sk("a", 0));
    }

    #[test]
    fn ttl_is_the_second_after_expiry_plus_the_grace() {
        assert_eq!(ttl_secs(UnixMillis(1_000), 0), 2);
        assert_eq!(ttl_secs(UnixMillis(1_999), 0), 2);
        assert_eq!(ttl_secs(UnixMillis(2_000), 60), 63);
    }

    fn body_len(form: &StoredForm) -> usize {
        match form {
            StoredForm::Inline(_, b) | StoredForm::Parts { bytes: b, .. } => b.len(),
        }
    }

    #[test]
    fn responses_stay_inline_then_compressed_then_in_parts() {
        let small = StoredResponse::new(200, vec![], b"ok".to_vec());
        assert!(matches!(stored_form(&small), StoredForm::Inline(RESPONSE, _)));
        let repetitive = StoredResponse::new(200, vec![], b"abcd".repeat(200_000));
        let form = stored_form(&repetitive);
        assert!(matches!(form, StoredForm::Inline(RESPONSE_LZ4, _)));
        assert!(body_len(&form) <= RESPONSE_INLINE);
        // Bytes LZ4 cannot shrink: kept raw, in parts.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let noise: Vec<u8> = (0..1_000_000)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let form = stored_form(&StoredResponse::new(200, vec![], noise));
        assert!(matches!(form, StoredForm::Parts { lz4: false, .. }));
    }

    #[test]
    fn not_retained_keeps_the_status_and_the_length() {
        let r = StoredResponse::new(201, vec![("location".into(), b"/x".to_vec())], vec![7; 10]);
        let kept = not_retained(&r, true);
        assert_eq!((kept.status, kept.body, kept.headers.len()), (201, StoredBody::NotRetained { len: Some(10) }, 1));
        assert!(not_retained(&r, false).headers.is_empty());
    }

    #[test]
    fn an_unknown_state_is_corrupt() {
        let mut item = record_key(RecordId::derive("p", "e", "k"));
        item.insert(STATE.to_owned(), s("bogus"));
        item.insert(TOKEN.to_owned(), n(1));
        item.insert(GEN.to_owned(), n(1));
        item.insert(LEASE.to_owned(), n(1));
        item.insert(EXPIRES.to_owned(), n(1));
        let e = Head::of(&item, RecordId::derive("p", "e", "k")).expect_err("unknown state");
        assert!(e.is_corrupt(), "{e:?}");
    }
}
