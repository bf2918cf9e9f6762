//! Behaviour specific to the SQLite backend: the file, its schema and its locks.

use std::sync::Arc;
use std::time::Duration;

use idem_core::sweeper::{SweepConfig, Sweeper};
use idem_core::{
    ClaimOutcome, ClaimRequest, Endpoint, FencingToken, Fingerprint, IdempotencyKey, JournalWrite, ManualClock,
    ReclaimOutcome, ReclaimRequest, RecordState, Scope, Store, StoreError, StoredResponse, UnixMillis,
};
use idem_sqlite::{Config, Error, SCHEMA_VERSION, SqliteStore};
use rusqlite::Connection;

fn req(key: &str) -> ClaimRequest {
    let scope = Scope::new("tenant-a", Endpoint::new("POST", "/v1/workers")).expect("scope");
    let key = IdempotencyKey::parse(key.as_bytes()).expect("key");
    ClaimRequest::new(scope, key, Fingerprint::of_bytes(b"{}"), Duration::from_secs(5), Duration::from_secs(60))
}

async fn open(path: std::path::PathBuf, clock: &ManualClock) -> SqliteStore {
    let clock = Arc::new(clock.clone());
    tokio::task::spawn_blocking(move || SqliteStore::open(path, Config::default().with_clock(clock)))
        .await
        .expect("open task")
        .expect("open")
}

#[tokio::test]
async fn records_survive_reopening_and_the_schema_is_versioned() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("idem.sqlite3");
    let clock = ManualClock::new(UnixMillis(1_700_000_000_000));
    let response =
        StoredResponse::new(201, vec![("location".into(), b"/v1/workers/42".to_vec())], b"{\"id\":42}".to_vec());
    {
        let store = open(path.clone(), &clock).await;
        let ClaimOutcome::Claimed(r) = store.claim(req("k1")).await.expect("claim") else { panic!("not claimed") };
        store.complete(r.id, r.token, response.clone()).await.expect("complete");
    }
    let store = open(path.clone(), &clock).await;
    let record = store.get(req("k1").id()).await.expect("get").expect("record survives");
    assert_eq!((record.state, record.response), (RecordState::Completed, Some(response)));

    let conn = Connection::open(&path).expect("inspect");
    let version: u32 = conn.pragma_query_value(None, "user_version", |r| r.get(0)).expect("user_version");
    let mode: String = conn.pragma_query_value(None, "journal_mode", |r| r.get(0)).expect("journal_mode");
    assert_eq!((version, mode.as_str()), (SCHEMA_VERSION, "wal"));
    let indices: Vec<String> = conn
        .prepare("SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'idem_records' AND sql IS NOT NULL ORDER BY name")
        .and_then(|mut s| s.query_map([], |r| r.get(0))?.collect())
        .expect("indices");
    assert_eq!(indices, ["idem_records_expires", "idem_records_lease", "idem_records_scope"]);
    let tables: i64 = conn
        .query_row(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name IN ('idem_records', 'idem_journal')",
            [],
            |r| r.get(0),
        )
        .expect("tables");
    assert_eq!(tables, 2);
}

#[test]
fn a_file_from_a_newer_build_is_refused() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("idem.sqlite3");
    drop(SqliteStore::open(&path, Config::default()).expect("create"));
    Connection::open(&path).and_then(|c| c.pragma_update(None, "user_version", 99)).expect("bump version");
    match SqliteStore::open(&path, Config::default()) {
        Err(Error::SchemaTooNew { found: 99, known }) => assert_eq!(known, SCHEMA_VERSION),
        other => panic!("expected SchemaTooNew, got {other:?}"),
    }
}

#[test]
fn an_in_memory_database_is_refused_because_it_cannot_use_wal() {
    match SqliteStore::open(":memory:", Config::default()) {
        Err(err @ Error::NotWal { .. }) => assert!(!err.is_retryable()),
        other => panic!("expected NotWal, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_lock_held_past_the_busy_timeout_is_a_retryable_error_then_the_claim_succeeds() {
    //! Another process holding the write lock longer than the busy timeout must surface as
    //! a retryable store error (503 + Retry-After upstream), never as a claim or a panic.
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("idem.sqlite3");
    let clock = ManualClock::new(UnixMillis(1_700_000_000_000));
    let store = {
        let (path, clock) = (path.clone(), Arc::new(clock.clone()));
        tokio::task::spawn_blocking(move || {
            SqliteStore::open(path, Config::default().with_clock(clock).with_busy_timeout(Duration::from_millis(50)))
        })
        .await
        .expect("task")
        .expect("open")
    };
    let other = Connection::open(&path).expect("other connection");
    other.execute_batch("BEGIN IMMEDIATE").expect("take the write lock");

    let err = store.claim(req("k1")).await.expect_err("the lock is held");
    assert!(err.is_retryable(), "{err}");
    // The group-commit executor wraps the cause its whole batch shares; the store's error,
    // and rusqlite's under it, are further down the chain.
    let chain = || std::iter::successors(Some(&err as &(dyn std::error::Error + 'static)), |e| e.source());
    let ours = chain().find_map(|e| e.downcast_ref::<Error>()).expect("idem_sqlite::Error");
    assert!(ours.is_retryable(), "{ours}");
    let driver = chain().find_map(|e| e.downcast_ref::<rusqlite::Error>()).expect("rusqlite error");
    assert_eq!(driver.sqlite_error_code(), Some(rusqlite::ErrorCode::DatabaseBusy));

    other.execute_batch("ROLLBACK").expect("release the write lock");
    assert!(matches!(store.claim(req("k1")).await.expect("claim"), ClaimOutcome::Claimed(_)));
}

#[tokio::test]
async fn a_corrupt_stored_response_is_a_typed_error_and_is_never_overwritten() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("idem.sqlite3");
    let clock = ManualClock::new(UnixMillis(1_700_000_000_000));
    let store = open(path.clone(), &clock).await;
    let ClaimOutcome::Claimed(r) = store.claim(req("k1")).await.expect("claim") else { panic!("not claimed") };
    store.complete(r.id, r.token, StoredResponse::new(200, vec![], b"ok".to_vec())).await.expect("complete");
    Connection::open(&path)
        .and_then(|c| c.execute("UPDATE idem_records SET response = x'09ff' WHERE id = ?1", [&r.id.as_bytes()[..]]))
        .expect("corrupt the response");

    assert!(matches!(store.get(r.id).await, Err(StoreError::Corrupt { id: Some(id), .. }) if id == r.id));
    assert!(matches!(store.claim(req("k1")).await, Err(StoreError::Corrupt { .. })));
    let raw: Vec<u8> = Connection::open(&path)
        .and_then(|c| {
            c.query_row("SELECT response FROM idem_records WHERE id = ?1", [&r.id.as_bytes()[..]], |row| row.get(0))
        })
        .expect("read back");
    assert_eq!(raw, [0x09, 0xff], "the claim must not overwrite a record it cannot read");
}

#[tokio::test]
async fn a_row_naming_another_tenant_is_corrupt_and_never_replayed() {
    //! A row whose scope was rewritten to another tenant's (bytes moved between rows by
    //! something with write access) was returned under the first tenant's id.
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("idem.sqlite3");
    let clock = ManualClock::new(UnixMillis(1_700_000_000_000));
    let store = open(path.clone(), &clock).await;
    let ClaimOutcome::Claimed(r) = store.claim(req("k1")).await.expect("claim") else { panic!("not claimed") };
    store.complete(r.id, r.token, StoredResponse::new(201, vec![], b"tenant a".to_vec())).await.expect("complete");
    Connection::open(&path)
        .and_then(|c| c.execute("UPDATE idem_records SET principal = 'tenant-b' WHERE id = ?1", [&r.id.as_bytes()[..]]))
        .expect("move the row to another tenant");

    assert!(matches!(store.get(r.id).await, Err(StoreError::Corrupt { id: Some(id), .. }) if id == r.id));
    assert!(matches!(store.claim(req("k1")).await, Err(StoreError::Corrupt { .. })));
}

#[tokio::test]
async fn a_value_of_the_wrong_type_is_corrupt_not_an_outage() {
    //! A column holding a value of another SQL type (an integer token stored as text) was
    //! reported as a retryable store outage instead of a corrupt record.
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("idem.sqlite3");
    let clock = ManualClock::new(UnixMillis(1_700_000_000_000));
    let store = open(path.clone(), &clock).await;
    let ClaimOutcome::Claimed(r) = store.claim(req("k1")).await.expect("claim") else { panic!("not claimed") };
    Connection::open(&path)
        .and_then(|c| {
            c.execute_batch("PRAGMA ignore_check_constraints = ON")?;
            c.execute("UPDATE idem_records SET token = 'many' WHERE id = ?1", [&r.id.as_bytes()[..]])
        })
        .expect("store a text token");
    match store.get(r.id).await {
        Err(StoreError::Corrupt { id: Some(id), .. }) => assert_eq!(id, r.id),
        other => panic!("a wrongly typed column gave {other:?}"),
    }
}

#[tokio::test]
async fn keys_and_scopes_round_trip_byte_exact_through_the_columns() {
    let dir = tempfile::tempdir().expect("dir");
    let clock = ManualClock::new(UnixMillis(1_700_000_000_000));
    let store = open(dir.path().join("idem.sqlite3"), &clock).await;
    // A key that itself starts with a quote and holds a backslash, and a non-ASCII principal.
    let key = IdempotencyKey::parse(br#""\"a\\b""#).expect("sf-string key");
    assert_eq!(key.as_str(), r#""a\b"#);
    let scope = Scope::new("tenant-é/🙂", Endpoint::new("PUT", "/tickets/{id}")).expect("scope");
    let req =
        ClaimRequest::new(scope, key, Fingerprint::of_bytes(b"x"), Duration::from_secs(5), Duration::from_secs(60));
    let ClaimOutcome::Claimed(written) = store.claim(req.clone()).await.expect("claim") else { panic!("not claimed") };
    let read = store.get(req.id()).await.expect("get").expect("present");
    assert_eq!(read, written);
    assert_eq!((read.key, read.scope), (req.key().clone(), req.scope().clone()));
}

#[tokio::test]
async fn journal_entries_follow_their_record_through_reclaim_sweep_and_replacement() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("idem.sqlite3");
    let clock = ManualClock::new(UnixMillis(1_700_000_000_000));
    let store = open(path.clone(), &clock).await;
    let ClaimOutcome::Claimed(r) = store.claim(req("k1")).await.expect("claim") else { panic!("not claimed") };
    assert_eq!(
        store.journal_put(r.id, r.token, "charge", b"ch_1".to_vec(), false).await.expect("put"),
        JournalWrite::Written
    );
    // First write wins without overwrite; a stale token is fenced.
    assert_eq!(
        store.journal_put(r.id, r.token, "charge", b"ch_2".to_vec(), false).await.expect("put"),
        JournalWrite::Exists(b"ch_1".to_vec())
    );
    assert!(
        store.journal_put(r.id, FencingToken(7), "charge", vec![], true).await.expect_err("fenced").is_lease_lost()
    );

    // The lease runs out; the retry reclaims and resumes from the journal.
    clock.advance(Duration::from_secs(6));
    let reclaim = ReclaimRequest {
        id: r.id,
        expected: r.token,
        fingerprint: r.fingerprint,
        lease_ttl: Duration::from_secs(5),
        retention: Duration::from_secs(60),
    };
    let ReclaimOutcome::Reclaimed(r2) = store.reclaim(reclaim).await.expect("reclaim") else { panic!("not reclaimed") };
    assert_eq!(store.journal_get(r2.id, "charge").await.expect("get"), Some(b"ch_1".to_vec()));
    assert_eq!(store.journal_get(r2.id, "other").await.expect("get"), None);

    // Past retention: invisible at once, then a new claim starts with an empty journal.
    clock.advance(Duration::from_secs(120));
    assert_eq!(store.journal_get(r2.id, "charge").await.expect("get"), None);
    let ClaimOutcome::Claimed(r3) = store.claim(req("k1")).await.expect("claim") else { panic!("not claimed") };
    assert_eq!(
        r3.token,
        FencingToken::first_at(UnixMillis(clock.now_ms())),
        "a new generation, its token from the clock"
    );
    assert!(r3.token > r2.token);
    assert_eq!(store.journal_get(r3.id, "charge").await.expect("get"), None);

    // The sweep removes a record's entries with it (trigger idem_records_delete_journal).
    store.journal_put(r3.id, r3.token, "charge", b"ch_3".to_vec(), false).await.expect("put");
    clock.advance(Duration::from_secs(120));
    assert_eq!(store.sweep(10).await.expect("sweep").removed, 1);
    let left: i64 = Connection::open(&path)
        .and_then(|c| c.query_row("SELECT count(*) FROM idem_journal", [], |row| row.get(0)))
        .expect("count");
    assert_eq!(left, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweeper_task_drains_every_expired_record_in_bounded_batches() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("idem.sqlite3");
    let clock = ManualClock::new(UnixMillis(1_700_000_000_000));
    let store = open(path.clone(), &clock).await;
    for i in 0..25 {
        store.claim(req(&format!("old-{i}"))).await.expect("claim");
    }
    clock.advance(Duration::from_secs(61));
    let ClaimOutcome::Claimed(live) = store.claim(req("live")).await.expect("claim") else { panic!("not claimed") };

    // Batches of 4: the sweeper must loop on `more` within one round.
    let sweeper = Sweeper::start(
        Arc::new(store.clone()),
        SweepConfig::default().with_period(Duration::from_secs(3600)).with_batch(4),
    );
    let count = || -> i64 {
        Connection::open(&path)
            .and_then(|c| c.query_row("SELECT count(*) FROM idem_records", [], |row| row.get(0)))
            .expect("count")
    };
    tokio::time::timeout(Duration::from_secs(10), async {
        while count() > 1 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the first round drains the backlog");
    sweeper.stop().await;
    assert_eq!(store.get(live.id).await.expect("get").map(|r| r.token), Some(live.token));
}

#[test]
fn a_file_at_an_older_schema_version_is_migrated_forward_on_open() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("idem.sqlite3");
    {
        let conn = Connection::open(&path).expect("create");
        conn.execute_batch(idem_sqlite::MIGRATIONS[0].sql).expect("migration 1 by hand");
        conn.pragma_update(None, "user_version", 1).expect("version 1");
    }
    drop(SqliteStore::open(&path, Config::default()).expect("open migrates"));
    let conn = Connection::open(&path).expect("inspect");
    let version: u32 = conn.pragma_query_value(None, "user_version", |r| r.get(0)).expect("user_version");
    let journal: i64 = conn
        .query_row("SELECT count(*) FROM sqlite_master WHERE name = 'idem_journal'", [], |r| r.get(0))
        .expect("journal table");
    assert_eq!((version, journal), (SCHEMA_VERSION, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_is_answered_by_a_reader_while_another_process_holds_the_write_lock() {
    //! A retry of a completed request must not wait for (or fail on) a write lock it does
    //! not need: a WAL reader answers it. With claim reads off, the same claim goes to the
    //! writer and meets the lock.
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("idem.sqlite3");
    let clock = Arc::new(ManualClock::new(UnixMillis(1_700_000_000_000)));
    let open = |claim_reads: bool| {
        let config = Config::default()
            .with_clock(clock.clone())
            .with_busy_timeout(Duration::from_millis(50))
            .with_max_readers(if claim_reads { 4 } else { 0 });
        SqliteStore::open(&path, config).expect("open")
    };
    let (reading, writing) = (open(true), open(false));
    let ClaimOutcome::Claimed(r) = reading.claim(req("k1")).await.expect("claim") else { panic!("not claimed") };
    reading.complete(r.id, r.token, StoredResponse::new(201, vec![], b"{}".to_vec())).await.expect("complete");

    let other = Connection::open(&path).expect("other connection");
    other.execute_batch("BEGIN IMMEDIATE").expect("take the write lock");
    let before = reading.batch_stats();
    let replay = reading.claim(req("k1")).await.expect("replay while locked");
    assert!(
        matches!(&replay, ClaimOutcome::Existing { record, .. } if record.state == RecordState::Completed),
        "{replay:?}"
    );
    let after = reading.batch_stats();
    assert_eq!((after.claims_read, after.operations), (before.claims_read + 1, before.operations));
    let err = writing.claim(req("k1")).await.expect_err("the writer meets the lock");
    assert!(err.is_retryable(), "{err}");
    other.execute_batch("ROLLBACK").expect("release the write lock");
}

#[test]
fn without_auto_migrate_open_refuses_an_outdated_file_until_migrate_runs() {
    //! Operators who migrate in a deployment step must get a typed refusal, not a store
    //! that fails on its first statement, and `migrate` must be safe to run again.
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("idem.sqlite3");
    let manual = Config::default().with_auto_migrate(false);
    match SqliteStore::open(&path, manual.clone()) {
        Err(err @ Error::SchemaOutdated { found: 0, required: SCHEMA_VERSION }) => assert!(!err.is_retryable()),
        other => panic!("expected SchemaOutdated, got {other:?}"),
    }
    let tables: i64 = Connection::open(&path)
        .and_then(|c| c.query_row("SELECT count(*) FROM sqlite_master WHERE type = 'table'", [], |r| r.get(0)))
        .expect("count tables");
    assert_eq!(tables, 0, "the check must not create the schema");

    assert_eq!(SqliteStore::migrate(&path, &manual).expect("migrate"), idem_sqlite::MIGRATIONS.len());
    assert_eq!(SqliteStore::migrate(&path, &manual).expect("migrate again"), 0);
    drop(SqliteStore::open(&path, manual).expect("open after migrate"));
}

/// Two processes sharing one file with clocks 10 s apart: the slow one's claims looked
/// expired to the fast one at once, which reclaimed a live lease and ran the handler a
/// second time. The slow process must refuse to open over the skew limit.
#[tokio::test]
async fn a_process_whose_clock_is_behind_the_file_refuses_to_open() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("idem.sqlite3");
    let t0 = UnixMillis(1_700_000_000_000);
    let fast = ManualClock::new(t0.saturating_add(Duration::from_secs(10)));
    let slow = ManualClock::new(t0);
    let fast_store = open(path.clone(), &fast).await;
    let ClaimOutcome::Claimed(_) = fast_store.claim(req("warm-up")).await.expect("claim") else { panic!() };

    // The default limit (1 s): the slow process is refused, naming the skew.
    let p = path.clone();
    let s = Arc::new(slow.clone());
    let refused = tokio::task::spawn_blocking(move || SqliteStore::open(p, Config::default().with_clock(s)))
        .await
        .expect("open task");
    match refused {
        Err(Error::ClockBehind { ahead_ms, limit_ms }) => assert_eq!((ahead_ms, limit_ms), (10_000, 1_000)),
        other => panic!("opened despite a 10 s skew: {other:?}"),
    }

    // The measured skew is exactly 10 s: a limit 1 ms below it refuses, the limit itself
    // opens.
    let open_with_limit = |limit: Duration| {
        let (p, s) = (path.clone(), Arc::new(slow.clone()));
        tokio::task::spawn_blocking(move || {
            SqliteStore::open(p, Config::default().with_clock(s).with_max_clock_skew(limit))
        })
    };
    match open_with_limit(Duration::from_millis(9_999)).await.expect("open task") {
        Err(Error::ClockBehind { ahead_ms, limit_ms }) => assert_eq!((ahead_ms, limit_ms), (10_000, 9_999)),
        other => panic!("opened despite a 10 s skew over a 9.999 s limit: {other:?}"),
    }
    drop(open_with_limit(Duration::from_secs(10)).await.expect("open task").expect("a skew at the limit opens"));

    // With the check off, the failure shows: the slow process's fresh 5 s claim is
    // reclaimed by the fast one at once.
    let slow_store = open_with_limit(Duration::MAX).await.expect("open task").expect("open with the check off");
    let ClaimOutcome::Claimed(held) = slow_store.claim(req("k1")).await.expect("claim") else { panic!() };
    let again = ReclaimRequest {
        id: held.id,
        expected: held.token,
        fingerprint: held.fingerprint,
        lease_ttl: Duration::from_secs(5),
        retention: Duration::from_secs(60),
    };
    let stolen = fast_store.reclaim(again).await.expect("reclaim");
    assert!(matches!(stolen, ReclaimOutcome::Reclaimed(_)), "a live lease was reclaimed early: {stolen:?}");
}

fn failure(code: i32) -> rusqlite::Error {
    rusqlite::Error::SqliteFailure(rusqlite::ffi::Error::new(code), None)
}

#[test]
fn busy_and_locked_are_retryable_others_are_not() {
    let busy = Error::Sqlite { operation: "claim", source: failure(rusqlite::ffi::SQLITE_BUSY) };
    let locked = Error::Sqlite { operation: "begin group commit", source: failure(rusqlite::ffi::SQLITE_LOCKED) };
    let full = Error::Sqlite { operation: "claim", source: failure(rusqlite::ffi::SQLITE_FULL) };
    assert!(busy.is_retryable());
    assert!(locked.is_retryable());
    assert!(!full.is_retryable());
    assert!(!Error::SchemaOutdated { found: 1, required: 2 }.is_retryable());
    assert!(!Error::SchemaTooNew { found: 9, known: 1 }.is_retryable());
}

#[test]
fn store_error_keeps_the_driver_error_as_source() {
    let busy = Error::Sqlite { operation: "claim", source: failure(rusqlite::ffi::SQLITE_BUSY) };
    let store: StoreError = busy.into();
    assert!(store.is_retryable());
    let ours = std::error::Error::source(&store).expect("source");
    let ours = ours.downcast_ref::<Error>().expect("idem_sqlite::Error");
    let driver = std::error::Error::source(ours).expect("driver source");
    assert!(driver.downcast_ref::<rusqlite::Error>().is_some());
}

#[test]
fn migrations_are_numbered_in_order_and_end_at_the_schema_version() {
    for (i, m) in idem_sqlite::MIGRATIONS.iter().enumerate() {
        assert_eq!(m.version as usize, i + 1);
        assert!(m.name.starts_with(&format!("{:04}_", m.version)));
    }
    assert_eq!(idem_sqlite::MIGRATIONS.last().map(|m| m.version), Some(SCHEMA_VERSION));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_of_one_key_in_one_batch_have_one_winner_first_and_over_an_expired_record() {
    //! A claim is decided by `INSERT ... ON CONFLICT DO NOTHING`, reading the row only on
    //! a conflict: of eight claims of one key in one batch, each with its own body, exactly
    //! one wins and its row stays as written, and a claim over an expired record takes the
    //! next generation's token and an empty journal.
    const N: usize = 8;
    let dir = tempfile::tempdir().expect("dir");
    let clock = ManualClock::new(UnixMillis(1_700_000_000_000));
    // Pooled readers on (the default): every claim looks first, finds nothing live, and
    // goes to the writer, which takes all eight in one batch.
    let batch = idem_sqlite::BatchConfig::default().with_max_batch(N).with_full_batches(Duration::from_millis(200));
    let config = Config::default().with_clock(Arc::new(clock.clone())).with_batch(batch);
    let store = SqliteStore::open(dir.path().join("idem.sqlite3"), config).expect("open");
    let claim = |body: usize| {
        let scope = Scope::new("tenant-a", Endpoint::new("POST", "/v1/workers")).expect("scope");
        let key = IdempotencyKey::parse(b"race").expect("key");
        let fingerprint = Fingerprint::of_bytes(&body.to_le_bytes());
        store.claim(ClaimRequest::new(scope, key, fingerprint, Duration::from_secs(5), Duration::from_secs(60)))
    };
    let one_winner = |outcomes: Vec<Result<ClaimOutcome, StoreError>>| {
        let (mut winners, mut seen) = (Vec::new(), Vec::new());
        for outcome in outcomes {
            match outcome.expect("claim") {
                ClaimOutcome::Claimed(r) => winners.push(r),
                ClaimOutcome::Existing { record, .. } => seen.push(record),
            }
        }
        assert_eq!(winners.len(), 1, "exactly one claim wins: {winners:?}");
        assert!(seen.iter().all(|r| *r == winners[0]), "the others see the winner's row untouched: {seen:?}");
        winners.remove(0)
    };

    let first = one_winner(futures::future::join_all((0..N).map(claim)).await);
    assert_eq!(store.get(first.id).await.expect("get"), Some(first.clone()));
    store.journal_put(first.id, first.token, "step", b"old".to_vec(), false).await.expect("journal put");

    clock.advance_ms(60_000);
    let second = one_winner(futures::future::join_all((0..N).map(claim)).await);
    assert_eq!(second.token, FencingToken::first_at(UnixMillis(clock.now_ms())).max(first.token.next()));
    assert_eq!(store.get(first.id).await.expect("get"), Some(second.clone()));
    assert_eq!(store.journal_get(first.id, "step").await.expect("journal_get"), None, "a new generation's journal");
    let stats = store.batch_stats();
    assert_eq!((stats.batches, stats.claims_read), (3, 0), "{stats:?}");
}

/// The clock-skew refusal printed a run of ten spaces mid-sentence (a lost line
/// continuation in its message); an operator reads it in a start-up log.
#[test]
fn the_clock_behind_message_reads_as_one_sentence() {
    let message = idem_sqlite::Error::ClockBehind { ahead_ms: 1_500, limit_ms: 1_000 }.to_string();
    assert!(!message.contains("  "), "{message}");
    assert!(message.contains("1500 ms behind") && message.contains("limit 1000 ms"), "{message}");
}
