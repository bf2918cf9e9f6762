//! One queued operation, typed by its outcome: what to apply, and the caller that waits for
//! exactly that outcome type.
//!
//! A batch mixes claims, completions, sweeps and journal writes, so the writer holds them
//! behind small traits; each operation still answers its caller with its own type
//! (a claim a `ClaimOutcome`, a completion a `Receipt`), with no outcome enum to unpack
//! and no "wrong kind" to report. Each stage is its own type: a queued [`Job`] is applied
//! once and becomes an [`Answer`] (sent when the batch commits) or a refusal; any of them
//! can still be failed with the batch's error.

use tokio::sync::oneshot;

use crate::store::StoreError;
use crate::table::RecordTable;
use crate::time::UnixMillis;

/// Where a caller waits for an outcome of type `R`.
pub(super) type Reply<R> = oneshot::Sender<Result<R, StoreError>>;

/// Whether an operation is still applied once its caller stopped waiting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Unawaited {
    /// Skip it: a claim or a reclaim nobody waits for would only hold a lease nobody uses.
    Skip,
    /// Apply it anyway: a completion, a fail, a renewal, a journal write or a sweep is
    /// worth keeping.
    Apply,
}

/// An applied operation: its answer, or its caller and the error it was refused with.
pub(super) type Applied = Result<Box<dyn Answer>, (Box<dyn Caller>, StoreError)>;

/// A caller, with the type of its outcome erased: all that is left is to fail it.
pub(super) trait Caller: Send {
    /// Sends `error` as the operation's outcome (a caller that went away needs none).
    fn fail(self: Box<Self>, error: StoreError);
}

/// An applied operation whose outcome waits for its batch's commit.
pub(super) trait Answer: Caller {
    /// Sends the outcome: the batch holding the operation committed.
    fn send(self: Box<Self>);
}

/// A queued operation, not yet applied.
pub(super) trait Job: Caller {
    /// Whether to skip it: its caller stopped waiting, and it only matters to one that
    /// waits ([`Unawaited::Skip`]).
    fn abandoned(&self) -> bool;

    /// Applies it on `table` at `now` through [`crate::engine`].
    fn apply(self: Box<Self>, table: &mut dyn RecordTable, now: UnixMillis) -> Applied;
}

/// An operation as a caller queues it: `apply` answers with `R`.
pub(super) struct Op<F, R> {
    apply: F,
    reply: Reply<R>,
    unawaited: Unawaited,
}

impl<F, R> Op<F, R> {
    pub(super) fn new(apply: F, reply: Reply<R>, unawaited: Unawaited) -> Self {
        Self { apply, reply, unawaited }
    }
}

/// An operation's outcome and its caller, waiting for the commit.
struct Done<R> {
    reply: Reply<R>,
    outcome: R,
}

impl<R: Send> Caller for Reply<R> {
    fn fail(self: Box<Self>, error: StoreError) {
        let _ = self.send(Err(error));
    }
}

impl<R: Send> Caller for Done<R> {
    fn fail(self: Box<Self>, error: StoreError) {
        let _ = self.reply.send(Err(error));
    }
}

impl<R: Send> Answer for Done<R> {
    fn send(self: Box<Self>) {
        let _ = self.reply.send(Ok(self.outcome));
    }
}

impl<F: Send, R: Send> Caller for Op<F, R> {
    fn fail(self: Box<Self>, error: StoreError) {
        let _ = self.reply.send(Err(error));
    }
}

impl<F, R> Job for Op<F, R>
where
    F: FnOnce(&mut dyn RecordTable, UnixMillis) -> Result<R, StoreError> + Send + 'static,
    R: Send + 'static,
{
    fn abandoned(&self) -> bool {
        self.unawaited == Unawaited::Skip && self.reply.is_closed()
    }

    fn apply(self: Box<Self>, table: &mut dyn RecordTable, now: UnixMillis) -> Applied {
        let Op { apply, reply, .. } = *self;
        match apply(table, now) {
            Ok(outcome) => Ok(Box::new(Done { reply, outcome })),
            Err(error) => Err((Box::new(reply), error)),
        }
    }
}
