//! The decision table (`docs/decision-table.md#the-table`): what a request carrying a key gets, given the stored
//! record, the request's fingerprint and the store's `now`.
//!
//! | stored record            | fingerprint | decision                          |
//! |--------------------------|-------------|-----------------------------------|
//! | none, or past retention  | -           | [`Decision::Claim`]               |
//! | in_flight, lease fresh   | same        | [`Decision::InFlight`] (409 + `Retry-After`) |
//! | in_flight, lease fresh   | different   | [`Decision::Mismatch`]            |
//! | in_flight, lease expired | same        | [`Decision::Reclaim`]             |
//! | in_flight, lease expired | different   | [`Decision::Mismatch`] (the key stays bound to its first request) |
//! | completed                | same        | [`Decision::Replay`]              |
//! | completed                | different   | [`Decision::Mismatch`]            |
//! | failed                   | same        | [`Decision::Reclaim`]             |
//! | failed                   | different   | [`Decision::Mismatch`]            |

use crate::fingerprint::Fingerprint;
use crate::record::{FencingToken, Record, RecordState};
use crate::time::UnixMillis;

/// The outcome of [`decide`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// No live record: claim the key and run the handler.
    Claim,
    /// Take over the record by compare-and-set on `expected`; the winner runs the handler.
    Reclaim {
        /// The token the record must still carry for the reclaim to succeed.
        expected: FencingToken,
    },
    /// Replay the stored response with `Idempotent-Replayed: true`.
    Replay,
    /// Another attempt holds a fresh lease: 409 with `Retry-After`.
    InFlight {
        /// Whole seconds until the lease expires, at least 1 (RFC 9110 §10.2.3 delay-seconds).
        retry_after_secs: u64,
    },
    /// Same key, different request: never retried by the client.
    Mismatch,
}

/// Applies the decision table. Pure: `now` is the store's clock reading.
#[must_use]
pub fn decide(record: Option<&Record>, fingerprint: &Fingerprint, now: UnixMillis) -> Decision {
    let Some(r) = record.filter(|r| !r.is_expired(now)) else {
        return Decision::Claim;
    };
    if r.fingerprint != *fingerprint {
        return Decision::Mismatch;
    }
    match r.state {
        RecordState::Completed => Decision::Replay,
        RecordState::Failed => Decision::Reclaim { expected: r.token },
        RecordState::InFlight if r.lease_is_fresh(now) => {
            Decision::InFlight { retry_after_secs: retry_after_secs(now, r.lease_expires_at) }
        }
        RecordState::InFlight => Decision::Reclaim { expected: r.token },
    }
}

/// Whole seconds from `now` until `until`, rounded up, at least 1.
#[must_use]
pub fn retry_after_secs(now: UnixMillis, until: UnixMillis) -> u64 {
    now.millis_until(until).div_ceil(1000).max(1)
}
