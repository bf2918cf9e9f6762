//! BLAKE3 `derive_key` hashers, set up once per context.
//!
//! `Hasher::new_derive_key` hashes its context string every time it is called; every
//! request derives a record id and a fingerprint, so the keyed starting state is computed
//! once per process and cloned (a copy of a few hundred bytes).

use std::sync::OnceLock;

/// The derive-key hasher for `context`, initialised once in `cell`.
pub(crate) fn keyed(cell: &'static OnceLock<blake3::Hasher>, context: &str) -> blake3::Hasher {
    cell.get_or_init(|| blake3::Hasher::new_derive_key(context)).clone()
}

pub(crate) static RECORD_ID_HASHER: OnceLock<blake3::Hasher> = OnceLock::new();
pub(crate) static FINGERPRINT_HASHER: OnceLock<blake3::Hasher> = OnceLock::new();
pub(crate) static SUBKEY_HASHER: OnceLock<blake3::Hasher> = OnceLock::new();

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
}
