//! Postgres-specific behaviour beyond the shared suite: connection loss mid-request,
//! migrations, schema names, corrupt rows, the server clock's unit, the sweeper task, journal
//! generations, fencing under row locks, first tokens from the clock, and record
//! generations across a sweep.
//! Runs against the real server at `IDEM_POSTGRES_URL`, each test in its own schema.

use crate::common;

use std::time::Duration;

use idem_conformance::{Oracle, Spec};
use idem_core::{
    ClaimOutcome, ClaimRequest, Clock, Endpoint, FencingToken, Fingerprint, IdempotencyKey, JournalWrite, ManualClock,
    Receipt, Record, RecordId, RecordState, Scope, Store, StoreError, StoredResponse, SystemClock, UnixMillis,
};
use idem_core::{SweepConfig, Sweeper};
use idem_postgres::{Config, Error, PostgresStore};
use sqlx::PgConnection;

fn claim_req(principal: &str, key: &str, lease: Duration, retention: Duration) -> ClaimRequest {
    let scope = Scope::new(principal, Endpoint::new("POST", "/v1/workers")).expect("principal");
    let key = IdempotencyKey::parse(key.as_bytes()).expect("key");
    ClaimRequest::new(scope, key, Fingerprint::of_bytes(b"{}"), lease, retention)
}

async fn must_claim(store: &impl Store, req: ClaimRequest) -> Record {
    match store.claim(req).await.expect("claim") {
        ClaimOutcome::Claimed(r) => r,
        other => panic!("expected Claimed, got {other:?}"),
    }
}

/// The record a fenced write just wrote, read back; its receipt must report it.
async fn written(store: &impl Store, id: RecordId, receipt: Receipt) -> Record {
    let record = store.get(id).await.expect("get after a write").expect("the record just written is live");
    assert_eq!(Receipt::of(&record), receipt, "the receipt reports the record as written");
    record
}

fn response() -> StoredResponse {
    StoredResponse::new(201, vec![("location".into(), b"/v1/workers/42".to_vec())], b"{\"id\":42}".to_vec())
}

/// Waits (polling the server, no clock involved) until a backend of this test's schema is
/// blocked on a row lock, and returns its pid.
async fn blocked_backend(admin: &mut PgConnection, schema: &str) -> i32 {
    let pattern = format!("%{schema}%");
    let found = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let pid = sqlx::query_scalar(
                "SELECT pid FROM pg_stat_activity
                 WHERE wait_event_type = 'Lock' AND query LIKE $1 AND pid <> pg_backend_pid()",
            )
            .bind(&pattern)
            .fetch_optional(&mut *admin)
            .await
            .expect("pg_stat_activity");
            if let Some(pid) = pid {
                return pid;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    found.expect("the store's statement never blocked on the row lock")
}

/// Holds `FOR UPDATE` on one record's row until dropped (rolled back), so a store
/// statement on that row waits and can be caught in flight.
async fn lock_row(schema: &str, id: &[u8]) -> PgConnection {
    let mut locker = common::raw().await;
    common::execute(&mut locker, "BEGIN").await;
    let n = sqlx::query(&format!("SELECT 1 FROM \"{schema}\".records WHERE id = $1 FOR UPDATE"))
        .bind(id)
        .execute(&mut locker)
        .await
        .expect("lock row")
        .rows_affected();
    assert_eq!(n, 1);
    locker
}

/// Terminates the backend `pid`.
async fn terminate(admin: &mut PgConnection, pid: i32) -> bool {
    sqlx::query_scalar("SELECT pg_terminate_backend($1)").bind(pid).fetch_one(admin).await.expect("terminate")
}

/// Pins: a connection killed while a complete is in flight (`pg_terminate_backend`) must
/// fail that call with a retryable error, leave the record exactly as it was (no
/// half-written response), and the pool must hand out a working connection next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminated_connection_mid_complete_leaves_record_intact_and_pool_recovers() {
    let clock = ManualClock::starting_now();
    // One connection: the call after the kill must go through a replaced connection.
    let store = common::fresh_store(Some(clock.clone()), 1).await;
    let schema = store.guard.name.clone();
    let r = must_claim(&store, claim_req("p", "kill-complete", Duration::from_secs(5), Duration::from_secs(60))).await;

    let mut locker = lock_row(&schema, r.id.as_bytes()).await;
    let in_flight = {
        let store = store.clone();
        tokio::spawn(async move { store.complete(r.id, r.token, response()).await })
    };
    let mut admin = common::raw().await;
    let pid = blocked_backend(&mut admin, &schema).await;
    assert!(terminate(&mut admin, pid).await);

    let err = in_flight.await.expect("task").expect_err("the complete's connection was killed");
    assert!(err.is_retryable(), "connection loss is retryable: {err:?}");
    assert!(!err.is_lease_lost());
    assert!(std::error::Error::source(&err).is_some(), "the driver error is kept as source");
    common::execute(&mut locker, "ROLLBACK").await;

    let now = store.get(r.id).await.expect("pool recovered for get").expect("record still there");
    assert_eq!(now, r, "no half-written record: still in flight, same token, no response");
    let done = store.complete(r.id, r.token, response()).await.expect("retry of complete succeeds");
    let done = written(&store, r.id, done).await;
    assert_eq!(done.state, RecordState::Completed);
    assert_eq!(done.response, Some(response()));
}

/// Pins: a claim killed mid-statement either never happened or happened whole; the pool
/// recovers and the retried claim sees a consistent record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminated_connection_mid_claim_leaves_no_partial_claim() {
    let clock = ManualClock::starting_now();
    let store = common::fresh_store(Some(clock.clone()), 1).await;
    let schema = store.guard.name.clone();
    let req = claim_req("p", "kill-claim", Duration::from_secs(5), Duration::from_secs(10));
    let old = must_claim(&store, req.clone()).await;
    // Past retention: the next claim replaces the record (the path that rewrites every column).
    clock.advance(Duration::from_secs(11));

    let mut locker = lock_row(&schema, old.id.as_bytes()).await;
    let in_flight = {
        let (store, req) = (store.clone(), req.clone());
        tokio::spawn(async move { store.claim(req).await })
    };
    let mut admin = common::raw().await;
    let pid = blocked_backend(&mut admin, &schema).await;
    terminate(&mut admin, pid).await;
    let err = in_flight.await.expect("task").expect_err("the claim's connection was killed");
    assert!(err.is_retryable(), "{err:?}");
    common::execute(&mut locker, "ROLLBACK").await;

    // The killed statement rolled back: the old (expired) row is untouched in the table.
    let (token, state, created_at): (i64, String, i64) =
        sqlx::query_as(&format!("SELECT token, state, created_at FROM \"{schema}\".records WHERE id = $1"))
            .bind(&old.id.as_bytes()[..])
            .fetch_one(&mut common::raw().await)
            .await
            .expect("row");
    assert_eq!(token, i64::try_from(old.token.0).expect("token fits the column"));
    assert_eq!(old.token, FencingToken::first_at(old.created_at));
    assert_eq!(state, "in_flight");
    assert_eq!(created_at, old.created_at.0);

    let new = must_claim(&store, req).await;
    assert_eq!(
        new.token,
        FencingToken::first_at(clock.now()),
        "the retried claim replaces the expired record with a token from its own clock reading"
    );
}

/// Runs the migrations of `schema` on `store`'s pool, as a deploy step would.
async fn migrate(store: &PostgresStore, schema: &str) -> Result<usize, Error> {
    PostgresStore::migrate(store.pool(), &Config::default().with_schema(schema)).await
}

/// Building a store migrates the schema once and records its version; `migrate()` is a
/// no-op afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_is_idempotent_and_recorded() {
    let store = common::fresh_store(None, 2).await;
    assert_eq!(migrate(&store.inner, &store.guard.name).await.expect("second migrate"), 0);
    assert_eq!(migrate(&store.inner, &store.guard.name).await.expect("third migrate"), 0);
    let mut raw = common::raw().await;
    let versions: Vec<i32> =
        sqlx::query_scalar(&format!("SELECT version FROM \"{}\".schema_migrations ORDER BY version", store.guard.name))
            .fetch_all(&mut raw)
            .await
            .expect("versions");
    assert_eq!(versions, idem_postgres::MIGRATIONS.iter().map(|m| m.version()).collect::<Vec<_>>());
    let indices: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pg_indexes WHERE schemaname = $1 AND tablename = 'records'")
            .bind(&store.guard.name)
            .fetch_one(&mut raw)
            .await
            .expect("indices");
    assert_eq!(indices, 3, "primary key, expires_at, in-flight lease");
}

/// Concurrent migrations (replicas starting together) serialise on the advisory lock:
/// stores built at once on a new schema all start, and concurrent `migrate()` calls on an
/// empty schema apply each migration exactly once, none failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_migrations_apply_once() {
    let guard = common::SchemaGuard::fresh().await;
    let mut starting = Vec::new();
    for _ in 0..4 {
        let name = guard.name.clone();
        starting.push(tokio::spawn(async move { common::connect(&name, None, 1).await }));
    }
    let mut stores = Vec::new();
    for t in starting {
        stores.push(t.await.expect("task"));
    }
    // Empty the schema again, so that the next migrations start from nothing.
    common::execute(&mut common::raw().await, &format!("DROP SCHEMA \"{}\" CASCADE", guard.name)).await;
    let tasks: Vec<_> = stores
        .into_iter()
        .map(|store| {
            let schema = guard.name.clone();
            tokio::spawn(async move { migrate(&store, &schema).await })
        })
        .collect();
    let mut applied = 0;
    for t in tasks {
        applied += t.await.expect("task").expect("migrate");
    }
    assert_eq!(applied, idem_postgres::MIGRATIONS.len());
}

/// A schema migrated by a newer build is refused, not written to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn newer_schema_is_refused() {
    let store = common::fresh_store(None, 2).await;
    let insert =
        format!("INSERT INTO \"{}\".schema_migrations (version, name) VALUES (999, 'future')", store.guard.name);
    common::execute(&mut common::raw().await, &insert).await;
    let err = migrate(&store.inner, &store.guard.name).await.expect_err("too new");
    assert!(matches!(err, Error::SchemaTooNew { found: 999, .. }), "{err:?}");
    assert!(!err.is_retryable());
    // Building another store on it is refused too, whether it would migrate or only check.
    for auto_migrate in [true, false] {
        let config = common::config(&store.guard.name, None, 1).with_auto_migrate(auto_migrate);
        let err = PostgresStore::connect(&common::url(), config).await.expect_err("too new");
        assert!(matches!(err, Error::SchemaTooNew { found: 999, .. }), "auto_migrate {auto_migrate}: {err:?}");
    }
}

/// Schema names that would need quoting, or could inject SQL, are refused before any SQL runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsafe_schema_names_are_refused() {
    for name in ["", "Idem", "idem; DROP TABLE x", "a\"b", "pg_catalog", "idem-x"] {
        let err = PostgresStore::connect("postgres://nobody@127.0.0.1:1/none", Config::default().with_schema(name))
            .await
            .expect_err(name);
        assert!(matches!(err, Error::InvalidSchema { .. }), "{name}: {err:?}");
    }
}

/// An unreachable server is a retryable connection error that keeps the driver's error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_server_is_a_retryable_connection_error() {
    let config = Config::default().with_acquire_timeout(Duration::from_secs(2));
    let err = PostgresStore::connect("postgres://postgres@127.0.0.1:1/test", config).await.expect_err("port 1");
    assert!(matches!(err, Error::Connection { .. }), "{err:?}");
    assert!(err.is_retryable());
    assert!(std::error::Error::source(&err).is_some());
}

/// Without auto-migration, building a store on a schema that lacks migrations fails with
/// a permanent, typed error that says to run `PostgresStore::migrate`, and creates nothing;
/// once a deploy step has migrated the schema on its own pool, the same configuration starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unmigrated_schema_without_auto_migrate_says_to_migrate() {
    let guard = common::SchemaGuard::fresh().await;
    let checking = || common::config(&guard.name, None, 1).with_auto_migrate(false);
    let err = PostgresStore::connect(&common::url(), checking()).await.expect_err("not migrated");
    assert!(matches!(err, Error::NotMigrated { found: 0, .. }), "{err:?}");
    assert!(!err.is_retryable());
    assert!(err.to_string().contains("PostgresStore::migrate("), "{err}");
    let schemas: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_namespace WHERE nspname = $1")
        .bind(&guard.name)
        .fetch_one(&mut common::raw().await)
        .await
        .expect("count");
    assert_eq!(schemas, 0, "the check created nothing");

    // The deploy step: migrations run on a pool before any store exists.
    let pool = common::pool(common::Via::Direct, 1).await;
    let applied = PostgresStore::migrate(&pool, &checking()).await.expect("migrate");
    assert_eq!(applied, idem_postgres::MIGRATIONS.len());
    let migrating = common::connect(&guard.name, None, 1).await;
    let store = PostgresStore::connect(&common::url(), checking()).await.expect("migrated schema starts");
    let r = must_claim(&store, claim_req("p", "k", Duration::from_secs(5), Duration::from_secs(60))).await;
    assert_eq!(migrating.get(r.id).await.expect("get"), Some(r));
}

/// Pins: a store starts on a schema already at this build's migration under a role that
/// may use the tables but not create schemas: with auto-migration on, start-up only reads
/// the version. The same role on an unmigrated schema fails with a permanent error (so the
/// role really lacks the privilege).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrated_schema_starts_without_create_privilege() {
    let store = common::fresh_store(None, 1).await;
    let empty = common::SchemaGuard::fresh().await;
    let schema = store.guard.name.clone();
    let role = format!("{schema}_user");
    let mut admin = common::raw().await;
    common::execute(
        &mut admin,
        &format!(
            "CREATE ROLE \"{role}\" LOGIN;
             GRANT USAGE ON SCHEMA \"{schema}\" TO \"{role}\";
             GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA \"{schema}\" TO \"{role}\";"
        ),
    )
    .await;
    let pool = |role: &str| {
        let options: sqlx::postgres::PgConnectOptions = common::url().parse().expect("url");
        sqlx::postgres::PgPoolOptions::new().max_connections(1).connect_lazy_with(options.username(role))
    };
    let (migrated, unmigrated) = (pool(&role), pool(&role));
    let (on_migrated, on_empty) = (schema.clone(), empty.name.clone());
    // In a task, so that the role is dropped below even when an assertion fails.
    let outcome = tokio::spawn(async move {
        let limited = PostgresStore::from_pool(migrated, Config::default().with_schema(on_migrated))
            .await
            .expect("starts without CREATE on a migrated schema");
        let r = must_claim(&limited, claim_req("p", "limited", Duration::from_secs(5), Duration::from_secs(60))).await;
        assert_eq!(limited.get(r.id).await.expect("get"), Some(r));
        let err = PostgresStore::from_pool(unmigrated, Config::default().with_schema(on_empty))
            .await
            .expect_err("migrating needs CREATE");
        assert!(matches!(err, Error::Postgres { .. }), "{err:?}");
        assert!(!err.is_retryable());
    })
    .await;
    common::execute(&mut admin, &format!("DROP OWNED BY \"{role}\"; DROP ROLE \"{role}\"")).await;
    if let Err(e) = outcome {
        std::panic::resume_unwind(e.into_panic());
    }
}

/// A table that disappears under a running store (dropped by hand) fails calls with a
/// permanent error that says what to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_table_says_to_migrate() {
    let store = common::fresh_store(None, 1).await;
    common::execute(&mut common::raw().await, &format!("DROP SCHEMA \"{}\" CASCADE", store.guard.name)).await;
    let err =
        store.claim(claim_req("p", "k", Duration::from_secs(5), Duration::from_secs(60))).await.expect_err("no table");
    assert!(!err.is_retryable());
    assert!(err.to_string().contains("migrate"), "{err}");
}

/// A response column that does not decode is `StoreError::Corrupt` naming the record, not
/// a panic or a generic error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_response_is_corrupt() {
    let store = common::fresh_store(Some(ManualClock::starting_now()), 2).await;
    let r = must_claim(&store, claim_req("p", "corrupt", Duration::from_secs(5), Duration::from_secs(60))).await;
    store.complete(r.id, r.token, response()).await.expect("complete");
    sqlx::query(&format!(
        "UPDATE \"{}\".records SET response = '\\x01ffffffff'::bytea WHERE id = $1",
        store.guard.name
    ))
    .bind(&r.id.as_bytes()[..])
    .execute(&mut common::raw().await)
    .await
    .expect("corrupt it");
    let err = store.get(r.id).await.expect_err("corrupt");
    assert!(matches!(err, StoreError::Corrupt { id: Some(id), .. } if id == r.id), "{err:?}");
}

/// Pins: a row the table's constraints should have excluded (written by a hostile writer
/// with `UPDATE`, or after its constraints were dropped) is `StoreError::Corrupt` naming the
/// record and the column, on every path that decodes it (a read, a claim that finds it),
/// never a panic or a generic error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_rows_are_corrupt_naming_the_column() {
    let store = common::fresh_store(Some(ManualClock::starting_now()), 2).await;
    let table = format!("\"{}\".records", store.guard.name);
    let mut raw = common::raw().await;
    let drop = "records_state, DROP CONSTRAINT records_token_positive, DROP CONSTRAINT records_fingerprint_length, \
                DROP CONSTRAINT records_response_iff_completed";
    common::execute(&mut raw, &format!("ALTER TABLE {table} DROP CONSTRAINT {drop}")).await;
    let cases = [
        ("state = 'bogus'", "state"),
        ("token = -1", "token"),
        ("fingerprint = '\\x00'::bytea", "fingerprint"),
        ("principal = '\\xff'::bytea", "principal"),
        ("principal = ''::bytea", "principal"),
        // Another tenant's scope under this id: refused, never replayed across tenants.
        ("principal = 'tenant-b'::bytea", "id"),
        ("key = 'not a key'", "key"),
        ("state = 'completed'", "response"),
    ];
    for (i, (set, column)) in cases.into_iter().enumerate() {
        let req = claim_req("p", &format!("hostile-{i}"), Duration::from_secs(5), Duration::from_secs(60));
        let r = must_claim(&store, req.clone()).await;
        let update = format!("UPDATE {table} SET {set} WHERE id = $1");
        let updated = sqlx::query(&update).bind(&r.id.as_bytes()[..]).execute(&mut raw).await.expect(set);
        assert_eq!(updated.rows_affected(), 1);
        for (path, err) in [("get", store.get(r.id).await.err()), ("claim", store.claim(req).await.err())] {
            match err {
                Some(StoreError::Corrupt { id, source: idem_core::codec::CodecError::BadField { field, .. } }) => {
                    assert_eq!((id, field), (Some(r.id), column), "{set}: {path}");
                }
                other => panic!("{set}: {path} gave {other:?}"),
            }
        }
    }
}

/// Without a pinned clock, `now` is the server's clock in milliseconds (not seconds or
/// microseconds: a unit mixed up in expiry would end leases 1000 times early or late).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_clock_is_in_milliseconds() {
    let store = common::fresh_store(None, 2).await;
    let before = SystemClock.now().0;
    let r = must_claim(&store, claim_req("p", "clock", Duration::from_millis(4_999), Duration::from_secs(60))).await;
    let after = SystemClock.now().0;
    // Same host: allow a second of slack for rounding and scheduling.
    assert!(
        r.created_at.0 >= before - 1_000 && r.created_at.0 <= after + 1_000,
        "{} not in [{before}, {after}]",
        r.created_at
    );
    assert_eq!(r.lease_expires_at.0 - r.created_at.0, 4_999);
    assert_eq!(r.token, FencingToken::first_at(r.created_at), "the first token comes from the server's clock");
}

/// The generic sweeper deletes expired records in batches and leaves live ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweeper_task_deletes_expired_records_only() {
    // In the past, so records expired on this clock are also expired in real time.
    let clock = ManualClock::new(idem_core::UnixMillis(SystemClock.now().0 - 86_400_000));
    let store = common::fresh_store(Some(clock.clone()), 2).await;
    let short = Duration::from_secs(10);
    for i in 0..5 {
        must_claim(&store, claim_req("p", &format!("old-{i}"), short, short)).await;
    }
    let live = must_claim(&store, claim_req("p", "live", Duration::from_secs(5), Duration::from_secs(3_600))).await;
    clock.advance(Duration::from_secs(11));

    let sweeper = Sweeper::start(
        std::sync::Arc::new(store.clone()),
        SweepConfig::default().with_period(Duration::from_millis(10)).with_batch(2),
    );
    let mut raw = common::raw().await;
    let count_sql = format!("SELECT count(*) FROM \"{}\".records", store.guard.name);
    let emptied = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let n: i64 = sqlx::query_scalar(&count_sql).fetch_one(&mut raw).await.expect("count");
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

/// A store built from a caller's own pool works the same (the leasebroker wiring).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_from_own_pool() {
    let guard = common::SchemaGuard::fresh().await;
    let pool = common::pool(common::Via::Direct, 2).await;
    let store = PostgresStore::from_pool(pool, Config::default().with_schema(guard.name.clone())).await.expect("store");
    assert_eq!(migrate(&store, &guard.name).await.expect("migrate"), 0, "building the store applied every migration");
    let r = must_claim(&store, claim_req("p", "own-pool", Duration::from_secs(5), Duration::from_secs(60))).await;
    assert_eq!(store.get(r.id).await.expect("get"), Some(r));
}

/// Pins: a store statement PostgreSQL picks as a deadlock victim (SQLSTATE 40P01: the
/// statement rolled back whole) runs again and succeeds; the caller never sees the deadlock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_picked_as_deadlock_victim_runs_again() {
    let store = common::fresh_store(Some(ManualClock::starting_now()), 2).await;
    let schema = store.guard.name.clone();
    let r = must_claim(&store, claim_req("p", "deadlock", Duration::from_secs(5), Duration::from_secs(60))).await;
    let put = store.journal_put(r.id, r.token, "s:a", b"first".to_vec(), false).await.expect("put");
    assert_eq!(put, JournalWrite::Written);
    // This transaction holds the entry's row and checks for deadlocks late, so the store's
    // session (the server's deadlock_timeout, 1 s by default) finds the cycle and is the victim.
    let mut other = common::raw().await;
    common::execute(&mut other, "BEGIN; SET LOCAL deadlock_timeout = '20s'").await;
    sqlx::query(&format!("SELECT 1 FROM \"{schema}\".journal WHERE id = $1 FOR UPDATE"))
        .bind(&r.id.as_bytes()[..])
        .execute(&mut other)
        .await
        .expect("lock the entry");
    let in_flight = {
        let store = store.clone();
        tokio::spawn(async move { store.journal_put(r.id, r.token, "s:a", b"second".to_vec(), true).await })
    };
    // The put holds the record's row FOR SHARE and waits for the entry's row; this
    // transaction then waits for the record's row: a cycle.
    blocked_backend(&mut common::raw().await, &schema).await;
    sqlx::query(&format!("UPDATE \"{schema}\".records SET lease_expires_at = lease_expires_at WHERE id = $1"))
        .bind(&r.id.as_bytes()[..])
        .execute(&mut other)
        .await
        .expect("the store's statement, not this one, is the deadlock victim");
    common::execute(&mut other, "COMMIT").await;
    let put = in_flight.await.expect("task").expect("the victim statement ran again");
    assert_eq!(put, JournalWrite::Written);
    assert_eq!(store.journal_get(r.id, "s:a").await.expect("get"), Some(b"second".to_vec()));
}

/// Pins: pooled connections killed while idle (server restart, `pg_terminate_backend` by
/// an operator) cost at most one retryable error; the call after it gets a fresh
/// connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminated_idle_connections_cost_at_most_one_retryable_error() {
    let store = common::fresh_store(Some(ManualClock::starting_now()), 1).await;
    let r = must_claim(&store, claim_req("p", "idle-kill", Duration::from_secs(5), Duration::from_secs(60))).await;
    let pattern = format!("%{}%", store.guard.name);
    let killed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
         WHERE application_name = 'idem-postgres' AND query LIKE $1 AND pid <> pg_backend_pid()) AS k",
    )
    .bind(&pattern)
    .fetch_one(&mut common::raw().await)
    .await
    .expect("terminate");
    assert_eq!(killed, 1, "the pool's one connection");
    match store.get(r.id).await {
        Ok(got) => assert_eq!(got, Some(r.clone())),
        Err(e) => assert!(e.is_retryable(), "{e:?}"),
    }
    assert_eq!(store.get(r.id).await.expect("fresh connection"), Some(r));
}

/// No transaction stays open after a call returns: the handler runs between claim and
/// complete without holding a connection, a lock or a snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_transaction_is_held_across_the_handler() {
    let store = common::fresh_store(Some(ManualClock::starting_now()), 4).await;
    let r = must_claim(&store, claim_req("p", "held", Duration::from_secs(5), Duration::from_secs(60))).await;
    let open: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity
         WHERE application_name = 'idem-postgres' AND query LIKE $1 AND state <> 'idle'",
    )
    .bind(format!("%{}%", store.guard.name))
    .fetch_one(&mut common::raw().await)
    .await
    .expect("activity");
    assert_eq!(open, 0, "every store connection is idle (not idle in transaction) while the handler runs");
    // sqlx gives a connection back to the pool in a task of its own, after a ping.
    let pool = store.inner.pool();
    let all_idle = tokio::time::timeout(Duration::from_secs(5), async {
        while pool.num_idle() != pool.size() as usize {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    all_idle.await.expect("every pooled connection is back in the pool");
    store.complete(r.id, r.token, response()).await.expect("complete");
}

/// A sweep skips an expired record whose row a concurrent claim holds, instead of waiting
/// for it, and removes the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweep_skips_rows_locked_by_a_claim_in_progress() {
    let clock = ManualClock::new(idem_core::UnixMillis(SystemClock.now().0 - 86_400_000));
    let store = common::fresh_store(Some(clock.clone()), 2).await;
    let short = Duration::from_secs(1);
    let held = must_claim(&store, claim_req("p", "held", short, short)).await;
    let free = must_claim(&store, claim_req("p", "free", short, short)).await;
    clock.advance(Duration::from_secs(2));
    let mut locker = lock_row(&store.guard.name, held.id.as_bytes()).await;
    let outcome = tokio::time::timeout(Duration::from_secs(5), store.sweep(10))
        .await
        .expect("the sweep does not wait for the locked row")
        .expect("sweep");
    assert_eq!(outcome.removed, 1);
    common::execute(&mut locker, "ROLLBACK").await;
    let ids: Vec<Vec<u8>> = sqlx::query_scalar(&format!("SELECT id FROM \"{}\".records", store.guard.name))
        .fetch_all(&mut common::raw().await)
        .await
        .expect("ids");
    assert_eq!(ids, vec![held.id.as_bytes().to_vec()], "the free record was swept, the locked one skipped");
    assert_ne!(free.id, held.id);
    assert_eq!(store.sweep(10).await.expect("sweep").removed, 1, "the next sweep takes it");
}

/// Counts the journal rows of record `id`, whatever their generation.
async fn journal_rows(schema: &str, id: &[u8]) -> i64 {
    sqlx::query_scalar(&format!("SELECT count(*) FROM \"{schema}\".journal WHERE id = $1"))
        .bind(id)
        .fetch_one(&mut common::raw().await)
        .await
        .expect("count journal rows")
}

/// Pins: journal rows live and die with their record. A claim that replaces an expired
/// record leaves the old rows in the table but they read as absent and a first write
/// overwrites them (the generation check on `record_created_at`); the sweep of the record
/// deletes every row through the foreign key's cascade.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn journal_rows_follow_their_record_generation_and_go_with_the_sweep() {
    let clock = ManualClock::new(idem_core::UnixMillis(SystemClock.now().0 - 86_400_000));
    let store = common::fresh_store(Some(clock.clone()), 2).await;
    let schema = store.guard.name.clone();
    let short = Duration::from_secs(1);
    let req = claim_req("p", "journal", short, Duration::from_secs(2));
    let old = must_claim(&store, req.clone()).await;
    for name in ["s:a", "s:b"] {
        let w = store.journal_put(old.id, old.token, name, b"old".to_vec(), false).await.expect("put");
        assert_eq!(w, JournalWrite::Written);
    }
    assert_eq!(journal_rows(&schema, old.id.as_bytes()).await, 2);
    clock.set(old.expires_at);
    let new = must_claim(&store, req).await;
    assert_eq!(new.token, FencingToken::first_at(old.expires_at), "a new generation's token, from the clock");
    assert_eq!(journal_rows(&schema, old.id.as_bytes()).await, 2, "the replaced generation's rows are still stored");
    assert_eq!(store.journal_get(new.id, "s:a").await.expect("get"), None, "but read as absent");
    let w = store.journal_put(new.id, new.token, "s:a", b"new".to_vec(), false).await.expect("put");
    assert_eq!(w, JournalWrite::Written, "a stale generation's row is overwritten, not returned as Exists");
    assert_eq!(store.journal_get(new.id, "s:a").await.expect("get"), Some(b"new".to_vec()));
    assert_eq!(store.journal_get(new.id, "s:b").await.expect("get"), None);
    clock.set(new.expires_at);
    assert_eq!(store.sweep(10).await.expect("sweep").removed, 1);
    assert_eq!(journal_rows(&schema, old.id.as_bytes()).await, 0, "the sweep removed every row of the record");
}

/// Pins: a journal put that waits on the record's row lock re-checks the owner on the row
/// as committed by the lock holder: a reclaim that commits first fences the put
/// (`LeaseLost` with the new token), and no entry is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn journal_put_waiting_on_a_reclaim_is_fenced_by_it() {
    let clock = ManualClock::starting_now();
    let store = common::fresh_store(Some(clock.clone()), 2).await;
    let schema = store.guard.name.clone();
    let r = must_claim(&store, claim_req("p", "journal-race", Duration::from_secs(5), Duration::from_secs(60))).await;
    let mut locker = lock_row(&schema, r.id.as_bytes()).await;
    let in_flight = {
        let store = store.clone();
        tokio::spawn(async move { store.journal_put(r.id, r.token, "s:a", b"late".to_vec(), false).await })
    };
    blocked_backend(&mut common::raw().await, &schema).await;
    // What a reclaim does to the row, committed while the put waits.
    sqlx::query(&format!("UPDATE \"{schema}\".records SET token = token + 1 WHERE id = $1"))
        .bind(&r.id.as_bytes()[..])
        .execute(&mut locker)
        .await
        .expect("bump token");
    common::execute(&mut locker, "COMMIT").await;
    match in_flight.await.expect("task") {
        Err(StoreError::LeaseLost { presented, current, .. }) => {
            assert_eq!(presented, r.token);
            assert_eq!(current, Some(r.token.next()));
        }
        other => panic!("expected LeaseLost, got {other:?}"),
    }
    assert_eq!(journal_rows(&schema, r.id.as_bytes()).await, 0, "the fenced put wrote nothing");
}

/// The first token of a fresh record is exactly `FencingToken::first_at` of the statement's
/// clock reading, computed in SQL: before the epoch and at it (the floor, 1), where the
/// shifted clock crosses 32 bits, at the cap of 2^47 - 1 ms and past it, and today.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_tokens_match_first_at_on_the_pinned_clock() {
    let clock = ManualClock::starting_now();
    let store = common::fresh_store(Some(clock.clone()), 2).await;
    let today = clock.now_ms();
    let readings = [-5, 0, 1, 0xffff, 0x1_0000, (1 << 47) - 1, 1 << 47, 1 << 53, today];
    for (i, t) in readings.into_iter().enumerate() {
        clock.set(UnixMillis(t));
        let r =
            must_claim(&store, claim_req("p", &format!("first-{i}"), Duration::from_secs(5), Duration::from_secs(60)))
                .await;
        assert_eq!(r.token, FencingToken::first_at(UnixMillis(t)), "clock {t}");
        assert_eq!(r.created_at, UnixMillis(t));
    }
    let at = |t: i64| FencingToken::first_at(UnixMillis(t)).0;
    assert_eq!((at(-5), at(0), at(1), at(0x1_0000)), (1, 1, 1 << 16, 1 << 32));
    assert_eq!(at(1 << 53), (u64::MAX >> 1) & !0xffff, "capped below 2^63: fits the bigint column");
}

/// A claim that replaces an expired record still in the table takes the larger of its token
/// + 1 and `first_at(now)`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_replacing_an_expired_record_takes_the_larger_token() {
    let clock = ManualClock::starting_now();
    let store = common::fresh_store(Some(clock.clone()), 2).await;
    let mut raw = common::raw().await;
    let start = clock.now();
    let first = FencingToken::first_at(UnixMillis(start.0 + 60_000)).0;
    let cases = [(1, first), (first - 2, first), (first - 1, first), (first, first + 1), (1 << 62, (1 << 62) + 1)];
    let set_token = format!("UPDATE \"{}\".records SET token = $2 WHERE id = $1", store.guard.name);
    for (i, (old, _)) in cases.into_iter().enumerate() {
        clock.set(start);
        let r =
            must_claim(&store, claim_req("p", &format!("k{i}"), Duration::from_secs(5), Duration::from_secs(60))).await;
        let old = i64::try_from(old).expect("fits");
        let set = sqlx::query(&set_token).bind(&r.id.as_bytes()[..]).bind(old).execute(&mut raw).await;
        assert_eq!(set.expect("set token").rows_affected(), 1);
    }
    clock.set(UnixMillis(start.0 + 60_000));
    for (i, (old, new)) in cases.into_iter().enumerate() {
        let r =
            must_claim(&store, claim_req("p", &format!("k{i}"), Duration::from_secs(5), Duration::from_secs(60))).await;
        assert_eq!(r.token, FencingToken(new), "case {i}: old token {old}");
        assert_eq!(r.created_at, clock.now(), "case {i}: replaced");
    }
}

/// Extend is one compare-and-set `UPDATE`: on the pinned clock it writes exactly what the
/// model writes (the lease moves forward, never back; retention follows a lease that passes
/// it), and a wrong token, a completed record, an expired one or none at all is
/// `LeaseLost` naming the current token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extend_matches_the_model_and_is_fenced() {
    let clock = ManualClock::starting_now();
    let store = common::fresh_store(Some(clock.clone()), 2).await;
    let mut model = Spec::new();
    let req = claim_req("p", "extend", Duration::from_secs(5), Duration::from_secs(60));
    let r = must_claim(&store, req.clone()).await;
    let ClaimOutcome::Claimed(m) = model.claim(&req, r.created_at) else { panic!("the model claims") };
    assert_eq!(m, r);
    // A lease that already ran out is renewed too, until someone reclaims it.
    for (advance, lease) in [(6_000, 30), (1_000, 1), (10_000, 120), (0, u64::MAX)] {
        clock.advance_ms(advance);
        let lease = Duration::from_secs(lease);
        let e = store.extend(r.id, r.token, lease).await.expect("extend");
        let m = model.extend(r.id, r.token, lease, clock.now()).expect("the model extends");
        assert_eq!(e, m, "after {advance} ms, lease {lease:?}");
        let got = store.get(r.id).await.expect("get");
        assert_eq!(got, model.get(r.id, clock.now()), "after {advance} ms, lease {lease:?}");
        assert_eq!(got.as_ref().map(Receipt::of), Some(e));
    }
    let lost = |res: Result<Receipt, StoreError>, current: Option<FencingToken>| match res {
        Err(StoreError::LeaseLost { current: c, .. }) => assert_eq!(c, current),
        other => panic!("expected LeaseLost, got {other:?}"),
    };
    lost(store.extend(r.id, r.token.next(), Duration::from_secs(5)).await, Some(r.token));
    store.complete(r.id, r.token, response()).await.expect("complete");
    lost(store.extend(r.id, r.token, Duration::from_secs(5)).await, Some(r.token));
    let none = claim_req("p", "never", Duration::from_secs(5), Duration::from_secs(60));
    lost(store.extend(none.id(), r.token, Duration::from_secs(5)).await, None);
    let short = claim_req("p", "short", Duration::from_secs(1), Duration::from_secs(2));
    let s = must_claim(&store, short).await;
    clock.set(s.expires_at);
    lost(store.extend(s.id, s.token, Duration::from_secs(5)).await, None);
}

/// An extend that waits on the record's row lock re-checks the token on the row as the lock
/// holder committed it: a reclaim that commits first fences the renewal (`LeaseLost` with
/// the new token, read after the refusal) and the lease stays where the reclaim put it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extend_waiting_on_a_reclaim_is_fenced_by_it() {
    let clock = ManualClock::starting_now();
    let store = common::fresh_store(Some(clock.clone()), 2).await;
    let schema = store.guard.name.clone();
    let r = must_claim(&store, claim_req("p", "extend-race", Duration::from_secs(5), Duration::from_secs(60))).await;
    let mut locker = lock_row(&schema, r.id.as_bytes()).await;
    let in_flight = {
        let store = store.clone();
        tokio::spawn(async move { store.extend(r.id, r.token, Duration::from_secs(600)).await })
    };
    blocked_backend(&mut common::raw().await, &schema).await;
    // What a reclaim does to the row, committed while the renewal waits.
    sqlx::query(&format!("UPDATE \"{schema}\".records SET token = token + 1 WHERE id = $1"))
        .bind(&r.id.as_bytes()[..])
        .execute(&mut locker)
        .await
        .expect("bump token");
    common::execute(&mut locker, "COMMIT").await;
    match in_flight.await.expect("task") {
        Err(StoreError::LeaseLost { presented, current, .. }) => {
            assert_eq!(presented, r.token);
            assert_eq!(current, Some(r.token.next()));
        }
        other => panic!("expected LeaseLost, got {other:?}"),
    }
    let now = store.get(r.id).await.expect("get").expect("present");
    assert_eq!((now.lease_expires_at, now.expires_at), (r.lease_expires_at, r.expires_at), "nothing was renewed");
}

/// A sweep deletes an expired record with its token; the next claim of the same key still
/// starts a later generation (its token from the server's clock is above the swept one), so
/// the old holder's late complete, extend, journal write and fail are all refused. Real
/// statements on the server's clock; the sweep is polled until it removes the record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_between_two_generations_fences_the_old_holder() {
    let store = common::fresh_store(None, 2).await;
    let req = claim_req("p", "generations", Duration::from_millis(50), Duration::from_millis(100));
    let old = must_claim(&store, req).await;
    assert_eq!(old.token, FencingToken::first_at(old.created_at));
    let put = store.journal_put(old.id, old.token, "s:a", b"old".to_vec(), false).await.expect("put");
    assert_eq!(put, JournalWrite::Written);
    let swept = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if store.sweep(10).await.expect("sweep").removed == 1 {
                return;
            }
            // Polling the server until its clock passes expires_at: no local clock is read.
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    swept.expect("the sweep removes the record once its retention ends on the server's clock");
    let count = format!("SELECT count(*) FROM \"{}\".records", store.guard.name);
    let left: i64 = sqlx::query_scalar(&count).fetch_one(&mut common::raw().await).await.expect("count");
    assert_eq!(left, 0);
    assert_eq!(journal_rows(&store.guard.name, old.id.as_bytes()).await, 0);

    // Same key, a retention long enough to outlive the checks below.
    let new = must_claim(&store, claim_req("p", "generations", Duration::from_secs(5), Duration::from_secs(60))).await;
    assert_eq!(new.id, old.id);
    assert_eq!(new.token, FencingToken::first_at(new.created_at));
    assert!(new.token > old.token, "new {} after old {}", new.token, old.token);
    let fenced = |res: Result<(), StoreError>, op: &str| match res {
        Err(StoreError::LeaseLost { id, presented, current }) => {
            assert_eq!((id, presented, current), (new.id, old.token, Some(new.token)), "{op}");
        }
        other => panic!("{op} with the swept generation's token: {other:?}"),
    };
    fenced(store.complete(old.id, old.token, response()).await.map(drop), "complete");
    fenced(store.extend(old.id, old.token, Duration::from_secs(60)).await.map(drop), "extend");
    fenced(store.journal_put(old.id, old.token, "s:a", b"late".to_vec(), true).await.map(drop), "journal_put");
    fenced(store.fail(old.id, old.token).await.map(drop), "fail");
    assert_eq!(store.get(new.id).await.expect("get"), Some(new.clone()), "the new generation is untouched");
    assert_eq!(store.journal_get(new.id, "s:a").await.expect("journal_get"), None);
}
