//! The hand-off from async callers to the writer thread: a mutex-guarded queue and a
//! condition variable.
//!
//! Pushing never blocks an async caller for longer than one short lock. The writer sleeps
//! on the condition variable until an operation arrives (no spinning, which would steal
//! one of few cores from the callers it waits for), takes everything queued under one
//! lock, and waits with a deadline for the linger.
//! Closing the queue is how the store tells the writer to stop.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

/// What a wait for the next item found.
pub(crate) enum Next<T> {
    /// An item.
    Item(T),
    /// The deadline passed first.
    Timeout,
    /// The queue was closed and is empty.
    Closed,
}

/// A multi-producer, single-consumer queue with blocking waits.
#[derive(Debug)]
pub(crate) struct Queue<T> {
    state: Mutex<State<T>>,
    ready: Condvar,
}

#[derive(Debug)]
struct State<T> {
    items: VecDeque<T>,
    closed: bool,
}

impl<T> Queue<T> {
    pub(crate) fn new() -> Self {
        Self { state: Mutex::new(State { items: VecDeque::new(), closed: false }), ready: Condvar::new() }
    }

    fn lock(&self) -> MutexGuard<'_, State<T>> {
        // Every critical section is a single push, pop or flag write, so a panic inside one
        // (there is none that can) would still leave the queue consistent.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Appends `item`; gives it back if the queue is closed.
    pub(crate) fn push(&self, item: T) -> Result<(), T> {
        let mut state = self.lock();
        if state.closed {
            return Err(item);
        }
        state.items.push_back(item);
        drop(state);
        self.ready.notify_one();
        Ok(())
    }

    /// Refuses further pushes; the consumer still gets what is queued.
    pub(crate) fn close(&self) {
        self.lock().closed = true;
        self.ready.notify_all();
    }

    /// Closes the queue and takes everything still in it.
    pub(crate) fn close_and_take(&self) -> Vec<T> {
        let mut state = self.lock();
        state.closed = true;
        state.items.drain(..).collect()
    }

    /// Waits for the next item, until `deadline` if there is one.
    pub(crate) fn next(&self, deadline: Option<Instant>) -> Next<T> {
        let mut state = self.lock();
        loop {
            if let Some(item) = state.items.pop_front() {
                return Next::Item(item);
            }
            if state.closed {
                return Next::Closed;
            }
            state = match deadline {
                None => self.ready.wait(state).unwrap_or_else(PoisonError::into_inner),
                Some(deadline) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Next::Timeout;
                    }
                    self.ready.wait_timeout(state, left).unwrap_or_else(PoisonError::into_inner).0
                }
            };
        }
    }

    /// Moves queued items into `out` without waiting, until `out` holds `max`.
    pub(crate) fn drain_into(&self, out: &mut Vec<T>, max: usize) {
        let mut state = self.lock();
        while out.len() < max {
            match state.items.pop_front() {
                Some(item) => out.push(item),
                None => break,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{Next, Queue};

    /// Closing refuses new items but the consumer still gets every queued one, in order,
    /// before it learns that the queue is closed.
    #[test]
    fn close_drains_in_order_then_reports_closed() {
        let q = Queue::new();
        q.push(1).expect("open");
        q.push(2).expect("open");
        q.close();
        assert!(matches!(q.push(3), Err(3)));
        assert!(matches!(q.next(None), Next::Item(1)));
        let mut out = Vec::new();
        q.drain_into(&mut out, 10);
        assert_eq!(out, vec![2]);
        assert!(matches!(q.next(None), Next::Closed));
    }

    /// A wait with a deadline returns `Timeout` on an empty open queue, and a push from
    /// another thread wakes a waiter without a deadline.
    #[test]
    fn waits_time_out_or_wake_on_push() {
        let q = std::sync::Arc::new(Queue::new());
        assert!(matches!(q.next(Some(std::time::Instant::now() + Duration::from_millis(1))), Next::<u8>::Timeout));
        let pusher = {
            let q = std::sync::Arc::clone(&q);
            std::thread::spawn(move || q.push(7).expect("open"))
        };
        assert!(matches!(q.next(None), Next::Item(7)));
        pusher.join().expect("pusher");
        assert_eq!(q.close_and_take(), Vec::<u8>::new());
    }
}
