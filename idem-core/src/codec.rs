//! The byte form of a record for stores that keep opaque values (redb, SQLite blobs,
//! files): one format-version byte, then postcard.
//!
//! postcard replaces bincode, whose final crates.io release is a deliberate compile error.
//! Decoding arbitrary bytes returns a typed [`CodecError`], never panics, and never
//! allocates more than the input can justify (postcard reads lengths against the
//! remaining input; compressed bodies are bounded by [`crate::record::MAX_DECODED_BODY`]).

use crate::record::Record;

/// The current format version, the first byte of every encoded record.
pub const FORMAT_VERSION: u8 = 1;

/// Why bytes are not a record.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CodecError {
    /// No bytes at all.
    #[error("empty record bytes")]
    Empty,
    /// Written by a format this build does not know.
    #[error("record format version {0} is not supported (this build reads {FORMAT_VERSION})")]
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
}

/// Encodes a record: `[FORMAT_VERSION] ++ postcard(record)`.
#[must_use]
pub fn encode(record: &Record) -> Vec<u8> {
    let out = vec![FORMAT_VERSION];
    // Serialising plain data into a Vec cannot fail; fall back to the version byte alone
    // (which decodes to a typed error) rather than panic if it ever did.
    match postcard::to_extend(record, out) {
        Ok(v) => v,
        Err(_) => vec![FORMAT_VERSION],
    }
}

/// Decodes bytes written by [`encode`].
///
/// # Errors
/// [`CodecError`] for empty, unknown-version, malformed or trailing input.
pub fn decode(bytes: &[u8]) -> Result<Record, CodecError> {
    let (&version, rest) = bytes.split_first().ok_or(CodecError::Empty)?;
    if version != FORMAT_VERSION {
        return Err(CodecError::UnknownVersion(version));
    }
    let (record, tail) = postcard::take_from_bytes::<Record>(rest).map_err(CodecError::Malformed)?;
    if !tail.is_empty() {
        return Err(CodecError::Trailing(tail.len()));
    }
    Ok(record)
}
