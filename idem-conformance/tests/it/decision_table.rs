//! The decision table and the state machine, row by row, on both statements of the rules:
//! the specification model ([`Spec`]) and the engine every in-process store runs
//! ([`Engine`]). A row written once runs on each, so a wrong rule in either fails it by name.

use std::time::Duration;

use idem_conformance::{Oracle, Spec};

use crate::engine::Engine;
use idem_core::*;
use proptest::prelude::*;

const LEASE: Duration = Duration::from_secs(5);
const RETENTION: Duration = Duration::from_secs(60);

fn fp(b: &[u8]) -> Fingerprint {
    Fingerprint::of_bytes(b)
}

fn req(key: &str, body: &[u8]) -> ClaimRequest {
    let scope = Scope::new("p", Endpoint::new("POST", "/e")).unwrap();
    ClaimRequest::new(scope, IdempotencyKey::parse(key.as_bytes()).unwrap(), fp(body), LEASE, RETENTION)
}

fn claimed(m: &mut impl Oracle, r: &ClaimRequest, now: i64) -> Record {
    match m.claim(r, UnixMillis(now)) {
        ClaimOutcome::Claimed(rec) => rec,
        other => panic!("expected Claimed, got {other:?}"),
    }
}

/// The record a model write at `now` just wrote, read back at `now`; its receipt must
/// report it.
#[track_caller]
fn written(m: &impl Oracle, id: RecordId, receipt: Receipt, now: i64) -> Record {
    let record = m.get(id, UnixMillis(now)).expect("the record just written is live");
    assert_eq!(Receipt::of(&record), receipt, "the receipt reports the record as written");
    record
}

fn reclaim_req(r: &Record, body: &[u8]) -> ReclaimRequest {
    ReclaimRequest { id: r.id, expected: r.token, fingerprint: fp(body), lease_ttl: LEASE, retention: RETENTION }
}

#[test]
fn row_none_claims() {
    assert_eq!(decide(None, &fp(b"x"), UnixMillis(0)), Decision::Claim);
}

fn row_in_flight_fresh_same_is_busy_with_retry_after<M: Oracle + Default + Clone + PartialEq + std::fmt::Debug>() {
    let mut m = M::default();
    let r = claimed(&mut m, &req("k", b"x"), 0);
    assert_eq!(r.token, FencingToken::first_at(UnixMillis(0)));
    assert_eq!(decide(Some(&r), &fp(b"x"), UnixMillis(0)), Decision::InFlight { retry_after_secs: 5 });
    assert_eq!(decide(Some(&r), &fp(b"x"), UnixMillis(4_001)), Decision::InFlight { retry_after_secs: 1 });
    // Never below one second, even in the last millisecond.
    assert_eq!(decide(Some(&r), &fp(b"x"), UnixMillis(4_999)), Decision::InFlight { retry_after_secs: 1 });
}

fn row_in_flight_fresh_different_is_mismatch<M: Oracle + Default + Clone + PartialEq + std::fmt::Debug>() {
    let mut m = M::default();
    let r = claimed(&mut m, &req("k", b"x"), 0);
    assert_eq!(decide(Some(&r), &fp(b"y"), UnixMillis(1)), Decision::Mismatch);
}

fn row_in_flight_expired_same_reclaims_exactly_at_lease_end<
    M: Oracle + Default + Clone + PartialEq + std::fmt::Debug,
>() {
    let mut m = M::default();
    let r = claimed(&mut m, &req("k", b"x"), 0);
    assert!(matches!(decide(Some(&r), &fp(b"x"), UnixMillis(4_999)), Decision::InFlight { .. }));
    assert_eq!(decide(Some(&r), &fp(b"x"), UnixMillis(5_000)), Decision::Reclaim { expected: r.token });
    assert!(matches!(m.reclaim(&reclaim_req(&r, b"x"), UnixMillis(4_999)), ReclaimOutcome::Conflict { .. }));
    let ReclaimOutcome::Reclaimed(n) = m.reclaim(&reclaim_req(&r, b"x"), UnixMillis(5_001)) else { panic!() };
    assert_eq!(n.token, r.token.next());
    assert_eq!(n.lease_expires_at, UnixMillis(10_001));
}

fn row_in_flight_expired_different_is_mismatch<M: Oracle + Default + Clone + PartialEq + std::fmt::Debug>() {
    let mut m = M::default();
    let r = claimed(&mut m, &req("k", b"x"), 0);
    assert_eq!(decide(Some(&r), &fp(b"y"), UnixMillis(9_000)), Decision::Mismatch);
    assert!(matches!(m.reclaim(&reclaim_req(&r, b"y"), UnixMillis(9_000)), ReclaimOutcome::Conflict { .. }));
}

fn row_completed_same_replays_different_mismatches<M: Oracle + Default + Clone + PartialEq + std::fmt::Debug>() {
    let mut m = M::default();
    let r = claimed(&mut m, &req("k", b"x"), 0);
    let receipt = m.complete(r.id, r.token, StoredResponse::new(201, vec![], b"ok".to_vec()), UnixMillis(10)).unwrap();
    let done = written(&m, r.id, receipt, 10);
    assert_eq!(decide(Some(&done), &fp(b"x"), UnixMillis(20)), Decision::Replay);
    assert_eq!(decide(Some(&done), &fp(b"y"), UnixMillis(20)), Decision::Mismatch);
    // A completed record is never reclaimable, even after its lease time.
    assert!(matches!(m.reclaim(&reclaim_req(&done, b"x"), UnixMillis(50_000)), ReclaimOutcome::Conflict { .. }));
}

fn row_failed_same_reclaims_different_mismatches<M: Oracle + Default + Clone + PartialEq + std::fmt::Debug>() {
    let mut m = M::default();
    let r = claimed(&mut m, &req("k", b"x"), 0);
    let receipt = m.fail(r.id, r.token, UnixMillis(10)).unwrap();
    let failed = written(&m, r.id, receipt, 10);
    assert_eq!(failed.state, RecordState::Failed);
    assert_eq!(decide(Some(&failed), &fp(b"x"), UnixMillis(11)), Decision::Reclaim { expected: r.token });
    assert_eq!(decide(Some(&failed), &fp(b"y"), UnixMillis(11)), Decision::Mismatch);
    assert!(matches!(m.reclaim(&reclaim_req(&failed, b"x"), UnixMillis(11)), ReclaimOutcome::Reclaimed(_)));
}

fn retention_end_makes_the_record_absent_and_a_new_claim_gets_a_higher_token<
    M: Oracle + Default + Clone + PartialEq + std::fmt::Debug,
>() {
    let mut m = M::default();
    let r = claimed(&mut m, &req("k", b"x"), 0);
    m.complete(r.id, r.token, StoredResponse::new(200, vec![], vec![]), UnixMillis(1)).unwrap();
    assert!(m.get(r.id, UnixMillis(59_999)).is_some());
    assert!(m.get(r.id, UnixMillis(60_000)).is_none());
    assert_eq!(decide(Some(&r), &fp(b"x"), UnixMillis(60_000)), Decision::Claim);
    let again = claimed(&mut m, &req("k", b"y"), 60_000);
    // The new record's first token comes from the clock, above every token of the old one.
    assert_eq!(again.token, FencingToken::first_at(UnixMillis(60_000)));
    assert!(again.token > r.token);
}

fn stale_token_writes_are_lease_lost_and_change_nothing<M: Oracle + Default + Clone + PartialEq + std::fmt::Debug>() {
    let mut m = M::default();
    let r = claimed(&mut m, &req("k", b"x"), 0);
    let ReclaimOutcome::Reclaimed(n) = m.reclaim(&reclaim_req(&r, b"x"), UnixMillis(6_000)) else { panic!() };
    let before = m.clone();
    let e = m.complete(r.id, r.token, StoredResponse::new(200, vec![], vec![]), UnixMillis(6_001)).unwrap_err();
    assert!(matches!(e, StoreError::LeaseLost { current: Some(t), .. } if t == r.token.next()), "{e:?}");
    assert!(m.fail(r.id, r.token, UnixMillis(6_001)).unwrap_err().is_lease_lost());
    assert_eq!(m, before);
    assert!(m.complete(n.id, n.token, StoredResponse::new(200, vec![], vec![]), UnixMillis(6_002)).is_ok());
}

fn extend_renews_from_now_never_earlier_and_keeps_the_rest<
    M: Oracle + Default + Clone + PartialEq + std::fmt::Debug,
>() {
    let mut m = M::default();
    let r = claimed(&mut m, &req("k", b"x"), 0);
    // From now, not from the old lease end; token, state and times other than the lease stay.
    let receipt = m.extend(r.id, r.token, Duration::from_secs(10), UnixMillis(3_000)).unwrap();
    let e = written(&m, r.id, receipt, 3_000);
    assert_eq!(e, Record { lease_expires_at: UnixMillis(13_000), ..r.clone() });
    // Never earlier: a shorter renewal leaves the lease where it is.
    let same = m.extend(r.id, r.token, Duration::from_secs(1), UnixMillis(4_000)).unwrap();
    assert_eq!(same, receipt);
    assert_eq!(written(&m, r.id, same, 4_000), e);
    // Past the retention: expires_at follows the lease, so a renewed claim is never swept.
    let receipt = m.extend(r.id, r.token, Duration::from_secs(100), UnixMillis(5_000)).unwrap();
    let long = written(&m, r.id, receipt, 5_000);
    assert_eq!((long.lease_expires_at, long.expires_at), (UnixMillis(105_000), UnixMillis(105_000)));
    assert_eq!(m.sweep(10, UnixMillis(60_000)).removed, 0);
    // A renewed lease blocks a retry until its new end.
    let retry = reclaim_req(&long, b"x");
    assert!(matches!(m.reclaim(&retry, UnixMillis(104_999)), ReclaimOutcome::Conflict { .. }));
    assert_eq!(m.get(r.id, UnixMillis(104_999)), Some(long));
    assert_eq!(m.get(r.id, UnixMillis(105_000)), None, "lease and retention end together");
}

fn extend_is_lease_lost_unless_the_caller_holds_the_in_flight_claim<
    M: Oracle + Default + Clone + PartialEq + std::fmt::Debug,
>() {
    let mut m = M::default();
    let r = claimed(&mut m, &req("k", b"x"), 0);
    // An owner whose lease ran out but whom nobody reclaimed still renews.
    let late = m.extend(r.id, r.token, LEASE, UnixMillis(9_000)).unwrap();
    assert_eq!(late.lease_expires_at, UnixMillis(14_000));
    let before = m.clone();
    for wrong in [r.token.next(), FencingToken(r.token.0 - 1)] {
        let e = m.extend(r.id, wrong, LEASE, UnixMillis(9_001)).unwrap_err();
        assert!(matches!(e, StoreError::LeaseLost { current: Some(t), .. } if t == r.token), "{e:?}");
    }
    assert_eq!(m, before);
    // Completed and failed records are not renewed, even by the token that ended them.
    let receipt = m.complete(r.id, r.token, StoredResponse::new(200, vec![], vec![]), UnixMillis(9_002)).unwrap();
    let done = written(&m, r.id, receipt, 9_002);
    assert!(m.extend(r.id, r.token, LEASE, UnixMillis(9_003)).unwrap_err().is_lease_lost());
    assert_eq!(m.get(r.id, UnixMillis(9_003)), Some(done));
    let f = claimed(&mut m, &req("f", b"x"), 0);
    let receipt = m.fail(f.id, f.token, UnixMillis(1)).unwrap();
    let failed = written(&m, f.id, receipt, 1);
    assert!(m.extend(f.id, f.token, LEASE, UnixMillis(2)).unwrap_err().is_lease_lost());
    assert_eq!(m.get(f.id, UnixMillis(2)), Some(failed));
    // Absent, and expired: LeaseLost with no current token.
    let absent = req("never", b"x").id();
    assert!(matches!(
        m.extend(absent, FencingToken::FIRST, LEASE, UnixMillis(0)),
        Err(StoreError::LeaseLost { current: None, .. })
    ));
    let e = m.extend(r.id, r.token, LEASE, UnixMillis(60_000)).unwrap_err();
    assert!(matches!(e, StoreError::LeaseLost { current: None, .. }), "{e:?}");
}

fn a_generation_s_first_token_comes_from_the_clock<M: Oracle + Default + Clone + PartialEq + std::fmt::Debug>() {
    // ms << 16: room for 65,536 reclaims per ms between two generations.
    assert_eq!(FencingToken::ATTEMPT_BITS, 16);
    assert_eq!(FencingToken::first_at(UnixMillis(1)), FencingToken(1 << 16));
    assert_eq!(FencingToken::first_at(UnixMillis(1_800_000_000_000)), FencingToken(1_800_000_000_000 << 16));
    // Never below the floor, even at or before the epoch.
    assert_eq!(FencingToken::first_at(UnixMillis(0)), FencingToken::FIRST);
    assert_eq!(FencingToken::first_at(UnixMillis(-5)), FencingToken::FIRST);
    // Saturates below 2^63, so it fits a signed 64-bit column.
    let top = FencingToken::first_at(UnixMillis(i64::MAX));
    assert_eq!(top, FencingToken(((1u64 << 47) - 1) << 16));
    assert!(i64::try_from(top.0).is_ok());
    // A later generation always starts above an earlier one's reclaims (fewer than 2^16 per ms).
    let early = FencingToken::first_at(UnixMillis(1_000));
    assert!(FencingToken(early.0 + (1 << 16) - 1) < FencingToken::first_at(UnixMillis(1_001)));
    // A claim replacing an expired record that is still stored stays above its token,
    // even when the clock gives less (two generations in one ms, or a clock stepped back).
    let mut m = M::default();
    let r = req("k", b"x");
    let zero = ClaimRequest::new(r.scope().clone(), r.key().clone(), r.fingerprint(), Duration::ZERO, Duration::ZERO);
    let first = claimed(&mut m, &zero, 1_000);
    let second = claimed(&mut m, &zero, 1_000);
    assert_eq!(second.token, first.token.next());
}

fn zero_lease_is_finite_and_expires_at_once<M: Oracle + Default + Clone + PartialEq + std::fmt::Debug>() {
    // A zero budget must never mean "no deadline" (docs/failures.md#zero-lease-means-no-deadline).
    let mut m = M::default();
    let r0 = req("k", b"x");
    let r0 = ClaimRequest::new(r0.scope().clone(), r0.key().clone(), r0.fingerprint(), Duration::ZERO, RETENTION);
    let r = claimed(&mut m, &r0, 1_000);
    assert_eq!(r.lease_expires_at, UnixMillis(1_000));
    assert_eq!(decide(Some(&r), &fp(b"x"), UnixMillis(1_000)), Decision::Reclaim { expected: r.token });
}

fn sweep_is_bounded_and_spares_live_records<M: Oracle + Default + Clone + PartialEq + std::fmt::Debug>() {
    let mut m = M::default();
    for i in 0..10 {
        claimed(&mut m, &req(&format!("k{i}"), b"x"), i);
    }
    // Nothing has expired at t=59_999.
    assert_eq!(m.sweep(100, UnixMillis(59_999)).removed, 0);
    let s = m.sweep(4, UnixMillis(60_005));
    assert_eq!((s.removed, s.more), (4, true));
    // Records 0..=5 expired by t=60_005 (retention 60 s from t=i): two are left to sweep.
    let s = m.sweep(4, UnixMillis(60_005));
    assert_eq!((s.removed, s.more), (2, false));
    // The other four are still held: once they expire too, a sweep removes exactly them.
    assert_eq!(m.sweep(100, UnixMillis(70_000)).removed, 4);
}

fn codec_round_trips_and_rejects_garbage<M: Oracle + Default + Clone + PartialEq + std::fmt::Debug>() {
    let mut m = M::default();
    let r = claimed(&mut m, &req("k", b"x"), 0);
    let body = vec![b'a'; 10_000];
    let receipt = m
        .complete(
            r.id,
            r.token,
            StoredResponse::compressed_over(201, vec![("location".into(), b"/w/1".to_vec())], body.clone(), 4096),
            UnixMillis(1),
        )
        .unwrap();
    let done = written(&m, r.id, receipt, 1);
    assert!(matches!(done.response.as_ref().unwrap().body, StoredBody::Lz4 { .. }));
    let bytes = codec::encode(&done);
    let back = codec::decode(&bytes).unwrap();
    assert_eq!(back, done);
    assert_eq!(back.response.unwrap().body_bytes().unwrap().unwrap().as_ref(), &body[..]);
    assert!(matches!(codec::decode(&[]), Err(codec::CodecError::Empty)));
    assert!(matches!(codec::decode(&[9, 1, 2]), Err(codec::CodecError::UnknownVersion(9))));
    assert!(codec::decode(&bytes[..bytes.len() - 1]).is_err());
}

proptest! {
    #[test]
    fn decoder_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = codec::decode(&bytes);
    }

    #[test]
    fn tokens_only_grow_on_spec(ops in proptest::collection::vec((0u8..6, 0i64..20_000), 1..60)) {
        tokens_only_grow::<Spec>(ops)?;
    }

    #[test]
    fn tokens_only_grow_on_the_engine(ops in proptest::collection::vec((0u8..6, 0i64..20_000), 1..60)) {
        tokens_only_grow::<Engine>(ops)?;
    }

}

#[test]
fn byte_string_bodies_keep_the_postcard_wire_format() {
    // Bodies are serialized as byte strings for speed; the bytes must equal the old
    // sequence-of-u8 encoding so records written before still decode.
    #[derive(serde::Serialize)]
    enum OldBody {
        Identity(Vec<u8>),
    }
    let body = vec![0u8, 1, 127, 128, 255, 7];
    let new = postcard::to_allocvec(&StoredBody::Identity(body.clone())).unwrap();
    let old = postcard::to_allocvec(&OldBody::Identity(body)).unwrap();
    assert_eq!(new, old);
}

/// Whatever the sequence, tokens only grow (see the two property tests above).
fn tokens_only_grow<M: Oracle + Default>(ops: Vec<(u8, i64)>) -> Result<(), TestCaseError> {
    // Whatever the sequence, the tokens of one record id never decrease, across its
    // generations too (a record swept or replaced after its retention), and every
    // successful claim or reclaim takes a token above every earlier one.
    let mut m = M::default();
    let r = req("k", b"x");
    let mut now = 0i64;
    let mut last = 0u64;
    for (op, dt) in ops {
        now += dt;
        let t = UnixMillis(now);
        let cur = m.get(r.id(), t);
        let won = match op {
            0 => match m.claim(&r, t) {
                ClaimOutcome::Claimed(n) => Some(n),
                ClaimOutcome::Existing { .. } => None,
            },
            1 => cur.as_ref().and_then(|c| match m.reclaim(&reclaim_req(c, b"x"), t) {
                ReclaimOutcome::Reclaimed(n) => Some(n),
                ReclaimOutcome::Conflict { .. } => None,
            }),
            2 => {
                if let Some(c) = &cur {
                    let _ = m.complete(c.id, c.token, StoredResponse::new(200, vec![], vec![]), t);
                }
                None
            }
            3 => {
                if let Some(c) = &cur {
                    let _ = m.fail(c.id, c.token, t);
                }
                None
            }
            4 => {
                if let Some(c) = &cur {
                    let _ = m.extend(c.id, c.token, LEASE, t);
                }
                None
            }
            _ => {
                let _ = m.sweep(10, t);
                None
            }
        };
        if let Some(n) = won {
            prop_assert!(n.token.0 > last, "token {} after {last}", n.token);
        }
        if let Some(after) = m.get(r.id(), t) {
            prop_assert!(after.token.0 >= last);
            prop_assert!(after.lease_expires_at <= after.expires_at || after.state != RecordState::InFlight);
            last = after.token.0;
        }
    }
    Ok(())
}

/// Each row above as a named test on one oracle.
macro_rules! rows {
    ($name:ident, $oracle:ty) => {
        mod $name {
            #[test]
            fn row_in_flight_fresh_same_is_busy_with_retry_after() {
                super::super::row_in_flight_fresh_same_is_busy_with_retry_after::<$oracle>();
            }
            #[test]
            fn row_in_flight_fresh_different_is_mismatch() {
                super::super::row_in_flight_fresh_different_is_mismatch::<$oracle>();
            }
            #[test]
            fn row_in_flight_expired_same_reclaims_exactly_at_lease_end() {
                super::super::row_in_flight_expired_same_reclaims_exactly_at_lease_end::<$oracle>();
            }
            #[test]
            fn row_in_flight_expired_different_is_mismatch() {
                super::super::row_in_flight_expired_different_is_mismatch::<$oracle>();
            }
            #[test]
            fn row_completed_same_replays_different_mismatches() {
                super::super::row_completed_same_replays_different_mismatches::<$oracle>();
            }
            #[test]
            fn row_failed_same_reclaims_different_mismatches() {
                super::super::row_failed_same_reclaims_different_mismatches::<$oracle>();
            }
            #[test]
            fn retention_end_makes_the_record_absent_and_a_new_claim_gets_a_higher_token() {
                super::super::retention_end_makes_the_record_absent_and_a_new_claim_gets_a_higher_token::<$oracle>();
            }
            #[test]
            fn stale_token_writes_are_lease_lost_and_change_nothing() {
                super::super::stale_token_writes_are_lease_lost_and_change_nothing::<$oracle>();
            }
            #[test]
            fn extend_renews_from_now_never_earlier_and_keeps_the_rest() {
                super::super::extend_renews_from_now_never_earlier_and_keeps_the_rest::<$oracle>();
            }
            #[test]
            fn extend_is_lease_lost_unless_the_caller_holds_the_in_flight_claim() {
                super::super::extend_is_lease_lost_unless_the_caller_holds_the_in_flight_claim::<$oracle>();
            }
            #[test]
            fn a_generation_s_first_token_comes_from_the_clock() {
                super::super::a_generation_s_first_token_comes_from_the_clock::<$oracle>();
            }
            #[test]
            fn zero_lease_is_finite_and_expires_at_once() {
                super::super::zero_lease_is_finite_and_expires_at_once::<$oracle>();
            }
            #[test]
            fn sweep_is_bounded_and_spares_live_records() {
                super::super::sweep_is_bounded_and_spares_live_records::<$oracle>();
            }
            #[test]
            fn codec_round_trips_and_rejects_garbage() {
                super::super::codec_round_trips_and_rejects_garbage::<$oracle>();
            }
        }
    };
}

mod on {
    rows!(spec, idem_conformance::Spec);
    rows!(engine, crate::engine::Engine);
}
