//! Header names the layer reads and writes, and the HTTP-date format.

use std::cell::RefCell;

use http::{HeaderName, HeaderValue};
use idem_core::UnixMillis;

/// `Idempotency-Key` (draft-ietf-httpapi-idempotency-key-header §2), read from requests.
/// Field names are case-insensitive; `http` stores them lower-case.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// `Idempotent-Replayed: true` on every replayed response (Stripe's name; not in the draft).
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// `Idempotent-Stored: false` on a handler's response that the layer could not store: the
/// store stayed out for the whole completion retry window, or another attempt took the
/// record over (lost lease). The operation ran, but a retry of the key will not replay
/// this response: while the record's lease lasts it gets 409 in flight, after that it may
/// run the handler again (outage) or get the other attempt's outcome (lost lease).
/// Non-standard, like `Idempotent-Replayed`; absent on every stored or replayed response.
pub const IDEMPOTENT_STORED: HeaderName = HeaderName::from_static("idempotent-stored");

/// `Idempotency-Key-Expires: <HTTP-date>` (RFC 9110 §5.6.7 IMF-fixdate): until when the key's
/// record is retained. After that instant the same key starts a new operation.
///
/// Non-standard: neither the IETF draft nor Stripe defines such a field. It is sent on
/// every response that concerns an existing record: a handler run under a claim, a
/// replay, a 409 in flight and a mismatch. The date is rounded down to the second, so the
/// record lives at least until then.
pub const IDEMPOTENCY_KEY_EXPIRES: HeaderName = HeaderName::from_static("idempotency-key-expires");

thread_local! {
    /// The last `Idempotency-Key-Expires` value this thread made, by its second. Retention
    /// is the same for every record of a layer and requests arrive in time order, so nearly
    /// every response of one second carries the same date: formatting it once per second
    /// (and per thread) instead of per response saves a `format!` and a copy into a new
    /// header value (cloning a `HeaderValue` only bumps a reference count).
    static LAST_EXPIRES: RefCell<Option<(i64, HeaderValue)>> = const { RefCell::new(None) };
}

/// `t` as an `Idempotency-Key-Expires` value (an IMF-fixdate, rounded down to the second).
pub(crate) fn expires_value(t: UnixMillis) -> HeaderValue {
    let secs = t.0.div_euclid(1000);
    let cached = LAST_EXPIRES.with_borrow(|last| last.as_ref().filter(|(s, _)| *s == secs).map(|(_, v)| v.clone()));
    cached.unwrap_or_else(|| {
        // An IMF-fixdate is ASCII letters, digits, spaces, commas and colons: always a valid value.
        let value = HeaderValue::from_maybe_shared(bytes::Bytes::from(http_date(t)))
            .unwrap_or_else(|_| HeaderValue::from_static("Thu, 01 Jan 1970 00:00:00 GMT"));
        LAST_EXPIRES.set(Some((secs, value.clone())));
        value
    })
}

/// Formats `t` as an IMF-fixdate, e.g. `Sun, 06 Nov 1994 08:49:37 GMT`.
pub(crate) fn http_date(t: UnixMillis) -> String {
    const DAYS: [&str; 7] = ["Thu", "Fri", "Sat", "Sun", "Mon", "Tue", "Wed"];
    const MONTHS: [&str; 12] = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"];
    let secs = t.0.div_euclid(1000);
    let days = secs.div_euclid(86_400);
    let in_day = secs.rem_euclid(86_400);
    // Civil date from a day count (proleptic Gregorian, eras of 400 years = 146 097 days,
    // year starting in March so the leap day comes last).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era = (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_from_march = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_from_march + 2) / 5 + 1;
    let month = if month_from_march < 10 { month_from_march + 3 } else { month_from_march - 9 };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    // Indices are in range by construction (rem_euclid of 7; month in 1..=12).
    let weekday = DAYS[usize::try_from(days.rem_euclid(7)).unwrap_or(0)];
    let month_name = MONTHS[usize::try_from(month - 1).unwrap_or(0)];
    format!(
        "{weekday}, {day:02} {month_name} {year:04} {:02}:{:02}:{:02} GMT",
        in_day / 3600,
        in_day % 3600 / 60,
        in_day % 60
    )
}

/// The fields of `fields` (headers or trailers) a record keeps: not hop-by-hop, not on the
/// deny list, and not named by the message's own `Connection` field (RFC 9110 §7.6.1: a
/// sender lists there the fields meant for the next hop only).
pub(crate) fn kept_fields(policy: &idem_core::Policy, fields: &http::HeaderMap) -> Vec<(String, Vec<u8>)> {
    let per_hop: Vec<String> = fields
        .get_all(http::header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|name| name.trim().to_ascii_lowercase())
        .filter(|name| !name.is_empty())
        .collect();
    fields
        .iter()
        .filter(|(name, _)| policy.stores_header(name.as_str()) && !per_hop.iter().any(|p| p == name.as_str()))
        .map(|(name, value)| (name.as_str().to_owned(), value.as_bytes().to_vec()))
        .collect()
}

/// The media type of a message's `content-type`: without parameters, trimmed; `None`
/// without one, or when the field holds a byte outside visible ASCII. Read on every
/// keyed request and response, so it is compared in place, never lower-cased into a copy.
pub(crate) fn media_type(headers: &http::HeaderMap) -> Option<&[u8]> {
    let value = headers.get(http::header::CONTENT_TYPE)?.to_str().ok()?;
    Some(value.split(';').next().unwrap_or_default().trim().as_bytes())
}

/// Whether a request or response is gRPC (`crate::grpc`). Without the `grpc` feature
/// never: a gRPC request is handled as plain HTTP.
pub(crate) fn is_grpc(headers: &http::HeaderMap) -> bool {
    #[cfg(feature = "grpc")]
    return crate::grpc::is_grpc(headers);
    #[cfg(not(feature = "grpc"))]
    {
        let _ = headers;
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn imf_fixdate_matches_known_instants() {
        assert_eq!(http_date(UnixMillis(0)), "Thu, 01 Jan 1970 00:00:00 GMT");
        // RFC 9110's own example.
        assert_eq!(http_date(UnixMillis(784_111_777_000)), "Sun, 06 Nov 1994 08:49:37 GMT");
        // A leap day, and rounding down of milliseconds.
        assert_eq!(http_date(UnixMillis(951_782_400_999)), "Tue, 29 Feb 2000 00:00:00 GMT");
        assert_eq!(http_date(UnixMillis(1_798_761_599_000)), "Thu, 31 Dec 2026 23:59:59 GMT");
    }

    /// The per-second cache of `Idempotency-Key-Expires` returned a stale date for another second.
    #[test]
    fn cached_expires_value_follows_the_second() {
        let at = |ms| expires_value(UnixMillis(ms)).to_str().map(str::to_owned).unwrap_or_default();
        assert_eq!(at(784_111_777_000), "Sun, 06 Nov 1994 08:49:37 GMT");
        assert_eq!(at(784_111_777_999), "Sun, 06 Nov 1994 08:49:37 GMT");
        assert_eq!(at(784_111_778_000), "Sun, 06 Nov 1994 08:49:38 GMT");
        assert_eq!(at(784_111_777_500), "Sun, 06 Nov 1994 08:49:37 GMT");
        assert_eq!(at(-1), "Wed, 31 Dec 1969 23:59:59 GMT");
    }
}
