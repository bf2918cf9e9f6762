//! Capabilities: what a store declares it offers, and the variants the suite runs for it.
//! Each scenario here prints the variant it ran (`variant:` lines on stderr).

use std::time::Duration;

use idem_core::{ClaimOutcome, Clock, FencingToken, SystemClock, UnixMillis};

use super::{claim_req, claim_req_timed, completed, existing, get, must_claim, response};
use crate::Env;

/// The declared capabilities hold: native expiry means sweep removes nothing yet expired
/// records read as absent; otherwise sweep removes them.
pub async fn declared_capabilities_hold(env: Env) {
    let s = env.sweep_session().await;
    let caps = env.capabilities();
    env.report(&format!(
        "capabilities: native_expiry={} server_clock={} shared={}",
        caps.native_expiry, caps.server_clock, caps.shared
    ));
    let r =
        must_claim(&env, claim_req_timed(&env, "p", "k", b"b", Duration::from_secs(1), Duration::from_secs(2))).await;
    env.clock.set(r.expires_at);
    let out = env.store.sweep(10_000).await.expect("sweep");
    if s.native_expiry {
        env.report("native expiry: sweep returned zero, record reads absent");
        assert_eq!((out.removed, out.more), (0, false));
    } else {
        env.report("sweep: removed the expired record");
        super::sweep_until_done(env.store.as_ref(), 10_000, 10_000).await;
        let now = UnixMillis(env.clock.now_ms());
        // One ms earlier a record that is still stored would read again.
        env.clock.set(UnixMillis(r.expires_at.0 - 1));
        assert_eq!(get(env.store.as_ref(), r.id).await, None, "the swept record is gone");
        env.clock.set(now);
        let n = super::claimed(env.store.as_ref(), claim_req(&env, "p", "k", b"b")).await;
        assert_eq!(n.token, FencingToken::first_at(now), "a new generation");
        return;
    }
    assert_eq!(get(env.store.as_ref(), r.id).await, None, "an expired record reads absent");
}

/// A second handle (`Backend::open_peer`) sees the first handle's writes at once.
pub async fn peer_handle_sees_the_same_records(env: Env) {
    let peer = env.peer().await;
    env.report(if std::sync::Arc::ptr_eq(&peer, &env.store) {
        "peer: same handle (embedded store, one opener)"
    } else {
        "peer: independent handle on shared storage"
    });
    let r = must_claim(&env, claim_req(&env, "p", "k", b"b")).await;
    assert_eq!(get(peer.as_ref(), r.id).await, Some(r.clone()));
    let done = completed(peer.as_ref(), &r, response()).await;
    assert_eq!(get(env.store.as_ref(), r.id).await, Some(done));
}

/// With a server clock (`Backend::open_server_clock`), leases and retention are computed from
/// the server's time: `created_at` is near real time and `lease_expires_at = created_at + lease`.
pub async fn server_clock_sets_leases_from_the_server(env: Env) {
    let Some(store) = env.server_clock_store().await else {
        env.report("no server clock: Backend::open_server_clock returned None");
        return;
    };
    env.report("server clock: checking leases against the server's time");
    // The server's clock may be skewed against ours; a minute either way is tolerated.
    const SKEW_MS: i64 = 60_000;
    let before = SystemClock.now().0;
    let req = claim_req(&env, "server-clock", "k", b"b");
    let r = match store.claim(req.clone()).await.expect("claim") {
        ClaimOutcome::Claimed(r) => r,
        other => panic!("expected Claimed on a fresh key, got {other:?}"),
    };
    let after = SystemClock.now().0;
    assert!(
        r.created_at.0 >= before - SKEW_MS && r.created_at.0 <= after + SKEW_MS,
        "created_at {} is the server's time",
        r.created_at
    );
    assert_eq!(r.lease_expires_at.0 - r.created_at.0, super::LEASE_MS);
    assert_eq!(r.expires_at.0 - r.created_at.0, super::RETENTION_MS);
    let (seen, now) = existing(store.as_ref(), req).await;
    assert_eq!(seen, r);
    assert!(now >= r.created_at, "the server's clock does not run backwards between two calls");
    assert!(seen.lease_is_fresh(now), "a 5 s lease is fresh right after the claim on the server's clock");
    completed(store.as_ref(), &r, response()).await;
}

/// What the store declares about its clock and sharing is what its backend does: a store
/// that declares [`idem_core::Capabilities::server_clock`] has a server-clock store
/// (`Backend::open_server_clock`, which then declares it too) and one that does not has
/// none; a store that declares [`idem_core::Capabilities::shared`] gets an independent
/// second handle from `Backend::open_peer` (one opener per file is not sharing), which
/// declares the same capabilities. (Native expiry, the journal and listing are checked
/// both ways by their own scenarios: declared means it works, undeclared means it is
/// refused.)
pub async fn declared_clock_and_sharing_match_the_backend(env: Env) {
    let caps = env.capabilities();
    let server = env.server_clock_store().await;
    assert_eq!(
        caps.server_clock,
        server.is_some(),
        "Capabilities::server_clock is {} but Backend::open_server_clock returned {}",
        caps.server_clock,
        if server.is_some() { "a store" } else { "None" }
    );
    if let Some(server) = server {
        assert!(server.capabilities().server_clock, "the server-clock store must declare server_clock");
    }
    let peer = env.peer().await;
    if caps.shared {
        env.report("shared: the peer handle is an independent handle");
        assert!(
            !std::sync::Arc::ptr_eq(&peer, &env.store),
            "a store that declares Capabilities::shared must get an independent handle from Backend::open_peer"
        );
        assert_eq!(peer.capabilities(), caps, "both handles on shared storage declare the same capabilities");
    } else {
        env.report("not shared: one handle per storage");
    }
}
