//! Listing records for operators: which records [`crate::Store::list`] returns, and the
//! pure selection every store that cannot filter in its engine reuses.
//!
//! Listing is an admin operation (the `idem` CLI's `list` and `stats`), never on a
//! request's path: no decision depends on it, and a store that cannot list answers
//! [`crate::StoreError::Unsupported`] and leaves [`crate::Capabilities::list`] unset.
//!
//! # Paging
//! Records come in ascending [`RecordId`] order (the primary key of every table, so SQL
//! and redb stores page through an index). A page holds up to `limit` records; when more
//! records match, [`Listing::more`] is true and the next page starts after the last id of
//! this one ([`ListFilter::after`]). Ids are hashes, so this order says nothing about age:
//! sort a page by [`Record::started_at`] to see the oldest first.

use crate::record::{Record, RecordState};
use crate::scope::{Principal, RecordId};
use crate::time::UnixMillis;

/// Which live records a [`crate::Store::list`] call returns. Every condition set must hold.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ListFilter {
    /// Only records in this state; `None`: any state.
    pub state: Option<RecordState>,
    /// Only records whose current attempt started at or before this time (ms since the
    /// epoch, the store's clock): "at least this old" for a stuck claim. `None`: any age.
    pub started_before: Option<UnixMillis>,
    /// Only records of this principal (exact match). `None`: every principal.
    pub principal: Option<Principal>,
    /// Only records whose id is greater than this one: where the previous page ended.
    pub after: Option<RecordId>,
    /// Most records in the page. Zero returns an empty page that still says (`more`)
    /// whether any record matches.
    pub limit: usize,
}

impl ListFilter {
    /// Every live record, up to `limit` per page.
    #[must_use]
    pub fn new(limit: usize) -> Self {
        Self { limit, ..Self::default() }
    }

    crate::setters! {
        /// Only records in `state`.
        #[must_use]
        pub fn with_state(state: RecordState) => state = Some(state);

        /// Only records whose current attempt started at or before `t`.
        #[must_use]
        pub fn with_started_before(t: UnixMillis) => started_before = Some(t);

        /// Only records of `principal`.
        #[must_use]
        pub fn with_principal(principal: impl Into<String>) => principal = Some(Principal(principal.into()));

        /// Only records after `id` (the last id of the previous page).
        #[must_use]
        pub fn with_after(id: RecordId) => after = Some(id);
    }

    /// Whether `record` belongs in the listing at `now`: live (`now < expires_at`, the
    /// rule [`crate::Store::get`] follows), after the cursor, and every set condition holds.
    #[must_use]
    pub fn matches(&self, record: &Record, now: UnixMillis) -> bool {
        !record.is_expired(now)
            && self.after.is_none_or(|after| record.id > after)
            && self.state.is_none_or(|s| record.state == s)
            && self.started_before.is_none_or(|t| record.started_at <= t)
            && self.principal.as_ref().is_none_or(|p| record.scope.principal == *p)
    }

    /// The page of `records` (any order, any mix of matching and other records) this
    /// filter selects at `now`: the matching ones in id order, at most `limit`, and
    /// whether more matched. For stores that visit records in no useful order (a map, a
    /// Redis `SCAN`); memory grows with the number of matching records.
    #[must_use]
    pub fn select(&self, records: impl IntoIterator<Item = Record>, now: UnixMillis) -> Listing {
        let mut page: Vec<Record> = records.into_iter().filter(|r| self.matches(r, now)).collect();
        page.sort_unstable_by_key(|r| r.id);
        let more = page.len() > self.limit;
        page.truncate(self.limit);
        Listing { now, records: page, more }
    }
}

/// One page of a [`crate::Store::list`] call.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Listing {
    /// The store's clock when it listed (ms since the epoch): ages and remaining leases are
    /// measured from it.
    pub now: UnixMillis,
    /// The matching records, ascending by id, at most the filter's `limit`.
    pub records: Vec<Record>,
    /// Whether more records matched than the page holds; the next page starts after the
    /// last id in `records`.
    pub more: bool,
}

impl Listing {
    /// A page of `records` (already in id order and within the limit) read at `now`.
    #[must_use]
    pub fn new(now: UnixMillis, records: Vec<Record>, more: bool) -> Self {
        Self { now, records, more }
    }
}
