//! Step 2, acquire: claim the record, and decide what to do with what the store found
//! ([`idem_core::decide`], `docs/decision-table.md`).
//!
//! `claim` is the first store call of every keyed request: `Claimed` runs the handler;
//! `Existing` goes to `decide`. A reclaim that another request won, or a record that
//! expired or vanished between two reads, is decided again, for at most [`MAX_ROUNDS`]
//! rounds. With a bounded wait (`with_in_flight_wait`), a record found in flight is read
//! again with `get` after short pauses until it is no longer in flight with a fresh lease,
//! or the wait is over; each read goes through the same decision as the claim's answer.
//! Nothing is held between two reads: no connection, no lock, no claim. A store with
//! [`Store::settlements`] wakes the wait when the record settles, so the read comes at once
//! rather than at the end of the pause; interest is registered before each read, so an
//! outcome written between the read and the pause is not missed. A wake-up is only a
//! hint: a lost one costs the rest of the pause, as without wake-ups.

use std::time::Duration;

use idem_core::{
    ClaimOutcome, ClaimRequest, Decision, IdempotencyKey, ReclaimOutcome, ReclaimRequest, Record, Scope, Store,
    StoreError, decide,
};
use tokio::time::Instant;

use super::Pipeline;
use crate::answer::{Answer, Refusal};
use crate::lease::capped;
use crate::observe::DecisionKind;

/// How many times one request re-reads a record that changed under it (a lost reclaim, a
/// record that expired between two reads) before it answers 409 busy. Each round follows
/// an actual change by another request, so three is plenty outside pathological
/// contention, and it bounds the store calls one request can make.
const MAX_ROUNDS: usize = 3;

/// First pause of a bounded wait for an in-flight record before it reads the record again;
/// each pause doubles, up to [`WAIT_POLL_MAX`]. Short first, so a duplicate that arrives as
/// the first attempt finishes gets the replay within milliseconds; longer later, so a long
/// wait costs a few reads per second.
const WAIT_POLL_FIRST: Duration = Duration::from_millis(20);
/// Longest pause between two reads of a bounded wait.
const WAIT_POLL_MAX: Duration = Duration::from_millis(500);

/// What acquiring the record came to.
pub(super) enum Acquired<B> {
    /// This request holds the claim (first claim or reclaim), sent at `sent`: the lease
    /// started no earlier.
    Claimed { record: Record, sent: Instant, decision: DecisionKind },
    /// Answered without running the handler: a replay, 409, a mismatch.
    Answered(Answer<B>, DecisionKind),
    /// The store failed: fail closed or open, per the layer's store failure mode.
    StoreFailed(StoreError),
    /// A record that does not decode (`StoreError::Corrupt`), or a completed record whose
    /// response cannot be rebuilt.
    Unreadable(String),
}

impl<B> Acquired<B> {
    fn claimed(record: Record, sent: Instant, decision: DecisionKind) -> Self {
        Acquired::Claimed { record, sent, decision }
    }

    /// A failed store call: a record that does not decode is no outage (it may be a
    /// completed operation).
    fn failed(error: StoreError) -> Self {
        if error.is_corrupt() { Acquired::Unreadable(error.to_string()) } else { Acquired::StoreFailed(error) }
    }
}

/// Claims `claim`'s record and decides (module docs).
///
/// The claim request goes to the store by value; the common cases (a first claim, a
/// replay, a 409) need nothing of it afterwards. A request that must claim anew (its record
/// expired or vanished between two reads) rebuilds it from a record it saw, which has the
/// same scope and key: the record id is their hash.
pub(super) async fn acquire<B>(pipeline: &Pipeline, claim: ClaimRequest, deadline: Option<Instant>) -> Acquired<B> {
    let calls = &*pipeline.store;
    let (id, fingerprint) = (claim.id(), claim.fingerprint());
    let (ttl, retention) = (pipeline.settings.policy.lease_ttl, pipeline.retention);
    let again = |scope: Scope, key: IdempotencyKey| {
        ClaimRequest::new(scope, key, fingerprint, capped(ttl, deadline), retention)
    };
    let sent = Instant::now();
    let (mut current, mut now) = match calls.claim(claim).await {
        Ok(ClaimOutcome::Claimed(record)) => return Acquired::claimed(record, sent, DecisionKind::Claimed),
        Ok(ClaimOutcome::Existing { record, now }) => (Some(record), now),
        Err(e) => return Acquired::failed(e),
    };
    // When the store's `now` was last read, for the estimate a `get` (which reports no
    // `now`) is decided with; only a bounded wait reads it.
    let mut wait = pipeline.settings.in_flight_wait.map(BoundedWait::new);
    let mut read_at = wait.as_ref().map(|_| Instant::now());
    // Scope and key of the last record seen, for a claim after a reclaim found none.
    let mut seen: Option<(Scope, IdempotencyKey)> = None;
    // Interest in the record's outcome, registered before the last read of a bounded wait.
    let mut settled = None;
    let mut rounds = 0;
    while rounds < MAX_ROUNDS {
        let next = match (decide(current.as_ref(), &fingerprint, now), current.as_ref()) {
            // No live record (it expired or vanished since the claim read it): claim anew.
            (Decision::Claim, _) | (_, None) => {
                let Some((scope, key)) = current.take().map(|r| (r.scope, r.key)).or_else(|| seen.take()) else {
                    // Unreachable: every round starts from a record or follows a reclaim,
                    // which remembered one. Answered like a record that kept changing.
                    break;
                };
                seen = Some((scope.clone(), key.clone()));
                let sent = Instant::now();
                // The calls after the first claim are rare (a race, an expiry, a wait):
                // boxed, their state stays out of every request's future.
                match Box::pin(calls.claim(again(scope, key))).await {
                    Ok(ClaimOutcome::Claimed(record)) => return Acquired::claimed(record, sent, DecisionKind::Claimed),
                    Ok(ClaimOutcome::Existing { record, now: n }) => (Some(record), n),
                    Err(e) => return Acquired::failed(e),
                }
            }
            (Decision::Replay, Some(_)) => {
                let Some(record) = current.take() else { break };
                return match Answer::replay(record) {
                    Ok(answer) => Acquired::Answered(answer, DecisionKind::Replayed),
                    Err(why) => Acquired::Unreadable(why),
                };
            }
            (Decision::InFlight { retry_after_secs }, Some(record)) => {
                if let Some(pause) = wait.as_mut().and_then(BoundedWait::next_pause) {
                    seen = Some((record.scope.clone(), record.key.clone()));
                    let hub = Store::settlements(calls);
                    match settled.take() {
                        // Woken: the record settled since the last read.
                        Some(woken) => drop(futures::future::select(Box::pin(tokio::time::sleep(pause)), woken).await),
                        // The first interest comes after the claim's read: read again at once.
                        None if hub.is_some() => {}
                        None => Box::pin(tokio::time::sleep(pause)).await,
                    }
                    settled = hub.map(|h| h.watch(id));
                    match Box::pin(calls.get(id)).await {
                        Ok(found) => {
                            // The store's clock moved on by (at least) the time that passed here.
                            now = now.saturating_add(read_at.map_or(Duration::ZERO, |at| at.elapsed()));
                            read_at = Some(Instant::now());
                            current = found;
                            // A read while waiting is not a round: nothing raced this request.
                            continue;
                        }
                        // A record that stopped opening (or decoding) while this request
                        // waited is answered like at the claim: 503, never retry.
                        Err(e) if e.is_corrupt() => return Acquired::Unreadable(e.to_string()),
                        // The record was in flight at the last read; say so rather than
                        // guess (failing open here could run the handler a second time).
                        Err(e) => tracing::warn!(
                            record = %id, error = %e,
                            "idempotency store failed during a bounded wait; answering in-flight"
                        ),
                    }
                }
                let secs = in_flight_retry_after_secs(retry_after_secs, pipeline.settings.in_flight_retry_after);
                return Acquired::Answered(
                    Answer::Refusal(Refusal::in_flight(secs, record.expires_at)),
                    DecisionKind::InFlight,
                );
            }
            (Decision::Mismatch, Some(record)) => {
                let refusal = Refusal::mismatch(pipeline.mismatch_status, record.expires_at);
                return Acquired::Answered(Answer::Refusal(refusal), DecisionKind::Mismatch);
            }
            (Decision::Reclaim { expected }, Some(record)) => {
                seen = Some((record.scope.clone(), record.key.clone()));
                let req = ReclaimRequest { id, expected, fingerprint, lease_ttl: capped(ttl, deadline), retention };
                let sent = Instant::now();
                match Box::pin(calls.reclaim(req)).await {
                    Ok(ReclaimOutcome::Reclaimed(record)) => {
                        return Acquired::claimed(record, sent, DecisionKind::Reclaimed);
                    }
                    // Another retry won the compare-and-set, or the record moved on: look again.
                    Ok(ReclaimOutcome::Conflict { current, now: n }) => (current, n),
                    Err(e) => return Acquired::failed(e),
                }
            }
        };
        (current, now) = next;
        if read_at.is_some() {
            read_at = Some(Instant::now());
        }
        rounds += 1;
    }
    Acquired::Answered(Answer::Refusal(Refusal::busy()), DecisionKind::Busy)
}

/// clamp(remaining lease, 1 s, cap): `Retry-After` is whole delay-seconds (RFC 9110
/// §10.2.3), so the cap counts in whole seconds too (rounded down, at least 1). A short
/// poll, because renewal keeps a live attempt's lease fresh however long it runs, so the
/// lease end says nothing about when the outcome lands.
fn in_flight_retry_after_secs(remaining_lease_secs: u64, cap: Duration) -> u64 {
    remaining_lease_secs.clamp(1, cap.as_secs().max(1))
}

/// The clock of one bounded wait: when it ends, and the next pause.
struct BoundedWait {
    deadline: Instant,
    pause: Duration,
}

impl BoundedWait {
    fn new(limit: Duration) -> Self {
        Self { deadline: Instant::now() + limit, pause: WAIT_POLL_FIRST }
    }

    /// How long to pause before the next read, never past the deadline; `None` once the
    /// wait is over.
    fn next_pause(&mut self) -> Option<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return None;
        }
        let pause = self.pause.min(left);
        self.pause = (self.pause * 2).min(WAIT_POLL_MAX);
        Some(pause)
    }
}
