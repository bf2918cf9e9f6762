//! The per-record journal ([`Store::journal_put`], [`Store::journal_get`]) that resumable
//! handlers' steps and intents ([`idem_core::Resumable`]) are built on: entries are fenced
//! like `complete`, the first write of a name wins unless it overwrites, entries survive a
//! reclaim (that is how a retry resumes) and die with their record (expiry, sweep, a claim
//! that replaces an expired record).
//!
//! A store that does not declare [`idem_core::Capabilities::journal`] runs the "journal
//! unsupported" variant of every scenario here: both methods must then return
//! [`StoreError::Unsupported`], and the scenario says so on a `variant:` line. Every store
//! in the idem repository declares it (`tests/registry.rs` checks that).

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use idem_core::store::MAX_JOURNAL_NAME;
use idem_core::{
    ClaimRequest, Endpoint, FencingToken, JournalWrite, Reconciled, Record, RecordId, Resumable, Scope, StepError,
    Store, StoreError, UnixMillis,
};

use super::{
    LEASE, LEASE_MS, RETENTION, claim_req, claim_req_timed, completed, failed, fp, get, key, must_claim, race,
    reclaim_req, reclaimed, response,
};
use crate::Env;

/// Whether the store declares the journal. When it does not, checks that both methods
/// refuse with `Unsupported` (on a live record this scenario holds) and reports the variant.
async fn supported(env: &Env) -> bool {
    if env.capabilities().journal {
        env.report("journal");
        return true;
    }
    env.report("journal unsupported");
    let r = must_claim(env, claim_req(env, "unsupported", "k", b"b")).await;
    match env.store.journal_put(r.id, r.token, "step", b"v".to_vec(), false).await {
        Err(StoreError::Unsupported { operation }) => assert_eq!(operation, "journal_put"),
        other => panic!("a store without Capabilities::journal must refuse journal_put as Unsupported, got {other:?}"),
    }
    match env.store.journal_get(r.id, "step").await {
        Err(StoreError::Unsupported { operation }) => assert_eq!(operation, "journal_get"),
        other => panic!("a store without Capabilities::journal must refuse journal_get as Unsupported, got {other:?}"),
    }
    false
}

/// Puts and expects `Written`.
async fn put(store: &dyn Store, r: &Record, name: &str, value: &[u8], overwrite: bool) {
    match store.journal_put(r.id, r.token, name, value.to_vec(), overwrite).await {
        Ok(JournalWrite::Written) => {}
        other => panic!("journal_put {name:?} by the current owner: expected Written, got {other:?}"),
    }
}

/// Reads an entry.
async fn jget(store: &dyn Store, id: RecordId, name: &str) -> Option<Vec<u8>> {
    store.journal_get(id, name).await.expect("journal_get")
}

/// Asserts a journal put was refused with exactly `LeaseLost { id, presented, current }`.
#[track_caller]
fn assert_put_lease_lost(
    res: Result<JournalWrite, StoreError>,
    id: RecordId,
    presented: FencingToken,
    current: Option<FencingToken>,
) {
    match res {
        Err(StoreError::LeaseLost { id: got_id, presented: got_presented, current: got_current }) => {
            assert_eq!(got_id, id, "LeaseLost names the record");
            assert_eq!(got_presented, presented, "LeaseLost carries the presented token");
            assert_eq!(got_current, current, "LeaseLost carries the current token (None: record gone)");
        }
        other => panic!("expected StoreError::LeaseLost from journal_put, got {other:?}"),
    }
}

/// Values of every shape round-trip byte-exact: empty, every byte value, 1 MiB.
pub async fn journal_values_round_trip_byte_exact(env: Env) {
    if !supported(&env).await {
        return;
    }
    let r = must_claim(&env, claim_req(&env, "p", "k", b"b")).await;
    let all_bytes: Vec<u8> = (0..=255u8).chain((0..=255u8).rev()).collect();
    let mib: Vec<u8> = (0..1u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    let values: [(&str, &[u8]); 4] = [("empty", &[]), ("bytes", &all_bytes), ("mib", &mib), ("nul", &[0])];
    for (name, value) in values {
        put(env.store.as_ref(), &r, name, value, false).await;
    }
    for (name, value) in values {
        assert_eq!(jget(env.store.as_ref(), r.id, name).await.as_deref(), Some(value), "entry {name} round-trips");
    }
    assert_eq!(jget(env.store.as_ref(), r.id, "never-written").await, None);
    assert_eq!(get(env.store.as_ref(), r.id).await, Some(r), "journal writes leave the record as it was");
}

/// Names at the limits are distinct entries that round-trip: 1 byte, 255 bytes, non-ASCII
/// and control characters within 255 bytes, names differing only in case or a last byte.
pub async fn journal_names_at_the_limits_round_trip(env: Env) {
    if !supported(&env).await {
        return;
    }
    let r = must_claim(&env, claim_req(&env, "p", "k", b"b")).await;
    let long = "n".repeat(MAX_JOURNAL_NAME);
    let long_other = format!("{}m", "n".repeat(MAX_JOURNAL_NAME - 1));
    // 'é' is two bytes: 127 of them are 254 bytes, plus one ASCII byte is 255.
    let accented = format!("{}x", "é".repeat(127));
    assert_eq!(accented.len(), MAX_JOURNAL_NAME);
    let names = [
        "a".to_owned(),
        "A".to_owned(),
        long,
        long_other,
        accented,
        "s:ステップ/🚀".to_owned(),
        "tab\tnew\nline\u{1}".to_owned(),
        "a ".to_owned(),
    ];
    for (i, name) in names.iter().enumerate() {
        put(env.store.as_ref(), &r, name, format!("value {i}").as_bytes(), false).await;
    }
    for (i, name) in names.iter().enumerate() {
        assert_eq!(
            jget(env.store.as_ref(), r.id, name).await,
            Some(format!("value {i}").into_bytes()),
            "entry {name:?} is its own entry"
        );
    }
}

/// With `overwrite = false` the first write wins: a second put returns `Exists` with the
/// stored value and changes nothing.
pub async fn journal_first_write_wins(env: Env) {
    if !supported(&env).await {
        return;
    }
    let r = must_claim(&env, claim_req(&env, "p", "k", b"b")).await;
    put(env.store.as_ref(), &r, "s:allocate", b"node-7", false).await;
    let again = env.store.journal_put(r.id, r.token, "s:allocate", b"node-9".to_vec(), false).await.expect("put");
    assert_eq!(again, JournalWrite::Exists(b"node-7".to_vec()));
    let empty = env.store.journal_put(r.id, r.token, "s:allocate", Vec::new(), false).await.expect("put");
    assert_eq!(empty, JournalWrite::Exists(b"node-7".to_vec()), "an empty value does not overwrite either");
    assert_eq!(jget(env.store.as_ref(), r.id, "s:allocate").await, Some(b"node-7".to_vec()));
    // An empty first value is a value: it wins too.
    put(env.store.as_ref(), &r, "s:empty", b"", false).await;
    let second = env.store.journal_put(r.id, r.token, "s:empty", b"x".to_vec(), false).await.expect("put");
    assert_eq!(second, JournalWrite::Exists(Vec::new()));
}

/// With `overwrite = true` a put replaces the entry (an intent moving from pending to done).
pub async fn journal_overwrite_replaces(env: Env) {
    if !supported(&env).await {
        return;
    }
    let r = must_claim(&env, claim_req(&env, "p", "k", b"b")).await;
    put(env.store.as_ref(), &r, "i:boot", b"pending", true).await;
    put(env.store.as_ref(), &r, "i:boot", b"done vm-1", true).await;
    assert_eq!(jget(env.store.as_ref(), r.id, "i:boot").await, Some(b"done vm-1".to_vec()));
    put(env.store.as_ref(), &r, "i:boot", b"", true).await;
    assert_eq!(jget(env.store.as_ref(), r.id, "i:boot").await, Some(Vec::new()), "overwritten with an empty value");
    assert_eq!(get(env.store.as_ref(), r.id).await, Some(r));
}

/// After a reclaim, a put with the stale token is `LeaseLost` (even with `overwrite`, even
/// for a name that exists) and changes nothing; a token from the future is refused too.
pub async fn journal_stale_token_is_lease_lost_and_changes_nothing(env: Env) {
    if !supported(&env).await {
        return;
    }
    let old = must_claim(&env, claim_req(&env, "p", "k", b"b")).await;
    put(env.store.as_ref(), &old, "s:a", b"first owner", false).await;
    env.clock.advance_ms(LEASE_MS + 1);
    let new = reclaimed(env.store.as_ref(), reclaim_req(&old)).await;
    for (name, overwrite) in [("s:a", false), ("s:a", true), ("s:b", false), ("s:b", true)] {
        let res = env.store.journal_put(old.id, old.token, name, b"stale".to_vec(), overwrite).await;
        assert_put_lease_lost(res, old.id, old.token, Some(new.token));
    }
    let future = FencingToken(new.token.0 + 1);
    assert_put_lease_lost(
        env.store.journal_put(old.id, future, "s:b", b"future".to_vec(), true).await,
        old.id,
        future,
        Some(new.token),
    );
    assert_eq!(jget(env.store.as_ref(), old.id, "s:a").await, Some(b"first owner".to_vec()));
    assert_eq!(jget(env.store.as_ref(), old.id, "s:b").await, None, "a refused put writes nothing");
    assert_eq!(get(env.store.as_ref(), old.id).await, Some(new));
}

/// A put on a completed record is `LeaseLost` with the record's token, even by the owner
/// that completed it; existing entries stay readable.
pub async fn journal_put_after_complete_is_lease_lost(env: Env) {
    if !supported(&env).await {
        return;
    }
    let r = must_claim(&env, claim_req(&env, "p", "k", b"b")).await;
    put(env.store.as_ref(), &r, "s:a", b"1", false).await;
    let done = completed(env.store.as_ref(), &r, response()).await;
    for overwrite in [false, true] {
        let res = env.store.journal_put(r.id, r.token, "s:a", b"2".to_vec(), overwrite).await;
        assert_put_lease_lost(res, r.id, r.token, Some(r.token));
    }
    assert_put_lease_lost(
        env.store.journal_put(r.id, r.token, "s:new", b"2".to_vec(), false).await,
        r.id,
        r.token,
        Some(r.token),
    );
    assert_eq!(jget(env.store.as_ref(), r.id, "s:a").await, Some(b"1".to_vec()));
    assert_eq!(jget(env.store.as_ref(), r.id, "s:new").await, None);
    assert_eq!(get(env.store.as_ref(), r.id).await, Some(done));
}

/// A put on a failed record is `LeaseLost` with the record's token; after the retry's
/// reclaim the new owner writes and sees the failed attempt's entries.
pub async fn journal_put_after_fail_is_lease_lost(env: Env) {
    if !supported(&env).await {
        return;
    }
    let r = must_claim(&env, claim_req(&env, "p", "k", b"b")).await;
    put(env.store.as_ref(), &r, "s:a", b"1", false).await;
    let f = failed(env.store.as_ref(), &r).await;
    assert_put_lease_lost(
        env.store.journal_put(r.id, r.token, "s:b", b"2".to_vec(), true).await,
        r.id,
        r.token,
        Some(r.token),
    );
    assert_eq!(get(env.store.as_ref(), r.id).await, Some(f.clone()));
    assert_eq!(jget(env.store.as_ref(), r.id, "s:b").await, None);
    let retry = reclaimed(env.store.as_ref(), reclaim_req(&f)).await;
    assert_eq!(jget(env.store.as_ref(), r.id, "s:a").await, Some(b"1".to_vec()), "a failed attempt's step survives");
    put(env.store.as_ref(), &retry, "s:b", b"2", false).await;
}

/// A put on a record that was never claimed is `LeaseLost` with no current token and
/// creates neither an entry nor a record.
pub async fn journal_put_on_absent_record_is_lease_lost(env: Env) {
    if !supported(&env).await {
        return;
    }
    let id = claim_req(&env, "p", "never-claimed", b"b").id();
    for overwrite in [false, true] {
        let res = env.store.journal_put(id, FencingToken::FIRST, "s:a", b"v".to_vec(), overwrite).await;
        assert_put_lease_lost(res, id, FencingToken::FIRST, None);
    }
    assert_eq!(jget(env.store.as_ref(), id, "s:a").await, None);
    assert_eq!(get(env.store.as_ref(), id).await, None);
    let r = must_claim(&env, claim_req(&env, "p", "never-claimed", b"b")).await;
    assert_eq!(jget(env.store.as_ref(), r.id, "s:a").await, None, "the refused put left nothing for a later claim");
}

/// Entries survive a reclaim: the new owner reads them, its first-write put gets `Exists`,
/// and it may overwrite them (memoisation across owners).
pub async fn journal_entries_survive_a_reclaim(env: Env) {
    if !supported(&env).await {
        return;
    }
    let first = must_claim(&env, claim_req(&env, "p", "k", b"b")).await;
    put(env.store.as_ref(), &first, "s:allocate", b"node-7", false).await;
    put(env.store.as_ref(), &first, "i:boot", b"pending", true).await;
    env.clock.advance_ms(LEASE_MS);
    let second = reclaimed(env.store.as_ref(), reclaim_req(&first)).await;
    assert_eq!(jget(env.store.as_ref(), first.id, "s:allocate").await, Some(b"node-7".to_vec()));
    let again = env.store.journal_put(second.id, second.token, "s:allocate", b"node-9".to_vec(), false).await;
    assert_eq!(again.expect("put by the new owner"), JournalWrite::Exists(b"node-7".to_vec()));
    put(env.store.as_ref(), &second, "i:boot", b"done vm-1", true).await;
    // A third owner after another lease still sees both.
    env.clock.advance_ms(LEASE_MS);
    let third = reclaimed(env.store.as_ref(), reclaim_req(&second)).await;
    assert_eq!(third.token.0, first.token.0 + 2);
    assert_eq!(jget(env.store.as_ref(), first.id, "s:allocate").await, Some(b"node-7".to_vec()));
    assert_eq!(jget(env.store.as_ref(), first.id, "i:boot").await, Some(b"done vm-1".to_vec()));
}

/// From `expires_at` on, before any sweep, `journal_get` is `None` and a put by the last
/// owner is `LeaseLost` with no current token; one ms earlier the entry is still there.
pub async fn journal_get_is_none_once_the_record_expired(env: Env) {
    if !supported(&env).await {
        return;
    }
    let r =
        must_claim(&env, claim_req_timed(&env, "p", "k", b"b", Duration::from_secs(1), Duration::from_secs(2))).await;
    put(env.store.as_ref(), &r, "s:a", b"1", false).await;
    env.clock.set(UnixMillis(r.expires_at.0 - 1));
    assert_eq!(jget(env.store.as_ref(), r.id, "s:a").await, Some(b"1".to_vec()), "live until expires_at");
    env.clock.set(r.expires_at);
    assert_eq!(jget(env.store.as_ref(), r.id, "s:a").await, None, "gone at expires_at, swept or not");
    assert_put_lease_lost(env.store.journal_put(r.id, r.token, "s:b", b"2".to_vec(), true).await, r.id, r.token, None);
    env.clock.set(UnixMillis(r.expires_at.0 - 1));
    assert_eq!(jget(env.store.as_ref(), r.id, "s:a").await, Some(b"1".to_vec()), "expiry alone deleted nothing");
    assert_eq!(jget(env.store.as_ref(), r.id, "s:b").await, None, "the refused put wrote nothing");
}

/// A sweep removes a record's entries with it: a new claim of the same id afterwards (a new
/// generation) sees no entries and writes fresh ones.
pub async fn journal_sweep_removes_entries_with_their_record(env: Env) {
    if !supported(&env).await {
        return;
    }
    let session = env.sweep_session().await;
    let short = |k| claim_req_timed(&env, "p", k, b"b", Duration::from_secs(1), Duration::from_secs(2));
    let r = must_claim(&env, short("k")).await;
    let live = must_claim(&env, claim_req(&env, "p", "live", b"b")).await;
    put(env.store.as_ref(), &r, "s:a", b"old", false).await;
    put(env.store.as_ref(), &r, "i:b", b"pending", true).await;
    put(env.store.as_ref(), &live, "s:a", b"live", false).await;
    env.clock.set(r.expires_at);
    if session.native_expiry {
        env.report("native expiry: entries vanish with their record");
        assert_eq!(env.store.sweep(100).await.expect("sweep").removed, 0);
    } else {
        env.report("sweep: entries removed with their record");
        assert!(super::sweep_until_done(env.store.as_ref(), 100, 1_000).await >= 1, "the expired record was swept");
    }
    assert_eq!(jget(env.store.as_ref(), r.id, "s:a").await, None);
    let now = UnixMillis(env.clock.now_ms());
    if !session.native_expiry {
        // One ms earlier a record (and entries) still stored would read again.
        env.clock.set(UnixMillis(r.expires_at.0 - 1));
        assert_eq!(get(env.store.as_ref(), r.id).await, None, "the expired record was swept");
        assert_eq!(jget(env.store.as_ref(), r.id, "s:a").await, None, "its entries went with it");
        env.clock.set(now);
    }
    let again = must_claim(&env, short("k")).await;
    assert_eq!(again.token, FencingToken::first_at(now), "a new generation, its token from the clock");
    assert_eq!(jget(env.store.as_ref(), r.id, "s:a").await, None, "the new claim sees no old entry");
    assert_eq!(jget(env.store.as_ref(), r.id, "i:b").await, None);
    put(env.store.as_ref(), &again, "s:a", b"new", false).await;
    assert_eq!(jget(env.store.as_ref(), r.id, "s:a").await, Some(b"new".to_vec()));
    assert_eq!(jget(env.store.as_ref(), live.id, "s:a").await, Some(b"live".to_vec()), "a live record's entry stays");
}

/// A claim that replaces an expired (unswept) record starts with an empty journal: old
/// entries are neither read nor returned as `Exists`.
pub async fn journal_claim_replacing_an_expired_record_starts_empty(env: Env) {
    if !supported(&env).await {
        return;
    }
    let req = claim_req_timed(&env, "p", "k", b"b", Duration::from_secs(1), Duration::from_secs(2));
    let old = must_claim(&env, req.clone()).await;
    put(env.store.as_ref(), &old, "s:a", b"old", false).await;
    put(env.store.as_ref(), &old, "s:b", b"old", false).await;
    env.clock.set(old.expires_at);
    let new = must_claim(&env, req).await;
    assert_eq!(new.token, FencingToken::first_at(old.expires_at), "a new generation replaced the expired record");
    assert_eq!(jget(env.store.as_ref(), new.id, "s:a").await, None, "the old attempt's entry is gone");
    let res = env.store.journal_put(new.id, new.token, "s:b", b"new".to_vec(), false).await.expect("put");
    assert_eq!(res, JournalWrite::Written, "first write of the new record, not Exists(old)");
    assert_eq!(jget(env.store.as_ref(), new.id, "s:b").await, Some(b"new".to_vec()));
    assert_put_lease_lost(
        env.store.journal_put(old.id, old.token, "s:c", b"old".to_vec(), true).await,
        old.id,
        old.token,
        Some(new.token),
    );
}

/// Eight concurrent first writes of one name by the owner: exactly one is `Written`, the
/// others get `Exists` with the winner's value, which is what stays.
pub async fn journal_concurrent_first_writes_have_one_winner(env: Env) {
    if !supported(&env).await {
        return;
    }
    let r = must_claim(&env, claim_req(&env, "p", "k", b"b")).await;
    let store = Arc::clone(&env.store);
    let outcomes = race(8, |i| {
        let (store, r) = (Arc::clone(&store), r.clone());
        async move {
            let value = format!("writer {i}").into_bytes();
            (value.clone(), store.journal_put(r.id, r.token, "s:race", value, false).await.expect("put"))
        }
    })
    .await;
    let winners: Vec<_> = outcomes.iter().filter(|(_, o)| *o == JournalWrite::Written).map(|(v, _)| v).collect();
    assert_eq!(winners.len(), 1, "exactly one first write wins: {outcomes:?}");
    let winner = winners[0].clone();
    for (_, o) in &outcomes {
        if let JournalWrite::Exists(v) = o {
            assert_eq!(*v, winner, "a loser sees the winner's value");
        }
    }
    assert_eq!(jget(env.store.as_ref(), r.id, "s:race").await, Some(winner));
}

/// Entries of different records are isolated: same name under another key, principal or
/// endpoint is another entry; completing one record leaves the others' entries writable.
pub async fn journal_entries_are_isolated_between_records(env: Env) {
    if !supported(&env).await {
        return;
    }
    let put_e = Scope::new(env.principal("p"), Endpoint::new("PUT", "/e")).expect("non-empty principal");
    let reqs = [
        claim_req(&env, "p", "k", b"b"),
        claim_req(&env, "p", "k2", b"b"),
        claim_req(&env, "q", "k", b"b"),
        ClaimRequest::new(put_e, key("k"), fp(b"b"), LEASE, RETENTION),
    ];
    let mut records = Vec::new();
    for req in reqs {
        records.push(must_claim(&env, req).await);
    }
    for (i, r) in records.iter().enumerate() {
        put(env.store.as_ref(), r, "s:same", format!("record {i}").as_bytes(), false).await;
    }
    put(env.store.as_ref(), &records[0], "s:only-first", b"x", false).await;
    for (i, r) in records.iter().enumerate() {
        assert_eq!(jget(env.store.as_ref(), r.id, "s:same").await, Some(format!("record {i}").into_bytes()));
    }
    for r in &records[1..] {
        assert_eq!(jget(env.store.as_ref(), r.id, "s:only-first").await, None, "an entry belongs to one record");
    }
    // One record's token does not open another's journal.
    assert_put_lease_lost(
        env.store.journal_put(records[1].id, FencingToken(99), "s:x", b"x".to_vec(), false).await,
        records[1].id,
        FencingToken(99),
        Some(records[1].token),
    );
    completed(env.store.as_ref(), &records[0], response()).await;
    put(env.store.as_ref(), &records[1], "s:after", b"y", false).await;
}

/// A second handle (`Backend::open_peer`) reads the first handle's entries at once, and
/// its first-write put of the same name gets `Exists`.
pub async fn journal_peer_handle_sees_entries(env: Env) {
    if !supported(&env).await {
        return;
    }
    let peer = env.peer().await;
    let r = must_claim(&env, claim_req(&env, "p", "k", b"b")).await;
    put(env.store.as_ref(), &r, "s:a", b"from the first handle", false).await;
    assert_eq!(jget(peer.as_ref(), r.id, "s:a").await, Some(b"from the first handle".to_vec()));
    let res = peer.journal_put(r.id, r.token, "s:a", b"peer".to_vec(), false).await.expect("put");
    assert_eq!(res, JournalWrite::Exists(b"from the first handle".to_vec()));
}

/// `Resumable::step` on this store runs a step once per record: after a reclaim the new
/// owner gets the first owner's result without running the step again.
pub async fn journal_step_memoises_across_a_reclaim(env: Env) {
    if !supported(&env).await {
        return;
    }
    let runs = Arc::new(AtomicU32::new(0));
    let first = must_claim(&env, claim_req(&env, "p", "k", b"b")).await;
    let step = |owner: &Record, value: u64| {
        let h = Resumable::new(Arc::clone(&env.store), owner.id, owner.token, owner.created_at);
        let runs = Arc::clone(&runs);
        async move {
            h.step("allocate", |sk| async move {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, std::io::Error>((value, sk.to_string()))
            })
            .await
        }
    };
    let a = step(&first, 7).await.expect("the first owner runs the step");
    env.clock.advance_ms(LEASE_MS);
    let second = reclaimed(env.store.as_ref(), reclaim_req(&first)).await;
    let b = step(&second, 9).await.expect("the second owner resumes");
    assert_eq!(b, a, "the journalled result, not a second run");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the step ran once across both owners");
    assert!(a.1.starts_with("idem-"), "the step got its sub-key");
}

/// A stale owner's step is fenced: its result is refused (`LeaseLost`) and the current
/// owner's result is the one journalled.
pub async fn journal_stale_owners_step_is_fenced(env: Env) {
    if !supported(&env).await {
        return;
    }
    let first = must_claim(&env, claim_req(&env, "p", "k", b"b")).await;
    env.clock.advance_ms(LEASE_MS);
    let second = reclaimed(env.store.as_ref(), reclaim_req(&first)).await;
    let stale = Resumable::new(Arc::clone(&env.store), first.id, first.token, first.created_at);
    let current = Resumable::new(Arc::clone(&env.store), second.id, second.token, second.created_at);
    let e = stale.step("lease", |_| async { Ok::<_, std::io::Error>(1u32) }).await.expect_err("a stale step");
    assert!(e.is_lease_lost(), "a stale owner's step is LeaseLost, got {e:?}");
    assert_eq!(current.step("lease", |_| async { Ok::<_, std::io::Error>(2u32) }).await.expect("step"), 2);
    assert_eq!(stale.step("lease", |_| async { Ok::<_, std::io::Error>(3u32) }).await.expect("read"), 2);
}

/// Intents left pending by a dead attempt are reconciled before anything is issued again:
/// `Found` adopts the real id, `NotFound` issues again, `Unknown` fails as ambiguous.
pub async fn journal_intent_reconcile_paths(env: Env) {
    if !supported(&env).await {
        return;
    }
    for (k, found) in [
        ("found", Reconciled::Found("vm-1".into())),
        ("not-found", Reconciled::NotFound),
        ("unknown", Reconciled::Unknown),
    ] {
        let first = must_claim(&env, claim_req(&env, "p", k, b"b")).await;
        let issued = Arc::new(AtomicU32::new(0));
        let h1 = Resumable::new(Arc::clone(&env.store), first.id, first.token, first.created_at);
        let i1 = Arc::clone(&issued);
        let died = h1
            .intent(
                "boot",
                |_| async move {
                    i1.fetch_add(1, Ordering::SeqCst);
                    Err::<String, &str>("killed after the call, before done was journalled")
                },
                |_| async { Ok(Reconciled::NotFound) },
            )
            .await;
        assert!(matches!(died, Err(StepError::Failed { .. })), "{died:?}");
        env.clock.advance_ms(LEASE_MS);
        let second = reclaimed(env.store.as_ref(), reclaim_req(&first)).await;
        let h2 = Resumable::new(Arc::clone(&env.store), second.id, second.token, second.created_at);
        let (i2, expected_tag) = (Arc::clone(&issued), h2.subkey("boot"));
        let got = h2
            .intent(
                "boot",
                |_| async move {
                    i2.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, &str>("vm-2".to_owned())
                },
                |tag| {
                    let found = found.clone();
                    async move {
                        assert_eq!(tag, expected_tag, "reconcile gets the same sub-key the call was tagged with");
                        Ok(found)
                    }
                },
            )
            .await;
        match k {
            "found" => {
                assert_eq!(got.expect("adopted"), "vm-1");
                assert_eq!(issued.load(Ordering::SeqCst), 1, "nothing issued again");
            }
            "not-found" => {
                assert_eq!(got.expect("issued again"), "vm-2");
                assert_eq!(issued.load(Ordering::SeqCst), 2);
            }
            _ => {
                assert!(matches!(got, Err(StepError::Ambiguous { .. })), "{got:?}");
                assert_eq!(issued.load(Ordering::SeqCst), 1, "nothing issued again");
                continue;
            }
        }
        // Done is journalled: a later read returns it without reconciling or issuing.
        let again = h2
            .intent::<&str, _, _, _, _>(
                "boot",
                |_| async { panic!("a done intent never issues") },
                |_| async { panic!("a done intent never reconciles") },
            )
            .await
            .expect("done");
        assert_eq!(Some(again), if k == "found" { Some("vm-1".to_owned()) } else { Some("vm-2".to_owned()) });
    }
}
