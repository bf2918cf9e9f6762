//! Which Redis failures a retry can fix, and the driver's error kept as the source: error
//! replies parsed as the driver parses them, no server needed.

use idem_core::StoreError;
use idem_redis::Error;
use idem_redis::redis::{self, RedisError};

fn server(code: &str) -> RedisError {
    // Parse a real error reply so the classification sees what the driver produces.
    let reply = format!("-{code} detail\r\n");
    match redis::parse_redis_value(reply.as_bytes()) {
        Ok(redis::Value::ServerError(e)) => e.into(),
        other => panic!("not a server error: {other:?}"),
    }
}

/// Pins: a call that met more `MOVED`/`ASK` redirects than it follows (a slot moving
/// again and again) failed as a permanent error (HTTP 500) although the script never
/// ran and the next call lands on the refreshed slot map; it is retryable (503).
///
/// Pins `docs/failures.md#redis-wait-refused-or-redirected-past-its-budget`.
#[test]
fn redirects_past_the_budget_are_retryable() {
    let moved = redis::parse_redis_value(b"-MOVED 3999 127.0.0.1:7001\r\n").expect("reply");
    let ask = redis::parse_redis_value(b"-ASK 3999 127.0.0.1:7001\r\n").expect("reply");
    for reply in [moved, ask] {
        let redis::Value::ServerError(e) = reply else { panic!("an error reply") };
        let store: StoreError = Error::Command { operation: "claim", source: e.into() }.into();
        assert!(store.is_retryable(), "{store:?}");
    }
}

#[test]
fn failover_and_busy_replies_are_retryable() {
    for code in ["READONLY", "LOADING", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN", "BUSY", "OOM", "NOREPLICAS"] {
        let e = Error::Command { operation: "claim", source: server(code) };
        assert!(e.is_retryable(), "{code} should be retryable");
        let store: StoreError = e.into();
        assert!(store.is_retryable(), "{code} should stay retryable as a StoreError");
    }
}

#[test]
fn permanent_replies_are_not_retryable() {
    for code in ["ERR", "NOPERM", "WRONGTYPE", "NOSCRIPT", "NOAUTH"] {
        assert!(
            !Error::Command { operation: "claim", source: server(code) }.is_retryable(),
            "{code} should not be retryable"
        );
    }
}

#[test]
fn io_errors_are_retryable() {
    for kind in [
        std::io::ErrorKind::ConnectionRefused,
        std::io::ErrorKind::ConnectionReset,
        std::io::ErrorKind::TimedOut,
        std::io::ErrorKind::BrokenPipe,
        std::io::ErrorKind::UnexpectedEof,
    ] {
        let e = Error::Command { operation: "claim", source: RedisError::from(std::io::Error::from(kind)) };
        assert!(e.is_retryable(), "{kind:?} should be retryable");
    }
}

#[test]
fn driver_error_is_kept_as_source() {
    let store: StoreError = Error::Command { operation: "claim", source: server("READONLY") }.into();
    let ours = std::error::Error::source(&store).expect("source");
    let ours = ours.downcast_ref::<Error>().expect("idem_redis::Error");
    let driver = std::error::Error::source(ours).expect("driver source");
    assert!(driver.downcast_ref::<RedisError>().is_some());
}
