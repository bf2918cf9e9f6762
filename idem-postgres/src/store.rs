//! [`PostgresStore`]: the [`Store`] contract as single SQL statements on a `sqlx::PgPool`.
//! The statements themselves, and why each is atomic, are in `src/sql.rs`.

use std::str::FromStr as _;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use idem_core::codec::encode_response;
use idem_core::time::duration_ms;
use idem_core::transition::is_reclaimable;
use idem_core::{
    Capabilities, ClaimOutcome, ClaimRequest, Clock, FencingToken, JournalWrite, ListFilter, Listing, Receipt,
    ReclaimOutcome, ReclaimRequest, Record, RecordId, RecordState, Settlements, Store, StoreError, StoredResponse,
    SweepOutcome, UnixMillis,
};
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions, PgRow};
use sqlx::{PgConnection, PgPool, Postgres};

use crate::config::Config;
use crate::error::{Error, is_session_lost};
use crate::sql::{
    COLUMNS, COMPLETE_IN_LEVELS, Columns, NOTIFY, Param, Statement, Statements, corrupt, query, receipt_at, record_at,
    token_param, validate_schema,
};

/// An idempotency [`Store`] in one PostgreSQL table, on a `sqlx::PgPool`. Cheap to clone
/// (shares the pool).
///
/// Every operation is one statement in its own implicit transaction (two on a lost
/// compare-and-set: the refusal is read in a fresh statement), so row locks give the
/// contract's atomicity and no transaction is held open across the handler; a call holds a
/// pooled connection for that statement only. The statements, and what each guarantees,
/// are in `docs/contract.md#postgresql` and [`PostgresStore::sql`]. A statement rolled
/// back by a serialization failure or deadlock (40001, 40P01) runs again, with a fresh
/// snapshot, up to 8 times (1, 4, 9, ... ms apart). A connection whose session died is
/// closed rather than returned to the pool.
#[derive(Clone, Debug)]
pub struct PostgresStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    pool: PgPool,
    clock: Option<Arc<dyn Clock>>,
    sql: Statements,
    prepared: bool,
    /// The schema, the channel completions and failures notify ([`Config::with_listen`]);
    /// `None` when off.
    channel: Option<String>,
    settlements: Arc<Settlements>,
    /// The task holding the `LISTEN` connection, once a waiter started it; ends with the store.
    listener: OnceLock<tokio::task::JoinSet<()>>,
}

/// How often a compare-and-set runs again after losing only to a claim its snapshot could
/// not see (see [`PostgresStore::compare_and_set`]).
const CAS_ATTEMPTS: usize = 4;

/// How often a statement runs again after a serialization failure or deadlock.
const SERIALIZATION_RETRIES: u32 = 8;

/// A pooled connection kept for a follow-up statement, or none yet.
type Slot = Option<PoolConnection<Postgres>>;

impl PostgresStore {
    /// Connects to `url` (`postgres://user@host:port/db?...`) with a pool of its own:
    /// [`Config::with_max_connections`] connections, [`Config::with_acquire_timeout`] to
    /// get one, `application_name=idem-postgres` unless the URL sets one, and READ
    /// COMMITTED pinned ([`Config::with_isolation_pin`]). TLS follows the URL's `sslmode`
    /// (`prefer` by default; `require`, `verify-ca`, `verify-full` with `sslrootcert`), with
    /// the TLS library the application enables on sqlx (`tls-rustls` or `tls-native-tls`).
    /// The pool does not ping a connection before lending it (a round trip per statement
    /// saved); a connection that died while idle costs one retryable error. Then migrates
    /// or checks the schema as [`PostgresStore::from_pool`] does.
    ///
    /// # Errors
    /// [`Error::InvalidSchema`], [`Error::InvalidUrl`], [`Error::Connection`] when the
    /// server cannot be reached within the acquire timeout (retryable), and those of
    /// [`PostgresStore::from_pool`].
    pub async fn connect(url: &str, config: Config) -> Result<Self, Error> {
        validate_schema(&config.schema)?;
        let mut options = PgConnectOptions::from_str(url).map_err(Error::InvalidUrl)?;
        if options.get_application_name().is_none() {
            options = options.application_name("idem-postgres");
        }
        if config.isolation_pin {
            // After the URL's own `options`, so it wins over a level they set.
            options = options.options([("default_transaction_isolation", "read\\ committed")]);
        }
        let pool = PgPoolOptions::new()
            .max_connections(u32::try_from(config.max_connections).unwrap_or(u32::MAX))
            .acquire_timeout(config.acquire_timeout)
            .test_before_acquire(false)
            .connect_lazy_with(options);
        Self::from_pool(pool, config).await
    }

    /// Builds the store on the application's own pool, whose settings (size, timeouts,
    /// TLS) apply; the config's pool settings are ignored. Applies the missing migrations
    /// ([`PostgresStore::migrate`]), or with [`Config::with_auto_migrate`] off checks that
    /// none is missing. Reads the pool's isolation level and logs a warning when it is not
    /// READ COMMITTED; to pin it on the pool's connections:
    /// `PgConnectOptions::options([("default_transaction_isolation", "read\\ committed")])`.
    ///
    /// # Errors
    /// [`Error::InvalidSchema`]; [`Error::Connection`] when no connection opens
    /// (retryable); [`Error::NotMigrated`]; [`Error::SchemaTooNew`]; [`Error::Postgres`]
    /// when a migration fails (e.g. no `CREATE` privilege).
    pub async fn from_pool(pool: PgPool, config: Config) -> Result<Self, Error> {
        validate_schema(&config.schema)?;
        if config.auto_migrate {
            crate::sql::migrate(&pool, &config.schema).await?;
        } else {
            crate::sql::check_migrated(&pool, &config.schema).await?;
        }
        const OP: &str = "reading the isolation level";
        let mut conn = pool.acquire().await.map_err(Error::connection(OP))?;
        let row = query(&mut conn, "SELECT current_setting('transaction_isolation')", &[], false).await;
        let isolation: String = row
            .and_then(|r| r.map(|r| sqlx::Row::try_get(&r, 0)).transpose())
            .map_err(Error::postgres(OP))?
            .unwrap_or_default();
        drop(conn);
        if isolation != "read committed" {
            tracing::warn!(
                isolation = %isolation, schema = %config.schema,
                "idem-postgres: the pool's connections run at {isolation:?}, not READ COMMITTED; the store stays correct \
                 (claims of live records write nothing and serialization failures are retried) but contended records \
                 cost retries. Pin READ COMMITTED on the pool's connections (startup option \
                 `-c default_transaction_isolation=read\\ committed`) where you can."
            );
        }
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
        let sql = Statements::new(&config.schema, config.listen);
        let (prepared, channel) = (config.prepared_statements, config.listen.then_some(config.schema));
        let inner = Inner {
            pool,
            clock: config.clock,
            sql,
            prepared,
            channel,
            settlements: Arc::default(),
            listener: OnceLock::new(),
        };
        Ok(Self { inner: Arc::new(inner) })
    }

    /// Applies the missing shipped migrations (`migrations/*.sql`) to `config`'s schema on
    /// `pool`, in one transaction under an advisory lock: idempotent, safe from several
    /// processes at once, and runnable by a deploy step before any store exists. Returns
    /// how many ran.
    ///
    /// # Errors
    /// [`Error::InvalidSchema`], [`Error::Connection`], [`Error::Postgres`] (e.g. no
    /// `CREATE` privilege), or [`Error::SchemaTooNew`] when a newer build migrated it.
    pub async fn migrate(pool: &PgPool, config: &Config) -> Result<usize, Error> {
        validate_schema(&config.schema)?;
        crate::sql::migrate(pool, &config.schema).await
    }

    /// The pool (shared with every clone of this store), e.g. to begin the handler's
    /// transaction for [`PostgresStore::complete_in`].
    #[must_use]
    pub fn pool(&self) -> &PgPool {
        &self.inner.pool
    }

    /// The text of `statement` as this store sends it (its schema filled in).
    #[must_use]
    pub fn sql(&self, statement: Statement) -> &str {
        &self.inner.sql[statement]
    }

    /// Completes the record inside the caller's transaction (`&mut tx` of a
    /// `sqlx::Transaction<'_, Postgres>`, or any `&mut PgConnection`): the handler's rows
    /// and the stored response commit together, or neither does. The compare-and-set of
    /// [`Store::complete`] locks the record's row until the transaction ends, so no retry
    /// can reclaim it before the commit. Roll back on any error: [`StoreError::LeaseLost`]
    /// means another attempt owns the record now. What each completion mode guarantees
    /// across a crash: `docs/operations.md#completion-in-the-handlers-transaction`.
    ///
    /// The transaction must run at READ COMMITTED (where a role or database defaults
    /// higher: `pool.begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")`): the lease
    /// renewal updates the record while the handler runs, and a REPEATABLE READ or
    /// SERIALIZABLE snapshot from before a renewal cannot update the row. Above READ
    /// COMMITTED the completion is refused every time, in the same statement and before it
    /// touches the row.
    ///
    /// # Errors
    /// [`StoreError::LeaseLost`]; [`StoreError::Unavailable`] for a driver failure, or, not
    /// retryable, wrapping [`Error::IsolationNotSupported`].
    pub async fn complete_in(
        &self,
        tx: &mut PgConnection,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Receipt, StoreError> {
        const OP: &str = "completing a record in the caller's transaction";
        let bytes = encode_response(&response);
        let params = complete_params(&id, token, &bytes, self.pinned_now());
        let row = query(tx, &self.inner.sql[Statement::CompleteIn], &params, self.inner.prepared).await;
        let row = row.map_err(Error::postgres(OP))?.ok_or_else(|| corrupt(None, "row", "no row"))?;
        let level: &str = Columns::of(&row).get(0, "isolation")?;
        if !COMPLETE_IN_LEVELS.contains(&level) {
            return Err(Error::IsolationNotSupported { level: level.to_owned() }.into());
        }
        if Columns::of(&row).bytes(1, "id")?.is_some() {
            return receipt_at(&row, 1, id);
        }
        let params = [Param::Bytes(id.as_bytes()), Param::OptI64(self.pinned_now())];
        let current = query(tx, &self.inner.sql[Statement::Read], &params, self.inner.prepared).await;
        let current = match current.map_err(Error::postgres(OP))? {
            Some(row) if Columns::of(&row).bytes(0, "id")?.is_some() => Some(record_at(&row, 0)?.token),
            _ => None,
        };
        Err(StoreError::LeaseLost { id, presented: token, current })
    }

    /// Wakes `id`'s waiters in every listening store ([`Config::with_listen`]): `NOTIFY` in a
    /// transaction of its own after the write's, so the write's commit does not hold the
    /// lock PostgreSQL serializes notifying commits with; a notification lost with it costs
    /// a waiter its poll pause.
    async fn settled(&self, id: RecordId) {
        let Some(channel) = &self.inner.channel else { return };
        if let Ok(mut conn) = self.inner.pool.acquire().await {
            let params = [Param::Text(channel), Param::Text(&id.to_hex())];
            let _ = query(&mut conn, NOTIFY, &params, self.inner.prepared).await;
        }
    }

    /// The pinned time, or `None` to use the server's clock.
    fn pinned_now(&self) -> Option<i64> {
        self.inner.clock.as_ref().map(|c| c.now().0)
    }

    /// Runs `statement` (one statement, its own implicit transaction) and returns at most
    /// one row, leaving the connection in `conn` for a follow-up statement. A serialization
    /// failure or deadlock rolled the statement back whole, so it runs again.
    async fn run(
        &self,
        conn: &mut Slot,
        operation: &'static str,
        statement: Statement,
        params: &[Param<'_>],
    ) -> Result<Option<PgRow>, StoreError> {
        let mut attempt: u32 = 0;
        loop {
            let c = match conn.take() {
                Some(c) => c,
                None => self.inner.pool.acquire().await.map_err(Error::connection(operation))?,
            };
            let c = conn.insert(c);
            let e = match query(c, &self.inner.sql[statement], params, self.inner.prepared).await {
                Ok(row) => return Ok(row),
                Err(e) => e,
            };
            if is_session_lost(&e) {
                // Closed rather than returned: the next call opens a fresh one.
                c.close_on_drop();
                *conn = None;
            }
            let e = Error::postgres(operation)(e);
            if !e.is_serialization_failure() || attempt >= SERIALIZATION_RETRIES {
                return Err(e.into());
            }
            attempt += 1;
            tokio::time::sleep(Duration::from_millis(u64::from(attempt * attempt))).await;
        }
    }

    /// The live record and the store's `now`.
    async fn read(
        &self,
        conn: &mut Slot,
        id: RecordId,
        now: Option<i64>,
    ) -> Result<(Option<Record>, UnixMillis), StoreError> {
        let params = [Param::Bytes(id.as_bytes()), Param::OptI64(now)];
        let row = self.run(conn, "reading a record", Statement::Read, &params).await?;
        let row = row.ok_or_else(|| corrupt(Some(id), "row", "the statement returned no row"))?;
        let now = UnixMillis(Columns::of(&row).get(COLUMNS.len(), "now")?);
        let record = if Columns::of(&row).bytes(0, "id")?.is_some() { Some(record_at(&row, 0)?) } else { None };
        Ok((record, now))
    }

    /// The journal entry `name` of the live record's current generation.
    async fn journal_read(
        &self,
        conn: &mut Slot,
        id: RecordId,
        name: &str,
        now: Option<i64>,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        let params = [Param::Bytes(id.as_bytes()), Param::Bytes(name.as_bytes()), Param::OptI64(now)];
        let row = self.run(conn, "reading a journal entry", Statement::JournalGet, &params).await?;
        Ok(match &row {
            Some(row) => Some(Columns::of(row).some_bytes(0, "value")?.into_owned()),
            None => None,
        })
    }

    /// Runs a compare-and-set `UPDATE` (`params` end with the pinned `now`). When it
    /// matches nothing, reads the record in a fresh statement and returns it as the state
    /// the CAS lost against.
    ///
    /// The `UPDATE` finds rows through its statement snapshot, so a record inserted by a
    /// claim that committed after that snapshot is invisible to it but visible to the
    /// follow-up read. If the read shows a record this CAS would have applied to
    /// (`would_apply`, the pure model's rule), the miss was that race, not a conflict, and
    /// the `UPDATE` runs again: reporting the read would describe an order of events that
    /// never happened (e.g. `LeaseLost` whose current token is the presented one).
    async fn compare_and_set(
        &self,
        operation: &'static str,
        id: RecordId,
        statement: Statement,
        params: &[Param<'_>],
        would_apply: impl Fn(&Record, UnixMillis) -> bool,
    ) -> Result<Result<PgRow, (Option<Record>, UnixMillis)>, StoreError> {
        // The follow-up read runs at the statement's pinned time (its last parameter).
        let now = match params.last() {
            Some(Param::OptI64(now)) => *now,
            _ => None,
        };
        let mut conn = None;
        for _ in 0..CAS_ATTEMPTS {
            if let Some(row) = self.run(&mut conn, operation, statement, params).await? {
                return Ok(Ok(row));
            }
            match self.read(&mut conn, id, now).await? {
                (Some(r), read_now) if would_apply(&r, read_now) => {}
                (current, read_now) => return Ok(Err((current, read_now))),
            }
        }
        Err(Error::Contention { operation }.into())
    }

    /// `LeaseLost`, or the receipt, of a compare-and-set that takes the current claim's token.
    async fn fenced(
        &self,
        operation: &'static str,
        id: RecordId,
        token: FencingToken,
        statement: Statement,
        params: &[Param<'_>],
    ) -> Result<Receipt, StoreError> {
        match self.compare_and_set(operation, id, statement, params, |r, _| owns(r, token)).await? {
            Ok(row) => receipt_at(&row, 0, id),
            Err((current, _)) => Err(StoreError::LeaseLost { id, presented: token, current: current.map(|r| r.token) }),
        }
    }
}

/// Wakes `hub`'s waiters from `LISTEN channel` on one connection outside the store's pool
/// (a waiter never holds up a statement), connecting again after a loss; a notification
/// sent meanwhile is lost, and its waiter reads at the end of its pause.
async fn listen(pool: PgPool, channel: String, hub: Arc<Settlements>) {
    let options = (*pool.connect_options()).clone();
    let own = PgPoolOptions::new().max_connections(1).idle_timeout(None).max_lifetime(None).connect_lazy_with(options);
    loop {
        if let Ok(mut listener) = PgListener::connect_with(&own).await
            && listener.listen(&channel).await.is_ok()
        {
            while let Ok(n) = listener.recv().await {
                if let Some(id) = RecordId::from_hex(n.payload()) {
                    hub.settle(id);
                }
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

fn complete_params<'a>(id: &'a RecordId, token: FencingToken, bytes: &'a [u8], now: Option<i64>) -> [Param<'a>; 4] {
    [Param::Bytes(id.as_bytes()), Param::I64(token_param(token)), Param::Bytes(bytes), Param::OptI64(now)]
}

/// Whether `token` is the live record's current in-flight claim (the rule complete, extend,
/// fail and journal writes check; the read already excludes expired records).
fn owns(r: &Record, token: FencingToken) -> bool {
    r.state == RecordState::InFlight && r.token == token
}

#[async_trait]
impl Store for PostgresStore {
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        const OP: &str = "claiming a record";
        let now = self.pinned_now();
        let mut conn = None;
        let (id, fingerprint) = (req.id(), req.fingerprint());
        let params = [
            Param::Bytes(id.as_bytes()),
            Param::Bytes(req.scope().principal.as_str().as_bytes()),
            Param::Bytes(req.scope().endpoint.as_str().as_bytes()),
            Param::Text(req.key().as_str()),
            Param::Bytes(fingerprint.as_bytes()),
            Param::I64(req.lease_ms()),
            Param::I64(req.retention_ms()),
            Param::OptI64(now),
        ];
        for _ in 0..CAS_ATTEMPTS {
            // The claim (inserted or replaced), or the live record as the statement's
            // snapshot saw it; no row when the live record was committed after that
            // snapshot (then a fresh read finds it).
            if let Some(row) = self.run(&mut conn, OP, Statement::Claim, &params).await? {
                let record = record_at(&row, 2)?;
                if Columns::of(&row).get(1, "claimed")? {
                    return Ok(ClaimOutcome::Claimed(record));
                }
                let now = UnixMillis(Columns::of(&row).get(2 + COLUMNS.len(), "now")?);
                return Ok(ClaimOutcome::Existing { record, now });
            }
            if let (Some(record), now) = self.read(&mut conn, id, now).await? {
                return Ok(ClaimOutcome::Existing { record, now });
            }
            // Gone again (expired or swept) between the two statements: claim again.
        }
        Err(Error::Contention { operation: OP }.into())
    }

    async fn reclaim(&self, req: ReclaimRequest) -> Result<ReclaimOutcome, StoreError> {
        let params = [
            Param::Bytes(req.id.as_bytes()),
            Param::I64(token_param(req.expected)),
            Param::Bytes(req.fingerprint.as_bytes()),
            Param::I64(req.lease_ms()),
            Param::I64(req.retention_ms()),
            Param::OptI64(self.pinned_now()),
        ];
        let reclaimable = |r: &Record, now| is_reclaimable(r, &req, now);
        match self.compare_and_set("reclaiming a record", req.id, Statement::Reclaim, &params, reclaimable).await? {
            Ok(row) => Ok(ReclaimOutcome::Reclaimed(record_at(&row, 0)?)),
            Err((current, now)) => Ok(ReclaimOutcome::Conflict { current, now }),
        }
    }

    async fn complete(
        &self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Receipt, StoreError> {
        let bytes = encode_response(&response);
        let params = complete_params(&id, token, &bytes, self.pinned_now());
        let receipt = self.fenced("completing a record", id, token, Statement::Complete, &params).await?;
        self.settled(id).await;
        Ok(receipt)
    }

    async fn extend(&self, id: RecordId, token: FencingToken, lease_ttl: Duration) -> Result<Receipt, StoreError> {
        let params = [
            Param::Bytes(id.as_bytes()),
            Param::I64(token_param(token)),
            Param::I64(duration_ms(lease_ttl)),
            Param::OptI64(self.pinned_now()),
        ];
        self.fenced("extending a lease", id, token, Statement::Extend, &params).await
    }

    async fn fail(&self, id: RecordId, token: FencingToken) -> Result<Receipt, StoreError> {
        let params = [Param::Bytes(id.as_bytes()), Param::I64(token_param(token)), Param::OptI64(self.pinned_now())];
        let receipt = self.fenced("marking a record failed", id, token, Statement::Fail, &params).await?;
        self.settled(id).await;
        Ok(receipt)
    }

    async fn get(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        Ok(self.read(&mut None, id, self.pinned_now()).await?.0)
    }

    async fn sweep(&self, limit: usize) -> Result<SweepOutcome, StoreError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let params = [Param::I64(limit), Param::I64(limit.saturating_add(1)), Param::OptI64(self.pinned_now())];
        let row = self.run(&mut None, "sweeping expired records", Statement::Sweep, &params).await?;
        let row = row.ok_or_else(|| corrupt(None, "row", "the statement returned no row"))?;
        let removed: i64 = Columns::of(&row).get(0, "removed")?;
        let found: i64 = Columns::of(&row).get(1, "found")?;
        Ok(SweepOutcome { removed: u64::try_from(removed).unwrap_or(0), more: found > removed })
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            backend: "postgres",
            server_clock: true,
            shared: true,
            journal: true,
            list: true,
            ..Capabilities::NONE
        }
    }

    /// One statement per record on one pooled connection, each the next matching id after
    /// the last, up to one past the limit (that one only says `more`). Every statement runs
    /// at the first one's `now`, so liveness and age in one page are judged at one instant.
    async fn list(&self, filter: ListFilter) -> Result<Listing, StoreError> {
        const OP: &str = "listing records";
        let mut conn = None;
        let state = filter.state.map_or("", RecordState::as_str);
        let principal = filter.principal.as_ref().map_or(&[][..], |p| p.as_str().as_bytes());
        let mut cursor: Vec<u8> = filter.after.map_or_else(Vec::new, |id| id.as_bytes().to_vec());
        let (mut page, mut first_now, mut more) = (Vec::new(), None, false);
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
            let row = self.run(&mut conn, OP, Statement::List, &params).await?;
            let row = row.ok_or_else(|| corrupt(None, "row", "the statement returned no row"))?;
            first_now.get_or_insert(UnixMillis(Columns::of(&row).get(COLUMNS.len(), "now")?));
            if Columns::of(&row).bytes(0, "id")?.is_none() {
                break;
            }
            if page.len() == filter.limit {
                more = true;
                break;
            }
            let record = record_at(&row, 0)?;
            cursor = record.id.as_bytes().to_vec();
            page.push(record);
        }
        Ok(Listing::new(first_now.unwrap_or(UnixMillis(0)), page, more))
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
            Param::Bytes(id.as_bytes()),
            Param::I64(token_param(token)),
            Param::Bytes(name.as_bytes()),
            Param::Bytes(&value),
            Param::Bool(overwrite),
            Param::OptI64(now),
        ];
        for _ in 0..CAS_ATTEMPTS {
            let row = self.run(&mut conn, OP, Statement::JournalPut, &params).await?;
            let row = row.ok_or_else(|| corrupt(Some(id), "row", "the statement returned no row"))?;
            let c = Columns { row: &row, id: Some(id) };
            if c.get(1, "written")? {
                return Ok(JournalWrite::Written);
            }
            if c.get(0, "owned")? {
                if let Some(v) = c.bytes(2, "existing")? {
                    return Ok(JournalWrite::Exists(v.into_owned()));
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

    /// Settled by `NOTIFY` on the schema's channel from every process on the database, heard
    /// by this store's `LISTEN` task, started on the first waiter's Tokio runtime; `None`
    /// with [`Config::with_listen`] off, or outside a runtime.
    fn settlements(&self) -> Option<&Settlements> {
        let (channel, runtime) = (self.inner.channel.as_ref()?, tokio::runtime::Handle::try_current().ok()?);
        self.inner.listener.get_or_init(|| {
            let mut task = tokio::task::JoinSet::new();
            let feed = listen(self.inner.pool.clone(), channel.clone(), Arc::clone(&self.inner.settlements));
            task.spawn_on(feed, &runtime);
            task
        });
        Some(&self.inner.settlements)
    }
}
