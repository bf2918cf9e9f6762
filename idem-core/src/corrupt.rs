//! Why stored bytes are not a record. A leaf module: [`crate::record`] (decompressing a
//! stored body) and [`crate::codec`] (decoding a record) both report it, and neither
//! imports the other for it.

/// Why bytes are not a record.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CodecError {
    /// No bytes at all.
    #[error("empty record bytes")]
    Empty,
    /// Written by a format this build does not know.
    #[error("stored format version {0} is not supported by this build")]
    UnknownVersion(u8),
    /// The postcard payload is malformed or truncated.
    #[error("malformed record")]
    Malformed(#[source] postcard::Error),
    /// Bytes left over after a complete record.
    #[error("{0} trailing bytes after the record")]
    Trailing(usize),
    /// A compressed body claims a size over the limit.
    #[error("a stored body claims {len} bytes, over the decoding limit")]
    BodyTooLarge {
        /// The claimed size, bytes.
        len: u64,
    },
    /// A compressed body does not decompress.
    #[error("a stored body's compression is corrupt")]
    BadCompression,
    /// One field (a column, a hash field) of a record kept as separate fields holds a
    /// value the store never writes: the wrong length, an unknown state name, a negative
    /// token. Every backend reports such a record with this variant, inside
    /// [`crate::StoreError::Corrupt`], so a caller tells "the record does not decode" from
    /// "the store is unavailable" the same way on every backend.
    #[error("stored field {field} is invalid: {reason}")]
    BadField {
        /// The field or column, e.g. `state`.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
}
