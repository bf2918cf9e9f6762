//! Generations of one record id. Once a record's retention ends, the same idempotency key
//! names a new operation: the next claim writes a new record (a new generation), whether
//! the old one was swept, expired natively, or is still stored. The new generation's first
//! token comes from the store's clock ([`FencingToken::first_at`]), so it is above every
//! token of every earlier generation even when the earlier record left the store, and a
//! late owner of an earlier generation can never complete, fail, extend, journal on or
//! reclaim the new one. Sub-keys differ between generations and stay the same across the
//! reclaims of one.

use std::sync::Arc;
use std::time::Duration;

use idem_core::{ClaimRequest, FencingToken, JournalWrite, Record, Resumable, StoreError, StoredResponse, UnixMillis};

use super::{
    LEASE, assert_lease_lost, claim_req_timed, completed, conflict, failed, get, must_claim, reclaim_req, reclaimed,
    response, sweep_all,
};
use crate::Env;

/// The journal entry the first generation writes and the second must never see.
const OLD_ENTRY: &str = "s:old-generation";

/// A request with a 1 s lease and a 2 s retention, so a generation ends quickly.
fn short(env: &Env) -> ClaimRequest {
    claim_req_timed(env, "p", "k", b"body", Duration::from_secs(1), Duration::from_secs(2))
}

/// A first generation with three attempts (claim, reclaim after the lease, reclaim after a
/// fail), the last still in flight, with a journal entry when the store keeps a journal.
/// Returns every attempt's record, oldest first.
async fn first_generation(env: &Env) -> Vec<Record> {
    let a = must_claim(env, short(env)).await;
    env.clock.set(a.lease_expires_at);
    let b = reclaimed(env.store.as_ref(), reclaim_req(&a)).await;
    let f = failed(env.store.as_ref(), &b).await;
    let c = reclaimed(env.store.as_ref(), reclaim_req(&f)).await;
    assert_eq!((b.token, c.token), (a.token.next(), a.token.next().next()));
    if env.capabilities().journal {
        let w = env.store.journal_put(c.id, c.token, OLD_ENTRY, b"old".to_vec(), false).await.expect("put");
        assert_eq!(w, JournalWrite::Written);
    }
    vec![a, b, c]
}

/// Claims the key now, as a new generation, and checks it starts at the first token of its
/// time ([`FencingToken::first_at`]), which is above the stored record's token + 1 whenever
/// the earlier generation lived at least a ms.
async fn next_generation(env: &Env) -> Record {
    let now = UnixMillis(env.clock.now_ms());
    let new = must_claim(env, short(env)).await;
    assert_eq!(new.token, FencingToken::first_at(now), "a new generation's first token comes from the clock");
    assert_eq!(new.created_at, now);
    new
}

/// Every write of every earlier-generation token on the new generation `new` is refused
/// with `LeaseLost { current: Some(new.token) }` and changes nothing; after the new lease a
/// reclaim with an old token conflicts too. Then the new owner completes.
async fn old_tokens_are_fenced_off(env: &Env, old: &[Record], new: &Record) {
    let store = env.store.as_ref();
    for r in old {
        assert!(new.token > r.token, "new generation token {} is not above earlier token {}", new.token, r.token);
        let t = r.token;
        let stale = StoredResponse::new(200, vec![], b"from an earlier generation".to_vec());
        assert_lease_lost(store.complete(new.id, t, stale).await, new.id, t, Some(new.token));
        assert_lease_lost(store.fail(new.id, t).await, new.id, t, Some(new.token));
        assert_lease_lost(store.extend(new.id, t, LEASE * 100).await, new.id, t, Some(new.token));
        if env.capabilities().journal {
            for overwrite in [false, true] {
                match store.journal_put(new.id, t, "s:late", b"late".to_vec(), overwrite).await {
                    Err(StoreError::LeaseLost { id, presented, current }) => {
                        assert_eq!((id, presented, current), (new.id, t, Some(new.token)));
                    }
                    other => panic!("journal_put with earlier-generation token {t}: expected LeaseLost, got {other:?}"),
                }
            }
        }
    }
    assert_eq!(get(store, new.id).await.as_ref(), Some(new), "the refused writes changed nothing");
    if env.capabilities().journal {
        assert_eq!(store.journal_get(new.id, "s:late").await.expect("get"), None, "a refused put wrote nothing");
        assert_eq!(store.journal_get(new.id, OLD_ENTRY).await.expect("get"), None, "the new generation starts empty");
    }
    // Once the new lease has passed, only its own token reclaims it.
    env.clock.set(new.lease_expires_at);
    for r in old {
        assert_eq!(
            conflict(store, reclaim_req(r)).await.as_ref(),
            Some(new),
            "a reclaim with earlier token {}",
            r.token
        );
    }
    let done = completed(store, new, response()).await;
    assert_eq!(done.token, new.token);
}

/// A record removed at the end of its retention (swept, or expired natively) takes its
/// tokens with it; the next claim of the id still gets a token above all of them (the
/// store's clock), and no earlier-generation token passes the fence on the new record.
pub async fn new_generation_after_removal_fences_every_earlier_token(env: Env) {
    let s = env.sweep_session().await;
    let old = first_generation(&env).await;
    let last = old.last().expect("attempts");
    env.clock.set(last.expires_at);
    sweep_all(&env, s.native_expiry).await;
    if !s.native_expiry {
        // Back one ms: a record that is still stored would read again; a swept one does not.
        env.clock.set(UnixMillis(last.expires_at.0 - 1));
        assert_eq!(get(env.store.as_ref(), last.id).await, None, "the sweep removed the expired record");
        env.clock.set(last.expires_at);
    }
    let new = next_generation(&env).await;
    old_tokens_are_fenced_off(&env, &old, &new).await;
}

/// A claim that replaces an expired record still in the store starts a new generation the
/// same way: its token is above every earlier one and every earlier token is fenced off.
pub async fn new_generation_over_a_stored_expired_record_fences_every_earlier_token(env: Env) {
    let old = first_generation(&env).await;
    let last = old.last().expect("attempts");
    env.clock.set(UnixMillis(last.expires_at.0 + 500));
    let new = next_generation(&env).await;
    old_tokens_are_fenced_off(&env, &old, &new).await;
}

/// Tokens keep growing over many short generations of one id: each generation's first
/// token is above the last token of the one before, whatever became of its record.
pub async fn tokens_grow_over_many_generations(env: Env) {
    let mut last: Option<Record> = None;
    for generation in 0..5 {
        let r = next_generation(&env).await;
        if let Some(prev) = &last {
            assert!(r.token > prev.token, "generation {generation}: {} after {}", r.token, prev.token);
            assert_lease_lost(env.store.complete(r.id, prev.token, response()).await, r.id, prev.token, Some(r.token));
        }
        env.clock.set(r.lease_expires_at);
        let n = reclaimed(env.store.as_ref(), reclaim_req(&r)).await;
        env.clock.set(n.expires_at);
        last = Some(n);
    }
}

/// Sub-keys are the same for every attempt of one generation (a reclaim keeps
/// `created_at`) and differ between generations of one idempotency key.
pub async fn sub_keys_stay_within_a_generation_and_change_between_generations(env: Env) {
    let handle = |r: &Record| Resumable::new(Arc::clone(&env.store), r.id, r.token, r.created_at);
    let a = must_claim(&env, short(&env)).await;
    env.clock.set(a.lease_expires_at);
    let b = reclaimed(env.store.as_ref(), reclaim_req(&a)).await;
    assert_eq!(b.created_at, a.created_at, "a reclaim keeps created_at");
    assert_eq!(handle(&b).subkey("charge"), handle(&a).subkey("charge"), "one generation, one sub-key");
    env.clock.set(b.expires_at);
    let c = must_claim(&env, short(&env)).await;
    assert_ne!(c.created_at, a.created_at, "a new generation has its own created_at");
    assert_eq!(c.id, a.id, "the same record id");
    assert_ne!(handle(&c).subkey("charge"), handle(&a).subkey("charge"), "a new generation, a new sub-key");
}

/// A late owner of an earlier generation still working on its step is fenced off the new
/// generation: its step result is refused and the new owner's is the one journalled.
pub async fn late_step_of_an_earlier_generation_is_fenced(env: Env) {
    if !env.capabilities().journal {
        env.report("journal unsupported: no steps to fence");
        return;
    }
    env.report("journal");
    let handle = |r: &Record| Resumable::new(Arc::clone(&env.store), r.id, r.token, r.created_at);
    let old = must_claim(&env, short(&env)).await;
    env.clock.set(old.expires_at);
    let new = must_claim(&env, short(&env)).await;
    let late = handle(&old).step("allocate", |_| async { Ok::<_, std::io::Error>(1u32) }).await;
    assert!(late.as_ref().is_err_and(|e| e.is_lease_lost()), "a late step is LeaseLost, got {late:?}");
    assert_eq!(handle(&new).step("allocate", |_| async { Ok::<_, std::io::Error>(2u32) }).await.expect("step"), 2);
}
