//! [`PostgresStore`]: the [`Store`] contract as single SQL statements.
//!
//! # Atomicity
//! Every operation is one statement in its own (implicit) transaction, so PostgreSQL's row
//! locks give the contract's atomicity; no transaction is ever held open across the
//! handler, and a dropped future can at worst leave a statement that either committed or
//! not.
//!
//! - **claim** is `INSERT ... ON CONFLICT (id) DO UPDATE SET col = CASE WHEN t.expires_at
//!   <= now THEN <new value> ELSE t.col END ... RETURNING`. With no row, the insert wins;
//!   with a row, `ON CONFLICT DO UPDATE` locks it and evaluates the `CASE` against its
//!   latest committed version (under READ COMMITTED the upsert always acts on the newest
//!   row, never on the statement's snapshot). A live row is rewritten with its own values
//!   and returned as `Existing`; a row past `expires_at` counts as absent and is replaced
//!   by the new claim with token + 1. Of N concurrent claims exactly one inserts or
//!   replaces; the rest wait on the row lock and then see the live winner. `DO NOTHING`
//!   would return no row on conflict, which is why it is not used. `RETURNING` cannot see
//!   the row as it was before the upsert, so "this call claimed" is read from the
//!   `claim_txid` column, which an insert or replacement sets to the writing transaction's
//!   `txid_current()` and a live hit leaves alone; `xmax = 0` tells an insert from a
//!   replacement. The price of returning the row in one statement is that a claim which
//!   finds a live record still writes one new row version (same values, so a HOT update
//!   that touches no index), reclaimed by page pruning and autovacuum.
//! - **reclaim**, **complete**, **fail** are `UPDATE ... WHERE id = $1 AND token = $2 AND
//!   <conditions> RETURNING ...`: compare-and-set on the fencing token. When the update
//!   matches nothing, a second statement reads the current row to build
//!   [`ReclaimOutcome::Conflict`] or [`StoreError::LeaseLost`]. That read is a separate
//!   statement on purpose: it takes a fresh snapshot, so it reports the record as it is
//!   after whichever concurrent write beat this one (a CTE in the same statement would
//!   read the statement's older snapshot). If that read shows a record the update would
//!   have applied to, the update missed only because a claim committed after its snapshot
//!   was taken; it runs again (a few times at most) rather than report an outcome no
//!   order of events explains. The model-based conformance test checks exactly this.
//! - **journal_put** is one statement: a CTE selects the parent record `FOR SHARE` where it
//!   is live, in flight and carries the token, and `INSERT ... SELECT FROM parent ON
//!   CONFLICT (id, name) DO UPDATE ... WHERE $overwrite OR <row of an older generation>`
//!   writes the entry; the statement returns whether the parent matched, whether it wrote,
//!   and the stored value. The share lock makes a reclaim, complete, fail or replacing
//!   claim of the record wait until the put commits, and a put that waited re-checks the
//!   owner on the row as committed. Slow paths take a second statement: when the parent
//!   did not match, a fresh read of the record builds `LeaseLost` (or, if the record turns
//!   out to be owned by the token after all, because its claim committed after the put's
//!   snapshot, the put runs again); when a first write lost to an entry committed after
//!   the snapshot, a fresh read returns it as `Exists`.
//! - **journal_get** joins the entry to its live record on `record_created_at =
//!   created_at`: entries of a replaced generation (a claim that replaced an expired
//!   record) are not returned. A replacing claim sets `created_at` to a `now` at or after
//!   the old `expires_at`, after which no entry of the old generation can be written, so
//!   equal `created_at` means the same generation.
//! - **sweep** deletes a bounded batch picked by `SELECT ... ORDER BY expires_at LIMIT n
//!   FOR UPDATE SKIP LOCKED`: a row a claim is replacing right now is skipped, not waited
//!   for, and the row lock means a sweep and a claim of one id leave the old record or the
//!   new claim, never a mix. `VACUUM` of the deleted rows is left to autovacuum.
//!
//! # Round trips
//! Each statement is prepared once per pooled connection (deadpool's statement cache) and
//! then runs as one round trip. A call takes a connection for one statement (two on the
//! lost-CAS path) and returns it at once. A connection whose session died (terminated
//! backend, server restart, broken socket) is detached from the pool rather than returned,
//! so the next call opens a fresh one instead of failing on the dead one.
//!
//! # Time
//! `now` is the server's `clock_timestamp()` in whole milliseconds, read once per statement
//! (every process sharing the database agrees on it). A test may pin time with
//! [`PostgresConfig::with_clock`]: its reading is passed as a parameter and used instead,
//! through `COALESCE($n, <server now>)`, so tests run the very statements production runs.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, RecyclingMethod, Runtime};
use idem_core::codec::CodecError;
use idem_core::transition::is_reclaimable;
use idem_core::{
    Capabilities, ClaimOutcome, ClaimRequest, Clock, Endpoint, FencingToken, Fingerprint, IdempotencyKey, JournalWrite,
    Principal, ReclaimOutcome, ReclaimRequest, Record, RecordId, RecordState, Scope, Store, StoreError, StoredResponse,
    SweepOutcome, UnixMillis,
};
use tokio_postgres::NoTls;
use tokio_postgres::types::ToSql;

use crate::error::{Error, is_session_lost, store_pg, store_pool};
use crate::schema::{DEFAULT_SCHEMA, quote_ident, validate_schema};

/// How a [`PostgresStore`] is set up. Built with `PostgresConfig::default()` and the
/// `with_*` methods.
#[derive(Clone, Debug)]
pub struct PostgresConfig {
    schema: String,
    clock: Option<Arc<dyn Clock>>,
    max_connections: usize,
    acquire_timeout: Duration,
    connect_timeout: Duration,
}

impl Default for PostgresConfig {
    fn default() -> Self {
        Self {
            schema: DEFAULT_SCHEMA.to_owned(),
            clock: None,
            max_connections: 16,
            acquire_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
        }
    }
}

impl PostgresConfig {
    /// The schema holding the `records` table (default `idem`). Checked when the store is
    /// built: lower-case ASCII letters, digits and `_`, at most 63 bytes, not `pg_*` (see
    /// [`crate::validate_schema`]). One database can hold several independent stores in
    /// different schemas.
    #[must_use]
    pub fn with_schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// Pins time to `clock` instead of the server's `clock_timestamp()`. For tests (the
    /// conformance suite passes its `ManualClock`); in production every process must read
    /// the same clock, which is what the server's is for.
    #[must_use]
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = Some(clock);
        self
    }

    /// Pool size for [`PostgresStore::connect`] (default 16 connections). Each in-flight
    /// store call holds one connection for one statement, never across the handler.
    #[must_use]
    pub fn with_max_connections(mut self, n: usize) -> Self {
        self.max_connections = n.max(1);
        self
    }

    /// How long a call waits for a free pooled connection before failing with a
    /// retryable error (default 5 s).
    #[must_use]
    pub fn with_acquire_timeout(mut self, d: Duration) -> Self {
        self.acquire_timeout = d;
        self
    }

    /// How long opening a connection may take (default 5 s; a `connect_timeout` in the
    /// URL wins).
    #[must_use]
    pub fn with_connect_timeout(mut self, d: Duration) -> Self {
        self.connect_timeout = d;
        self
    }

    /// The configured schema name (not yet validated).
    #[must_use]
    pub fn schema(&self) -> &str {
        &self.schema
    }
}

/// The SQL text of every statement a store runs, for `EXPLAIN`, for operators, and for
/// benchmarks that send the same statements by hand. Parameters are listed per statement;
/// times and durations are milliseconds (`bigint`), the last parameter of each is the
/// pinned time or `NULL` for the server's clock.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Statements {
    /// Claim. `$1` id, `$2` principal (UTF-8 bytes), `$3` endpoint (UTF-8 bytes), `$4`
    /// key, `$5` fingerprint, `$6` lease ms, `$7` retention ms, `$8` now. Returns
    /// `inserted, claimed`, the record columns, and `now`.
    pub claim: String,
    /// Reclaim. `$1` id, `$2` expected token, `$3` fingerprint, `$4` lease ms, `$5`
    /// retention ms, `$6` now. Returns the record columns and `now`, or no row.
    pub reclaim: String,
    /// Complete. `$1` id, `$2` token, `$3` encoded response, `$4` now. Returns the record
    /// columns with `response` as `NULL` (the caller has it; a large body is not sent back
    /// over the wire), or no row.
    pub complete: String,
    /// Fail. `$1` id, `$2` token, `$3` now. Returns the record columns, or no row.
    pub fail: String,
    /// Read a live record. `$1` id, `$2` now. Returns one row: the record columns (all
    /// `NULL` when absent or expired) and `now`.
    pub read: String,
    /// Sweep. `$1` batch size, `$2` batch size + 1, `$3` now. Returns `removed, found`.
    pub sweep: String,
    /// Journal put. `$1` id, `$2` token, `$3` name (UTF-8 bytes), `$4` value, `$5`
    /// overwrite, `$6` now. Returns one row: `owned` (the token holds the live in-flight
    /// record), `written`, and `existing` (the current generation's value when not
    /// written, if this statement's snapshot can see it).
    pub journal_put: String,
    /// Journal read. `$1` id, `$2` name (UTF-8 bytes), `$3` now. Returns the value of the
    /// live record's current generation, or no row.
    pub journal_get: String,
}

/// The record columns, in the order [`record_at`] reads them.
const COLUMNS: [&str; 12] = [
    "id",
    "principal",
    "endpoint",
    "key",
    "fingerprint",
    "state",
    "token",
    "response",
    "created_at",
    "started_at",
    "lease_expires_at",
    "expires_at",
];

/// The server's clock in whole milliseconds since the epoch (UTC).
const SERVER_NOW_MS: &str = "floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint";

impl Statements {
    fn for_schema(schema: &str) -> Self {
        let table = format!("{}.records", quote_ident(schema));
        let cols = |prefix: &str| COLUMNS.iter().map(|c| format!("{prefix}{c}")).collect::<Vec<_>>().join(", ");
        let now = |p: &str| format!("COALESCE({p}::bigint, {SERVER_NOW_MS})");
        // now + d, saturating like the pure model (a huge retention must not overflow).
        let plus = |d: &str| format!("LEAST(n.ms::numeric + {d}::bigint, 9223372036854775807)::bigint");
        let expired = "t.expires_at <= EXCLUDED.created_at";
        let replace = |c: &str| format!("{c} = CASE WHEN {expired} THEN EXCLUDED.{c} ELSE t.{c} END");
        let replaced_cols = [
            "principal",
            "endpoint",
            "key",
            "fingerprint",
            "state",
            "response",
            "created_at",
            "started_at",
            "lease_expires_at",
            "expires_at",
            "claim_txid",
        ]
        .map(replace)
        .join(",\n        ");
        let claim = format!(
            "WITH n AS (SELECT {now8} AS ms),
up AS (
    INSERT INTO {table} AS t ({cols}, claim_txid)
    SELECT $1::bytea, $2::bytea, $3::bytea, $4::text, $5::bytea, 'in_flight'::text, 1::bigint, NULL::bytea,
           n.ms, n.ms, {lease}, {retention}, txid_current()
    FROM n
    ON CONFLICT (id) DO UPDATE SET
        {replaced_cols},
        token = CASE WHEN {expired} THEN t.token + 1 ELSE t.token END
    RETURNING (t.xmax = 0) AS inserted, (t.claim_txid = txid_current()) AS claimed, {tcols}
)
SELECT up.*, n.ms AS now FROM up CROSS JOIN n",
            now8 = now("$8"),
            cols = cols(""),
            lease = plus("$6"),
            retention = plus("$7"),
            tcols = cols("t."),
        );
        let reclaim = format!(
            "WITH n AS (SELECT {now6} AS ms)
UPDATE {table} AS t SET
    state = 'in_flight', token = t.token + 1, response = NULL, started_at = n.ms,
    lease_expires_at = {lease}, expires_at = GREATEST(t.expires_at, {retention})
FROM n
WHERE t.id = $1::bytea AND t.token = $2::bigint AND t.fingerprint = $3::bytea AND n.ms < t.expires_at
  AND (t.state = 'failed' OR (t.state = 'in_flight' AND t.lease_expires_at <= n.ms))
RETURNING {tcols}, n.ms AS now",
            now6 = now("$6"),
            lease = plus("$4"),
            retention = plus("$5"),
            tcols = cols("t."),
        );
        let complete = format!(
            "WITH n AS (SELECT {now4} AS ms)
UPDATE {table} AS t SET state = 'completed', response = $3::bytea
FROM n
WHERE t.id = $1::bytea AND t.token = $2::bigint AND t.state = 'in_flight' AND n.ms < t.expires_at
RETURNING {tcols}",
            now4 = now("$4"),
            tcols = cols("t.").replace("t.response", "NULL::bytea AS response"),
        );
        let fail = format!(
            "WITH n AS (SELECT {now3} AS ms)
UPDATE {table} AS t SET state = 'failed', response = NULL, lease_expires_at = LEAST(t.lease_expires_at, n.ms)
FROM n
WHERE t.id = $1::bytea AND t.token = $2::bigint AND t.state = 'in_flight' AND n.ms < t.expires_at
RETURNING {tcols}",
            now3 = now("$3"),
            tcols = cols("t."),
        );
        let read = format!(
            "SELECT {rcols}, n.ms AS now
FROM (SELECT {now2} AS ms) AS n
LEFT JOIN {table} AS r ON r.id = $1::bytea AND n.ms < r.expires_at",
            rcols = cols("r."),
            now2 = now("$2"),
        );
        let sweep = format!(
            "WITH n AS (SELECT {now3} AS ms),
victims AS (
    SELECT r.id, r.expires_at FROM {table} AS r, n
    WHERE r.expires_at <= n.ms
    ORDER BY r.expires_at
    LIMIT $2::bigint
    FOR UPDATE OF r SKIP LOCKED
),
gone AS (
    DELETE FROM {table} AS d
    USING (SELECT id FROM victims ORDER BY expires_at, id LIMIT $1::bigint) AS v
    WHERE d.id = v.id
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone) AS removed, (SELECT count(*) FROM victims) AS found",
            now3 = now("$3"),
        );
        let journal = format!("{}.journal", quote_ident(schema));
        // The parent row is locked FOR SHARE until the put commits: a reclaim, complete,
        // fail or replacing claim of the record waits for it, so the entry is written
        // while the token still owns the record (and FOR SHARE re-checks the conditions
        // on the newest row version if one committed meanwhile).
        let journal_put = format!(
            "WITH n AS (SELECT {now6} AS ms),
parent AS (
    SELECT r.id, r.created_at FROM {table} AS r, n
    WHERE r.id = $1::bytea AND r.token = $2::bigint AND r.state = 'in_flight' AND n.ms < r.expires_at
    FOR SHARE OF r
),
up AS (
    INSERT INTO {journal} AS j (id, name, value, record_created_at)
    SELECT parent.id, $3::bytea, $4::bytea, parent.created_at FROM parent
    ON CONFLICT (id, name) DO UPDATE SET value = EXCLUDED.value, record_created_at = EXCLUDED.record_created_at
    WHERE $5::boolean OR j.record_created_at <> EXCLUDED.record_created_at
    RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM parent) AS owned, EXISTS (SELECT 1 FROM up) AS written,
       (SELECT j.value FROM {journal} AS j, parent
        WHERE j.id = parent.id AND j.name = $3::bytea AND j.record_created_at = parent.created_at) AS existing",
            now6 = now("$6"),
        );
        let journal_get = format!(
            "SELECT j.value FROM {table} AS r
JOIN {journal} AS j ON j.id = r.id AND j.record_created_at = r.created_at
WHERE r.id = $1::bytea AND j.name = $2::bytea AND {now3} < r.expires_at",
            now3 = now("$3"),
        );
        Self { claim, reclaim, complete, fail, read, sweep, journal_put, journal_get }
    }
}

/// An idempotency [`Store`] in one PostgreSQL table. Cheap to clone (shares the pool).
///
/// Build with [`PostgresStore::connect`] (a URL) or [`PostgresStore::from_pool`] (your own
/// deadpool `Pool`, e.g. with TLS), then call [`PostgresStore::migrate`] once.
#[derive(Clone, Debug)]
pub struct PostgresStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    pool: Pool,
    schema: String,
    clock: Option<Arc<dyn Clock>>,
    sql: Statements,
}

impl PostgresStore {
    /// Connects to `url` (`postgres://user@host:port/db?...` or the key=value form) over
    /// plain TCP or a Unix socket, without TLS, and checks that one connection opens.
    /// Connections carry `application_name=idem-postgres` unless the URL sets one.
    /// Does not create anything: call [`PostgresStore::migrate`].
    ///
    /// # Errors
    /// [`Error::InvalidSchema`], [`Error::InvalidUrl`], [`Error::Pool`], or
    /// [`Error::Connection`] when the server cannot be reached (retryable).
    pub async fn connect(url: &str, config: PostgresConfig) -> Result<Self, Error> {
        validate_schema(&config.schema)?;
        let mut pg: tokio_postgres::Config = url.parse().map_err(Error::InvalidUrl)?;
        if pg.get_application_name().is_none() {
            pg.application_name("idem-postgres");
        }
        if pg.get_connect_timeout().is_none() {
            pg.connect_timeout(config.connect_timeout);
        }
        let manager = Manager::from_config(pg, NoTls, ManagerConfig { recycling_method: RecyclingMethod::Fast });
        let pool = Pool::builder(manager)
            .max_size(config.max_connections)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(config.acquire_timeout))
            .create_timeout(Some(config.connect_timeout))
            .recycle_timeout(Some(config.connect_timeout))
            .build()
            .map_err(Error::Pool)?;
        drop(pool.get().await.map_err(|source| Error::Connection { operation: "connecting", source })?);
        Self::from_pool(pool, config)
    }

    /// Wraps an existing pool. The pool's own settings (size, timeouts, TLS) apply;
    /// the config's pool settings are ignored.
    ///
    /// # Errors
    /// [`Error::InvalidSchema`].
    pub fn from_pool(pool: Pool, config: PostgresConfig) -> Result<Self, Error> {
        validate_schema(&config.schema)?;
        let sql = Statements::for_schema(&config.schema);
        Ok(Self { inner: Arc::new(Inner { pool, schema: config.schema, clock: config.clock, sql }) })
    }

    /// Creates the schema, the `records` table and its indices, applying whichever shipped
    /// migrations (`migrations/*.sql`) are missing, in one transaction under an advisory
    /// lock. Safe to call on every start and from several processes at once. Returns how
    /// many migrations ran.
    ///
    /// # Errors
    /// [`Error::Connection`], [`Error::Postgres`] (e.g. no `CREATE` privilege), or
    /// [`Error::SchemaTooNew`] when a newer build migrated the schema.
    pub async fn migrate(&self) -> Result<usize, Error> {
        crate::schema::migrate(&self.inner.pool, &self.inner.schema).await
    }

    /// The pool (shared with every clone of this store).
    #[must_use]
    pub fn pool(&self) -> &Pool {
        &self.inner.pool
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

    /// The pinned time, or `None` to use the server's clock.
    fn pinned_now(&self) -> Option<i64> {
        self.inner.clock.as_ref().map(|c| c.now().0)
    }

    async fn client(&self, operation: &'static str) -> Result<Object, StoreError> {
        self.inner.pool.get().await.map_err(|e| store_pool(operation, e))
    }

    /// Runs `sql` (prepared once per connection) and returns at most one row, handing the
    /// connection back for a follow-up statement. On an error that means the session is
    /// gone (terminated backend, closed socket), the connection is detached from the pool
    /// instead of returned to it: the driver may not have noticed the close yet, and the
    /// pool's recycle check would then hand the dead connection to the next call.
    async fn run(
        &self,
        client: Object,
        operation: &'static str,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<(Object, Option<tokio_postgres::Row>), StoreError> {
        let result = match client.prepare_cached(sql).await {
            Ok(stmt) => client.query_opt(&stmt, params).await,
            Err(e) => Err(e),
        };
        match result {
            Ok(row) => Ok((client, row)),
            Err(e) => {
                if is_session_lost(&e) {
                    drop(Object::take(client));
                }
                Err(store_pg(operation, e))
            }
        }
    }

    /// The live record and the store's `now`, handing the connection back.
    async fn read(
        &self,
        client: Object,
        id: RecordId,
        now: Option<i64>,
    ) -> Result<(Object, Option<Record>, UnixMillis), StoreError> {
        const OP: &str = "reading a record";
        let (client, row) = self.run(client, OP, &self.inner.sql.read, &[&&id.0[..], &now]).await?;
        let row = row.ok_or_else(|| corrupt(Some(id), postcard::Error::DeserializeUnexpectedEnd))?;
        let now = UnixMillis(row.try_get(COLUMNS.len()).map_err(|e| store_pg(OP, e))?);
        let present: Option<&[u8]> = row.try_get(0).map_err(|e| store_pg(OP, e))?;
        let record = if present.is_some() { Some(record_at(&row, 0, None)?) } else { None };
        Ok((client, record, now))
    }

    /// The journal entry `name` of the live record's current generation.
    async fn journal_read(
        &self,
        client: Object,
        id: RecordId,
        name: &str,
        now: Option<i64>,
    ) -> Result<(Object, Option<Vec<u8>>), StoreError> {
        const OP: &str = "reading a journal entry";
        let (client, row) =
            self.run(client, OP, &self.inner.sql.journal_get, &[&&id.0[..], &name.as_bytes(), &now]).await?;
        let value = row.map(|row| row.try_get::<_, Vec<u8>>(0)).transpose().map_err(|e| store_pg(OP, e))?;
        Ok((client, value))
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
        params: &[&(dyn ToSql + Sync)],
        now: Option<i64>,
        would_apply: impl Fn(&Record, UnixMillis) -> bool,
    ) -> Result<Result<tokio_postgres::Row, (Option<Record>, UnixMillis)>, StoreError> {
        let mut client = self.client(operation).await?;
        for _ in 0..CAS_ATTEMPTS {
            let (c, row) = self.run(client, operation, sql, params).await?;
            if let Some(row) = row {
                return Ok(Ok(row));
            }
            let (c, current, read_now) = self.read(c, id, now).await?;
            match current {
                Some(r) if would_apply(&r, read_now) => client = c,
                current => return Ok(Err((current, read_now))),
            }
        }
        Err(crate::error::contention(operation))
    }
}

/// How often a compare-and-set runs again after losing only to a claim its snapshot could
/// not see (see [`PostgresStore::compare_and_set`]). One retry is enough unless the
/// record is replaced again and again in the same milliseconds.
const CAS_ATTEMPTS: usize = 4;

/// Whether `token` is the live record's current in-flight claim (the rule complete and fail
/// check; the read already excludes expired records).
fn owns(r: &Record, token: FencingToken) -> bool {
    r.state == RecordState::InFlight && r.token == token
}

/// A token as the `bigint` column holds it. Tokens above `i64::MAX` cannot exist in the
/// table (they start at 1 and grow by one), so they map to -1, which matches no row.
fn token_param(t: FencingToken) -> i64 {
    i64::try_from(t.0).unwrap_or(-1)
}

/// Format version of the `response` column: the first byte, then postcard.
pub const RESPONSE_FORMAT_VERSION: u8 = 1;

/// Encodes a stored response for the `response` column: `[RESPONSE_FORMAT_VERSION] ++
/// postcard(response)`. Headers and body bytes round-trip exactly.
#[must_use]
pub fn encode_response(response: &StoredResponse) -> Vec<u8> {
    // Serialising plain data into a Vec cannot fail; the bare version byte (which decodes
    // to a typed error) is the fallback rather than a panic.
    postcard::to_extend(response, vec![RESPONSE_FORMAT_VERSION]).unwrap_or_else(|_| vec![RESPONSE_FORMAT_VERSION])
}

/// Decodes the `response` column.
///
/// # Errors
/// [`CodecError`] for empty, unknown-version, malformed or trailing input.
pub fn decode_response(bytes: &[u8]) -> Result<StoredResponse, CodecError> {
    let (&version, rest) = bytes.split_first().ok_or(CodecError::Empty)?;
    if version != RESPONSE_FORMAT_VERSION {
        return Err(CodecError::UnknownVersion(version));
    }
    let (response, tail) = postcard::take_from_bytes::<StoredResponse>(rest).map_err(CodecError::Malformed)?;
    if !tail.is_empty() {
        return Err(CodecError::Trailing(tail.len()));
    }
    Ok(response)
}

fn corrupt(id: Option<RecordId>, why: postcard::Error) -> StoreError {
    StoreError::Corrupt { id, source: CodecError::Malformed(why) }
}

/// Reads the record whose columns start at `base` (in [`COLUMNS`] order). Values the
/// table's constraints should have excluded are reported as [`StoreError::Corrupt`].
/// `written` is the response this call just stored (complete), used instead of decoding
/// the column back.
fn record_at(row: &tokio_postgres::Row, base: usize, written: Option<StoredResponse>) -> Result<Record, StoreError> {
    fn get<'a, T: tokio_postgres::types::FromSql<'a>>(
        row: &'a tokio_postgres::Row,
        idx: usize,
    ) -> Result<T, StoreError> {
        row.try_get(idx).map_err(|e| store_pg("decoding a record", e))
    }
    let id_bytes: Vec<u8> = get(row, base)?;
    let id = RecordId(id_bytes.try_into().map_err(|_| corrupt(None, postcard::Error::DeserializeBadEncoding))?);
    let bad = |why| corrupt(Some(id), why);
    let text = |idx| -> Result<String, StoreError> {
        String::from_utf8(get::<Vec<u8>>(row, idx)?).map_err(|_| bad(postcard::Error::DeserializeBadUtf8))
    };
    let principal = text(base + 1)?;
    let endpoint = text(base + 2)?;
    let key: String = get(row, base + 3)?;
    let key = stored_key(&key).ok_or_else(|| bad(postcard::Error::DeserializeBadEncoding))?;
    let fingerprint: Vec<u8> = get(row, base + 4)?;
    let fingerprint = Fingerprint(fingerprint.try_into().map_err(|_| bad(postcard::Error::DeserializeBadEncoding))?);
    let state = match get::<&str>(row, base + 5)? {
        "in_flight" => RecordState::InFlight,
        "completed" => RecordState::Completed,
        "failed" => RecordState::Failed,
        _ => return Err(bad(postcard::Error::DeserializeBadEnum)),
    };
    let token = u64::try_from(get::<i64>(row, base + 6)?).map_err(|_| bad(postcard::Error::DeserializeBadVarint))?;
    let response = match (written, get::<Option<&[u8]>>(row, base + 7)?) {
        (Some(written), _) => Some(written),
        (None, Some(b)) => Some(decode_response(b).map_err(|source| StoreError::Corrupt { id: Some(id), source })?),
        (None, None) => None,
    };
    if response.is_some() != (state == RecordState::Completed) {
        return Err(bad(postcard::Error::DeserializeBadOption));
    }
    Ok(Record {
        id,
        // An empty principal is refused when a scope is built, never by a stored record.
        scope: Scope { principal: Principal(principal), endpoint: Endpoint(endpoint) },
        key,
        fingerprint,
        state,
        token: FencingToken(token),
        response,
        created_at: UnixMillis(get(row, base + 8)?),
        started_at: UnixMillis(get(row, base + 9)?),
        lease_expires_at: UnixMillis(get(row, base + 10)?),
        expires_at: UnixMillis(get(row, base + 11)?),
    })
}

/// Rebuilds a stored key. Keys are stored unquoted; quoting them again as an RFC 8941
/// sf-string and parsing that returns exactly the stored bytes for every visible-ASCII
/// key, including ones that start with `"` (which the bare form would misread).
fn stored_key(stored: &str) -> Option<IdempotencyKey> {
    let mut quoted = String::with_capacity(stored.len() + 2);
    quoted.push('"');
    for c in stored.chars() {
        if c == '"' || c == '\\' {
            quoted.push('\\');
        }
        quoted.push(c);
    }
    quoted.push('"');
    let key = IdempotencyKey::parse_with_limit(quoted.as_bytes(), usize::MAX).ok()?;
    (key.as_str() == stored).then_some(key)
}

#[async_trait]
impl Store for PostgresStore {
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        const OP: &str = "claiming a record";
        let client = self.client(OP).await?;
        let now = self.pinned_now();
        let (_, row) = self
            .run(
                client,
                OP,
                &self.inner.sql.claim,
                &[
                    &&req.id.0[..],
                    &req.scope.principal.0.as_bytes(),
                    &req.scope.endpoint.0.as_bytes(),
                    &req.key.as_str(),
                    &&req.fingerprint.0[..],
                    &req.lease_ms(),
                    &req.retention_ms(),
                    &now,
                ],
            )
            .await?;
        // An upsert with RETURNING always yields its row.
        let row = row.ok_or_else(|| corrupt(Some(req.id), postcard::Error::DeserializeUnexpectedEnd))?;
        let claimed: bool = row.try_get(1).map_err(|e| store_pg(OP, e))?;
        let record = record_at(&row, 2, None)?;
        if claimed {
            Ok(ClaimOutcome::Claimed(record))
        } else {
            let now = UnixMillis(row.try_get(2 + COLUMNS.len()).map_err(|e| store_pg(OP, e))?);
            Ok(ClaimOutcome::Existing { record, now })
        }
    }

    async fn reclaim(&self, req: ReclaimRequest) -> Result<ReclaimOutcome, StoreError> {
        let now = self.pinned_now();
        let outcome = self
            .compare_and_set(
                "reclaiming a record",
                req.id,
                &self.inner.sql.reclaim,
                &[
                    &&req.id.0[..],
                    &token_param(req.expected),
                    &&req.fingerprint.0[..],
                    &req.lease_ms(),
                    &req.retention_ms(),
                    &now,
                ],
                now,
                |r, now| is_reclaimable(r, &req, now),
            )
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
        let outcome = self
            .compare_and_set(
                "completing a record",
                id,
                &self.inner.sql.complete,
                &[&&id.0[..], &token_param(token), &bytes, &now],
                now,
                |r, _| owns(r, token),
            )
            .await?;
        match outcome {
            Ok(row) => record_at(&row, 0, Some(response)),
            Err((current, _)) => Err(StoreError::LeaseLost { id, presented: token, current: current.map(|r| r.token) }),
        }
    }

    async fn fail(&self, id: RecordId, token: FencingToken) -> Result<Record, StoreError> {
        let now = self.pinned_now();
        let outcome = self
            .compare_and_set(
                "marking a record failed",
                id,
                &self.inner.sql.fail,
                &[&&id.0[..], &token_param(token), &now],
                now,
                |r, _| owns(r, token),
            )
            .await?;
        match outcome {
            Ok(row) => record_at(&row, 0, None),
            Err((current, _)) => Err(StoreError::LeaseLost { id, presented: token, current: current.map(|r| r.token) }),
        }
    }

    async fn get(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        let client = self.client("reading a record").await?;
        Ok(self.read(client, id, self.pinned_now()).await?.1)
    }

    async fn sweep(&self, limit: usize) -> Result<SweepOutcome, StoreError> {
        const OP: &str = "sweeping expired records";
        let client = self.client(OP).await?;
        let now = self.pinned_now();
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let probe = limit.saturating_add(1);
        let (_, row) = self.run(client, OP, &self.inner.sql.sweep, &[&limit, &probe, &now]).await?;
        let row = row.ok_or_else(|| corrupt(None, postcard::Error::DeserializeUnexpectedEnd))?;
        let removed: i64 = row.try_get(0).map_err(|e| store_pg(OP, e))?;
        let found: i64 = row.try_get(1).map_err(|e| store_pg(OP, e))?;
        Ok(SweepOutcome { removed: u64::try_from(removed).unwrap_or(0), more: found > removed })
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::new().with_server_clock(true).with_shared(true).with_journal(true)
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
        let mut client = self.client(OP).await?;
        for _ in 0..CAS_ATTEMPTS {
            let params: [&(dyn ToSql + Sync); 6] =
                [&&id.0[..], &token_param(token), &name.as_bytes(), &value, &overwrite, &now];
            let (c, row) = self.run(client, OP, &self.inner.sql.journal_put, &params).await?;
            let row = row.ok_or_else(|| corrupt(Some(id), postcard::Error::DeserializeUnexpectedEnd))?;
            let owned: bool = row.try_get(0).map_err(|e| store_pg(OP, e))?;
            let written: bool = row.try_get(1).map_err(|e| store_pg(OP, e))?;
            let existing: Option<Vec<u8>> = row.try_get(2).map_err(|e| store_pg(OP, e))?;
            if written {
                return Ok(JournalWrite::Written);
            }
            if owned {
                if let Some(v) = existing {
                    return Ok(JournalWrite::Exists(v));
                }
                // The entry that won was inserted by a put that committed after this
                // statement's snapshot: read it with a fresh one.
                let (c, stored) = self.journal_read(c, id, name, now).await?;
                if let Some(v) = stored {
                    return Ok(JournalWrite::Exists(v));
                }
                client = c;
                continue;
            }
            // Not the owner, or the record was claimed after this statement's snapshot
            // (then the put runs again rather than report a refusal no order explains).
            let (c, current, _) = self.read(c, id, now).await?;
            match current {
                Some(r) if owns(&r, token) => client = c,
                current => {
                    return Err(StoreError::LeaseLost { id, presented: token, current: current.map(|r| r.token) });
                }
            }
        }
        Err(crate::error::contention(OP))
    }

    async fn journal_get(&self, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let client = self.client("reading a journal entry").await?;
        Ok(self.journal_read(client, id, name, self.pinned_now()).await?.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_keys_round_trip() {
        for k in ["abc", "\"abc", "a\"b", "a\\b", "\"", "\\", "~!@#$%^&*()"] {
            assert_eq!(stored_key(k).map(|k| k.as_str().to_owned()).as_deref(), Some(k));
        }
        assert!(stored_key("a b").is_none());
        assert!(stored_key("").is_none());
    }

    #[test]
    fn responses_round_trip_and_reject_garbage() {
        let r = StoredResponse::new(201, vec![("location".into(), b"/t/42".to_vec())], vec![0, 255, 1]);
        assert_eq!(decode_response(&encode_response(&r)).unwrap(), r);
        assert!(matches!(decode_response(&[]), Err(CodecError::Empty)));
        assert!(matches!(decode_response(&[9, 1]), Err(CodecError::UnknownVersion(9))));
        assert!(matches!(decode_response(&[1, 0xff, 0xff, 0xff]), Err(CodecError::Malformed(_))));
        let mut long = encode_response(&r);
        long.push(0);
        assert!(matches!(decode_response(&long), Err(CodecError::Trailing(1))));
    }

    #[test]
    fn statements_quote_the_schema() {
        let s = Statements::for_schema("idem_x");
        assert!(s.claim.contains("\"idem_x\".records"));
        assert!(s.sweep.contains("SKIP LOCKED"));
    }
}
