//! [`Error`]: what can go wrong talking to DynamoDB, and which failures are worth a retry.

use aws_sdk_dynamodb::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use idem_core::StoreError;

/// Error codes after which the same call may succeed: throttling, capacity, server-side
/// faults, and a transaction that collided with another one on the same items.
const RETRYABLE_CODES: &[&str] = &[
    "ProvisionedThroughputExceededException",
    "ThrottlingException",
    "RequestLimitExceeded",
    "InternalServerError",
    "ServiceUnavailable",
    "TransactionConflictException",
    "TransactionInProgressException",
    "LimitExceededException",
];

/// A failure of the DynamoDB store. Inside a [`StoreError`] it is the `source` of
/// [`StoreError::Unavailable`] (backend `dynamodb`).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A DynamoDB call failed.
    #[error("DynamoDB refused or failed {operation}: {message}")]
    Sdk {
        /// What was being done.
        operation: &'static str,
        /// DynamoDB's error code (`ThrottlingException`, `ResourceNotFoundException`, ...),
        /// when it answered with one.
        code: Option<String>,
        /// The SDK's description, its causes included.
        message: String,
        /// Whether the same call may succeed if retried.
        retryable: bool,
    },
    /// The table is missing, still being created, or has another key schema than the
    /// store's (`pk` string hash key, `sk` string range key).
    #[error("DynamoDB table {table:?}: {reason}")]
    Table {
        /// The table name.
        table: String,
        /// What is wrong.
        reason: String,
    },
    /// A conditional write kept losing to other writers of the same record (retryable).
    #[error("{operation} kept losing to concurrent writes of the same record")]
    Contention {
        /// What was being done.
        operation: &'static str,
    },
    /// A journal value over [`crate::MAX_JOURNAL_VALUE`] bytes (one transaction carries it).
    #[error("a journal value of {len} bytes is over the limit of {limit} bytes")]
    JournalValueTooLarge {
        /// The value's length.
        len: usize,
        /// The limit.
        limit: usize,
    },
}

impl Error {
    /// Whether the same call may succeed if retried.
    #[must_use]
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Sdk { retryable, .. } => *retryable,
            Error::Contention { .. } => true,
            Error::Table { .. } | Error::JournalValueTooLarge { .. } => false,
        }
    }

    /// DynamoDB's error code, when the failure is one.
    #[must_use]
    pub fn code(&self) -> Option<&str> {
        match self {
            Error::Sdk { code, .. } => code.as_deref(),
            _ => None,
        }
    }

    /// Wraps an SDK error: timeouts, connection failures, unreadable responses, throttling
    /// and server faults are retryable; anything else (a missing table, bad credentials, a
    /// validation error) is not.
    pub(crate) fn sdk<E, R>(operation: &'static str, e: &SdkError<E, R>) -> Self
    where
        E: ProvideErrorMetadata + std::error::Error + 'static,
        R: std::fmt::Debug,
    {
        let code = e.as_service_error().and_then(|s| s.code()).map(str::to_owned);
        let retryable = match e {
            SdkError::TimeoutError(_) | SdkError::DispatchFailure(_) | SdkError::ResponseError(_) => true,
            SdkError::ServiceError(_) => code.as_deref().is_some_and(|c| RETRYABLE_CODES.contains(&c)),
            _ => false,
        };
        Error::Sdk { operation, code, message: DisplayErrorContext(e).to_string(), retryable }
    }
}

impl From<Error> for StoreError {
    fn from(e: Error) -> Self {
        let retryable = e.is_retryable();
        StoreError::unavailable("dynamodb", e.to_string(), retryable, e)
    }
}
