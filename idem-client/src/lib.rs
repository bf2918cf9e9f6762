//! # idem-client
//!
//! The client half of the idempotency contract (`docs/contract.md#the-client`):
//! - generate the key once per logical operation, before the first attempt, and keep it
//!   across every retry ([`OperationKey`]) and, through an optional on-disk
//!   [`KeyJournal`], across process restarts;
//! - retry connection errors, timeouts, 5xx and in-flight `409` answers (those carry
//!   `Retry-After`, which is honoured) with exponential backoff and full jitter inside a
//!   time budget ([`RetryPolicy`]);
//! - keep polling an operation that is in flight for as long as the budget lasts: an
//!   in-flight 409 is not a failure and does not count against
//!   [`RetryPolicy::max_attempts`], and a `Retry-After` longer than what is left of the
//!   budget (an older server's whole remaining lease) is cut so the last poll lands at the
//!   budget's end. An idem server answers in-flight 409s with a short `Retry-After`
//!   (at most 2 s by default) while its lease renewal keeps a long operation claimed, so a
//!   client with a 60 s budget sees a 40 s operation through to its response;
//! - stop on a fingerprint mismatch (a problem body of type `urn:idem:problem:mismatch`,
//!   whatever status the server maps it to) and on any other 4xx; done on 2xx;
//! - stop at once on an answer it would otherwise retry that carries `x-should-retry:
//!   false` (an idem server's 503 for a record that does not decode): the server says no
//!   retry can change it. The error is [`ClientError::GaveUp`] after that one attempt.
//!
//! ```no_run
//! # async fn demo() -> Result<(), idem_client::ClientError> {
//! use idem_client::{IdempotentClient, OperationKey, RetryPolicy};
//! let client = IdempotentClient::new(reqwest::Client::new(), RetryPolicy::default());
//! let key = OperationKey::generate(); // once per logical operation
//! let reply = client
//!     .post("http://127.0.0.1:8080/v1/workers", &key)
//!     .bearer("token-a")
//!     .json_body(br#"{"image":"worker-base:2025.11","cpu":16}"#.to_vec())
//!     .send()
//!     .await?;
//! println!("{} after {} attempts (replayed: {})", reply.status, reply.stats.attempts, reply.replayed);
//! # Ok(()) }
//! ```
//!
//! # Layout
//! - [`retry`]: [`RetryPolicy`], [`IdempotentClient`], [`Reply`], [`ClientError`].
//! - [`journal`]: [`KeyJournal`], keys that survive a restart.
//! - `middleware` (feature `middleware`): the same behaviour as a `reqwest-middleware`
//!   middleware that composes with `reqwest-retry` and tracing middleware.

pub mod journal;
#[cfg(feature = "middleware")]
pub mod middleware;
pub mod retry;

pub use journal::{JournalError, KeyJournal};
pub use retry::{
    AttemptStats, ClientError, IdempotentClient, MAX_RETRY_AFTER, MISMATCH_PROBLEM_TYPE, OperationKey, Reply,
    RequestBuilder, RetryPolicy,
};
