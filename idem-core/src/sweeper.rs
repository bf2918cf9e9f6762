//! The sweeper (feature `sweeper`): one background task that removes expired records from
//! any [`Store`], started by one call.
//!
//! Records past their retention are already invisible (every read treats them as absent);
//! sweeping only gives their space back. A store with [`Capabilities::native_expiry`]
//! (Redis) expires records itself, so [`Sweeper::start`] starts nothing for it. For the
//! others (redb, SQLite, Postgres, custom stores), each round calls [`Store::sweep`] with a
//! bounded batch until it reports no `more`, yielding between batches so a backlog drains
//! in short transactions that other writes interleave with. Only records past
//! `expires_at` are removed, never a live claim (retention is never shorter than the
//! lease).
//!
//! [`Capabilities::native_expiry`]: crate::Capabilities::native_expiry

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;

use crate::store::Store;

/// How often and how much a [`Sweeper`] sweeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use]
pub struct SweepConfig {
    period: Duration,
    batch: usize,
}

impl Default for SweepConfig {
    /// Every 60 s, 1,000 records per transaction: a day's retention of a busy API drains in
    /// rounds of a few ms each.
    fn default() -> Self {
        Self { period: Duration::from_secs(60), batch: 1_000 }
    }
}

impl SweepConfig {
    crate::setters! {
        /// Time between rounds (default 60 s; raised to 1 ms). The first round runs at once.
        pub fn with_period(period: Duration) => period = period.max(Duration::from_millis(1));

        /// Most records removed per [`Store::sweep`] call (default 1,000; raised to 1).
        pub fn with_batch(batch: usize) => batch = batch.max(1);
    }
}

/// A running sweep task. Dropping it stops the task (so a test or a short-lived store does
/// not leak one); keep it as long as the store serves.
#[derive(Debug)]
#[must_use = "dropping the Sweeper stops sweeping"]
pub struct Sweeper {
    task: Option<JoinHandle<()>>,
}

impl Sweeper {
    /// Starts sweeping `store` as `config` says, on the current Tokio runtime. A store with
    /// native expiry gets no task. A failed sweep is
    /// logged (`tracing` warning) and tried again next period.
    ///
    /// # Panics
    /// Outside a Tokio runtime (as `tokio::spawn` does).
    pub fn start<S: Store + ?Sized>(store: Arc<S>, config: SweepConfig) -> Self {
        if store.capabilities().native_expiry {
            tracing::debug!(store = ?store, "store expires records natively; no sweeper started");
            return Self { task: None };
        }
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(config.period);
            tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                #[cfg(feature = "metrics")]
                let backend = store.capabilities().backend;
                loop {
                    let result = store.sweep(config.batch).await;
                    #[cfg(feature = "metrics")]
                    {
                        let status = if result.is_ok() { "ok" } else { "error" };
                        metrics::counter!("idem_sweeps_total", "backend" => backend, "status" => status).increment(1);
                        if let Ok(outcome) = &result {
                            metrics::counter!("idem_swept_records_total", "backend" => backend)
                                .increment(outcome.removed);
                        }
                    }
                    match result {
                        Ok(outcome) => {
                            tracing::debug!(removed = outcome.removed, more = outcome.more, "idem sweep");
                            if !outcome.more {
                                break;
                            }
                            tokio::task::yield_now().await;
                        }
                        Err(error) => {
                            tracing::warn!(%error, "idem sweep failed; trying again next period");
                            break;
                        }
                    }
                }
            }
        });
        Self { task: Some(task) }
    }

    /// Whether a task runs (`false` for stores with native expiry).
    #[cfg(test)]
    fn is_running(&self) -> bool {
        self.task.as_ref().is_some_and(|t| !t.is_finished())
    }

    /// Stops sweeping and waits until the task has let go of the store (dropping the
    /// `Sweeper` stops it too, but the task releases the store only on its next poll; await
    /// this when the store must be closed right after, e.g. to reopen a redb file).
    pub async fn stop(mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
            // The task never ends on its own, so this only reports the cancellation.
            let _ = task.await;
        }
    }
}

impl Drop for Sweeper {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::{SweepConfig, Sweeper};
    use crate::{Capabilities, MemoryStore};

    /// A store that expires records natively gets no sweep task; one that does not, gets one.
    #[tokio::test]
    async fn native_expiry_starts_no_task() {
        let native = MemoryStore::new().with_capabilities(Capabilities { native_expiry: true, ..Capabilities::NONE });
        assert!(!Sweeper::start(Arc::new(native), SweepConfig::default()).is_running());
        let sweeping = Sweeper::start(Arc::new(MemoryStore::new()), SweepConfig::default());
        assert!(sweeping.is_running());
        sweeping.stop().await;
    }
}
