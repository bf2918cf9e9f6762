//! [`PostgresStore`]: the [`Store`] contract as single SQL statements. The type's docs say
//! how each operation stays atomic; the statements themselves are in `src/sql.rs`.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, RecyclingMethod, Runtime};
use idem_core::codec::encode_response;
use idem_core::time::duration_ms;
use idem_core::transition::is_reclaimable;
use idem_core::{
    Capabilities, ClaimOutcome, ClaimRequest, Clock, FencingToken, JournalWrite, ReclaimOutcome, ReclaimRequest,
    Record, RecordId, RecordState, Store, StoreError, StoredResponse, SweepOutcome, UnixMillis,
};
use tokio_postgres::NoTls;
use tokio_postgres::types::ToSql;

use crate::config::Config;
use crate::error::{Error, is_session_lost};
use crate::sql::{self, COLUMNS, Statements, corrupt, record_at, token_param, validate_schema};

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
/// - **claim** is `INSERT ... ON CONFLICT (id) DO UPDATE SET col = CASE WHEN t.expires_at
///   <= now THEN <new value> ELSE t.col END ... RETURNING`. With no row, the insert wins;
///   with a row, `ON CONFLICT DO UPDATE` locks it and evaluates the `CASE` against its
///   latest committed version (under READ COMMITTED the upsert always acts on the newest
///   row, never on the statement's snapshot). A live row is rewritten with its own values
///   and returned as `Existing`; a row past `expires_at` counts as absent and is replaced
///   by the new claim with `GREATEST(token + 1, first_at(now))` (an inserted row gets
///   `first_at(now)`, see the crate docs on fencing tokens). Of N concurrent claims
///   exactly one inserts or replaces; the rest wait on the row lock and then see the live
///   winner. `DO NOTHING` would return no row on conflict, which is why it is not used.
///   `RETURNING` cannot see the row as it was before the upsert, so "this call claimed" is
///   read from the `claim_txid` column, which an insert or replacement sets to the writing
///   transaction's `txid_current()` and a live hit leaves alone; `xmax = 0` tells an insert
///   from a replacement. The price of returning the row in one statement is that a claim
///   which finds a live record still writes one new row version (same values, so a HOT
///   update that touches no index), reclaimed by page pruning and autovacuum.
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
/// Each statement is prepared once per pooled connection (deadpool's statement cache) and
/// then runs as one round trip. A call takes a connection for one statement (two on the
/// lost-CAS path) and returns it at once. A connection whose session died (terminated
/// backend, server restart, broken socket) is detached from the pool rather than returned,
/// so the next call opens a fresh one instead of failing on the dead one.
///
/// # Time
/// `now` is the server's `clock_timestamp()` in whole milliseconds, read once per statement
/// (every process sharing the database agrees on it). A new record's first fencing token
/// is taken from it too. A test may pin time with
/// [`Config::with_clock`]: its reading is passed as a parameter and used instead,
/// through `COALESCE($n, <server now>)`, so tests run the very statements production runs.
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
    /// plain TCP or a Unix socket, without TLS, then migrates or checks the schema as
    /// [`PostgresStore::from_pool`] does. Connections carry
    /// `application_name=idem-postgres` unless the URL sets one.
    ///
    /// # Errors
    /// [`Error::InvalidSchema`], [`Error::InvalidUrl`], [`Error::Pool`],
    /// [`Error::Connection`] when the server cannot be reached (retryable), and those of
    /// [`PostgresStore::from_pool`].
    pub async fn connect(url: &str, config: Config) -> Result<Self, Error> {
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
        Self::from_pool(pool, config).await
    }

    /// Uses the application's own pool. The pool's own settings (size, timeouts, TLS)
    /// apply; the config's pool settings are ignored. Applies the missing migrations
    /// ([`PostgresStore::migrate`]), or with [`Config::with_auto_migrate`] off only checks
    /// that the schema is at this build's migration.
    ///
    /// # Errors
    /// [`Error::InvalidSchema`]; [`Error::Connection`] when no connection opens
    /// (retryable); [`Error::NotMigrated`] when auto-migration is off and migrations are
    /// missing; [`Error::SchemaTooNew`]; [`Error::Postgres`] when a migration fails (e.g.
    /// no `CREATE` privilege).
    pub async fn from_pool(pool: Pool, config: Config) -> Result<Self, Error> {
        validate_schema(&config.schema)?;
        let sql = Statements::for_schema(&config.schema);
        let store = Self { inner: Arc::new(Inner { pool, schema: config.schema, clock: config.clock, sql }) };
        if config.auto_migrate {
            sql::migrate(&store.inner.pool, &store.inner.schema).await?;
        } else {
            sql::check_migrated(&store.inner.pool, &store.inner.schema).await?;
        }
        Ok(store)
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
        sql::migrate(pool, &config.schema).await
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
        Ok(self.inner.pool.get().await.map_err(Error::connection(operation))?)
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
                Err(Error::postgres(operation)(e).into())
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
        let (client, row) = self.run(client, OP, self.inner.sql.read(), &[&&id.0[..], &now]).await?;
        let row = row.ok_or_else(|| corrupt(Some(id), "row", "the statement returned no row"))?;
        let now = UnixMillis(row.try_get(COLUMNS.len()).map_err(Error::postgres(OP))?);
        let present: Option<&[u8]> = row.try_get(0).map_err(Error::postgres(OP))?;
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
            self.run(client, OP, self.inner.sql.journal_get(), &[&&id.0[..], &name.as_bytes(), &now]).await?;
        let value = row.map(|row| row.try_get::<_, Vec<u8>>(0)).transpose().map_err(Error::postgres(OP))?;
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
        Err(Error::Contention { operation }.into())
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
                self.inner.sql.claim(),
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
        let row = row.ok_or_else(|| corrupt(Some(req.id), "row", "the statement returned no row"))?;
        let claimed: bool = row.try_get(1).map_err(Error::postgres(OP))?;
        let record = record_at(&row, 2, None)?;
        if claimed {
            Ok(ClaimOutcome::Claimed(record))
        } else {
            let now = UnixMillis(row.try_get(2 + COLUMNS.len()).map_err(Error::postgres(OP))?);
            Ok(ClaimOutcome::Existing { record, now })
        }
    }

    async fn reclaim(&self, req: ReclaimRequest) -> Result<ReclaimOutcome, StoreError> {
        let now = self.pinned_now();
        let outcome = self
            .compare_and_set(
                "reclaiming a record",
                req.id,
                self.inner.sql.reclaim(),
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
                self.inner.sql.complete(),
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

    async fn extend(&self, id: RecordId, token: FencingToken, lease_ttl: Duration) -> Result<Record, StoreError> {
        let now = self.pinned_now();
        let lease_ms = duration_ms(lease_ttl);
        let outcome = self
            .compare_and_set(
                "extending a lease",
                id,
                self.inner.sql.extend(),
                &[&&id.0[..], &token_param(token), &lease_ms, &now],
                now,
                |r, _| owns(r, token),
            )
            .await?;
        match outcome {
            Ok(row) => record_at(&row, 0, None),
            Err((current, _)) => Err(StoreError::LeaseLost { id, presented: token, current: current.map(|r| r.token) }),
        }
    }

    async fn fail(&self, id: RecordId, token: FencingToken) -> Result<Record, StoreError> {
        let now = self.pinned_now();
        let outcome = self
            .compare_and_set(
                "marking a record failed",
                id,
                self.inner.sql.fail(),
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
        let (_, row) = self.run(client, OP, self.inner.sql.sweep(), &[&limit, &probe, &now]).await?;
        let row = row.ok_or_else(|| corrupt(None, "row", "the statement returned no row"))?;
        let removed: i64 = row.try_get(0).map_err(Error::postgres(OP))?;
        let found: i64 = row.try_get(1).map_err(Error::postgres(OP))?;
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
            let (c, row) = self.run(client, OP, self.inner.sql.journal_put(), &params).await?;
            let row = row.ok_or_else(|| corrupt(Some(id), "row", "the statement returned no row"))?;
            let owned: bool = row.try_get(0).map_err(Error::postgres(OP))?;
            let written: bool = row.try_get(1).map_err(Error::postgres(OP))?;
            let existing: Option<Vec<u8>> = row.try_get(2).map_err(Error::postgres(OP))?;
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
        Err(Error::Contention { operation: OP }.into())
    }

    async fn journal_get(&self, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let client = self.client("reading a journal entry").await?;
        Ok(self.journal_read(client, id, name, self.pinned_now()).await?.1)
    }
}
