//! # idem-core
//!
//! The pure core of idem: everything that decides what a retried request gets, with no
//! I/O, no runtime and no clock reads (`now` is always an argument). Backends implement
//! [`Store`]; the HTTP layer calls [`decide`]; the in-process stores run [`engine`] over a
//! table such as [`Model`], and the conformance suite checks every backend against its own
//! statement of the rules (`idem_conformance::Spec`).
//!
//! ```
//! use std::time::Duration;
//! use idem_core::engine;
//! use idem_core::{decide, ClaimOutcome, ClaimRequest, Decision, Endpoint, Fingerprint, IdempotencyKey,
//!     Model, RequestParts, Scope, UnixMillis};
//!
//! let key = IdempotencyKey::parse(b"\"7c3f5d1e-91a4\"").unwrap();
//! let scope = Scope::new("token:ml-eval", Endpoint::new("POST", "/v1/workers")).unwrap();
//! let fp = Fingerprint::of(&RequestParts {
//!     method: "POST", path: "/v1/workers", query: None, headers: &[], body: b"{}",
//! });
//! let mut model = Model::new();
//! let now = UnixMillis(1_000);
//! assert_eq!(decide(None, &fp, now), Decision::Claim);
//! let req = ClaimRequest::new(scope, key, fp, Duration::from_secs(300), Duration::from_secs(86_400));
//! let ClaimOutcome::Claimed(record) = engine::claim(&mut model, &req, now).unwrap() else { unreachable!() };
//! // A retry while the first attempt runs: 409 with Retry-After.
//! assert_eq!(decide(Some(&record), &fp, UnixMillis(2_000)), Decision::InFlight { retry_after_secs: 299 });
//! ```
//!
//! # Layout
//! - [`key`]: parsing the `Idempotency-Key` header (bare token or RFC 8941 sf-string).
//! - [`scope`]: principal, endpoint, scope and the 32-byte [`RecordId`].
//! - [`fingerprint`]: what makes a retry "the same request" (canonical JSON with feature
//!   `canonical-json`).
//! - [`record`]: the record, its states, the fencing token and the stored response.
//! - [`policy`]: the record rules: retention, lease TTL, cacheable statuses, and which
//!   headers and how much body a stored response keeps.
//! - [`decision`]: the decision table.
//! - [`transition`]: the state machine as pure functions, and the store requests/outcomes.
//! - [`table`]: the record-table seam ([`RecordTable`]) an in-process store implements.
//! - [`engine`]: every store operation as a read-compute-write on a [`RecordTable`],
//!   shared by the model, redb, SQLite and any custom in-process store.
//! - [`model`]: the reference model (oracle), the smallest [`RecordTable`].
//! - [`resume`]: sub-keys, steps and intents for handlers whose side effects must
//!   converge on retry.
//! - [`store`]: the [`Store`] contract and [`StoreError`].
//! - [`settle`]: [`Settlements`], the waiters a store wakes when a record settles.
//! - [`list`]: what [`Store::list`] returns to operators, and the pure page selection.
//! - [`codec`]: the versioned postcard byte form of a record.
//! - `seal` (feature `seal`): `Sealing`, which encrypts and authenticates stored
//!   responses (XChaCha20-Poly1305) bound to their record id and fencing token.
//!   It reads OS randomness for nonces, the one thing here besides the executors that
//!   touches the system.
//! - [`time`]: milliseconds since the epoch and the clocks stores read.
//! - `memory` (feature `memory`, on by default): [`MemoryStore`] and [`TableStore`], any
//!   record table behind one mutex.
//! - `group_commit` (feature `group-commit`): the writer thread that batches an embedded
//!   store's writes into one transaction, and `Embedded`, the `Store` of every store on
//!   it. With `sweeper` (feature `sweeper`), the only modules that run anything:
//!   everything else here is pure.
//! - `sweeper` (feature `sweeper`): `Sweeper`, the one background task that removes
//!   expired records from any store.

/// Builder setters that put their argument, or a value made from it, in one field: each
/// `fn with_x(arg: T) => field = value;` is `fn with_x(mut self, arg: T) -> Self`, with the
/// docs and attributes written before it (`=> via().field`: the field of what `via` returns).
#[doc(hidden)]
#[macro_export]
macro_rules! setters {
    ($($(#[$attr:meta])* $vis:vis fn $name:ident($arg:ident: $ty:ty) => $($field:ident).+ = $value:expr;)+) => {
        $($(#[$attr])* $vis fn $name(mut self, $arg: $ty) -> Self {
            self.$($field).+ = $value;
            self
        })+
    };
    ($($(#[$attr:meta])* $vis:vis fn $name:ident($arg:ident: $ty:ty) => $via:ident().$($field:ident).+ = $value:expr;)+) => {
        $($(#[$attr])* $vis fn $name(mut self, $arg: $ty) -> Self {
            self.$via().$($field).+ = $value;
            self
        })+
    };
}

pub mod codec;
mod corrupt;
pub mod decision;
pub mod engine;
pub mod fingerprint;
#[cfg(feature = "group-commit")]
pub mod group_commit;
mod hash;
pub mod key;
pub mod list;
#[cfg(feature = "memory")]
pub mod memory;
pub mod model;
pub mod policy;
pub mod record;
pub mod resume;
pub mod scope;
#[cfg(feature = "seal")]
pub mod seal;
pub mod settle;
pub mod store;
#[cfg(feature = "sweeper")]
pub mod sweeper;
pub mod table;
pub mod time;
pub mod transition;

pub use decision::{Decision, decide, retry_after_secs};
pub use fingerprint::{Fingerprint, FingerprintMode, RequestParts};
pub use key::{IdempotencyKey, KeyError};
pub use list::{ListFilter, Listing};
#[cfg(feature = "memory")]
pub use memory::{MemoryStore, TableStore};
pub use model::Model;
pub use policy::Policy;
pub use record::{FencingToken, Record, RecordState, StoredBody, StoredResponse};
pub use resume::{LeaseWatch, Reconciled, Resumable, StepError, SubKey};
pub use scope::{Endpoint, Principal, RecordId, Scope, ScopeError};
pub use settle::{Settlement, Settlements};
pub use store::{BoxError, Capabilities, JournalWrite, Receipt, Store, StoreError, SweepOutcome};
#[cfg(feature = "sweeper")]
pub use sweeper::{SweepConfig, Sweeper};
pub use table::{Expired, RecordRead, RecordTable};
pub use time::{Clock, ManualClock, SystemClock, UnixMillis};
pub use transition::{ClaimOutcome, ClaimRequest, LeaseLost, ReclaimOutcome, ReclaimRequest};
