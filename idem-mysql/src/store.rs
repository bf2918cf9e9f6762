//! [`MySqlStore`]: the [`Store`] contract as short InnoDB transactions on a
//! `sqlx::MySqlPool`. The statements are in `src/sql.rs`; the rules each transaction
//! applies are idem-core's pure [`idem_core::transition`] functions, so no rule is
//! restated here.

use std::str::FromStr as _;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idem_core::codec::encode_response;
use idem_core::store::MAX_JOURNAL_NAME;
use idem_core::transition::{self, ClaimOutcome, ClaimRequest, ReclaimOutcome, ReclaimRequest};
use idem_core::{
    Capabilities, Clock, FencingToken, JournalWrite, ListFilter, Listing, Receipt, Record, RecordId, Store, StoreError,
    StoredResponse, SweepOutcome, UnixMillis,
};
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::pool::PoolConnection;
use sqlx::{MySql, MySqlConnection, MySqlPool};

use crate::config::Config;
use crate::error::{Error, code, is_session_lost, is_transient_lock, number};
use crate::sql::{SERVER_NOW_MS, Statements, record_at, token_param, validate_prefix};

/// An idempotency [`Store`] in MySQL 8 or MariaDB 10.11 (InnoDB): a records table and a
/// journal table, on a `sqlx::MySqlPool`. Cheap to clone (shares the pool).
///
/// Every write is one short transaction at READ COMMITTED: a locking read of the
/// record's row (`SELECT ... FOR UPDATE`), the store's `now`, the pure rule of
/// [`idem_core::transition`], and at most one record write (`INSERT` of a new row, or
/// `UPDATE` of the locked one; a claim replacing an expired generation also deletes its
/// journal entries). Reads (`get`, `list`, `journal_get`) are single consistent reads. Why that is atomic, and what happens when two claims race for an id
/// nobody holds yet, is in the crate docs (`# Why the claim is atomic`). No transaction is
/// held open across the handler; a call holds a pooled connection for its transaction
/// only. A transaction rolled back by a deadlock (1213) or a lock-wait timeout (1205), or a
/// claim whose insert lost to a concurrent one (1062), runs again from `BEGIN` (nothing of
/// it was committed) up to 8 times, 1, 4, 9, ... ms apart; one whose session died before
/// `COMMIT` was sent runs again once, on a fresh connection. A connection whose session
/// died is closed rather than returned to the pool.
#[derive(Clone, Debug)]
pub struct MySqlStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    pool: MySqlPool,
    clock: Option<Arc<dyn Clock>>,
    sql: Statements,
}

/// Most records one sweep call removes, whatever limit it is given (the contract allows
/// fewer, reporting `more`): it bounds the locks one transaction holds and the number of
/// ids in one statement.
pub const SWEEP_BATCH: usize = 1000;

/// How often a transaction runs in all: the first attempt and the retries after a
/// deadlock, a lock-wait timeout, or a lost insert race.
const ATTEMPTS: u32 = 9;

/// Why one attempt of a transaction stopped: a driver error (which may be worth running
/// the transaction again), or an outcome of the store's own (a lost compare-and-set, a
/// row that does not decode), which is final.
#[derive(Debug)]
enum Abort {
    Sql(sqlx::Error),
    Store(StoreError),
}

impl From<sqlx::Error> for Abort {
    fn from(e: sqlx::Error) -> Self {
        Abort::Sql(e)
    }
}

impl From<StoreError> for Abort {
    fn from(e: StoreError) -> Self {
        Abort::Store(e)
    }
}

/// Runs `$body` (an expression awaiting on `$conn`, a `&mut MySqlConnection` inside a
/// transaction, evaluating to `Result<T, Abort>`) in a fresh transaction, committing on
/// `Ok`, rolling back otherwise, and running it again after an error that left nothing
/// committed and may pass (see [`MySqlStore`]). A macro rather than a function taking an
/// async closure, so the futures stay `Send` for `async_trait`.
macro_rules! in_transaction {
    ($self:ident, $op:expr, |$conn:ident| $body:expr) => {{
        let op: &'static str = $op;
        let mut attempt: u32 = 0;
        loop {
            attempt += 1;
            let pooled = $self.inner.pool.acquire().await.map_err(Error::connection(op))?;
            let mut tx = match Open::begin(pooled).await {
                Ok(tx) => tx,
                // A pooled session that died while idle: nothing was done, so once more on
                // a fresh connection.
                Err(e) if is_session_lost(&e) && attempt == 1 => continue,
                Err(e) => return Err(Error::mysql(op)(e).into()),
            };
            let result = {
                let $conn: &mut MySqlConnection = &mut tx.conn;
                $body.await
            };
            let e = match result {
                // Whether a failed COMMIT committed is unknown: never run it again here.
                Ok(value) => match tx.end("COMMIT").await {
                    Ok(()) => break value,
                    Err(e) => return Err(Error::mysql(op)(e).into()),
                },
                Err(Abort::Store(e)) => {
                    // Nothing was written; release the row lock now.
                    let _ = tx.end("ROLLBACK").await;
                    return Err(e);
                }
                Err(Abort::Sql(e)) => e,
            };
            let lost = is_session_lost(&e);
            if !lost {
                let _ = tx.end("ROLLBACK").await;
            }
            // A session lost before COMMIT was sent takes its transaction with it (the
            // server rolls it back), so it is run again, but only once: a server that is
            // down should fail the call within one acquire timeout, not eight.
            let again = (lost && attempt == 1) || is_transient_lock(&e) || number(&e) == Some(code::DUPLICATE_KEY);
            if !again {
                return Err(Error::mysql(op)(e).into());
            }
            if attempt >= ATTEMPTS {
                return Err(Error::Contention { operation: op }.into());
            }
            tokio::time::sleep(Duration::from_millis(u64::from(attempt * attempt))).await;
        }
    }};
}

/// Runs `$body` (reads only, awaiting on `$conn`, a pooled connection in autocommit mode,
/// evaluating to `Result<T, Abort>`) and returns its value. A read is safe to resend, so
/// one whose pooled session turned out dead runs once more on a fresh connection (only
/// once: a server that is down fails the call within one acquire timeout).
macro_rules! reading {
    ($self:ident, $op:expr, |$conn:ident| $body:expr) => {{
        let op: &'static str = $op;
        let mut attempt: u32 = 0;
        loop {
            attempt += 1;
            let mut pooled = $self.inner.pool.acquire().await.map_err(Error::connection(op))?;
            let result = {
                let $conn: &mut MySqlConnection = &mut pooled;
                $body.await
            };
            match result {
                Ok(value) => break value,
                Err(Abort::Store(e)) => return Err(e),
                Err(Abort::Sql(e)) => {
                    let lost = is_session_lost(&e);
                    if lost {
                        pooled.close_on_drop();
                    }
                    if !(lost && attempt == 1) {
                        return Err(Error::mysql(op)(e).into());
                    }
                }
            }
        }
    }};
}

/// A pooled connection inside a transaction the store began. Dropped before the
/// transaction ended (a failed `COMMIT` or `ROLLBACK`, a lost session, or the caller's
/// future cancelled mid-way), it closes the connection, which ends the transaction on the
/// server, rather than return it to the pool with the transaction open.
struct Open {
    conn: PoolConnection<MySql>,
    open: bool,
}

impl Open {
    async fn begin(mut conn: PoolConnection<MySql>) -> Result<Self, sqlx::Error> {
        if let Err(e) = sqlx::Executor::execute(&mut *conn, sqlx::raw_sql("BEGIN")).await {
            if is_session_lost(&e) {
                conn.close_on_drop();
            }
            return Err(e);
        }
        Ok(Self { conn, open: true })
    }

    /// `COMMIT` or `ROLLBACK`; after an error the connection is closed on drop.
    async fn end(mut self, statement: &'static str) -> Result<(), sqlx::Error> {
        sqlx::Executor::execute(&mut *self.conn, sqlx::raw_sql(statement)).await?;
        self.open = false;
        Ok(())
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        if self.open {
            self.conn.close_on_drop();
        }
    }
}

impl MySqlStore {
    /// Connects to `url` (`mysql://user:password@host:port/database`) with a pool of its
    /// own: [`Config::with_max_connections`] connections, [`Config::with_acquire_timeout`]
    /// to get one, and every session pinned to READ COMMITTED as it opens. Then checks the
    /// pool and migrates as [`MySqlStore::from_pool`] does.
    ///
    /// # Errors
    /// [`Error::InvalidPrefix`], [`Error::InvalidUrl`], [`Error::Connection`] when the
    /// server cannot be reached within the acquire timeout (retryable), and those of
    /// [`MySqlStore::from_pool`].
    pub async fn connect(url: &str, config: Config) -> Result<Self, Error> {
        validate_prefix(&config.prefix)?;
        let options = MySqlConnectOptions::from_str(url).map_err(Error::InvalidUrl)?;
        let pool = MySqlPoolOptions::new()
            .max_connections(u32::try_from(config.max_connections).unwrap_or(u32::MAX))
            .acquire_timeout(config.acquire_timeout)
            // No ping before lending a connection (a round trip per transaction saved); a
            // connection that died while idle costs one retryable error.
            .test_before_acquire(false)
            .after_connect(|conn, _meta| Box::pin(async move { pin_read_committed(conn).await }))
            .connect_lazy_with(options);
        Self::from_pool(pool, config).await
    }

    /// Builds the store on the application's own pool, whose sessions must run at READ
    /// COMMITTED (set in its `after_connect`, see [`pin_read_committed`]); one connection
    /// is checked. Then applies the missing migrations ([`Config::with_auto_migrate`], the
    /// default) or checks that none is missing.
    ///
    /// # Errors
    /// [`Error::InvalidPrefix`]; [`Error::Connection`] (retryable) when no connection can
    /// be had; [`Error::IsolationNotSupported`] when the session runs at another level;
    /// [`Error::NotMigrated`] with auto-migration off and tables behind this build;
    /// [`Error::SchemaTooNew`]; [`Error::MySql`] when a migration fails.
    pub async fn from_pool(pool: MySqlPool, config: Config) -> Result<Self, Error> {
        validate_prefix(&config.prefix)?;
        {
            let mut conn = pool.acquire().await.map_err(Error::connection("checking the isolation level"))?;
            let level = session_isolation(&mut conn).await.map_err(Error::mysql("checking the isolation level"))?;
            if !level.eq_ignore_ascii_case("READ-COMMITTED") {
                return Err(Error::IsolationNotSupported { level });
            }
        }
        if config.auto_migrate {
            crate::sql::migrate(&pool, &config.prefix).await?;
        } else {
            crate::sql::check_migrated(&pool, &config.prefix).await?;
        }
        let sql = Statements::for_prefix(&config.prefix);
        Ok(Self { inner: Arc::new(Inner { pool, clock: config.clock, sql }) })
    }

    /// Applies the migrations `config`'s tables lack, for a deploy step that runs before
    /// stores built with [`Config::with_auto_migrate`] off start; returns how many ran (0
    /// when up to date). Concurrent calls wait for each other (`GET_LOCK`).
    ///
    /// # Errors
    /// [`Error::InvalidPrefix`], [`Error::Connection`], [`Error::SchemaTooNew`],
    /// [`Error::MySql`] when a statement fails (e.g. no `CREATE` privilege).
    pub async fn migrate(pool: &MySqlPool, config: &Config) -> Result<usize, Error> {
        validate_prefix(&config.prefix)?;
        crate::sql::migrate(pool, &config.prefix).await
    }

    /// The pool the store runs on.
    #[must_use]
    pub fn pool(&self) -> &MySqlPool {
        &self.inner.pool
    }

    /// Completes the record inside the caller's own transaction `tx` (begun on a
    /// connection of any pool reaching the same database), so the handler's writes and the
    /// stored response commit or roll back together. It takes the record's row lock until
    /// `tx` ends: a concurrent renewal, reclaim or claim of this record waits for the
    /// commit. Any isolation level works: InnoDB's locking reads and updates see the last
    /// committed row whatever the transaction's snapshot, so a lease renewal committed
    /// while the handler ran does not make the completion fail. Not retried here: a
    /// deadlock rolls back the caller's whole transaction, which only the caller can run
    /// again.
    ///
    /// # Errors
    /// [`StoreError::LeaseLost`] when `token` is not the current claim (nothing written,
    /// roll back); [`StoreError::Unavailable`] when a statement fails.
    pub async fn complete_in(
        &self,
        tx: &mut MySqlConnection,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Receipt, StoreError> {
        const OP: &str = "completing a record in the caller's transaction";
        let done = async {
            let current = self.lock(tx, id).await?;
            let now = self.now(tx).await?;
            let new = transition::complete(current.as_ref(), id, token, response, now)
                .map_err(|lost| StoreError::lease_lost(id, lost))?;
            self.write(tx, current.is_some(), &new).await?;
            Ok::<_, Abort>(Receipt::of(&new))
        };
        match done.await {
            Ok(receipt) => Ok(receipt),
            Err(Abort::Store(e)) => Err(e),
            Err(Abort::Sql(e)) => Err(Error::mysql(OP)(e).into()),
        }
    }

    /// The record's row, locked exclusively until the transaction ends. Under READ
    /// COMMITTED a locking read returns the last committed version (waiting for a
    /// transaction that holds the lock), never an older snapshot.
    async fn lock(&self, conn: &mut MySqlConnection, id: RecordId) -> Result<Option<Record>, Abort> {
        let row = sqlx::query(&self.inner.sql.lock).bind(id.as_bytes().as_slice()).fetch_optional(conn).await?;
        Ok(row.as_ref().map(record_at).transpose()?)
    }

    /// The store's `now`: the pinned clock, or the server's, read after the row lock was
    /// granted so that it is never earlier than the commit of the transaction waited for.
    async fn now(&self, conn: &mut MySqlConnection) -> Result<UnixMillis, sqlx::Error> {
        if let Some(clock) = &self.inner.clock {
            return Ok(clock.now());
        }
        let ms: i64 = sqlx::query_scalar(&format!("SELECT {SERVER_NOW_MS}")).fetch_one(conn).await?;
        Ok(UnixMillis(ms))
    }

    /// Writes the whole record: a new row, or over the row `lock` returned.
    async fn write(&self, conn: &mut MySqlConnection, exists: bool, r: &Record) -> Result<(), sqlx::Error> {
        let response = r.response.as_ref().map(encode_response);
        let q = if exists {
            sqlx::query(&self.inner.sql.update)
        } else {
            sqlx::query(&self.inner.sql.insert).bind(r.id.as_bytes().as_slice())
        };
        let q = q
            .bind(r.scope.principal.as_str().as_bytes())
            .bind(r.scope.endpoint.as_str().as_bytes())
            .bind(r.key.as_str().as_bytes())
            .bind(r.fingerprint.as_bytes().as_slice())
            .bind(r.state.as_str())
            .bind(token_param(r.token))
            .bind(response)
            .bind(r.created_at.0)
            .bind(r.started_at.0)
            .bind(r.lease_expires_at.0)
            .bind(r.expires_at.0);
        let q = if exists { q.bind(r.id.as_bytes().as_slice()) } else { q };
        q.execute(conn).await?;
        Ok(())
    }

    /// Reads the record, locks it, applies `rule` at the store's `now`, writes what the
    /// rule returns, all in one transaction: the compare-and-set behind complete, fail and
    /// extend.
    async fn fenced(
        &self,
        operation: &'static str,
        id: RecordId,
        rule: impl Fn(Option<&Record>, UnixMillis) -> Result<Record, transition::LeaseLost> + Send + Sync,
    ) -> Result<Receipt, StoreError> {
        Ok(in_transaction!(self, operation, |conn| async {
            let current = self.lock(conn, id).await?;
            let now = self.now(conn).await?;
            let new = rule(current.as_ref(), now).map_err(|lost| StoreError::lease_lost(id, lost))?;
            self.write(conn, current.is_some(), &new).await?;
            Ok::<_, Abort>(Receipt::of(&new))
        }))
    }
}

/// Sets the session's isolation level to READ COMMITTED: what [`MySqlStore::connect`] runs
/// on every new connection, and what an application's own pool runs in its
/// `after_connect` before handing the pool to [`MySqlStore::from_pool`]. The same
/// statement on MySQL 8 and MariaDB.
///
/// # Errors
/// The driver's error.
pub async fn pin_read_committed(conn: &mut MySqlConnection) -> Result<(), sqlx::Error> {
    sqlx::Executor::execute(conn, sqlx::raw_sql("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")).await?;
    Ok(())
}

/// The session's isolation level as the server spells it (`READ-COMMITTED`). The variable
/// is `transaction_isolation` on MySQL 8 (which removed `tx_isolation`) and on MariaDB
/// from 11.1; MariaDB 10.11 knows only `tx_isolation`.
pub(crate) async fn session_isolation(conn: &mut MySqlConnection) -> Result<String, sqlx::Error> {
    match sqlx::query_scalar::<_, String>("SELECT @@session.transaction_isolation").fetch_one(&mut *conn).await {
        Err(e) if number(&e) == Some(code::UNKNOWN_SYSTEM_VARIABLE) => {
            sqlx::query_scalar("SELECT @@session.tx_isolation").fetch_one(conn).await
        }
        other => other,
    }
}

#[async_trait]
impl Store for MySqlStore {
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        Ok(in_transaction!(self, "claiming a record", |conn| async {
            // Locked when present; when absent, nothing is locked (READ COMMITTED takes no
            // gap locks) and the INSERT below is what two racing claims contend on: the
            // primary key lets one commit, and the other's INSERT fails with 1062 once it
            // does, which runs this transaction again to find the winner's row.
            let current = self.lock(conn, req.id()).await?;
            let now = self.now(conn).await?;
            let (write, outcome) = transition::claim(current.as_ref(), &req, now);
            if let Some(new) = write {
                if current.is_some() {
                    // A new generation starts with an empty journal; the old one's entries
                    // go in the same transaction, under the same lock.
                    sqlx::query(&self.inner.sql.journal_clear)
                        .bind(new.id.as_bytes().as_slice())
                        .execute(&mut *conn)
                        .await?;
                }
                self.write(conn, current.is_some(), &new).await?;
            }
            Ok::<_, Abort>(outcome)
        }))
    }

    async fn reclaim(&self, req: ReclaimRequest) -> Result<ReclaimOutcome, StoreError> {
        Ok(in_transaction!(self, "reclaiming a record", |conn| async {
            let current = self.lock(conn, req.id).await?;
            let now = self.now(conn).await?;
            let (write, outcome) = transition::reclaim(current.as_ref(), &req, now);
            if let Some(new) = write {
                self.write(conn, true, &new).await?;
            }
            Ok::<_, Abort>(outcome)
        }))
    }

    async fn complete(
        &self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Receipt, StoreError> {
        self.fenced("completing a record", id, |current, now| {
            transition::complete(current, id, token, response.clone(), now)
        })
        .await
    }

    async fn extend(&self, id: RecordId, token: FencingToken, lease_ttl: Duration) -> Result<Receipt, StoreError> {
        self.fenced("extending a lease", id, |current, now| transition::extend(current, id, token, lease_ttl, now))
            .await
    }

    async fn fail(&self, id: RecordId, token: FencingToken) -> Result<Receipt, StoreError> {
        self.fenced("marking a record failed", id, |current, now| transition::fail(current, id, token, now)).await
    }

    async fn get(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        // Two autocommit statements: a consistent read of the last committed row, then
        // `now`, which is at or after that commit.
        Ok(reading!(self, "reading a record", |conn| async {
            let row =
                sqlx::query(&self.inner.sql.read).bind(id.as_bytes().as_slice()).fetch_optional(&mut *conn).await?;
            let record = row.as_ref().map(record_at).transpose()?;
            let now = self.now(conn).await?;
            Ok::<_, Abort>(record.filter(|r| !r.is_expired(now)))
        }))
    }

    /// One transaction: lock up to `limit` (at most [`SWEEP_BATCH`]) expired records,
    /// oldest expiry first, delete their journal entries, then them. A record being
    /// replaced by a claim is locked: the locking read waits for it and, at READ
    /// COMMITTED, skips it once the committed row is live again.
    async fn sweep(&self, limit: usize) -> Result<SweepOutcome, StoreError> {
        let limit = limit.min(SWEEP_BATCH);
        Ok(in_transaction!(self, "sweeping expired records", |conn| async {
            let now = self.now(conn).await?;
            let ids: Vec<Vec<u8>> = sqlx::query_scalar(&self.inner.sql.sweep)
                .bind(now.0)
                .bind(u64::try_from(limit).unwrap_or(u64::MAX))
                .fetch_all(&mut *conn)
                .await?;
            let mut removed = 0;
            if !ids.is_empty() {
                let marks = format!("({})", vec!["?"; ids.len()].join(", "));
                for (prefix, count) in [(&self.inner.sql.journal_of, false), (&self.inner.sql.records_of, true)] {
                    let sql = format!("{prefix}{marks}");
                    let q = ids.iter().fold(sqlx::query(&sql), |q, id| q.bind(id.as_slice()));
                    let done = q.execute(&mut *conn).await?;
                    if count {
                        removed = done.rows_affected();
                    }
                }
            }
            let more: bool = sqlx::query_scalar(&self.inner.sql.expired_left).bind(now.0).fetch_one(conn).await?;
            Ok::<_, Abort>(SweepOutcome { removed, more })
        }))
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            backend: "mysql",
            server_clock: true,
            shared: true,
            journal: true,
            list: true,
            ..Capabilities::NONE
        }
    }

    /// The record's row lock, then the owner check (before the entry is looked at, so a
    /// stale owner never learns the value), then the entry: every journal write of a record
    /// holds its lock, so the check and the write see one state.
    async fn journal_put(
        &self,
        id: RecordId,
        token: FencingToken,
        name: &str,
        value: Vec<u8>,
        overwrite: bool,
    ) -> Result<JournalWrite, StoreError> {
        if name.is_empty() || name.len() > MAX_JOURNAL_NAME {
            return Err(Error::InvalidJournalName { len: name.len() }.into());
        }
        Ok(in_transaction!(self, "writing a journal entry", |conn| async {
            let current = self.lock(conn, id).await?;
            let now = self.now(conn).await?;
            transition::check_journal_owner(current.as_ref(), id, token, now)
                .map_err(|lost| StoreError::lease_lost(id, lost))?;
            let (id_bytes, name_bytes) = (id.as_bytes().as_slice(), name.as_bytes());
            if !overwrite {
                let stored: Option<Vec<u8>> = sqlx::query_scalar(&self.inner.sql.journal_read)
                    .bind(id_bytes)
                    .bind(name_bytes)
                    .fetch_optional(&mut *conn)
                    .await?;
                if let Some(stored) = stored {
                    return Ok(JournalWrite::Exists(stored));
                }
            }
            sqlx::query(&self.inner.sql.journal_write)
                .bind(id_bytes)
                .bind(name_bytes)
                .bind(value.as_slice())
                .bind(value.as_slice())
                .execute(&mut *conn)
                .await?;
            Ok::<_, Abort>(JournalWrite::Written)
        }))
    }

    async fn journal_get(&self, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(reading!(self, "reading a journal entry", |conn| async {
            let now = self.now(conn).await?;
            let value = sqlx::query_scalar(&self.inner.sql.journal_get)
                .bind(id.as_bytes().as_slice())
                .bind(name.as_bytes())
                .bind(now.0)
                .fetch_optional(conn)
                .await?;
            Ok::<_, Abort>(value)
        }))
    }

    /// One consistent read (autocommit, so one snapshot for the page): the live records
    /// after the cursor in id order, through the primary key, one more than the limit to
    /// tell `more`. The filter's conditions are pushed into the `WHERE` (each only when
    /// set, from fixed text) so a page reads about `limit` rows, and checked again with
    /// [`ListFilter::matches`] on the decoded records.
    async fn list(&self, filter: ListFilter) -> Result<Listing, StoreError> {
        let (now, rows) = reading!(self, "listing records", |conn| async {
            let now = self.now(conn).await?;
            let mut sql = format!("{} WHERE expires_at > ?", self.inner.sql.scan);
            if filter.after.is_some() {
                sql.push_str(" AND id > ?");
            }
            if filter.state.is_some() {
                sql.push_str(" AND state = ?");
            }
            if filter.started_before.is_some() {
                sql.push_str(" AND started_at <= ?");
            }
            if filter.principal.is_some() {
                sql.push_str(" AND principal = ?");
            }
            sql.push_str(" ORDER BY id LIMIT ?");
            let mut q = sqlx::query(&sql).bind(now.0);
            if let Some(after) = &filter.after {
                q = q.bind(after.as_bytes().as_slice());
            }
            if let Some(state) = filter.state {
                q = q.bind(state.as_str());
            }
            if let Some(t) = filter.started_before {
                q = q.bind(t.0);
            }
            if let Some(p) = &filter.principal {
                q = q.bind(p.as_str().as_bytes());
            }
            let q = q.bind(u64::try_from(filter.limit).unwrap_or(u64::MAX).saturating_add(1));
            Ok::<_, Abort>((now, q.fetch_all(conn).await?))
        });
        let mut page = Vec::with_capacity(rows.len());
        for row in &rows {
            let r = record_at(row)?;
            if filter.matches(&r, now) {
                page.push(r);
            }
        }
        let more = page.len() > filter.limit;
        page.truncate(filter.limit);
        Ok(Listing::new(now, page, more))
    }
}
