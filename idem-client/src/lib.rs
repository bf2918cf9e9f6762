#![doc = include_str!("../README.md")]
//!
//! # Layout
//! - `src/retry.rs`: [`OperationKey`], [`RetryPolicy`], [`IdempotentClient`] and its
//!   [`RequestBuilder`] (the retry loop), [`Reply`], [`ClientError`].
//! - `src/journal.rs`: [`KeyJournal`], keys that survive a restart.
//! - `src/middleware.rs` (feature `middleware`): the same behaviour as a
//!   `reqwest-middleware` middleware that composes with `reqwest-retry`.

mod journal;
#[cfg(feature = "middleware")]
pub mod middleware;
mod retry;

pub use journal::{JournalError, KeyJournal};
pub use retry::{
    AttemptStats, ClientError, IdempotentClient, MAX_RETRY_AFTER, MISMATCH_PROBLEM_TYPE, OperationKey, Reply,
    RequestBuilder, RetryPolicy,
};
