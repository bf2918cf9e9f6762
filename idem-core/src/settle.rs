//! [`Settlements`]: who waits for which record's outcome, so a store that learns a record
//! settled (completed or failed) can wake its waiters instead of letting them poll.
//!
//! A wake-up is a hint: the waiter reads the record again and decides on what it reads,
//! so a spurious one costs a read and a lost one costs the waiter's poll pause.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};

use tokio::sync::Notify;
use tokio::sync::futures::OwnedNotified;

use crate::scope::RecordId;

/// The waiters of one store, by record; a record with no waiter has no entry, so the map
/// holds at most one entry per waiting request.
#[derive(Debug, Default)]
pub struct Settlements {
    waiting: Mutex<HashMap<RecordId, Arc<Notify>>>,
}

/// Interest in one record's outcome: a future that completes at the first
/// [`Settlements::settle`] of the record after [`Settlements::watch`] made it, whether or
/// not it was polled by then. Dropping it withdraws the interest.
#[derive(Debug)]
pub struct Settlement<'a> {
    hub: &'a Settlements,
    id: RecordId,
    notified: Option<Pin<Box<OwnedNotified>>>,
}

impl Settlements {
    fn lock(&self) -> MutexGuard<'_, HashMap<RecordId, Arc<Notify>>> {
        // Every critical section is one map operation: a poisoned map is still whole.
        self.waiting.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers interest in `id`'s outcome. Call it before the read whose answer the
    /// wait follows, so an outcome written between that read and the wait still wakes it.
    pub fn watch(&self, id: RecordId) -> Settlement<'_> {
        let notify = Arc::clone(self.lock().entry(id).or_default());
        Settlement { hub: self, id, notified: Some(Box::pin(notify.notified_owned())) }
    }

    /// Wakes every waiter of `id` (the record was completed or failed).
    pub fn settle(&self, id: RecordId) {
        if let Some(notify) = self.lock().get(&id) {
            notify.notify_waiters();
        }
    }
}

impl Future for Settlement<'_> {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        self.notified.as_mut().map_or(Poll::Ready(()), |n| n.as_mut().poll(cx))
    }
}

impl Drop for Settlement<'_> {
    fn drop(&mut self) {
        // This waiter's reference goes first; under the lock (which `watch` takes to add
        // one), only the map's reference left means nobody else waits.
        self.notified = None;
        let mut waiting = self.hub.lock();
        if waiting.get(&self.id).is_some_and(|n| Arc::strong_count(n) == 1) {
            waiting.remove(&self.id);
        }
    }
}
