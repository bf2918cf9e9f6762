//! Resumable handlers: making the side effects inside one request converge on retry
//! (docs/contract.md, "Side effects", also says what stays unsafe).
//!
//! - [`Resumable::subkey`]: a stable id per step for a downstream API that takes a
//!   caller-supplied id or idempotency key, the same for every attempt of one generation.
//! - [`Resumable::step`]: runs a future once per record and journals its result, fenced by
//!   the attempt's token; a retry gets the journalled result back.
//! - [`Resumable::intent`]: a two-phase record (`pending`, then `done(id)`) for a call
//!   that cannot take a caller id but can be looked up afterwards by its sub-key tag.

use std::future::Future;
use std::sync::Arc;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::record::FencingToken;
use crate::scope::RecordId;
use crate::store::{JournalWrite, MAX_JOURNAL_NAME, Store, StoreError};
use crate::time::UnixMillis;

/// BLAKE3 `derive_key` context for sub-keys. Version 2 added the record's generation
/// (`created_at`) to the input.
pub const SUBKEY_CONTEXT: &str = "idem 2026-12-01 sub-key v2";

/// A sub-key: `idem-` followed by 48 lower-case hex digits (53 ASCII bytes, alphabet
/// `[0-9a-f-]`), which fits the usual downstream limits (64-byte client tokens,
/// 255-byte idempotency keys, cloud resource tags).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SubKey(String);

impl SubKey {
    /// The sub-key of step `name` of the generation of record `record` created at
    /// `created_at` (the record's [`crate::Record::created_at`], ms): BLAKE3 `derive_key`
    /// over the record id, `created_at` (i64, little-endian) and the length-prefixed name,
    /// truncated to 24 bytes.
    ///
    /// Never depends on the attempt or randomness: every attempt of one operation derives
    /// the same value; a new generation of the same key (another `created_at`) derives
    /// others (docs/contract.md, "Sub-key").
    #[must_use]
    pub fn derive(record: RecordId, created_at: UnixMillis, name: &str) -> Self {
        let mut h = crate::hash::keyed(&crate::hash::SUBKEY_HASHER, SUBKEY_CONTEXT);
        h.update(&record.0);
        h.update(&created_at.0.to_le_bytes());
        h.update(&(name.len() as u64).to_le_bytes());
        h.update(name.as_bytes());
        let digest = h.finalize();
        Self(format!("idem-{}", crate::scope::to_hex(&digest.as_bytes()[..24])))
    }

    /// The sub-key text.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for SubKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Why a step or intent did not produce a value.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StepError<E> {
    /// The step's own future failed; nothing was journalled, so a retry runs it again.
    #[error("step {name} failed")]
    Failed {
        /// The step.
        name: String,
        /// The future's error.
        #[source]
        source: E,
    },
    /// The store refused or failed. `StoreError::LeaseLost` means another attempt owns the
    /// record now: stop working and return.
    #[error("step {name}: store error")]
    Store {
        /// The step.
        name: String,
        /// The store's error.
        #[source]
        source: StoreError,
    },
    /// A journalled value does not decode as the step's type (the code changed the type
    /// between attempts).
    #[error("step {name}: the journalled value does not decode")]
    Decode {
        /// The step.
        name: String,
        /// The decoder's error.
        #[source]
        source: postcard::Error,
    },
    /// A step name that is empty or longer than the journal allows.
    #[error("step name {0:?} must be 1-250 bytes")]
    BadName(String),
    /// An intent was found pending and `reconcile` could not tell whether the call
    /// happened: the request must fail rather than risk a second call.
    #[error("intent {name} is ambiguous: a previous attempt may have made the call")]
    Ambiguous {
        /// The intent.
        name: String,
    },
    /// The attempt's [`LeaseWatch`] reports its lease lost (a renewal was refused: another
    /// attempt may own the record now), so the step or intent did not start: nothing was
    /// called and nothing journalled. Stop working and return.
    #[error("step {name} not started: this attempt lost its lease")]
    LeaseLost {
        /// The step or intent.
        name: String,
    },
}

impl<E> StepError<E> {
    /// Whether the attempt lost its lease (another attempt now owns the record): a fenced
    /// journal write, or a step refused up front by the [`LeaseWatch`].
    #[must_use]
    pub fn is_lease_lost(&self) -> bool {
        match self {
            StepError::Store { source, .. } => source.is_lease_lost(),
            StepError::LeaseLost { .. } => true,
            _ => false,
        }
    }
}

/// What a reconcile function found for a pending intent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reconciled {
    /// The earlier call happened; this is the real id it produced. It is adopted.
    Found(String),
    /// The earlier call did not happen; it is issued again (with the same sub-key).
    NotFound,
    /// Cannot tell; the request fails with [`StepError::Ambiguous`].
    Unknown,
}

#[derive(Serialize, serde::Deserialize)]
enum IntentState {
    Pending,
    Done(String),
}

/// What the code that renews an attempt's lease knows about it, asked by [`Resumable`]
/// before each step and intent (see [`Resumable::with_lease_watch`]).
pub trait LeaseWatch: Send + Sync + std::fmt::Debug {
    /// Whether the attempt's lease is known lost (a renewal was refused with
    /// [`StoreError::LeaseLost`]). Once true, stays true.
    fn is_lease_lost(&self) -> bool;
}

/// The handle a handler uses for steps, sub-keys and intents of the record it holds.
#[derive(Clone)]
pub struct Resumable {
    store: Arc<dyn Store>,
    id: RecordId,
    token: FencingToken,
    created_at: UnixMillis,
    lease: Option<Arc<dyn LeaseWatch>>,
}

impl std::fmt::Debug for Resumable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Resumable")
            .field("id", &self.id)
            .field("token", &self.token)
            .field("created_at", &self.created_at)
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}

fn journal_name<E>(prefix: &str, name: &str) -> Result<String, StepError<E>> {
    if name.is_empty() || name.len() + prefix.len() > MAX_JOURNAL_NAME.min(252) {
        return Err(StepError::BadName(name.to_string()));
    }
    Ok(format!("{prefix}{name}"))
}

impl Resumable {
    /// The handle for record `id` held with `token`, of the generation created at
    /// `created_at`: all three from the claimed or reclaimed [`crate::Record`] (the HTTP
    /// layer builds it from its claim; other callers from their own
    /// [`crate::ClaimOutcome`] or [`crate::ReclaimOutcome`]). `created_at` makes the
    /// sub-keys of one generation differ from another's (see [`SubKey::derive`]).
    #[must_use]
    pub fn new(store: Arc<dyn Store>, id: RecordId, token: FencingToken, created_at: UnixMillis) -> Self {
        Self { store, id, token, created_at, lease: None }
    }

    /// Makes every later [`Resumable::step`] and [`Resumable::intent`] ask `watch` first,
    /// and once more right before its own call, and refuse with [`StepError::LeaseLost`]
    /// without calling anything when the lease is lost. The journal write of an attempt
    /// that lost its lease is refused by the store anyway; this stops the side effect
    /// before it happens, not only its record.
    #[must_use]
    pub fn with_lease_watch(mut self, watch: Arc<dyn LeaseWatch>) -> Self {
        self.lease = Some(watch);
        self
    }

    /// `Err(LeaseLost)` once the lease watch says the lease is lost.
    fn check_lease<E>(&self, name: &str) -> Result<(), StepError<E>> {
        match &self.lease {
            Some(watch) if watch.is_lease_lost() => Err(StepError::LeaseLost { name: name.to_string() }),
            _ => Ok(()),
        }
    }

    /// The sub-key of step `name` of this record's generation (see [`SubKey::derive`]).
    #[must_use]
    pub fn subkey(&self, name: &str) -> SubKey {
        SubKey::derive(self.id, self.created_at, name)
    }

    /// Runs `f` once per record: returns the journalled result if an earlier attempt
    /// finished this step, else runs `f(subkey)` and journals its `Ok` value (postcard).
    /// If two attempts race (a stale one whose lease was reclaimed), the write of the
    /// stale one is refused ([`StepError::Store`] with `LeaseLost`) and the current
    /// owner's value stands.
    ///
    /// # Errors
    /// [`StepError`]: the future's error (not journalled), store errors, decode errors.
    pub async fn step<T, E, F, Fut>(&self, name: &str, f: F) -> Result<T, StepError<E>>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce(SubKey) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let jname = journal_name("s:", name)?;
        self.check_lease(name)?;
        let store_err = |source| StepError::Store { name: name.to_string(), source };
        let decode = |bytes: &[u8]| {
            postcard::from_bytes::<T>(bytes).map_err(|source| StepError::Decode { name: name.to_string(), source })
        };
        if let Some(bytes) = self.store.journal_get(self.id, &jname).await.map_err(store_err)? {
            return decode(&bytes);
        }
        self.check_lease(name)?;
        let value =
            f(self.subkey(name)).await.map_err(|source| StepError::Failed { name: name.to_string(), source })?;
        let bytes =
            postcard::to_allocvec(&value).map_err(|source| StepError::Decode { name: name.to_string(), source })?;
        match self.store.journal_put(self.id, self.token, &jname, bytes, false).await.map_err(store_err)? {
            JournalWrite::Written => Ok(value),
            JournalWrite::Exists(stored) => decode(&stored),
        }
    }

    /// Runs a two-phase call named `name`: `issue(subkey)` makes the call (stamping the
    /// sub-key on it as a tag) and returns the real id; `reconcile(subkey)` looks the tag
    /// up when an earlier attempt left the intent pending.
    ///
    /// 1. `done(id)` journalled: returns `id`, calls nothing.
    /// 2. `pending` journalled: `reconcile` decides: `Found(id)` adopts it (journals
    ///    `done`), `NotFound` issues again, `Unknown` fails with [`StepError::Ambiguous`].
    /// 3. Nothing journalled: journals `pending` (fenced), calls `issue`, journals
    ///    `done(id)`. If `issue` fails, the intent stays pending, so the next attempt
    ///    reconciles before issuing again.
    ///
    /// # Errors
    /// [`StepError`]: `issue`'s or `reconcile`'s error, store errors, ambiguity.
    pub async fn intent<E, I, IFut, R, RFut>(&self, name: &str, issue: I, reconcile: R) -> Result<String, StepError<E>>
    where
        I: FnOnce(SubKey) -> IFut,
        IFut: Future<Output = Result<String, E>>,
        R: FnOnce(SubKey) -> RFut,
        RFut: Future<Output = Result<Reconciled, E>>,
    {
        let jname = journal_name("i:", name)?;
        self.check_lease(name)?;
        let n = || name.to_string();
        let store_err = |source| StepError::Store { name: name.to_string(), source };
        let put = |state: IntentState| {
            let bytes = postcard::to_allocvec(&state).unwrap_or_default();
            self.store.journal_put(self.id, self.token, &jname, bytes, true)
        };
        let subkey = self.subkey(name);
        match self.store.journal_get(self.id, &jname).await.map_err(store_err)? {
            Some(bytes) => match postcard::from_bytes::<IntentState>(&bytes) {
                Ok(IntentState::Done(id)) => return Ok(id),
                Ok(IntentState::Pending) => {
                    match reconcile(subkey.clone()).await.map_err(|source| StepError::Failed { name: n(), source })? {
                        Reconciled::Found(id) => {
                            put(IntentState::Done(id.clone())).await.map_err(store_err)?;
                            return Ok(id);
                        }
                        Reconciled::NotFound => {}
                        Reconciled::Unknown => return Err(StepError::Ambiguous { name: n() }),
                    }
                }
                Err(source) => return Err(StepError::Decode { name: n(), source }),
            },
            None => {
                put(IntentState::Pending).await.map_err(store_err)?;
            }
        }
        self.check_lease(name)?;
        let id = issue(subkey).await.map_err(|source| StepError::Failed { name: n(), source })?;
        put(IntentState::Done(id.clone())).await.map_err(store_err)?;
        Ok(id)
    }
}
