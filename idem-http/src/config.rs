//! The layer's settings: the types of its HTTP knobs, and the read-only settings bundle
//! every [`crate::Idempotency`] service shares.
//!
//! Both [`crate::layer`] (which builds the bundle) and [`crate::service`] (which reads it)
//! import this module; neither imports the other.

use std::fmt;
use std::sync::Arc;

use idem_core::key::DEFAULT_MAX_KEY_LEN;
use idem_core::{FingerprintMode, Policy, Store};

use crate::principal::{BearerToken, PrincipalResolver};

/// What the layer does with a non-safe request that has no `Idempotency-Key` field.
///
/// A field that is present but empty, blank or otherwise invalid is always a 400, whatever
/// this says: a client that meant to send a key must not silently lose its protection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyRequirement {
    /// 400 with a [`crate::ProblemKind::MissingKey`] problem (default). The layer is put on
    /// routes that create or change things; a retry without a key cannot be made safe, so
    /// the safe default is to say so rather than run unprotected.
    #[default]
    Required,
    /// Run the handler without idempotency and store nothing (Stripe's behaviour). Every
    /// keyless request runs: two keyless requests are never merged into one record.
    Optional,
}

/// What the layer does with a keyed request whose principal the resolver cannot find.
///
/// Never a shared bucket: records are always scoped by a real principal, so one tenant can
/// neither replay nor block another's key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum MissingPrincipal {
    /// 401 with a [`crate::ProblemKind::MissingPrincipal`] problem; the handler does not
    /// run (default).
    #[default]
    Reject,
    /// Run the handler without idempotency and store nothing, as for a keyless request
    /// under [`KeyRequirement::Optional`]. For APIs with anonymous endpoints that accept
    /// duplicates.
    SkipIdempotency,
}

/// Status of the answer to a fingerprint mismatch (same key, different request).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum MismatchStatus {
    /// 409 Conflict (default).
    #[default]
    Conflict,
    /// 422 Unprocessable Content, as draft-ietf-httpapi-idempotency-key-header §2.7 suggests.
    UnprocessableContent,
    /// 400 Bad Request.
    BadRequest,
}

impl MismatchStatus {
    /// The numeric status.
    #[must_use]
    pub fn code(self) -> u16 {
        match self {
            MismatchStatus::Conflict => 409,
            MismatchStatus::UnprocessableContent => 422,
            MismatchStatus::BadRequest => 400,
        }
    }
}

/// What the layer does when the store cannot be reached.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreFailureMode {
    /// Answer 503 with `Retry-After`; the handler never runs without a claim (default).
    #[default]
    FailClosed,
    /// Run the handler without idempotency protection. Only for endpoints whose handler is
    /// already safe to repeat; the layer logs every such request.
    FailOpen,
}

/// Where the handler runs once a request holds the claim (first claim or reclaim).
///
/// The choice decides what a client disconnect does to the operation. A server (hyper,
/// axum) drops a request's response future when its client goes away; whatever that
/// future owns is cancelled at its next await point.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum HandlerExecution {
    /// The handler call, the reading of its whole response body and the `complete` or
    /// `fail` write are work that outlives the response future (default). While the client
    /// waits, the response future polls that work in place (no task per request); if the
    /// response future is dropped before the work finished, the work moves to a task of its
    /// own (`tokio::spawn` on the runtime current when the request was claimed) and runs
    /// to its end there.
    ///
    /// A client that disconnects takes nothing with it: the work finishes, its outcome is
    /// stored, and the client's retry gets 409 `in-flight` while it runs, then the replay.
    /// The handler runs once. This is the right mode for infrastructure APIs, whose
    /// handlers allocate things (a node, a lease, a VM) in steps that a cancellation can cut
    /// in half.
    ///
    /// A handler panic still marks the record failed (inside the work) and is then
    /// re-raised from the response future, if that is still alive. If the runtime shuts
    /// down before a moved task finished, the record is marked failed when the runtime can
    /// still run the write, or frees itself when its lease ends.
    ///
    /// Do not rely on task-locals (`tokio::task_local!`) in the handler: they are visible
    /// while the work is polled in place and gone once it moved to its own task. The current
    /// tracing span is carried over. Outside a tokio runtime the handler runs inline.
    #[default]
    Detached,
    /// The handler runs inside the response future, as a plain tower middleware would run
    /// it: when the client disconnects, the handler is cancelled at its next await point
    /// and the record is marked failed, so a retry runs the handler again.
    ///
    /// Only safe when a cancelled handler leaves nothing behind: its side effects are
    /// transactional with its response, or keyed downstream by a sub-key from
    /// [`crate::IdempotencyContext`]. Work that outlives the cancelled future (a
    /// `spawn_blocking` transaction, a downstream call already sent, a spawned task)
    /// completes, and the retry does it again. For handlers that must be cancellable, or
    /// that rely on task-locals.
    Inline,
}

/// Everything one layer was configured with, shared read-only by every service it makes.
#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) store: Arc<dyn Store>,
    /// The record rules.
    pub(crate) policy: Policy,
    pub(crate) resolver: Arc<dyn PrincipalResolver>,
    pub(crate) key_requirement: KeyRequirement,
    /// Longest accepted key, bytes.
    pub(crate) max_key_len: usize,
    pub(crate) missing_principal: MissingPrincipal,
    /// Largest request body buffered to fingerprint, bytes.
    pub(crate) max_request_body: usize,
    /// Request headers (lower-case) that enter the fingerprint.
    pub(crate) fingerprint_headers: Vec<String>,
    pub(crate) fingerprint_mode: FingerprintMode,
    pub(crate) mismatch_status: MismatchStatus,
    pub(crate) store_failure_mode: StoreFailureMode,
    pub(crate) handler_execution: HandlerExecution,
}

impl Config {
    /// The defaults over `store` (listed on [`crate::IdempotencyLayer`]).
    pub(crate) fn new(store: Arc<dyn Store>) -> Self {
        Self {
            store,
            policy: Policy::default(),
            resolver: Arc::new(BearerToken),
            key_requirement: KeyRequirement::default(),
            max_key_len: DEFAULT_MAX_KEY_LEN,
            missing_principal: MissingPrincipal::default(),
            max_request_body: 1 << 20,
            fingerprint_headers: vec!["content-type".into()],
            fingerprint_mode: FingerprintMode::default(),
            mismatch_status: MismatchStatus::default(),
            store_failure_mode: StoreFailureMode::default(),
            handler_execution: HandlerExecution::default(),
        }
    }
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Config")
            .field("store", &self.store)
            .field("policy", &self.policy)
            .field("key_requirement", &self.key_requirement)
            .field("max_key_len", &self.max_key_len)
            .field("missing_principal", &self.missing_principal)
            .field("max_request_body", &self.max_request_body)
            .field("fingerprint_headers", &self.fingerprint_headers)
            .field("fingerprint_mode", &self.fingerprint_mode)
            .field("mismatch_status", &self.mismatch_status)
            .field("store_failure_mode", &self.store_failure_mode)
            .field("handler_execution", &self.handler_execution)
            .finish_non_exhaustive()
    }
}
