//! Listing for operators ([`idem_core::Store::list`], the `idem` CLI's `list` and `stats`):
//! live records only, in id order, every filter condition applied, pages that resume after
//! the cursor and say whether more matched, nothing changed by reading. A store without
//! [`idem_core::Capabilities::list`] must refuse with `Unsupported`.

use std::collections::BTreeSet;
use std::time::Duration;

use idem_core::{ListFilter, Listing, RecordId, RecordState, StoreError, UnixMillis};

use super::{claim_req, claim_req_timed, completed, failed, get, must_claim, response};
use crate::Env;

async fn list(env: &Env, filter: ListFilter) -> Listing {
    env.store.list(filter).await.expect("list")
}

fn ids(listing: &Listing) -> Vec<RecordId> {
    listing.records.iter().map(|r| r.id).collect()
}

/// Checks the "list unsupported" variant when the store does not declare listing; returns
/// whether the scenario should go on.
async fn declared(env: &Env) -> bool {
    if env.capabilities().list {
        env.report("list: the store lists records");
        return true;
    }
    env.report("list unsupported: list must answer Unsupported");
    match env.store.list(ListFilter::new(10)).await {
        Err(StoreError::Unsupported { .. }) => false,
        other => panic!("a store without Capabilities::list must answer Unsupported, got {other:?}"),
    }
}

/// One principal's live records by state and age, in id order, each exactly as `get`
/// reads it; expired records and other principals' records never appear.
pub async fn list_filters_live_records_by_state_age_and_principal(env: Env) {
    if !declared(&env).await {
        return;
    }
    let principal = env.principal("lister");
    let store = env.store.as_ref();
    // A record whose retention has passed (swept or not, it is gone).
    let second = Duration::from_secs(1);
    must_claim(&env, claim_req_timed(&env, "lister", "gone", b"g", second, second)).await;
    env.clock.advance_ms(2_000);
    let started = UnixMillis(env.clock.now_ms());
    let in_flight = must_claim(&env, claim_req(&env, "lister", "in-flight", b"a")).await;
    let done = must_claim(&env, claim_req(&env, "lister", "completed", b"b")).await;
    let done = completed(store, &done, response()).await;
    let broke = must_claim(&env, claim_req(&env, "lister", "failed", b"c")).await;
    let broke = failed(store, &broke).await;
    env.clock.advance_ms(10);
    let later = must_claim(&env, claim_req(&env, "lister", "later", b"d")).await;
    let other = must_claim(&env, claim_req(&env, "other", "in-flight", b"a")).await;

    let mut all: Vec<_> = [&in_flight, &done, &broke, &later].map(|r| r.id).to_vec();
    all.sort_unstable();
    let page = list(&env, ListFilter::new(100).with_principal(principal.clone())).await;
    assert_eq!(ids(&page), all, "the principal's live records, ascending by id, the expired one left out");
    assert!(!page.more, "every match fits in the page");
    assert_eq!(page.now, UnixMillis(env.clock.now_ms()), "the listing reports the store's clock");
    for record in &page.records {
        assert_eq!(Some(record.clone()), get(store, record.id).await, "a listed record is what get reads");
    }

    let by_state = |state| ListFilter::new(100).with_principal(principal.clone()).with_state(state);
    let mut flying = vec![in_flight.id, later.id];
    flying.sort_unstable();
    assert_eq!(ids(&list(&env, by_state(RecordState::InFlight)).await), flying, "in-flight records only");
    assert_eq!(ids(&list(&env, by_state(RecordState::Completed)).await), vec![done.id], "completed only");
    assert_eq!(ids(&list(&env, by_state(RecordState::Failed)).await), vec![broke.id], "failed only");

    let old = ListFilter::new(100).with_principal(principal.clone()).with_started_before(started);
    let mut first_three = vec![in_flight.id, done.id, broke.id];
    first_three.sort_unstable();
    assert_eq!(ids(&list(&env, old).await), first_three, "started at or before the bound, not after");

    let others = list(&env, ListFilter::new(100).with_principal(env.principal("other"))).await;
    assert_eq!(ids(&others), vec![other.id], "another principal's listing holds only its record");
}

/// Pages of one record resume after the cursor, say `more` until the last, and together
/// list every match once; a zero limit lists nothing but says whether anything matches.
pub async fn list_pages_resume_after_the_cursor(env: Env) {
    if !declared(&env).await {
        return;
    }
    let principal = env.principal("pager");
    let mut made = BTreeSet::new();
    for i in 0..5 {
        let r = must_claim(&env, claim_req(&env, "pager", &format!("k{i}"), b"x")).await;
        made.insert(r.id);
    }
    let filter = ListFilter::new(1).with_principal(principal.clone());
    let mut seen = Vec::new();
    let mut page = list(&env, filter.clone()).await;
    for pages in 1.. {
        assert!(pages <= made.len(), "more pages than records: the cursor does not advance");
        assert!(page.records.len() <= 1, "a page never holds more than its limit");
        seen.extend(ids(&page));
        if !page.more {
            break;
        }
        let last = *seen.last().expect("a page that says more holds a record");
        page = list(&env, filter.clone().with_after(last)).await;
    }
    assert_eq!(seen, made.iter().copied().collect::<Vec<_>>(), "the pages list every record once, in id order");

    let empty = list(&env, ListFilter::new(0).with_principal(principal.clone())).await;
    assert!(empty.records.is_empty() && empty.more, "limit 0: no records, but more say some match");
    let past =
        list(&env, ListFilter::new(10).with_principal(principal).with_after(RecordId::from_bytes([0xff; 32]))).await;
    assert!(past.records.is_empty() && !past.more, "nothing sorts after the largest id");
}
