//! The background sweep: deletes expired records in bounded batches, on a period.

use std::time::Duration;

use idem_core::Store;
use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;

/// Spawns a task that sweeps `store` every `period`: each round calls
/// [`Store::sweep`] with `batch` until it reports no `more`, yielding between batches so
/// one round never holds a runtime thread or a large lock set for long. Only records past
/// `expires_at` are deleted, never a live claim. A failed sweep is logged (`tracing`
/// warning) and retried next period.
///
/// `period` is raised to 1 ms and `batch` to 1 if given as zero. The task runs until the
/// returned handle is aborted (dropping the handle detaches it). The first round runs at
/// once. For PostgreSQL, reclaiming the space of deleted rows stays autovacuum's job; a
/// batch of a few hundred to a few thousand rows keeps each delete short.
///
/// Must be called inside a Tokio runtime.
pub fn spawn_sweeper<S: Store>(store: S, period: Duration, batch: usize) -> JoinHandle<()> {
    let period = period.max(Duration::from_millis(1));
    let batch = batch.max(1);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            loop {
                match store.sweep(batch).await {
                    Ok(outcome) if outcome.more => tokio::task::yield_now().await,
                    Ok(_) => break,
                    Err(error) => {
                        tracing::warn!(%error, "idem sweep failed; retrying next period");
                        break;
                    }
                }
            }
        }
    })
}
