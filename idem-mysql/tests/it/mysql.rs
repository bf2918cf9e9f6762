//! MySQL-specific behaviour beyond the shared suite: the isolation level pinned and
//! checked, migrations and their version checks, table prefixes, bad input as typed
//! errors, a missing table, corrupt rows, races on one key and on many new keys, the
//! server's clock, and the sweep through the shared `Sweeper`.
//! Runs against the real server at `IDEM_MYSQL_URL`, each test on its own tables.

use std::sync::Arc;
use std::time::Duration;

use idem_core::{
    ClaimOutcome, ClaimRequest, Clock as _, Endpoint, Fingerprint, IdempotencyKey, ManualClock, Record, RecordState,
    Scope, Store, StoreError, StoredResponse, SweepConfig, Sweeper, SystemClock, UnixMillis,
};
use idem_mysql::sqlx::{self, Connection as _};
use idem_mysql::{Config, Error, MIGRATIONS, MySqlStore};

use crate::common::{self, PrefixGuard};

fn claim_req(principal: &str, key: &str, lease: Duration, retention: Duration) -> ClaimRequest {
    let scope = Scope::new(principal, Endpoint::new("POST", "/v1/workers")).expect("principal");
    let key = IdempotencyKey::parse(key.as_bytes()).expect("key");
    ClaimRequest::new(scope, key, Fingerprint::of_bytes(b"{}"), lease, retention)
}

fn req(key: &str) -> ClaimRequest {
    claim_req("tenant-a", key, Duration::from_secs(30), Duration::from_secs(3600))
}

async fn must_claim(store: &impl Store, req: ClaimRequest) -> Record {
    match store.claim(req).await.expect("claim") {
        ClaimOutcome::Claimed(r) => r,
        other => panic!("expected Claimed, got {other:?}"),
    }
}

fn response() -> StoredResponse {
    StoredResponse::new(201, vec![("location".into(), b"/v1/workers/42".to_vec())], b"{\"id\":42}".to_vec())
}

fn clock() -> ManualClock {
    ManualClock::new(UnixMillis(1_800_000_000_000))
}

/// The store's own error out of a `StoreError::Unavailable`.
fn ours(e: &StoreError) -> &Error {
    std::error::Error::source(e).and_then(|s| s.downcast_ref::<Error>()).expect("idem_mysql::Error as source")
}

async fn isolation_of(pool: &sqlx::MySqlPool) -> String {
    let mut conn = pool.acquire().await.expect("connection");
    match sqlx::query_scalar::<_, String>("SELECT @@session.tx_isolation").fetch_one(&mut *conn).await {
        Ok(level) => level,
        // MySQL 8 knows only the new name.
        Err(_) => {
            sqlx::query_scalar("SELECT @@session.transaction_isolation").fetch_one(&mut *conn).await.expect("level")
        }
    }
}

#[tokio::test]
async fn connect_pins_read_committed_on_every_session() {
    let store = common::fresh_store(None, 3).await;
    let pool = store.0.inner.pool().clone();
    // Several sessions at once, so more than the first connection is looked at.
    let conns = futures_like_join(&pool, 3).await;
    for mut c in conns {
        let level: String = match sqlx::query_scalar("SELECT @@session.tx_isolation").fetch_one(&mut *c).await {
            Ok(l) => l,
            Err(_) => sqlx::query_scalar("SELECT @@session.transaction_isolation").fetch_one(&mut *c).await.unwrap(),
        };
        assert_eq!(level, "READ-COMMITTED");
    }
}

async fn futures_like_join(pool: &sqlx::MySqlPool, n: usize) -> Vec<sqlx::pool::PoolConnection<sqlx::MySql>> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(pool.acquire().await.expect("connection"));
    }
    out
}

#[tokio::test]
async fn a_pool_at_the_default_level_is_refused_with_a_typed_error() {
    let pool = common::pool(2, false).await;
    let level = isolation_of(&pool).await;
    assert_ne!(level, "READ-COMMITTED", "the test needs a server whose default is not READ COMMITTED");
    let guard = PrefixGuard::fresh().await;
    let err = MySqlStore::from_pool(pool, common::config(&guard.name, None, 2)).await.expect_err("refused");
    match &err {
        Error::IsolationNotSupported { level: got } => assert_eq!(got, &level),
        other => panic!("expected IsolationNotSupported, got {other:?}"),
    }
    assert!(!err.is_retryable());
}

#[tokio::test]
async fn a_refused_pool_creates_no_tables() {
    let pool = common::pool(1, false).await;
    let guard = PrefixGuard::fresh().await;
    assert!(MySqlStore::from_pool(pool.clone(), common::config(&guard.name, None, 1)).await.is_err());
    let n: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name LIKE ?",
    )
    .bind(format!("{}%", guard.name))
    .fetch_one(&pool)
    .await
    .expect("count");
    assert_eq!(n, 0);
}

#[tokio::test]
async fn a_pool_pinned_to_read_committed_is_accepted() {
    let pool = common::pool(2, true).await;
    let guard = PrefixGuard::fresh().await;
    let store = MySqlStore::from_pool(pool, common::config(&guard.name, Some(clock()), 2)).await.expect("store");
    let r = must_claim(&store, req("from-pool")).await;
    assert_eq!(r.state, RecordState::InFlight);
}

#[tokio::test]
async fn migrate_applies_once_and_then_nothing() {
    let pool = common::pool(2, true).await;
    let guard = PrefixGuard::fresh().await;
    let config = common::config(&guard.name, None, 2);
    assert_eq!(MySqlStore::migrate(&pool, &config).await.expect("migrate"), MIGRATIONS.len());
    assert_eq!(MySqlStore::migrate(&pool, &config).await.expect("again"), 0);
}

#[tokio::test]
async fn concurrent_migrations_apply_each_version_once() {
    let pool = common::pool(8, true).await;
    let guard = PrefixGuard::fresh().await;
    let config = common::config(&guard.name, None, 2);
    let mut tasks = Vec::new();
    for _ in 0..6 {
        let (pool, config) = (pool.clone(), config.clone());
        tasks.push(tokio::spawn(async move { MySqlStore::migrate(&pool, &config).await }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.expect("task").expect("migrate");
    }
    assert_eq!(total, MIGRATIONS.len());
    let rows: i64 = sqlx::query_scalar(&format!("SELECT COUNT(*) FROM `{}_schema_migrations`", guard.name))
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(rows, i64::try_from(MIGRATIONS.len()).unwrap());
}

#[tokio::test]
async fn without_auto_migration_fresh_tables_are_not_migrated() {
    let guard = PrefixGuard::fresh().await;
    let config = common::config(&guard.name, None, 2).with_auto_migrate(false);
    let err = MySqlStore::connect(&common::url(), config).await.expect_err("not migrated");
    assert!(matches!(err, Error::NotMigrated { found: 0, known: 3, .. }), "{err:?}");
    assert!(!err.is_retryable());
    assert!(err.to_string().contains("MySqlStore::migrate("), "{err}");
}

#[tokio::test]
async fn without_auto_migration_migrated_tables_are_used() {
    let pool = common::pool(2, true).await;
    let guard = PrefixGuard::fresh().await;
    MySqlStore::migrate(&pool, &common::config(&guard.name, None, 2)).await.expect("migrate");
    let config = common::config(&guard.name, Some(clock()), 2).with_auto_migrate(false);
    let store = MySqlStore::from_pool(pool, config).await.expect("store");
    must_claim(&store, req("deployed")).await;
}

#[tokio::test]
async fn tables_migrated_by_a_newer_build_are_refused() {
    let guard = PrefixGuard::fresh().await;
    let store = common::connect(&guard.name, None, 2).await;
    let sql = format!("INSERT INTO `{}_schema_migrations` (version, name) VALUES (99, 'future')", guard.name);
    sqlx::query(&sql).execute(store.pool()).await.expect("insert");
    for auto in [true, false] {
        let config = common::config(&guard.name, None, 2).with_auto_migrate(auto);
        let err = MySqlStore::connect(&common::url(), config).await.expect_err("too new");
        assert!(matches!(err, Error::SchemaTooNew { found: 99, known: 3, .. }), "{err:?}");
    }
}

#[tokio::test]
async fn the_migration_creates_the_expiry_index() {
    let store = common::fresh_store(None, 2).await;
    let prefix = &store.0.guard.name;
    let columns: Vec<String> = sqlx::query_scalar(
        "SELECT CAST(column_name AS CHAR) FROM information_schema.statistics
         WHERE table_schema = DATABASE() AND table_name = ? AND index_name = ?",
    )
    .bind(format!("{prefix}_records"))
    .bind(format!("{prefix}_records_expires_at"))
    .fetch_all(store.0.inner.pool())
    .await
    .expect("statistics");
    assert_eq!(columns, ["expires_at"]);
}

#[tokio::test]
async fn a_migration_can_be_run_again_after_a_crash_before_its_bookkeeping_row() {
    let pool = common::pool(2, true).await;
    let guard = PrefixGuard::fresh().await;
    // The DDL ran, the process died before recording it.
    sqlx::Executor::execute(&pool, sqlx::raw_sql(&MIGRATIONS[0].sql_for(&guard.name))).await.expect("ddl");
    let config = common::config(&guard.name, Some(clock()), 2);
    assert_eq!(MySqlStore::migrate(&pool, &config).await.expect("migrate"), MIGRATIONS.len());
    let store = MySqlStore::from_pool(pool, config).await.expect("store");
    must_claim(&store, req("after-crash")).await;
}

#[tokio::test]
async fn bad_prefixes_are_typed_errors_before_any_connection() {
    for bad in ["", "Idem", "1a", "a-b", "a`b", "a b", "x;drop table t", "é", &"a".repeat(41)] {
        // Port 9 (discard) on loopback: nothing must be tried before the name is checked.
        let config = Config::default().with_table_prefix(bad);
        let err = MySqlStore::connect("mysql://root@127.0.0.1:9/test", config.clone()).await.expect_err(bad);
        assert!(matches!(err, Error::InvalidPrefix { .. }), "{bad}: {err:?}");
        let pool = sqlx::mysql::MySqlPoolOptions::new().connect_lazy("mysql://root@127.0.0.1:9/test").expect("lazy");
        let err = MySqlStore::migrate(&pool, &config).await.expect_err(bad);
        assert!(matches!(err, Error::InvalidPrefix { .. }), "{bad}: {err:?}");
        let err = MySqlStore::from_pool(pool, config).await.expect_err(bad);
        assert!(matches!(err, Error::InvalidPrefix { .. }), "{bad}: {err:?}");
    }
}

#[tokio::test]
async fn bad_urls_are_typed_errors() {
    for bad in ["not a url", "mysql://root@127.0.0.1/test?ssl-mode=nonsense", "mysql://root@127.0.0.1:notaport/test"] {
        let err = MySqlStore::connect(bad, Config::default()).await.expect_err(bad);
        assert!(matches!(err, Error::InvalidUrl(_)), "{bad}: {err:?}");
        assert!(!err.is_retryable());
    }
}

#[tokio::test]
async fn a_server_that_is_not_there_is_a_retryable_connection_error() {
    let config = Config::default().with_acquire_timeout(Duration::from_millis(300));
    // Port 1 on loopback: nothing listens there.
    let err = MySqlStore::connect("mysql://root@127.0.0.1:1/test", config).await.expect_err("down");
    assert!(matches!(err, Error::Connection { .. }), "{err:?}");
    assert!(err.is_retryable());
}

#[tokio::test]
async fn a_missing_table_says_to_migrate() {
    let store = common::fresh_store(Some(clock()), 2).await;
    let prefix = store.0.guard.name.clone();
    let drop = format!("DROP TABLE `{prefix}_journal`, `{prefix}_records`");
    sqlx::query(&drop).execute(store.0.inner.pool()).await.expect("drop");
    let err = store.claim(req("gone")).await.expect_err("no table");
    assert!(!err.is_retryable());
    assert!(err.to_string().contains("MySqlStore::migrate"), "{err}");
    assert!(matches!(ours(&err), Error::MySql { .. }));
    assert!(store.get(req("gone").id()).await.is_err());
    assert!(store.sweep(10).await.is_err());
}

async fn corrupt_with(set: &str) -> StoreError {
    let store = common::fresh_store(Some(clock()), 2).await;
    let r = must_claim(&store, req("corrupt")).await;
    store.complete(r.id, r.token, response()).await.expect("complete");
    let sql = format!("UPDATE `{}_records` SET {set} WHERE id = ?", store.0.guard.name);
    sqlx::query(&sql).bind(r.id.as_bytes().as_slice()).execute(store.0.inner.pool()).await.expect("spoil");
    let err = store.get(r.id).await.expect_err("corrupt");
    // A claim of the same key meets the same row and must not replace or replay it.
    let claimed = store.claim(req("corrupt")).await.expect_err("corrupt");
    assert!(matches!(claimed, StoreError::Corrupt { .. }), "{claimed:?}");
    err
}

#[tokio::test]
async fn a_response_that_does_not_decode_is_corrupt() {
    let err = corrupt_with("response = x'ff00'").await;
    assert!(matches!(err, StoreError::Corrupt { .. }), "{err:?}");
}

#[tokio::test]
async fn a_key_moved_to_another_row_is_corrupt() {
    let err = corrupt_with("idem_key = 'another-key'").await;
    assert!(matches!(err, StoreError::Corrupt { .. }), "{err:?}");
    assert!(err.to_string().contains("another record") || format!("{err:?}").contains("another record"), "{err:?}");
}

#[tokio::test]
async fn a_principal_that_is_not_utf8_is_corrupt() {
    let err = corrupt_with("principal = x'c3'").await;
    assert!(matches!(err, StoreError::Corrupt { .. }), "{err:?}");
}

#[tokio::test]
async fn a_negative_token_is_corrupt() {
    // The CHECK constraint refuses it on both servers; a table without it (an older MySQL
    // that parses and ignores CHECK) would reach the decoder, which refuses it too.
    let store = common::fresh_store(Some(clock()), 2).await;
    let r = must_claim(&store, req("negative")).await;
    let sql = format!("UPDATE `{}_records` SET token = -5 WHERE id = ?", store.0.guard.name);
    let res = sqlx::query(&sql).bind(r.id.as_bytes().as_slice()).execute(store.0.inner.pool()).await;
    if res.is_ok() {
        assert!(matches!(store.get(r.id).await, Err(StoreError::Corrupt { .. })));
    }
}

#[tokio::test]
async fn the_state_check_constraint_holds() {
    let store = common::fresh_store(Some(clock()), 2).await;
    let r = must_claim(&store, req("state")).await;
    let sql = format!("UPDATE `{}_records` SET state = 'bogus' WHERE id = ?", store.0.guard.name);
    let res = sqlx::query(&sql).bind(r.id.as_bytes().as_slice()).execute(store.0.inner.pool()).await;
    assert!(res.is_err(), "CHECK (state IN ...) refuses an unknown state");
    assert_eq!(store.get(r.id).await.expect("get").expect("live").state, RecordState::InFlight);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thirty_two_claims_of_one_new_key_make_one_owner() {
    for round in 0..3 {
        let store = Arc::new(common::fresh_store(Some(clock()), 8).await);
        let mut tasks = Vec::new();
        for _ in 0..32 {
            let store = Arc::clone(&store);
            tasks.push(tokio::spawn(async move { store.claim(req(&format!("race-{round}"))).await }));
        }
        let (mut claimed, mut existing) = (Vec::new(), Vec::new());
        for t in tasks {
            match t.await.expect("task").expect("claim") {
                ClaimOutcome::Claimed(r) => claimed.push(r),
                ClaimOutcome::Existing { record, .. } => existing.push(record),
            }
        }
        assert_eq!(claimed.len(), 1, "exactly one owner");
        assert!(existing.iter().all(|r| r.token == claimed[0].token), "everyone else sees the owner's claim");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thirty_two_claims_of_one_expired_key_make_one_new_generation() {
    let clock = clock();
    let store = Arc::new(common::fresh_store(Some(clock.clone()), 8).await);
    let first = must_claim(&*store, req("expired-race")).await;
    clock.advance(Duration::from_secs(7200));
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let store = Arc::clone(&store);
        tasks.push(tokio::spawn(async move { store.claim(req("expired-race")).await }));
    }
    let mut winners = Vec::new();
    for t in tasks {
        if let ClaimOutcome::Claimed(r) = t.await.expect("task").expect("claim") {
            winners.push(r);
        }
    }
    assert_eq!(winners.len(), 1, "one new generation");
    assert!(winners[0].token > first.token, "the new generation's token is above the old one");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_claims_of_many_new_keys_all_succeed() {
    let store = Arc::new(common::fresh_store(Some(clock()), 8).await);
    let mut tasks = Vec::new();
    for i in 0..64 {
        let store = Arc::clone(&store);
        tasks.push(tokio::spawn(async move { store.claim(req(&format!("many-{i}"))).await }));
    }
    for t in tasks {
        assert!(matches!(t.await.expect("task").expect("claim"), ClaimOutcome::Claimed(_)));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_completes_with_one_token_write_once_and_the_rest_lose_nothing() {
    let store = Arc::new(common::fresh_store(Some(clock()), 8).await);
    let r = must_claim(&*store, req("complete-race")).await;
    let mut tasks = Vec::new();
    for i in 0..16u16 {
        let store = Arc::clone(&store);
        tasks.push(tokio::spawn(async move {
            store.complete(r.id, r.token, StoredResponse::new(200 + i, vec![], vec![])).await
        }));
    }
    let mut ok = 0;
    for t in tasks {
        match t.await.expect("task") {
            Ok(_) => ok += 1,
            Err(StoreError::LeaseLost { .. }) => {}
            Err(e) => panic!("unexpected {e:?}"),
        }
    }
    assert_eq!(ok, 1, "one completion wins the compare-and-set");
    assert_eq!(store.get(r.id).await.expect("get").expect("live").state, RecordState::Completed);
}

#[tokio::test]
async fn the_server_clock_is_utc_milliseconds() {
    let store = common::fresh_store(None, 2).await;
    let before = SystemClock.now().0;
    let r = must_claim(&store, req("server-clock")).await;
    let after = SystemClock.now().0;
    // The server runs on this machine (or one synchronised with it): within a few seconds.
    assert!(r.created_at.0 > before - 5_000 && r.created_at.0 < after + 5_000, "{r:?} vs {before}..{after}");
    assert_eq!(r.lease_expires_at.0 - r.created_at.0, 30_000);
    assert_eq!(r.expires_at.0 - r.created_at.0, 3_600_000);
}

#[tokio::test]
async fn the_server_clock_does_not_depend_on_the_session_time_zone() {
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(1)
        .after_connect(|conn, _| {
            Box::pin(async move {
                idem_mysql::pin_read_committed(conn).await?;
                sqlx::Executor::execute(conn, sqlx::raw_sql("SET time_zone = '+09:30'")).await.map(drop)
            })
        })
        .connect(&common::url())
        .await
        .unwrap_or_else(|e| common::unreachable(&e));
    let guard = PrefixGuard::fresh().await;
    let store = MySqlStore::from_pool(pool, common::config(&guard.name, None, 1)).await.expect("store");
    let now = SystemClock.now().0;
    let r = must_claim(&store, req("time-zone")).await;
    assert!((r.created_at.0 - now).abs() < 5_000, "{} vs {now}", r.created_at.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shared_sweeper_removes_expired_records_only() {
    let clock = clock();
    let store = common::fresh_store(Some(clock.clone()), 2).await;
    let short = Duration::from_secs(10);
    for i in 0..5 {
        must_claim(&store, claim_req("p", &format!("old-{i}"), short, short)).await;
    }
    let live = must_claim(&store, claim_req("p", "live", Duration::from_secs(5), Duration::from_secs(3_600))).await;
    clock.advance(Duration::from_secs(11));
    let sweeper = Sweeper::start(
        Arc::new(store.clone()),
        SweepConfig::default().with_period(Duration::from_millis(10)).with_batch(2),
    );
    let count_sql = format!("SELECT COUNT(*) FROM `{}_records`", store.0.guard.name);
    let pool = store.0.inner.pool().clone();
    let emptied = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let n: i64 = sqlx::query_scalar(&count_sql).fetch_one(&pool).await.expect("count");
            if n == 1 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    sweeper.stop().await;
    emptied.expect("the sweeper removed the five expired records");
    assert_eq!(store.get(live.id).await.expect("get"), Some(live));
}

#[tokio::test]
async fn sweep_reports_more_when_the_batch_is_full() {
    let clock = clock();
    let store = common::fresh_store(Some(clock.clone()), 2).await;
    for i in 0..5 {
        must_claim(&store, claim_req("t", &format!("k{i}"), Duration::from_secs(1), Duration::from_secs(2))).await;
    }
    clock.advance(Duration::from_secs(10));
    let first = store.sweep(3).await.expect("sweep");
    assert_eq!((first.removed, first.more), (3, true));
    let second = store.sweep(3).await.expect("sweep");
    assert_eq!((second.removed, second.more), (2, false));
    let third = store.sweep(3).await.expect("sweep");
    assert_eq!((third.removed, third.more), (0, false));
}

#[tokio::test]
async fn stores_on_different_prefixes_do_not_see_each_other() {
    let a = common::fresh_store(Some(clock()), 2).await;
    let b = common::fresh_store(Some(clock()), 2).await;
    let r = must_claim(&a, req("shared-key")).await;
    assert!(b.get(r.id).await.expect("get").is_none());
    must_claim(&b, req("shared-key")).await;
}

#[tokio::test]
async fn a_killed_pooled_session_is_replaced_without_an_error() {
    let store = common::fresh_store(Some(clock()), 1).await;
    must_claim(&store, req("before-kill")).await;
    let id: u64 = {
        let mut conn = store.0.inner.pool().acquire().await.expect("conn");
        sqlx::query_scalar("SELECT CONNECTION_ID()").fetch_one(&mut *conn).await.expect("id")
    };
    let mut admin = common::raw().await;
    common::execute(&mut admin, &format!("KILL {id}")).await;
    let _ = admin.close().await;
    // The pooled session is dead: the claim notices before COMMIT and runs again on a
    // fresh connection.
    must_claim(&store, req("after-kill")).await;
    must_claim(&store, req("after-kill-2")).await;
}

/// Kills the one pooled session of `store` behind its back.
async fn kill_pooled_session(store: &MySqlStore) {
    let id: u64 = {
        let mut conn = store.pool().acquire().await.expect("conn");
        sqlx::query_scalar("SELECT CONNECTION_ID()").fetch_one(&mut *conn).await.expect("id")
    };
    let mut admin = common::raw().await;
    common::execute(&mut admin, &format!("KILL {id}")).await;
    let _ = admin.close().await;
}

#[tokio::test]
async fn reads_on_a_killed_pooled_session_run_again_on_a_fresh_one() {
    let store = common::fresh_store(Some(clock()), 1).await;
    let r = must_claim(&store, req("read-after-kill")).await;
    kill_pooled_session(&store.0.inner).await;
    assert_eq!(store.get(r.id).await.expect("get"), Some(r.clone()));
    kill_pooled_session(&store.0.inner).await;
    assert_eq!(store.list(idem_core::ListFilter::new(10)).await.expect("list").records, vec![r.clone()]);
    kill_pooled_session(&store.0.inner).await;
    assert_eq!(store.journal_get(r.id, "step").await.expect("journal_get"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_sweep_racing_claims_of_expired_records_never_removes_a_new_claim() {
    let clock = clock();
    let store = Arc::new(common::fresh_store(Some(clock.clone()), 8).await);
    let short = Duration::from_secs(1);
    for i in 0..24 {
        must_claim(&*store, claim_req("p", &format!("swept-{i}"), short, short)).await;
    }
    clock.advance(Duration::from_secs(10));
    let sweeper = {
        let store = Arc::clone(&store);
        tokio::spawn(async move {
            let mut removed = 0;
            loop {
                let outcome = store.sweep(3).await.expect("sweep");
                removed += outcome.removed;
                if !outcome.more {
                    return removed;
                }
            }
        })
    };
    let mut claims = Vec::new();
    for i in 0..24 {
        let store = Arc::clone(&store);
        claims
            .push(tokio::spawn(async move { store.claim(claim_req("p", &format!("swept-{i}"), short, short)).await }));
    }
    let mut fresh = Vec::new();
    for c in claims {
        // The old record is expired whether or not the sweep got to it first: a new claim.
        match c.await.expect("task").expect("claim") {
            ClaimOutcome::Claimed(r) => fresh.push(r),
            other => panic!("expected Claimed, got {other:?}"),
        }
    }
    let removed = sweeper.await.expect("sweeper");
    assert!(removed <= 24);
    for r in fresh {
        assert_eq!(store.get(r.id).await.expect("get"), Some(r), "a claim made during the sweep survives it");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_wait_timeout_runs_the_transaction_again() {
    // The store's sessions give up on a row lock after 1 s (a knob of the pool, not of
    // the store), while the test holds the record's lock for about 2.5 s.
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(2)
        .after_connect(|conn, _| {
            Box::pin(async move {
                idem_mysql::pin_read_committed(conn).await?;
                sqlx::Executor::execute(conn, sqlx::raw_sql("SET SESSION innodb_lock_wait_timeout = 1")).await.map(drop)
            })
        })
        .connect(&common::url())
        .await
        .unwrap_or_else(|e| common::unreachable(&e));
    let guard = PrefixGuard::fresh().await;
    let store = MySqlStore::from_pool(pool, common::config(&guard.name, Some(clock()), 2)).await.expect("store");
    let r = must_claim(&store, req("held-lock")).await;
    let mut holder = common::raw().await;
    let mut tx = holder.begin().await.expect("begin");
    let lock = format!("SELECT token FROM `{}_records` WHERE id = ? FOR UPDATE", guard.name);
    sqlx::query(&lock).bind(r.id.as_bytes().as_slice()).fetch_one(&mut *tx).await.expect("lock");
    let started = std::time::Instant::now();
    let complete = {
        let store = store.clone();
        tokio::spawn(async move { store.complete(r.id, r.token, response()).await })
    };
    tokio::time::sleep(Duration::from_millis(2500)).await;
    tx.rollback().await.expect("release");
    complete.await.expect("task").expect("completed after the lock was released");
    assert!(started.elapsed() >= Duration::from_secs(2), "it waited out at least one lock-wait timeout");
    assert_eq!(store.get(r.id).await.expect("get").expect("live").state, RecordState::Completed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_caught_in_a_deadlock_still_claims() {
    // The claim that replaces an expired record locks the record, then deletes its journal
    // entries; a foreign transaction holding those entries and then asking for the record
    // closes the cycle. The foreign one has written many rows, so InnoDB makes the claim
    // (the smaller transaction) the victim: the store must run it again, not fail.
    let clock = clock();
    let store = common::fresh_store(Some(clock.clone()), 2).await;
    let prefix = store.0.guard.name.clone();
    let short = Duration::from_secs(1);
    let r = must_claim(&store, claim_req("p", "deadlock", short, Duration::from_secs(2))).await;
    store.journal_put(r.id, r.token, "step", b"v1".to_vec(), false).await.expect("journal");
    clock.advance(Duration::from_secs(10));

    let mut foreign = common::raw().await;
    let scratch = format!("`{prefix}_scratch`");
    common::execute(&mut foreign, &format!("CREATE TABLE {scratch} (n INT PRIMARY KEY) ENGINE = InnoDB")).await;
    let mut tx = foreign.begin().await.expect("begin");
    let rows = (0..300).map(|n| format!("({n})")).collect::<Vec<_>>().join(",");
    sqlx::query(&format!("INSERT INTO {scratch} (n) VALUES {rows}")).execute(&mut *tx).await.expect("weight");
    let lock_journal = format!("SELECT value FROM `{prefix}_journal` WHERE id = ? FOR UPDATE");
    sqlx::query(&lock_journal).bind(r.id.as_bytes().as_slice()).fetch_all(&mut *tx).await.expect("journal lock");

    let claim = {
        let store = store.clone();
        tokio::spawn(async move { store.claim(claim_req("p", "deadlock", short, Duration::from_secs(2))).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let lock_record = format!("SELECT token FROM `{prefix}_records` WHERE id = ? FOR UPDATE");
    let foreign_outcome = sqlx::query(&lock_record).bind(r.id.as_bytes().as_slice()).fetch_optional(&mut *tx).await;
    // Whichever side InnoDB chose, the foreign transaction ends here.
    let _ = tx.rollback().await;
    match claim.await.expect("task").expect("the claim succeeds despite the deadlock") {
        ClaimOutcome::Claimed(new) => assert!(new.token > r.token),
        other => panic!("expected a new generation, got {other:?}"),
    }
    assert_eq!(
        store.journal_get(r.id, "step").await.expect("journal_get"),
        None,
        "the new generation's journal is empty"
    );
    // The foreign transaction got the record's lock only if the claim, blocked on the
    // journal until then, was rolled back as the victim: then the claim above succeeded on
    // a second run. (If the foreign one was the victim, the claim never had to retry.)
    if let Err(e) = foreign_outcome {
        eprintln!("the foreign transaction was the victim: {e}");
    }
    common::execute(&mut foreign, &format!("DROP TABLE {scratch}")).await;
}

#[tokio::test]
async fn journal_names_outside_1_to_255_bytes_are_refused_before_the_server() {
    let store = common::fresh_store(Some(clock()), 2).await;
    let r = must_claim(&store, req("journal-names")).await;
    for name in [String::new(), "n".repeat(256), "é".repeat(128)] {
        let err = store.journal_put(r.id, r.token, &name, b"v".to_vec(), false).await.expect_err("refused");
        assert!(!err.is_retryable());
        assert!(matches!(ours(&err), Error::InvalidJournalName { len } if *len == name.len()), "{err:?}");
    }
    let longest = "n".repeat(255);
    store.journal_put(r.id, r.token, &longest, b"v".to_vec(), false).await.expect("255 bytes is allowed");
    assert_eq!(store.journal_get(r.id, &longest).await.expect("get"), Some(b"v".to_vec()));
    // A name that differs only past byte 255 could not have been stored: nothing is there.
    assert_eq!(store.journal_get(r.id, &"n".repeat(256)).await.expect("get"), None);
}

#[tokio::test]
async fn journal_entries_go_with_their_generation_and_their_swept_record() {
    let clock = clock();
    let store = common::fresh_store(Some(clock.clone()), 2).await;
    let short = Duration::from_secs(1);
    let r = must_claim(&store, claim_req("p", "journal-gen", short, Duration::from_secs(2))).await;
    store.journal_put(r.id, r.token, "step", b"one".to_vec(), false).await.expect("put");
    clock.advance(Duration::from_secs(10));
    let next = must_claim(&store, claim_req("p", "journal-gen", short, Duration::from_secs(2))).await;
    assert_eq!(store.journal_get(next.id, "step").await.expect("get"), None, "a new generation starts empty");
    store.journal_put(next.id, next.token, "step", b"two".to_vec(), false).await.expect("put");
    clock.advance(Duration::from_secs(10));
    assert_eq!(store.sweep(10).await.expect("sweep").removed, 1);
    let n: i64 = sqlx::query_scalar(&format!("SELECT COUNT(*) FROM `{}_journal`", store.0.guard.name))
        .fetch_one(store.0.inner.pool())
        .await
        .expect("count");
    assert_eq!(n, 0, "the sweep took the record's entries with it");
}

#[tokio::test]
async fn keys_longer_than_the_default_limit_round_trip() {
    // The application may raise the key limit (`IdempotencyKey::parse_with_limit`); the
    // column has no length of its own.
    let store = common::fresh_store(Some(clock()), 2).await;
    let long = "k".repeat(4096);
    let key = IdempotencyKey::parse_with_limit(long.as_bytes(), 8192).expect("key");
    let scope = Scope::new("tenant-a", Endpoint::new("POST", "/v1/long")).expect("principal");
    let claim =
        ClaimRequest::new(scope, key, Fingerprint::of_bytes(b"{}"), Duration::from_secs(30), Duration::from_secs(60));
    let r = must_claim(&store, claim).await;
    assert_eq!(r.key.as_str().len(), 4096);
    assert_eq!(store.get(r.id).await.expect("get"), Some(r));
}

#[tokio::test]
async fn tables_at_migration_1_are_upgraded_in_place() {
    let pool = common::pool(2, true).await;
    let guard = PrefixGuard::fresh().await;
    let prefix = &guard.name;
    // What a build shipping only migration 1 left behind.
    sqlx::Executor::execute(&pool, sqlx::raw_sql(&MIGRATIONS[0].sql_for(prefix))).await.expect("v1");
    let bookkeeping = format!(
        "CREATE TABLE `{prefix}_schema_migrations` (version INT NOT NULL PRIMARY KEY, name VARCHAR(64) NOT NULL,
         applied_at TIMESTAMP(3) NOT NULL DEFAULT CURRENT_TIMESTAMP(3)) ENGINE = InnoDB"
    );
    sqlx::query(&bookkeeping).execute(&pool).await.expect("bookkeeping");
    let record = format!("INSERT INTO `{prefix}_schema_migrations` (version, name) VALUES (1, 'records')");
    sqlx::query(&record).execute(&pool).await.expect("v1 row");
    let config = common::config(prefix, Some(clock()), 2);
    assert_eq!(MySqlStore::migrate(&pool, &config).await.expect("upgrade"), MIGRATIONS.len() - 1);
    let store = MySqlStore::from_pool(pool, config).await.expect("store");
    let long = "k".repeat(1000);
    let key = IdempotencyKey::parse_with_limit(long.as_bytes(), 2048).expect("key");
    let scope = Scope::new("tenant-a", Endpoint::new("POST", "/v1/upgraded")).expect("principal");
    let claim =
        ClaimRequest::new(scope, key, Fingerprint::of_bytes(b"{}"), Duration::from_secs(30), Duration::from_secs(60));
    let r = must_claim(&store, claim).await;
    assert_eq!(store.get(r.id).await.expect("get"), Some(r));
}

#[tokio::test]
async fn a_sweep_with_an_unbounded_limit_removes_one_batch() {
    let clock = clock();
    let store = common::fresh_store(Some(clock.clone()), 2).await;
    for i in 0..3 {
        must_claim(&store, claim_req("t", &format!("u{i}"), Duration::from_secs(1), Duration::from_secs(2))).await;
    }
    clock.advance(Duration::from_secs(10));
    let outcome = store.sweep(usize::MAX).await.expect("sweep");
    assert_eq!((outcome.removed, outcome.more), (3, false));
}
