//! [`IdempotencyLayer`]: the configuration, and the tower [`Layer`] that wraps a service
//! in [`Idempotency`].

use std::fmt;
use std::sync::Arc;

use idem_core::{Policy, Store};
use tower::Layer;

use crate::principal::{BearerToken, PrincipalResolver};
use crate::service::Idempotency;

/// What the layer does with a non-safe request that has no `Idempotency-Key` field.
///
/// A field that is present but empty, blank or otherwise invalid is always a 400, whatever
/// this says: a client that meant to send a key must not silently lose its protection
/// (handed case C12).
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
/// Never a shared bucket: records are always scoped by a real principal (handed case C11).
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

/// Shared, read-only configuration of every service the layer makes.
#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) store: Arc<dyn Store>,
    pub(crate) policy: Policy,
    pub(crate) resolver: Arc<dyn PrincipalResolver>,
    pub(crate) key_requirement: KeyRequirement,
    pub(crate) missing_principal: MissingPrincipal,
    pub(crate) handler_execution: HandlerExecution,
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Config")
            .field("store", &self.store)
            .field("policy", &self.policy)
            .field("key_requirement", &self.key_requirement)
            .field("missing_principal", &self.missing_principal)
            .field("handler_execution", &self.handler_execution)
            .finish_non_exhaustive()
    }
}

/// Tower layer that makes the wrapped service idempotent per `Idempotency-Key`.
///
/// Defaults: [`Policy::default()`] (24 h retention, 5 min lease, 1 MiB body limits, fail
/// closed), principals from [`BearerToken`], [`KeyRequirement::Required`],
/// [`MissingPrincipal::Reject`], [`HandlerExecution::Detached`]. Cloning is cheap (one `Arc`).
///
/// ```
/// use std::sync::Arc;
/// use std::time::Duration;
/// use idem_core::{MemoryStore, Policy};
/// use idem_http::{IdempotencyLayer, KeyRequirement};
///
/// let layer = IdempotencyLayer::new(Arc::new(MemoryStore::new()))
///     .with_policy(Policy::default().with_retention(Duration::from_secs(7 * 86_400)))
///     .with_key_requirement(KeyRequirement::Optional);
/// assert_eq!(layer.policy().retention, Duration::from_secs(7 * 86_400));
/// ```
#[derive(Clone, Debug)]
pub struct IdempotencyLayer {
    config: Arc<Config>,
}

impl IdempotencyLayer {
    /// A layer over `store` with the defaults above.
    #[must_use]
    pub fn new(store: Arc<dyn Store>) -> Self {
        Self {
            config: Arc::new(Config {
                store,
                policy: Policy::default(),
                resolver: Arc::new(BearerToken),
                key_requirement: KeyRequirement::default(),
                missing_principal: MissingPrincipal::default(),
                handler_execution: HandlerExecution::default(),
            }),
        }
    }

    /// Replaces the policy (retention, lease, limits, cacheable statuses, header rules,
    /// mismatch status, store failure mode).
    #[must_use]
    pub fn with_policy(mut self, policy: Policy) -> Self {
        Arc::make_mut(&mut self.config).policy = policy;
        self
    }

    /// Replaces the principal resolver (default [`BearerToken`]).
    #[must_use]
    pub fn with_principal_resolver(mut self, resolver: impl PrincipalResolver) -> Self {
        Arc::make_mut(&mut self.config).resolver = Arc::new(resolver);
        self
    }

    /// Sets what happens to non-safe requests without a key (default
    /// [`KeyRequirement::Required`]).
    #[must_use]
    pub fn with_key_requirement(mut self, requirement: KeyRequirement) -> Self {
        Arc::make_mut(&mut self.config).key_requirement = requirement;
        self
    }

    /// Sets what happens to keyed requests without a principal (default
    /// [`MissingPrincipal::Reject`]).
    #[must_use]
    pub fn on_missing_principal(mut self, rule: MissingPrincipal) -> Self {
        Arc::make_mut(&mut self.config).missing_principal = rule;
        self
    }

    /// Sets where a claimed request's handler runs (default [`HandlerExecution::Detached`]:
    /// in its own task, so a client disconnect does not cancel it half-way).
    #[must_use]
    pub fn with_handler_execution(mut self, execution: HandlerExecution) -> Self {
        Arc::make_mut(&mut self.config).handler_execution = execution;
        self
    }

    /// The policy in force.
    #[must_use]
    pub fn policy(&self) -> &Policy {
        &self.config.policy
    }

    /// The store records go to.
    #[must_use]
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.config.store
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency::new(inner, Arc::clone(&self.config))
    }
}
