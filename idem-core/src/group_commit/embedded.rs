//! [`Embedded`]: what a store on an embedded engine supplies (its writer, its read views),
//! and the [`Store`] every such store is on top of them, written once.

use std::fmt;
use std::time::Duration;

use async_trait::async_trait;

use super::GroupCommit;
use super::job::Unawaited;
use crate::engine;
use crate::list::{ListFilter, Listing};
use crate::record::{FencingToken, Record, StoredResponse};
use crate::scope::RecordId;
use crate::settle::Settlements;
use crate::store::{Capabilities, JournalWrite, Receipt, Store, StoreError, SweepOutcome};
use crate::table::RecordRead;
use crate::time::UnixMillis;
use crate::transition::{ClaimOutcome, ClaimRequest, ReclaimOutcome, ReclaimRequest};

/// A store on an embedded engine (redb, SQLite): a [`GroupCommit`] writer over the
/// engine's write transactions, and read views of its committed state. Implementing it
/// makes the type a [`Store`]:
///
/// - every operation that may write goes to [`Embedded::writer`], so it is applied in a
///   batch through [`crate::engine`] and answered after the batch's commit;
/// - a claim first looks in a view at hand ([`Embedded::try_view`]): a live record is the
///   answer, without the writer, so replays never wait for (or dilute) a group commit;
///   anything else goes to the writer, which writes the claim where nothing is stored and
///   decides on what is stored in the same step ([`crate::RecordTable::create`]);
/// - `get`, `journal_get` and `list` read one [`Embedded::view`] on Tokio's blocking pool,
///   with `now` read after the view began (a record live now was live at its snapshot).
pub trait Embedded: Clone + fmt::Debug + Send + Sync + 'static {
    /// What the store offers ([`Store::capabilities`]).
    const CAPABILITIES: Capabilities;

    /// The writer every write goes to.
    fn writer(&self) -> &GroupCommit;

    /// Runs `read` on a view the caller's thread can use at once (a redb read transaction,
    /// a free pooled SQLite reader), for a claim's first look; `None` when no view is at
    /// hand, and the claim goes to the writer. Runs on an async task: it must not wait
    /// (no file to open, no lock another connection holds). Every acknowledged write is
    /// visible to a view begun after it, because the writer answers only after its commit.
    fn try_view<T>(&self, read: impl FnOnce(&dyn RecordRead) -> T) -> Option<T>;

    /// Runs `read` on a view whose reads all see one committed snapshot. May block (open
    /// the file again, connect a reader): it runs on Tokio's blocking pool.
    ///
    /// # Errors
    /// When no view can be begun; what `read` returns.
    fn view<T>(&self, read: impl FnOnce(&dyn RecordRead) -> Result<T, StoreError>) -> Result<T, StoreError>;
}

/// Runs `read` on a view of `store` on the blocking pool, with the store's `now` read
/// after the view began.
async fn read<E: Embedded, T: Send + 'static>(
    store: &E,
    read: impl FnOnce(&dyn RecordRead, UnixMillis) -> Result<T, StoreError> + Send + 'static,
) -> Result<T, StoreError> {
    let store = store.clone();
    let backend = store.writer().backend();
    tokio::task::spawn_blocking(move || {
        let clock = store.writer().clock();
        store.view(|view| read(view, clock.now()))
    })
    .await
    .map_err(|join| StoreError::unavailable(backend, "a blocking read task failed", false, join))?
}

#[async_trait]
impl<E: Embedded> Store for E {
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let writer = self.writer();
        // Before the first await: a claim that goes on to the writer is queued in the order
        // its future was first polled.
        if let Some(Some(outcome)) = self.try_view(|view| writer.claim_from_view(view, &req)) {
            return Ok(outcome);
        }
        writer.submit(Unawaited::Skip, move |t, now| engine::claim(t, &req, now)).await
    }

    async fn reclaim(&self, req: ReclaimRequest) -> Result<ReclaimOutcome, StoreError> {
        self.writer().submit(Unawaited::Skip, move |t, now| engine::reclaim(t, &req, now)).await
    }

    async fn complete(
        &self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Receipt, StoreError> {
        let done = self.writer().submit(Unawaited::Apply, move |t, now| engine::complete(t, id, token, response, now));
        done.await.inspect(|_| self.writer().settlements().settle(id))
    }

    async fn fail(&self, id: RecordId, token: FencingToken) -> Result<Receipt, StoreError> {
        let done = self.writer().submit(Unawaited::Apply, move |t, now| engine::fail(t, id, token, now));
        done.await.inspect(|_| self.writer().settlements().settle(id))
    }

    async fn extend(&self, id: RecordId, token: FencingToken, lease_ttl: Duration) -> Result<Receipt, StoreError> {
        self.writer().submit(Unawaited::Apply, move |t, now| engine::extend(t, id, token, lease_ttl, now)).await
    }

    async fn get(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        read(self, move |view, now| engine::get(view, id, now)).await
    }

    async fn sweep(&self, limit: usize) -> Result<SweepOutcome, StoreError> {
        self.writer().submit(Unawaited::Apply, move |t, now| engine::sweep(t, limit, now)).await
    }

    fn capabilities(&self) -> Capabilities {
        Self::CAPABILITIES
    }

    async fn journal_put(
        &self,
        id: RecordId,
        token: FencingToken,
        name: &str,
        value: Vec<u8>,
        overwrite: bool,
    ) -> Result<JournalWrite, StoreError> {
        let name = name.to_owned();
        self.writer()
            .submit(Unawaited::Apply, move |t, now| engine::journal_put(t, id, token, &name, &value, overwrite, now))
            .await
    }

    async fn journal_get(&self, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let name = name.to_owned();
        read(self, move |view, now| engine::journal_get(view, id, &name, now)).await
    }

    async fn list(&self, filter: ListFilter) -> Result<Listing, StoreError> {
        read(self, move |view, now| view.list(&filter, now)).await
    }

    /// Settled after the commit, by this handle and its clones (one writer); another
    /// handle on the same file has a writer of its own, so its waiters poll.
    fn settlements(&self) -> Option<&Settlements> {
        Some(self.writer().settlements())
    }
}
