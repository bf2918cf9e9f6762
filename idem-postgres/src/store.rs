//! [`PostgresStore`]: the [`Store`] contract as single SQL statements. The type's docs say
//! how each operation stays atomic; the statements themselves are in `src/sql.rs`.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use idem_core::codec::encode_response;
use idem_core::time::duration_ms;
use idem_core::transition::is_reclaimable;
use idem_core::{
    Capabilities, ClaimOutcome, ClaimRequest, Clock, FencingToken, JournalWrite, ListFilter, Listing, ReclaimOutcome,
    ReclaimRequest, Record, RecordId, RecordState, Store, StoreError, StoredResponse, SweepOutcome, UnixMillis,
};
use tokio_postgres::NoTls;
use tokio_postgres::Socket;
use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};

use crate::config::Config;
use crate::driver::sealed::Sealed as _;
use crate::driver::{Deadpool, Driver, Param, Protocol, Row};
use crate::error::Error;
use crate::sql::{COLUMNS, COMPLETE_IN_LEVELS, Statements, corrupt, record_at, token_param, validate_schema};

/// An idempotency [`Store`] in one PostgreSQL table. Cheap to clone (shares the pool).
///
/// Build with [`PostgresStore::connect`] (a URL) or [`PostgresStore::from_pool`] (your own
/// deadpool `Pool`, e.g. with TLS). Either applies the missing migrations first, or with
/// [`Config::with_auto_migrate`] off checks that none is missing.
///
/// # Atomicity
/// Every operation is one statement in its own (implicit) transaction, so PostgreSQL's row
/// locks give the contract's atomicity; no transaction is ever held open across the
/// handler, and a dropped future can at worst leave a statement that either committed or
/// not.
///
/// - **claim** is `INSERT ... ON CONFLICT (id) DO UPDATE SET <new values> WHERE
///   t.expires_at <= now RETURNING ...`, with a second branch of the same statement that
///   selects the row when the upsert returned nothing. With no row, the insert wins; with a
///   row, `ON CONFLICT DO UPDATE` locks it and evaluates the `WHERE` against its latest
///   committed version. A row past `expires_at` counts as absent and is replaced by the new
///   claim with `GREATEST(token + 1, first_at(now))` (an inserted row gets `first_at(now)`,
///   see the crate docs on fencing tokens). A live row is locked but **not written** (no new
///   row version: nothing for a concurrent compare-and-set under REPEATABLE READ to
///   conflict with, nothing for autovacuum) and comes back from the second branch as
///   `Existing`, as the statement's snapshot saw it; when the live row was committed after
///   that snapshot the statement returns no row and a fresh read returns it. Of N
///   concurrent claims exactly one inserts or replaces; the rest wait on the row lock and
///   then see the live winner. `DO NOTHING` would not lock the row and return nothing,
///   which is why it is not used. `xmax = 0` tells an insert from a replacement; the
///   `claim_txid` column records the claiming transaction for operators.
/// - **reclaim**, **complete**, **extend**, **fail** are `UPDATE ... WHERE id = $1 AND
///   token = $2 AND <conditions> RETURNING ...`: compare-and-set on the fencing token. When
///   the update matches nothing, a second statement reads the current row to build
///   [`ReclaimOutcome::Conflict`] or [`StoreError::LeaseLost`]. That read is a separate
///   statement on purpose: it takes a fresh snapshot, so it reports the record as it is
///   after whichever concurrent write beat this one (a CTE in the same statement would
///   read the statement's older snapshot). If that read shows a record the update would
///   have applied to, the update missed only because a claim committed after its snapshot
///   was taken; it runs again (a few times at most) rather than report an outcome no
///   order of events explains. The model-based conformance test checks exactly this.
/// - **journal_put** is one statement: a CTE selects the parent record `FOR SHARE` where it
///   is live, in flight and carries the token, and `INSERT ... SELECT FROM parent ON
///   CONFLICT (id, name) DO UPDATE ... WHERE $overwrite OR <row of an older generation>`
///   writes the entry; the statement returns whether the parent matched, whether it wrote,
///   and the stored value. The share lock makes a reclaim, complete, fail or replacing
///   claim of the record wait until the put commits, and a put that waited re-checks the
///   owner on the row as committed. Slow paths take a second statement: when the parent
///   did not match, a fresh read of the record builds `LeaseLost` (or, if the record turns
///   out to be owned by the token after all, because its claim committed after the put's
///   snapshot, the put runs again); when a first write lost to an entry committed after
///   the snapshot, a fresh read returns it as `Exists`.
/// - **journal_get** joins the entry to its live record on `record_created_at =
///   created_at`: entries of a replaced generation (a claim that replaced an expired
///   record) are not returned. A replacing claim sets `created_at` to a `now` at or after
///   the old `expires_at`, after which no entry of the old generation can be written, so
///   equal `created_at` means the same generation.
/// - **sweep** deletes a bounded batch picked by `SELECT ... ORDER BY expires_at LIMIT n
///   FOR UPDATE SKIP LOCKED`: a row a claim is replacing right now is skipped, not waited
///   for, and the row lock means a sweep and a claim of one id leave the old record or the
///   new claim, never a mix. `VACUUM` of the deleted rows is left to autovacuum.
///
/// # Round trips
/// Each statement is prepared once per pooled connection (deadpool's statement cache, or
/// sqlx's) and then runs as one round trip; with [`Config::with_prepared_statements`] off
/// (PgBouncer in transaction mode) it is sent unnamed, still in one round trip. A call
/// takes a connection for one statement (two on the lost-CAS path) and returns it at once. A connection whose session died (terminated
/// backend, server restart, broken socket) is detached from the pool rather than returned,
/// so the next call opens a fresh one instead of failing on the dead one.
///
/// # Time
/// `now` is the server's `clock_timestamp()` in whole milliseconds, read once per statement
/// (every process sharing the database agrees on it). A new record's first fencing token
/// is taken from it too. A test may pin time with
/// [`Config::with_clock`]: its reading is passed as a parameter and used instead,
/// through `COALESCE($n, <server now>)`, so tests run the very statements production runs.
#[derive(Debug)]
pub struct PostgresStore<D: Driver = Deadpool> {
    inner: Arc<Inner<D>>,
}

impl<D: Driver> Clone for PostgresStore<D> {
    fn clone(&self) -> Self {
        Self { inner: Arc::clone(&self.inner) }
    }
}

#[derive(Debug)]
struct Inner<D> {
    driver: D,
    schema: String,
    clock: Option<Arc<dyn Clock>>,
    sql: Statements,
    protocol: Protocol,
    /// `transaction_isolation` of a pooled connection when the store was built.
    isolation: String,
}

/// The option that pins READ COMMITTED on a connection the store opens itself (see
/// [`Config::with_isolation_pin`]).
const PIN_READ_COMMITTED: &str = "-c default_transaction_isolation=read\\ committed";

impl PostgresStore<Deadpool> {
    /// Connects to `url` (`postgres://user@host:port/db?...` or the key=value form) over
    /// plain TCP or a Unix socket, without TLS, then migrates or checks the schema as
    /// [`PostgresStore::from_pool`] does. Connections carry
    /// `application_name=idem-postgres` unless the URL sets one, and (unless
    /// [`Config::with_isolation_pin`] is off) the startup option
    /// `-c default_transaction_isolation=read\ committed`, appended to any `options` the
    /// URL sets. For TLS use [`PostgresStore::connect_tls`].
    ///
    /// # Errors
    /// [`Error::InvalidSchema`], [`Error::InvalidUrl`], [`Error::Pool`],
    /// [`Error::Connection`] when the server cannot be reached (retryable), and those of
    /// [`PostgresStore::from_pool`].
    pub async fn connect(url: &str, config: Config) -> Result<Self, Error> {
        Self::connect_tls(url, NoTls, config).await
    }

    /// [`PostgresStore::connect`] with a TLS connector, e.g.
    /// `postgres_native_tls::MakeTlsConnector` or `tokio_postgres_rustls::MakeRustlsConnect`
    /// (crates of their own; this crate does not pick a TLS library for you). Whether TLS is
    /// required follows the URL's `sslmode` (`prefer` by default in tokio-postgres,
    /// `require` to refuse plain connections).
    ///
    /// # Errors
    /// As [`PostgresStore::connect`].
    pub async fn connect_tls<T>(url: &str, tls: T, config: Config) -> Result<Self, Error>
    where
        T: MakeTlsConnect<Socket> + Clone + Sync + Send + 'static,
        T::Stream: Sync + Send,
        T::TlsConnect: Sync + Send,
        <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
    {
        validate_schema(&config.schema)?;
        let mut pg: tokio_postgres::Config = url.parse().map_err(Error::InvalidUrl)?;
        if pg.get_application_name().is_none() {
            pg.application_name("idem-postgres");
        }
        if pg.get_connect_timeout().is_none() {
            pg.connect_timeout(config.connect_timeout);
        }
        if config.isolation_pin {
            // Appended, so it wins over an isolation level the URL's own options set.
            let options = match pg.get_options() {
                Some(o) if !o.trim().is_empty() => format!("{o} {PIN_READ_COMMITTED}"),
                _ => PIN_READ_COMMITTED.to_owned(),
            };
            pg.options(options);
        }
        let manager = Manager::from_config(pg, tls, ManagerConfig { recycling_method: RecyclingMethod::Fast });
        let pool = Pool::builder(manager)
            .max_size(config.max_connections)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(config.acquire_timeout))
            .create_timeout(Some(config.connect_timeout))
            .recycle_timeout(Some(config.connect_timeout))
            .build()
            .map_err(Error::Pool)?;
        Self::from_pool(pool, config).await
    }

    /// Uses the application's own pool. The pool's own settings (size, timeouts, TLS)
    /// apply; the config's pool settings are ignored. Applies the missing migrations
    /// ([`PostgresStore::migrate`]), or with [`Config::with_auto_migrate`] off only checks
    /// that the schema is at this build's migration. Reads the isolation level of a pooled
    /// connection and logs a warning when it is not READ COMMITTED (see
    /// [`PostgresStore::isolation`]).
    ///
    /// # Errors
    /// [`Error::InvalidSchema`]; [`Error::Connection`] when no connection opens
    /// (retryable); [`Error::NotMigrated`] when auto-migration is off and migrations are
    /// missing; [`Error::SchemaTooNew`]; [`Error::Postgres`] when a migration fails (e.g.
    /// no `CREATE` privilege).
    pub async fn from_pool(pool: Pool, config: Config) -> Result<Self, Error> {
        Self::build(Deadpool(pool), config).await
    }

    /// Creates `config`'s schema, the `records` table and its indices on `pool`, applying
    /// whichever shipped migrations (`migrations/*.sql`) are missing, in one transaction
    /// under an advisory lock. Idempotent: safe to call on every start and from several
    /// processes at once. Returns how many migrations ran.
    ///
    /// An associated function, like `SqliteStore::migrate`, so a deploy step can run it
    /// before any store exists: a store built with [`Config::with_auto_migrate`] off refuses
    /// an unmigrated schema.
    ///
    /// # Errors
    /// [`Error::InvalidSchema`] for a bad schema name, [`Error::Connection`],
    /// [`Error::Postgres`] (e.g. no `CREATE` privilege), or [`Error::SchemaTooNew`] when a
    /// newer build migrated the schema.
    pub async fn migrate(pool: &Pool, config: &Config) -> Result<usize, Error> {
        validate_schema(&config.schema)?;
        Deadpool(pool.clone()).migrate(&config.schema).await
    }

    /// The pool (shared with every clone of this store).
    #[must_use]
    pub fn pool(&self) -> &Pool {
        &self.inner.driver.0
    }

    /// Completes the record inside the caller's own transaction `tx`: the handler's rows
    /// and the stored response commit together, or neither does. See the crate docs,
    /// "Completion inside the handler's transaction", for what each mode guarantees.
    ///
    /// The statement is the compare-and-set of [`Store::complete`]: it locks the record's
    /// row until `tx` ends, so no reclaim can take the record between this call and the
    /// commit. Roll `tx` back on any error: [`StoreError::LeaseLost`] means another attempt
    /// owns the record now (a retry reclaimed it after the lease ran out) and this attempt's
    /// rows must not commit.
    ///
    /// `tx` must run at READ COMMITTED (PostgreSQL's default; where a role or database
    /// defaults higher, start it with
    /// `build_transaction().isolation_level(IsolationLevel::ReadCommitted)`). The layer
    /// renews the lease with an `UPDATE` of the record while the handler runs, and a
    /// REPEATABLE READ or SERIALIZABLE transaction whose snapshot predates that renewal
    /// cannot update the row (SQLSTATE 40001), so the completion would fail or not
    /// depending on how long the handler took. Above READ COMMITTED it is refused every
    /// time, in the same statement and before it touches the row, with
    /// [`Error::IsolationNotSupported`] (as the source of a [`StoreError::Unavailable`]
    /// that is not retryable).
    ///
    /// # Errors
    /// [`StoreError::LeaseLost`]; [`StoreError::Unavailable`] for a driver failure, or
    /// wrapping [`Error::IsolationNotSupported`] when `tx` runs above READ COMMITTED.
    pub async fn complete_in(
        &self,
        tx: &tokio_postgres::Transaction<'_>,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Record, StoreError> {
        const OP: &str = "completing a record in the caller's transaction";
        let bytes = encode_response(&response);
        let params = complete_params(&id, token, &bytes, self.pinned_now());
        // Unnamed: the caller's connection may sit behind PgBouncer, and a named statement
        // would outlive the transaction in its connection's cache.
        let row = crate::driver::pg_query_unnamed(tx, self.inner.sql.complete_in(), &params)
            .await
            .map_err(Error::postgres(OP))?;
        match completed_in(row)? {
            Some(row) => record_at(&row, 1, Some(response)),
            None => {
                let current =
                    crate::driver::pg_query_unnamed(tx, self.inner.sql.read(), &read_params(&id, self.pinned_now()))
                        .await
                        .map_err(Error::postgres(OP))?;
                Err(lease_lost_in(id, token, current.as_ref())?)
            }
        }
    }
}

#[cfg(feature = "sqlx")]
impl PostgresStore<crate::driver::Sqlx> {
    /// Builds the store on the application's own `sqlx::PgPool`: the pool's settings (size,
    /// timeouts, TLS through `PgConnectOptions::ssl_mode` and sqlx's `tls-rustls` or
    /// `tls-native-tls` feature) apply; the config's pool settings are ignored. Migrates or
    /// checks the schema and reads the isolation level as [`PostgresStore::from_pool`] does.
    /// To pin READ COMMITTED on the pool's connections, give sqlx the startup option:
    /// `PgConnectOptions::options([("default_transaction_isolation", "read committed")])`.
    ///
    /// # Errors
    /// As [`PostgresStore::from_pool`], with [`Error::Sqlx`] for driver failures.
    pub async fn from_sqlx(pool: sqlx::PgPool, config: Config) -> Result<Self, Error> {
        Self::build(crate::driver::Sqlx(pool), config).await
    }

    /// [`PostgresStore::migrate`] on a `sqlx::PgPool`: the shipped migrations run through
    /// the application's pool, in one transaction under an advisory lock.
    ///
    /// # Errors
    /// As [`PostgresStore::migrate`], with [`Error::Sqlx`] for driver failures.
    pub async fn migrate_sqlx(pool: &sqlx::PgPool, config: &Config) -> Result<usize, Error> {
        validate_schema(&config.schema)?;
        crate::driver::Sqlx(pool.clone()).migrate(&config.schema).await
    }

    /// The pool (shared with every clone of this store).
    #[must_use]
    pub fn pool(&self) -> &sqlx::PgPool {
        &self.inner.driver.0
    }

    /// [`PostgresStore::complete_in`] for a sqlx transaction: the handler's rows and the
    /// stored response commit together, or neither does. Roll back on any error.
    ///
    /// `tx` must run at READ COMMITTED, as for the deadpool `complete_in` (and for the same
    /// reason: the lease renewal updates the record while the handler runs); where a role
    /// or database defaults higher, start it with
    /// `pool.begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")`.
    ///
    /// # Errors
    /// [`StoreError::LeaseLost`]; [`StoreError::Unavailable`] for a driver failure, or
    /// wrapping [`Error::IsolationNotSupported`] when `tx` runs above READ COMMITTED.
    pub async fn complete_in(
        &self,
        tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Record, StoreError> {
        const OP: &str = "completing a record in the caller's transaction";
        let bytes = encode_response(&response);
        let params = complete_params(&id, token, &bytes, self.pinned_now());
        let conn: &mut sqlx::PgConnection = tx;
        let row = crate::driver::sqlx_query_opt(conn, self.inner.sql.complete_in(), &params, self.inner.protocol)
            .await
            .map_err(Error::sqlx(OP))?;
        match completed_in(row)? {
            Some(row) => record_at(&row, 1, Some(response)),
            None => {
                let current = crate::driver::sqlx_query_opt(
                    conn,
                    self.inner.sql.read(),
                    &read_params(&id, self.pinned_now()),
                    self.inner.protocol,
                )
                .await
                .map_err(Error::sqlx(OP))?;
                Err(lease_lost_in(id, token, current.as_ref())?)
            }
        }
    }
}

fn complete_params<'a>(id: &'a RecordId, token: FencingToken, bytes: &'a [u8], now: Option<i64>) -> [Param<'a>; 4] {
    [Param::Bytes(&id.0), Param::I64(token_param(token)), Param::Bytes(bytes), Param::OptI64(now)]
}

fn read_params(id: &RecordId, now: Option<i64>) -> [Param<'_>; 2] {
    [Param::Bytes(&id.0), Param::OptI64(now)]
}

/// The row of [`Statements::complete_in`] when it completed the record (the record's
/// columns start at 1), `None` when the compare-and-set matched nothing, or the refusal of
/// a transaction above READ COMMITTED (the statement then wrote nothing).
fn completed_in(row: Option<Row>) -> Result<Option<Row>, StoreError> {
    let row = row.ok_or_else(|| corrupt(None, "row", "the statement returned no row"))?;
    let level = row.text(0)?;
    if !COMPLETE_IN_LEVELS.contains(&level) {
        return Err(Error::IsolationNotSupported { level: level.to_owned() }.into());
    }
    Ok(row.opt_bytes(1)?.is_some().then_some(row))
}

/// `LeaseLost` from the read that followed a refused completion in a caller's transaction.
fn lease_lost_in(id: RecordId, token: FencingToken, current: Option<&Row>) -> Result<StoreError, StoreError> {
    let current = match current {
        Some(row) if row.opt_bytes(0)?.is_some() => Some(record_at(row, 0, None)?.token),
        _ => None,
    };
    Ok(StoreError::LeaseLost { id, presented: token, current })
}

impl<D: Driver> PostgresStore<D> {
    async fn build(driver: D, config: Config) -> Result<Self, Error> {
        validate_schema(&config.schema)?;
        let sql = Statements::for_schema(&config.schema);
        let protocol = if config.prepared_statements { Protocol::Prepared } else { Protocol::Unnamed };
        if config.auto_migrate {
            driver.migrate(&config.schema).await?;
        } else {
            driver.check_migrated(&config.schema).await?;
        }
        const OP: &str = "reading the isolation level";
        let mut conn = Some(driver.acquire(OP).await?);
        let row = D::query_opt(&mut conn, OP, "SELECT current_setting('transaction_isolation')", &[], protocol).await?;
        let isolation = row.and_then(|r| r.text(0).ok().map(str::to_owned)).unwrap_or_default();
        if isolation != "read committed" {
            tracing::warn!(
                isolation = %isolation, schema = %config.schema,
                "idem-postgres: the pool's connections run at {isolation:?}, not READ COMMITTED; the store stays correct \
                 (claims of live records write nothing and serialization failures are retried) but contended records \
                 cost retries. Pin READ COMMITTED on the pool's connections (startup option \
                 `-c default_transaction_isolation=read\\ committed`) where you can."
            );
        }
        drop(conn);
        // The settings this store runs on (docs/observability.md).
        tracing::info!(
            backend = "postgres",
            schema = %config.schema,
            schema_version = crate::sql::KNOWN_VERSION,
            isolation = %isolation,
            prepared_statements = config.prepared_statements,
            auto_migrate = config.auto_migrate,
            server_clock = config.clock.is_none(),
            "idem-postgres: store settings"
        );
        Ok(Self {
            inner: Arc::new(Inner { driver, schema: config.schema, clock: config.clock, sql, protocol, isolation }),
        })
    }

    /// The schema name.
    #[must_use]
    pub fn schema(&self) -> &str {
        &self.inner.schema
    }

    /// The SQL this store runs.
    #[must_use]
    pub fn statements(&self) -> &Statements {
        &self.inner.sql
    }

    /// `transaction_isolation` of a pooled connection when the store was built, as
    /// PostgreSQL spells it (`read committed`, `repeatable read`, `serializable`). The
    /// store assumes nothing about it: see the crate docs, "Isolation".
    #[must_use]
    pub fn isolation(&self) -> &str {
        &self.inner.isolation
    }

    /// The pinned time, or `None` to use the server's clock.
    fn pinned_now(&self) -> Option<i64> {
        self.inner.clock.as_ref().map(|c| c.now().0)
    }

    /// Runs `sql` (one statement, its own implicit transaction) and returns at most one
    /// row, leaving the connection in `conn` for a follow-up statement (or taking one when
    /// `conn` is empty). A serialization failure or deadlock (SQLSTATE 40001, 40P01; under
    /// REPEATABLE READ or SERIALIZABLE a row changed after the statement's snapshot) rolled
    /// the statement back whole, so it runs again, with a fresh snapshot, a few times.
    async fn run(
        &self,
        conn: &mut Option<D::Conn>,
        operation: &'static str,
        sql: &str,
        params: &[Param<'_>],
    ) -> Result<Option<Row>, StoreError> {
        let mut attempt: u32 = 0;
        loop {
            if conn.is_none() {
                *conn = Some(self.inner.driver.acquire(operation).await?);
            }
            match D::query_opt(conn, operation, sql, params, self.inner.protocol).await {
                Ok(row) => return Ok(row),
                Err(e) if e.is_serialization_failure() && attempt < SERIALIZATION_RETRIES => {
                    attempt += 1;
                    tokio::time::sleep(Duration::from_millis(u64::from(attempt * attempt))).await;
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// The live record and the store's `now`.
    async fn read(
        &self,
        conn: &mut Option<D::Conn>,
        id: RecordId,
        now: Option<i64>,
    ) -> Result<(Option<Record>, UnixMillis), StoreError> {
        const OP: &str = "reading a record";
        let row = self.run(conn, OP, self.inner.sql.read(), &read_params(&id, now)).await?;
        let row = row.ok_or_else(|| corrupt(Some(id), "row", "the statement returned no row"))?;
        let now = UnixMillis(row.i64(COLUMNS.len())?);
        let record = if row.opt_bytes(0)?.is_some() { Some(record_at(&row, 0, None)?) } else { None };
        Ok((record, now))
    }

    /// The journal entry `name` of the live record's current generation.
    async fn journal_read(
        &self,
        conn: &mut Option<D::Conn>,
        id: RecordId,
        name: &str,
        now: Option<i64>,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        const OP: &str = "reading a journal entry";
        let params = [Param::Bytes(&id.0), Param::Bytes(name.as_bytes()), Param::OptI64(now)];
        let row = self.run(conn, OP, self.inner.sql.journal_get(), &params).await?;
        row.map(|row| row.bytes(0).map(<[u8]>::to_vec)).transpose()
    }

    /// Runs a compare-and-set `UPDATE` (`params` end with the pinned `now`). When it
    /// matches nothing, reads the record in a fresh statement and returns it as the state
    /// the CAS lost against.
    ///
    /// One case needs care for linearizability: the `UPDATE` finds rows through its
    /// statement snapshot, so a record inserted by a claim that committed after that
    /// snapshot is invisible to it but visible to the follow-up read. If the read shows a
    /// record this CAS would have applied to (`would_apply`, the pure model's rule), the
    /// miss was that race, not a real conflict, and the `UPDATE` runs again; reporting the
    /// read would describe an order of events that never happened (e.g. `LeaseLost` whose
    /// current token is the presented one). Otherwise the read is a valid outcome: the
    /// operation takes effect, as a no-op, at the read.
    async fn compare_and_set(
        &self,
        operation: &'static str,
        id: RecordId,
        sql: &str,
        params: &[Param<'_>],
        now: Option<i64>,
        would_apply: impl Fn(&Record, UnixMillis) -> bool,
    ) -> Result<Result<Row, (Option<Record>, UnixMillis)>, StoreError> {
        let mut conn = None;
        for _ in 0..CAS_ATTEMPTS {
            if let Some(row) = self.run(&mut conn, operation, sql, params).await? {
                return Ok(Ok(row));
            }
            match self.read(&mut conn, id, now).await? {
                (Some(r), read_now) if would_apply(&r, read_now) => {}
                (current, read_now) => return Ok(Err((current, read_now))),
            }
        }
        Err(Error::Contention { operation }.into())
    }
}

/// How often a compare-and-set runs again after losing only to a claim its snapshot could
/// not see (see [`PostgresStore::compare_and_set`]). One retry is enough unless the
/// record is replaced again and again in the same milliseconds.
const CAS_ATTEMPTS: usize = 4;

/// How often a statement runs again after a serialization failure or deadlock (40001,
/// 40P01), waiting 1, 4, 9, ... ms in between.
const SERIALIZATION_RETRIES: u32 = 8;

/// Whether `token` is the live record's current in-flight claim (the rule complete and fail
/// check; the read already excludes expired records).
fn owns(r: &Record, token: FencingToken) -> bool {
    r.state == RecordState::InFlight && r.token == token
}

#[async_trait]
impl<D: Driver> Store for PostgresStore<D> {
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        const OP: &str = "claiming a record";
        let now = self.pinned_now();
        let mut conn = None;
        let params = [
            Param::Bytes(&req.id.0),
            Param::Bytes(req.scope.principal.0.as_bytes()),
            Param::Bytes(req.scope.endpoint.0.as_bytes()),
            Param::Text(req.key.as_str()),
            Param::Bytes(&req.fingerprint.0),
            Param::I64(req.lease_ms()),
            Param::I64(req.retention_ms()),
            Param::OptI64(now),
        ];
        for _ in 0..CAS_ATTEMPTS {
            // One row: the claim (inserted or replaced), or the live record as the
            // statement's snapshot saw it; no row when the live record was committed after
            // that snapshot (then a fresh read finds it).
            if let Some(row) = self.run(&mut conn, OP, self.inner.sql.claim(), &params).await? {
                let claimed = row.bool(1)?;
                let record = record_at(&row, 2, None)?;
                if claimed {
                    return Ok(ClaimOutcome::Claimed(record));
                }
                let now = UnixMillis(row.i64(2 + COLUMNS.len())?);
                return Ok(ClaimOutcome::Existing { record, now });
            }
            if let (Some(record), now) = self.read(&mut conn, req.id, now).await? {
                return Ok(ClaimOutcome::Existing { record, now });
            }
            // Gone again (expired or swept) between the two statements: claim again.
        }
        Err(Error::Contention { operation: OP }.into())
    }

    async fn reclaim(&self, req: ReclaimRequest) -> Result<ReclaimOutcome, StoreError> {
        let now = self.pinned_now();
        let params = [
            Param::Bytes(&req.id.0),
            Param::I64(token_param(req.expected)),
            Param::Bytes(&req.fingerprint.0),
            Param::I64(req.lease_ms()),
            Param::I64(req.retention_ms()),
            Param::OptI64(now),
        ];
        let outcome = self
            .compare_and_set("reclaiming a record", req.id, self.inner.sql.reclaim(), &params, now, |r, now| {
                is_reclaimable(r, &req, now)
            })
            .await?;
        match outcome {
            Ok(row) => Ok(ReclaimOutcome::Reclaimed(record_at(&row, 0, None)?)),
            Err((current, now)) => Ok(ReclaimOutcome::Conflict { current, now }),
        }
    }

    async fn complete(
        &self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Record, StoreError> {
        let now = self.pinned_now();
        let bytes = encode_response(&response);
        let params = complete_params(&id, token, &bytes, now);
        let outcome = self
            .compare_and_set("completing a record", id, self.inner.sql.complete(), &params, now, |r, _| owns(r, token))
            .await?;
        match outcome {
            Ok(row) => record_at(&row, 0, Some(response)),
            Err((current, _)) => Err(StoreError::LeaseLost { id, presented: token, current: current.map(|r| r.token) }),
        }
    }

    async fn extend(&self, id: RecordId, token: FencingToken, lease_ttl: Duration) -> Result<Record, StoreError> {
        let now = self.pinned_now();
        let params = [
            Param::Bytes(&id.0),
            Param::I64(token_param(token)),
            Param::I64(duration_ms(lease_ttl)),
            Param::OptI64(now),
        ];
        let outcome = self
            .compare_and_set("extending a lease", id, self.inner.sql.extend(), &params, now, |r, _| owns(r, token))
            .await?;
        match outcome {
            Ok(row) => record_at(&row, 0, None),
            Err((current, _)) => Err(StoreError::LeaseLost { id, presented: token, current: current.map(|r| r.token) }),
        }
    }

    async fn fail(&self, id: RecordId, token: FencingToken) -> Result<Record, StoreError> {
        let now = self.pinned_now();
        let params = [Param::Bytes(&id.0), Param::I64(token_param(token)), Param::OptI64(now)];
        let outcome = self
            .compare_and_set("marking a record failed", id, self.inner.sql.fail(), &params, now, |r, _| owns(r, token))
            .await?;
        match outcome {
            Ok(row) => record_at(&row, 0, None),
            Err((current, _)) => Err(StoreError::LeaseLost { id, presented: token, current: current.map(|r| r.token) }),
        }
    }

    async fn get(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        Ok(self.read(&mut None, id, self.pinned_now()).await?.0)
    }

    async fn sweep(&self, limit: usize) -> Result<SweepOutcome, StoreError> {
        const OP: &str = "sweeping expired records";
        let now = self.pinned_now();
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let probe = limit.saturating_add(1);
        let params = [Param::I64(limit), Param::I64(probe), Param::OptI64(now)];
        let row = self.run(&mut None, OP, self.inner.sql.sweep(), &params).await?;
        let row = row.ok_or_else(|| corrupt(None, "row", "the statement returned no row"))?;
        let removed = row.i64(0)?;
        let found = row.i64(1)?;
        Ok(SweepOutcome { removed: u64::try_from(removed).unwrap_or(0), more: found > removed })
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities { backend: "postgres", server_clock: true, shared: true, journal: true, list: true, ..Capabilities::NONE }
    }

    /// One statement per record on one pooled connection, each the next matching id after
    /// the last (see `sql::list_statement`), up to one past the limit (that one only says
    /// `more`). Every statement runs at the first one's `now` (the pinned clock or the
    /// server's), so liveness and age in one page are judged at one instant.
    async fn list(&self, filter: ListFilter) -> Result<Listing, StoreError> {
        const OP: &str = "listing records";
        let mut conn = None;
        let state = filter.state.map_or("", RecordState::as_str);
        let principal = filter.principal.as_ref().map_or(&[][..], |p| p.0.as_bytes());
        let mut cursor: Vec<u8> = filter.after.map_or_else(Vec::new, |id| id.0.to_vec());
        let mut page = Vec::new();
        let mut first_now = None;
        let mut more = false;
        let sql = crate::sql::list_statement(&self.inner.schema);
        loop {
            let now = first_now.map(|n: UnixMillis| n.0).or(self.pinned_now());
            let params = [
                Param::Bytes(&cursor),
                Param::Text(state),
                Param::OptI64(filter.started_before.map(|t| t.0)),
                Param::Bool(filter.principal.is_some()),
                Param::Bytes(principal),
                Param::OptI64(now),
            ];
            let row = self.run(&mut conn, OP, &sql, &params).await?;
            let row = row.ok_or_else(|| corrupt(None, "row", "the statement returned no row"))?;
            first_now.get_or_insert(UnixMillis(row.i64(COLUMNS.len())?));
            if row.opt_bytes(0)?.is_none() {
                break;
            }
            if page.len() == filter.limit {
                more = true;
                break;
            }
            let record = record_at(&row, 0, None)?;
            cursor = record.id.0.to_vec();
            page.push(record);
        }
        let now = first_now.unwrap_or(UnixMillis(0));
        Ok(Listing::new(now, page, more))
    }

    async fn journal_put(
        &self,
        id: RecordId,
        token: FencingToken,
        name: &str,
        value: Vec<u8>,
        overwrite: bool,
    ) -> Result<JournalWrite, StoreError> {
        const OP: &str = "writing a journal entry";
        let now = self.pinned_now();
        let mut conn = None;
        let params = [
            Param::Bytes(&id.0),
            Param::I64(token_param(token)),
            Param::Bytes(name.as_bytes()),
            Param::Bytes(&value),
            Param::Bool(overwrite),
            Param::OptI64(now),
        ];
        for _ in 0..CAS_ATTEMPTS {
            let row = self.run(&mut conn, OP, self.inner.sql.journal_put(), &params).await?;
            let row = row.ok_or_else(|| corrupt(Some(id), "row", "the statement returned no row"))?;
            let owned = row.bool(0)?;
            let written = row.bool(1)?;
            if written {
                return Ok(JournalWrite::Written);
            }
            if owned {
                if let Some(v) = row.opt_bytes(2)? {
                    return Ok(JournalWrite::Exists(v.to_vec()));
                }
                // The entry that won was inserted by a put that committed after this
                // statement's snapshot: read it with a fresh one.
                if let Some(v) = self.journal_read(&mut conn, id, name, now).await? {
                    return Ok(JournalWrite::Exists(v));
                }
                continue;
            }
            // Not the owner, or the record was claimed after this statement's snapshot
            // (then the put runs again rather than report a refusal no order explains).
            match self.read(&mut conn, id, now).await?.0 {
                Some(r) if owns(&r, token) => {}
                current => {
                    return Err(StoreError::LeaseLost { id, presented: token, current: current.map(|r| r.token) });
                }
            }
        }
        Err(Error::Contention { operation: OP }.into())
    }

    async fn journal_get(&self, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.journal_read(&mut None, id, name, self.pinned_now()).await
    }
}
