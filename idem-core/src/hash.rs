//! BLAKE3 `derive_key` hashers, set up once per context and fed through a small buffer.
//!
//! `Hasher::new_derive_key` hashes its context string every time it is called; every
//! request derives a record id and a fingerprint, so the context key is computed once per
//! process. Both hash a sequence of short fields (a tag, a little-endian length, a few
//! bytes), and `Hasher::update` has a fixed cost per call far above hashing a dozen bytes:
//! [`Fields`] gathers them in a stack buffer and hands the hasher whole runs instead. The
//! bytes hashed are the same, in the same order, so every hash is the same.

use std::sync::OnceLock;

use blake3::hazmat::HasherExt;

/// The derive-key hasher for `context`, its context key computed once in `cell`.
pub(crate) fn keyed(cell: &'static OnceLock<blake3::hazmat::ContextKey>, context: &str) -> blake3::Hasher {
    blake3::Hasher::new_from_context_key(cell.get_or_init(|| blake3::hazmat::hash_derive_key_context(context)))
}

pub(crate) static RECORD_ID_HASHER: OnceLock<blake3::hazmat::ContextKey> = OnceLock::new();
pub(crate) static FINGERPRINT_HASHER: OnceLock<blake3::hazmat::ContextKey> = OnceLock::new();
pub(crate) static SUBKEY_HASHER: OnceLock<blake3::hazmat::ContextKey> = OnceLock::new();

/// Bytes gathered before the hasher sees them: a request's fields up to a small body fit
/// at once.
const GATHER: usize = 512;

/// A derive-key hasher fed through a stack buffer (module docs). The hasher (two
/// kilobytes of state) is made where it is used, when the input is complete, unless the
/// input outgrows the buffer: then it is made once, on the heap, and fed as it comes.
pub(crate) struct Fields {
    context_key: &'static blake3::hazmat::ContextKey,
    buf: [u8; GATHER],
    len: usize,
    spilled: Option<Box<blake3::Hasher>>,
}

impl Fields {
    pub(crate) fn new(cell: &'static OnceLock<blake3::hazmat::ContextKey>, context: &str) -> Self {
        let context_key = cell.get_or_init(|| blake3::hazmat::hash_derive_key_context(context));
        Self { context_key, buf: [0; GATHER], len: 0, spilled: None }
    }

    /// Appends `bytes` to the hashed input.
    #[inline]
    pub(crate) fn write(&mut self, bytes: &[u8]) {
        match self.buf.get_mut(self.len..self.len + bytes.len()) {
            Some(room) => {
                room.copy_from_slice(bytes);
                self.len += bytes.len();
            }
            None => self.spill(bytes),
        }
    }

    /// Appends `len` as a little-endian u64, then `bytes`: one length-prefixed field.
    #[inline]
    pub(crate) fn prefixed(&mut self, bytes: &[u8]) {
        self.write(&(bytes.len() as u64).to_le_bytes());
        self.write(bytes);
    }

    /// `bytes` do not fit: what was gathered goes to the hasher, then `bytes` (a large
    /// body as it is: the hasher's SIMD path wants long runs).
    #[cold]
    fn spill(&mut self, bytes: &[u8]) {
        let context_key = self.context_key;
        let hasher = self.spilled.get_or_insert_with(|| Box::new(blake3::Hasher::new_from_context_key(context_key)));
        hasher.update(&self.buf[..self.len]);
        self.len = 0;
        if bytes.len() < GATHER {
            self.buf[..bytes.len()].copy_from_slice(bytes);
            self.len = bytes.len();
        } else {
            hasher.update(bytes);
        }
    }

    pub(crate) fn finalize(self) -> [u8; 32] {
        let gathered = &self.buf[..self.len];
        match self.spilled {
            None => {
                let mut hasher = blake3::Hasher::new_from_context_key(self.context_key);
                hasher.update(gathered);
                *hasher.finalize().as_bytes()
            }
            Some(mut hasher) => {
                hasher.update(gathered);
                *hasher.finalize().as_bytes()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cached_hasher_equals_a_fresh_derive_key() {
        for _ in 0..2 {
            let mut cached = keyed(&RECORD_ID_HASHER, crate::scope::RECORD_ID_CONTEXT);
            let mut fresh = blake3::Hasher::new_derive_key(crate::scope::RECORD_ID_CONTEXT);
            cached.update(b"abc");
            fresh.update(b"abc");
            assert_eq!(cached.finalize(), fresh.finalize());
        }
    }

    /// Gathering changed the hashed bytes: a split at the buffer's edge, a long run, or
    /// empty writes gave another hash than one `update` per slice.
    #[test]
    fn gathered_fields_hash_like_one_update_per_slice() {
        let long = vec![7u8; 3 * GATHER + 5];
        let cases: [&[&[u8]]; 5] = [
            &[],
            &[b"", b"a", b"", b"bc"],
            &[&long[..GATHER - 1], b"xy", b"z"],
            &[b"head", &long, b"tail"],
            &[&long[..GATHER], &long[..GATHER], b""],
        ];
        for slices in cases {
            let mut fields = Fields::new(&FINGERPRINT_HASHER, crate::fingerprint::FINGERPRINT_CONTEXT);
            let mut plain = blake3::Hasher::new_derive_key(crate::fingerprint::FINGERPRINT_CONTEXT);
            for s in slices {
                fields.write(s);
                plain.update(s);
            }
            assert_eq!(fields.finalize(), *plain.finalize().as_bytes());
        }
    }
}
