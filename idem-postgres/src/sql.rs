//! The SQL of the store: the schema name, the shipped migrations and how they run, the
//! text of every statement, and how a returned row becomes a record.
//!
//! Migrations are SQL files in `migrations/`, compiled into the crate with `include_str!`
//! and applied in version order by [`crate::PostgresStore::migrate`] (which building a
//! store runs unless [`crate::Config::with_auto_migrate`] is off). Each file names the
//! schema as `{schema}`, replaced by the quoted schema name before it runs. Applied
//! versions are recorded in `<schema>.schema_migrations`; running `migrate()` again
//! applies only what is missing, and concurrent callers serialise on an advisory lock.
//! Teams that run their own migration tool can take [`MIGRATIONS`] and
//! [`Migration::sql_for`] instead, and record each applied version (`version`, `name`)
//! in `<schema>.schema_migrations` so that stores built without auto-migration find it.

use deadpool_postgres::Pool;
use idem_core::codec::{CodecError, decode_response};
use idem_core::{
    Endpoint, FencingToken, Fingerprint, IdempotencyKey, Principal, Record, RecordId, RecordState, Scope, StoreError,
    StoredResponse, UnixMillis,
};
use tokio_postgres::types::Type;

use crate::driver::Row;
use crate::error::Error;

/// One versioned migration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Migration {
    version: i32,
    name: &'static str,
    sql: &'static str,
}

impl Migration {
    /// Version, starting at 1, strictly increasing.
    #[must_use]
    pub const fn version(&self) -> i32 {
        self.version
    }

    /// Short name (the file name without the number).
    #[must_use]
    pub const fn name(&self) -> &'static str {
        self.name
    }

    /// The SQL, with `{schema}` where the quoted schema name goes.
    #[must_use]
    pub const fn sql(&self) -> &'static str {
        self.sql
    }

    /// The SQL for `schema` (an already validated name, see [`validate_schema`]).
    #[must_use]
    pub fn sql_for(&self, schema: &str) -> String {
        self.sql.replace("{schema}", &quote_ident(schema))
    }
}

/// Every migration this build ships, in order.
pub const MIGRATIONS: &[Migration] = &[
    Migration { version: 1, name: "records", sql: include_str!("../migrations/0001_records.sql") },
    Migration { version: 2, name: "journal", sql: include_str!("../migrations/0002_journal.sql") },
];

/// The version this build's statements need: the last of [`MIGRATIONS`].
pub(crate) const KNOWN_VERSION: i32 = MIGRATIONS[MIGRATIONS.len() - 1].version;

/// The highest migration recorded in `schema`.
fn applied_version_sql(schema: &str) -> String {
    format!("SELECT COALESCE(max(version), 0) FROM {}.schema_migrations", quote_ident(schema))
}

/// Whether the bookkeeping table exists is asked of the catalog tables, not by naming it:
/// a failed lookup by name leaves the session a cached "no such schema", which the
/// migration that follows would trust even after waiting on the lock for another process
/// that creates the schema (and then fail creating it twice).
const MIGRATIONS_TABLE_EXISTS: &str = "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_class AS c
    JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
    WHERE n.nspname = $1::text AND c.relname = 'schema_migrations')";

/// Statements that serialise concurrent `migrate()` calls on a schema (several replicas
/// starting at once); the lock is released at commit or rollback.
const MIGRATION_LOCK: &str = "SELECT pg_advisory_xact_lock(hashtext($1::text))";

fn lock_key(schema: &str) -> String {
    format!("idem-postgres migrate {schema}")
}

fn create_bookkeeping(schema: &str) -> String {
    let q = quote_ident(schema);
    format!(
        "CREATE SCHEMA IF NOT EXISTS {q};
         CREATE TABLE IF NOT EXISTS {q}.schema_migrations (
             version    integer     PRIMARY KEY,
             name       text        NOT NULL,
             applied_at timestamptz NOT NULL DEFAULT now()
         );"
    )
}

fn record_migration_sql(schema: &str) -> String {
    format!("INSERT INTO {}.schema_migrations (version, name) VALUES ($1::integer, $2::text)", quote_ident(schema))
}

fn checked_version(schema: &str, found: i32) -> Result<i32, Error> {
    if found > KNOWN_VERSION {
        return Err(Error::SchemaTooNew { schema: schema.to_owned(), found, known: KNOWN_VERSION });
    }
    Ok(found)
}

fn not_migrated(schema: &str, found: i32) -> Result<(), Error> {
    match found {
        KNOWN_VERSION => Ok(()),
        found => Err(Error::NotMigrated { schema: schema.to_owned(), found, known: KNOWN_VERSION }),
    }
}

/// The highest migration recorded in `schema` (0 when it has none, or does not exist),
/// read without changing anything; refuses a schema migrated by a newer build. Unnamed
/// statements only, so that it runs behind PgBouncer in transaction mode too.
async fn applied_version(client: &impl tokio_postgres::GenericClient, schema: &str) -> Result<i32, Error> {
    const OP: &str = "reading the schema's migration version";
    let exists: bool = client
        .query_typed(MIGRATIONS_TABLE_EXISTS, &[(&schema, Type::TEXT)])
        .await
        .and_then(|rows| rows.first().map_or(Ok(false), |row| row.try_get(0)))
        .map_err(Error::postgres(OP))?;
    if !exists {
        return Ok(0);
    }
    let found: i32 = client
        .query_typed(&applied_version_sql(schema), &[])
        .await
        .and_then(|rows| rows.first().map_or(Ok(0), |row| row.try_get(0)))
        .map_err(Error::postgres(OP))?;
    checked_version(schema, found)
}

/// Checks, without changing anything, that `schema` is at exactly this build's migration:
/// the start-up check of a store built without auto-migration.
pub(crate) async fn check_migrated(pool: &Pool, schema: &str) -> Result<(), Error> {
    let client = pool.get().await.map_err(Error::connection("reading the schema's migration version"))?;
    not_migrated(schema, applied_version(&**client, schema).await?)
}

/// The schema used when none is configured.
pub const DEFAULT_SCHEMA: &str = "idem";

/// Checks a schema name: 1 to 63 bytes (PostgreSQL's identifier limit), a lower-case ASCII
/// letter or `_` first, then lower-case ASCII letters, digits or `_`, and not starting
/// with `pg_` (reserved for system schemas).
///
/// Lower case only, because PostgreSQL folds unquoted names to lower case: a name that
/// needs quoting to keep its case would name a different schema in `psql` than in this
/// crate. The name is still always quoted when it is written into SQL.
///
/// # Errors
/// [`Error::InvalidSchema`] naming the broken rule.
pub fn validate_schema(name: &str) -> Result<(), Error> {
    let bad = |reason| Err(Error::InvalidSchema { name: name.to_owned(), reason });
    let bytes = name.as_bytes();
    let Some(&first) = bytes.first() else {
        return bad("it is empty");
    };
    if bytes.len() > 63 {
        return bad("it is longer than 63 bytes");
    }
    if !(first.is_ascii_lowercase() || first == b'_') {
        return bad("it must start with a lower-case ASCII letter or '_'");
    }
    if !bytes.iter().all(|&b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_') {
        return bad("only lower-case ASCII letters, digits and '_' are allowed");
    }
    if name.starts_with("pg_") {
        return bad("names starting with 'pg_' are reserved by PostgreSQL");
    }
    Ok(())
}

/// `"name"` with any `"` doubled: a safe identifier whatever the input (the input is also
/// validated, so this is defence in depth).
#[must_use]
pub(crate) fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// Applies the missing migrations to `schema` in one transaction; returns how many ran.
///
/// A schema already at this build's migration is left alone after one read, so starting a
/// store on it needs no privilege beyond using the tables (`CREATE SCHEMA IF NOT EXISTS`
/// alone would need `CREATE` on the database).
pub(crate) async fn migrate(pool: &Pool, schema: &str) -> Result<usize, Error> {
    let mut client = pool.get().await.map_err(Error::connection("migrating"))?;
    if applied_version(&**client, schema).await? == KNOWN_VERSION {
        return Ok(0);
    }
    let tx = client.transaction().await.map_err(Error::postgres("starting the migration transaction"))?;
    match apply(&tx, schema).await {
        Ok(applied) => {
            tx.commit().await.map_err(Error::postgres("committing the migrations"))?;
            Ok(applied)
        }
        Err(e) => {
            // Roll back now rather than on drop: dropping only queues the ROLLBACK, and the
            // session would keep its locks until the pooled connection is next used.
            let _ = tx.rollback().await;
            Err(e)
        }
    }
}

async fn apply(tx: &deadpool_postgres::Transaction<'_>, schema: &str) -> Result<usize, Error> {
    tx.query_typed(MIGRATION_LOCK, &[(&lock_key(schema), Type::TEXT)])
        .await
        .map_err(Error::postgres("taking the migration lock"))?;
    tx.batch_execute(&create_bookkeeping(schema)).await.map_err(Error::postgres("creating the schema"))?;
    // Read again under the lock: another process may have migrated meanwhile. (The table
    // exists now, so the read cannot fail on a missing one and abort the transaction.)
    let found = applied_version(&**tx, schema).await?;
    let mut applied = 0;
    for m in MIGRATIONS.iter().filter(|m| m.version > found) {
        tracing::debug!(
            backend = "postgres",
            schema,
            version = m.version,
            name = m.name,
            "idem-postgres: applying migration"
        );
        tx.batch_execute(&m.sql_for(schema)).await.map_err(Error::postgres("applying a migration"))?;
        tx.query_typed(&record_migration_sql(schema), &[(&m.version, Type::INT4), (&m.name, Type::TEXT)])
            .await
            .map_err(Error::postgres("recording a migration"))?;
        applied += 1;
    }
    Ok(applied)
}

/// The migrations through a `sqlx::PgPool`: the same statements, the same transaction and
/// lock.
#[cfg(feature = "sqlx")]
pub(crate) mod via_sqlx {
    use sqlx::Connection as _;

    use super::*;
    use crate::driver::{Param, Protocol, sqlx_query_opt};

    /// Unnamed (simple protocol) statements only, as the store's own behind PgBouncer.
    async fn query(
        conn: &mut sqlx::PgConnection,
        op: &'static str,
        sql: &str,
        params: &[Param<'_>],
    ) -> Result<Option<Row>, Error> {
        sqlx_query_opt(conn, sql, params, Protocol::Unnamed).await.map_err(Error::sqlx(op))
    }

    async fn applied_version(conn: &mut sqlx::PgConnection, schema: &str) -> Result<i32, Error> {
        const OP: &str = "reading the schema's migration version";
        let bad = || Error::sqlx(OP)(sqlx::Error::RowNotFound);
        let exists = query(conn, OP, MIGRATIONS_TABLE_EXISTS, &[Param::Text(schema)]).await?;
        if !exists.ok_or_else(bad)?.bool(0).map_err(|_| bad())? {
            return Ok(0);
        }
        let sql = applied_version_sql(schema).replace("COALESCE(max(version), 0)", "COALESCE(max(version), 0)::bigint");
        let found = query(conn, OP, &sql, &[]).await?.ok_or_else(bad)?.i64(0).map_err(|_| bad())?;
        checked_version(schema, i32::try_from(found).unwrap_or(i32::MAX))
    }

    pub(crate) async fn check_migrated(pool: &sqlx::PgPool, schema: &str) -> Result<(), Error> {
        let mut conn = pool.acquire().await.map_err(Error::sqlx("reading the schema's migration version"))?;
        not_migrated(schema, applied_version(&mut conn, schema).await?)
    }

    pub(crate) async fn migrate(pool: &sqlx::PgPool, schema: &str) -> Result<usize, Error> {
        let mut conn = pool.acquire().await.map_err(Error::sqlx("migrating"))?;
        if applied_version(&mut conn, schema).await? == KNOWN_VERSION {
            return Ok(0);
        }
        let mut tx = conn.begin().await.map_err(Error::sqlx("starting the migration transaction"))?;
        match apply(&mut tx, schema).await {
            Ok(applied) => {
                tx.commit().await.map_err(Error::sqlx("committing the migrations"))?;
                Ok(applied)
            }
            Err(e) => {
                let _ = tx.rollback().await;
                Err(e)
            }
        }
    }

    async fn apply(tx: &mut sqlx::PgConnection, schema: &str) -> Result<usize, Error> {
        query(tx, "taking the migration lock", MIGRATION_LOCK, &[Param::Text(&lock_key(schema))]).await?;
        sqlx::Executor::execute(&mut *tx, sqlx::raw_sql(&create_bookkeeping(schema)))
            .await
            .map_err(Error::sqlx("creating the schema"))?;
        let found = applied_version(tx, schema).await?;
        let mut applied = 0;
        for m in MIGRATIONS.iter().filter(|m| m.version > found) {
            tracing::debug!(
                backend = "postgres",
                schema,
                version = m.version,
                name = m.name,
                "idem-postgres: applying migration"
            );
            sqlx::Executor::execute(&mut *tx, sqlx::raw_sql(&m.sql_for(schema)))
                .await
                .map_err(Error::sqlx("applying a migration"))?;
            let sql = record_migration_sql(schema).replace("$1::integer", "$1::bigint::integer");
            query(tx, "recording a migration", &sql, &[Param::I64(i64::from(m.version)), Param::Text(m.name)]).await?;
            applied += 1;
        }
        Ok(applied)
    }
}

/// The SQL text of every statement a store runs, for `EXPLAIN`, for operators, and for
/// benchmarks that send the same statements by hand. Parameters are listed per statement;
/// times and durations are milliseconds (`bigint`), the last parameter of each is the
/// pinned time or `NULL` for the server's clock.
#[derive(Clone, Debug)]
pub struct Statements {
    claim: String,
    reclaim: String,
    complete: String,
    complete_in: String,
    extend: String,
    fail: String,
    read: String,
    sweep: String,
    journal_put: String,
    journal_get: String,
}

/// The record columns, in the order [`record_at`] reads them.
pub(crate) const COLUMNS: [&str; 12] = [
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

/// The isolation levels, as `transaction_isolation` spells them, at which
/// [`Statements::complete_in`] writes: READ COMMITTED, and READ UNCOMMITTED, which
/// PostgreSQL runs as READ COMMITTED.
pub(crate) const COMPLETE_IN_LEVELS: [&str; 2] = ["read committed", "read uncommitted"];

/// The server's clock in whole milliseconds since the epoch (UTC).
const SERVER_NOW_MS: &str = "floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint";

/// `idem_core::FencingToken::first_at(n.ms)`, the first token of a new record generation:
/// the clock in ms, clamped to 0 ..= 2^47 - 1, shifted left by
/// `FencingToken::ATTEMPT_BITS` (16), at least 1. Fits a `bigint` (below 2^63).
const FIRST_TOKEN: &str = "GREATEST(LEAST(GREATEST(n.ms, 0), 140737488355327) << 16, 1)";

impl Statements {
    /// Claim. `$1` id, `$2` principal (UTF-8 bytes), `$3` endpoint (UTF-8 bytes), `$4`
    /// key, `$5` fingerprint, `$6` lease ms, `$7` retention ms, `$8` now. Returns
    /// `inserted, claimed`, the record columns, and `now`: the new claim, or the live
    /// record (`claimed` false, nothing written), or no row when the live record was
    /// committed after the statement's snapshot (read it with [`Statements::read`]).
    #[must_use]
    pub fn claim(&self) -> &str {
        &self.claim
    }

    /// Reclaim. `$1` id, `$2` expected token, `$3` fingerprint, `$4` lease ms, `$5`
    /// retention ms, `$6` now. Returns the record columns and `now`, or no row.
    #[must_use]
    pub fn reclaim(&self) -> &str {
        &self.reclaim
    }

    /// Complete. `$1` id, `$2` token, `$3` encoded response, `$4` now. Returns the record
    /// columns with `response` as `NULL` (the caller has it; a large body is not sent back
    /// over the wire), or no row.
    #[must_use]
    pub fn complete(&self) -> &str {
        &self.complete
    }

    /// Complete inside the caller's transaction
    /// ([`crate::PostgresStore::complete_in`]). Parameters as [`Statements::complete`].
    /// Returns one row: the transaction's `transaction_isolation`, then the record columns
    /// as [`Statements::complete`] returns them, all `NULL` when nothing was written: the
    /// compare-and-set matched nothing, or the transaction runs above READ COMMITTED. In
    /// that case the `UPDATE` never reaches the row, so it cannot fail with a serialization
    /// error (a REPEATABLE READ transaction cannot update a row changed after its snapshot,
    /// as a lease renewal during the handler changes it), and the caller is told why.
    #[must_use]
    pub fn complete_in(&self) -> &str {
        &self.complete_in
    }

    /// Extend (renew the lease). `$1` id, `$2` token, `$3` lease ms, `$4` now. Returns the
    /// record columns as written, or no row.
    #[must_use]
    pub fn extend(&self) -> &str {
        &self.extend
    }

    /// Fail. `$1` id, `$2` token, `$3` now. Returns the record columns, or no row.
    #[must_use]
    pub fn fail(&self) -> &str {
        &self.fail
    }

    /// Read a live record. `$1` id, `$2` now. Returns one row: the record columns (all
    /// `NULL` when absent or expired) and `now`.
    #[must_use]
    pub fn read(&self) -> &str {
        &self.read
    }

    /// Sweep. `$1` batch size, `$2` batch size + 1, `$3` now. Returns `removed, found`.
    #[must_use]
    pub fn sweep(&self) -> &str {
        &self.sweep
    }

    /// Journal put. `$1` id, `$2` token, `$3` name (UTF-8 bytes), `$4` value, `$5`
    /// overwrite, `$6` now. Returns one row: `owned` (the token holds the live in-flight
    /// record), `written`, and `existing` (the current generation's value when not
    /// written, if this statement's snapshot can see it).
    #[must_use]
    pub fn journal_put(&self) -> &str {
        &self.journal_put
    }

    /// Journal read. `$1` id, `$2` name (UTF-8 bytes), `$3` now. Returns the value of the
    /// live record's current generation, or no row.
    #[must_use]
    pub fn journal_get(&self) -> &str {
        &self.journal_get
    }

    pub(crate) fn for_schema(schema: &str) -> Self {
        let table = format!("{}.records", quote_ident(schema));
        let cols = |prefix: &str| COLUMNS.iter().map(|c| format!("{prefix}{c}")).collect::<Vec<_>>().join(", ");
        let now = |p: &str| format!("COALESCE({p}::bigint, {SERVER_NOW_MS})");
        // now + d, saturating like the pure model (a huge retention must not overflow).
        let plus = |d: &str| format!("LEAST(n.ms::numeric + {d}::bigint, 9223372036854775807)::bigint");
        let replace = |c: &str| format!("{c} = EXCLUDED.{c}");
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
        // The upsert writes only when there is no live row: `DO UPDATE ... WHERE expired`
        // locks a live row but leaves it unchanged (no new row version, nothing for a
        // concurrent compare-and-set to conflict with under REPEATABLE READ). The live row
        // is then returned by the second branch as the statement's snapshot saw it; a live
        // row committed after that snapshot returns no row at all, and the store reads it
        // in a fresh statement.
        let claim = format!(
            "WITH n AS (SELECT {now8} AS ms),
up AS (
    INSERT INTO {table} AS t ({cols}, claim_txid)
    SELECT $1::bytea, $2::bytea, $3::bytea, $4::text, $5::bytea, 'in_flight'::text, {FIRST_TOKEN}, NULL::bytea,
           n.ms, n.ms, {lease}, {retention}, txid_current()
    FROM n
    ON CONFLICT (id) DO UPDATE SET
        {replaced_cols},
        token = GREATEST(t.token + 1, EXCLUDED.token)
    WHERE t.expires_at <= EXCLUDED.created_at
    RETURNING (t.xmax = 0) AS inserted, true AS claimed, {tcols}
)
SELECT up.*, n.ms AS now FROM up CROSS JOIN n
UNION ALL
SELECT false, false, {rcols}, n.ms FROM {table} AS r CROSS JOIN n
WHERE r.id = $1::bytea AND n.ms < r.expires_at AND NOT EXISTS (SELECT 1 FROM up)",
            now8 = now("$8"),
            cols = cols(""),
            lease = plus("$6"),
            retention = plus("$7"),
            tcols = cols("t."),
            rcols = cols("r."),
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
        // The isolation test filters the one-row `n`, and a record row reaches the UPDATE only
        // joined to a row of `n`: above READ COMMITTED the join is empty, so no row is locked
        // or updated, and none can raise a serialization failure.
        let complete_in = format!(
            "WITH n AS (SELECT {now4} AS ms, current_setting('transaction_isolation') AS isolation),
done AS (
    UPDATE {table} AS t SET state = 'completed', response = $3::bytea
    FROM n
    WHERE n.isolation IN ({levels})
      AND t.id = $1::bytea AND t.token = $2::bigint AND t.state = 'in_flight' AND n.ms < t.expires_at
    RETURNING {tcols}
)
SELECT n.isolation, done.* FROM n LEFT JOIN done ON true",
            now4 = now("$4"),
            levels = COMPLETE_IN_LEVELS.map(|l| format!("'{l}'")).join(", "),
            tcols = cols("t.").replace("t.response", "NULL::bytea AS response"),
        );
        // The new lease end never moves earlier, and the retention end follows it: a renewed
        // claim is never swept while its lease runs (SET reads the row's old values).
        let extend = format!(
            "WITH n AS (SELECT {now4} AS ms)
UPDATE {table} AS t SET
    lease_expires_at = GREATEST(t.lease_expires_at, {lease}),
    expires_at = GREATEST(t.expires_at, t.lease_expires_at, {lease})
FROM n
WHERE t.id = $1::bytea AND t.token = $2::bigint AND t.state = 'in_flight' AND n.ms < t.expires_at
RETURNING {tcols}",
            now4 = now("$4"),
            lease = plus("$3"),
            tcols = cols("t."),
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
        Self { claim, reclaim, complete, complete_in, extend, fail, read, sweep, journal_put, journal_get }
    }
}

/// The next record of a listing ([`idem_core::Store::list`]) in `schema`. `$1` the cursor
/// (the last id listed, or an empty `bytea`, which sorts before every id), `$2` the state
/// name or `''` for any, `$3` latest `started_at` or `NULL`, `$4` whether to match `$5`,
/// the principal (UTF-8 bytes), `$6` now. Always one row: the record columns (all `NULL`
/// when no further live record matches) and `now`. One record per statement, found
/// through the primary key from the cursor, so a page costs one index step per record
/// and the driver reads single rows only. Built per call (listing is an operator's
/// command, not a request path), so it is not one of the cached [`Statements`].
pub(crate) fn list_statement(schema: &str) -> String {
    let table = format!("{}.records", quote_ident(schema));
    let rcols = COLUMNS.iter().map(|c| format!("r.{c}")).collect::<Vec<_>>().join(", ");
    format!(
        "SELECT {rcols}, n.ms AS now
FROM (SELECT COALESCE($6::bigint, {SERVER_NOW_MS}) AS ms) AS n
LEFT JOIN LATERAL (
    SELECT * FROM {table} AS t
    WHERE t.id > $1::bytea AND n.ms < t.expires_at
      AND ($2::text = '' OR t.state = $2::text)
      AND ($3::bigint IS NULL OR t.started_at <= $3::bigint)
      AND (NOT $4::boolean OR t.principal = $5::bytea)
    ORDER BY t.id
    LIMIT 1
) AS r ON true"
    )
}

/// A token as the `bigint` column holds it. Tokens above `i64::MAX` cannot exist in the
/// table (a generation starts below 2^63 and grows by one per reclaim; the column is
/// signed), so they map to -1, which matches no row.
pub(crate) fn token_param(t: FencingToken) -> i64 {
    i64::try_from(t.0).unwrap_or(-1)
}

/// A value the table's constraints should have excluded: the one "does not decode" kind
/// every backend reports ([`CodecError::BadField`]).
pub(crate) fn corrupt(id: Option<RecordId>, column: &'static str, reason: &'static str) -> StoreError {
    StoreError::Corrupt { id, source: CodecError::BadField { field: column, reason: reason.into() } }
}

/// Reads the record whose columns start at `base` (in [`COLUMNS`] order). Values the
/// table's constraints should have excluded are reported as [`StoreError::Corrupt`].
/// `written` is the response this call just stored (complete), used instead of decoding
/// the column back.
pub(crate) fn record_at(row: &Row, base: usize, written: Option<StoredResponse>) -> Result<Record, StoreError> {
    let id = RecordId(row.bytes(base)?.try_into().map_err(|_| corrupt(None, "id", "not 32 bytes"))?);
    let bad = |column, why| corrupt(Some(id), column, why);
    let text = |idx, column| -> Result<String, StoreError> {
        String::from_utf8(row.bytes(idx)?.to_vec()).map_err(|_| bad(column, "not UTF-8"))
    };
    let principal = text(base + 1, "principal")?;
    let endpoint = text(base + 2, "endpoint")?;
    let key =
        IdempotencyKey::from_stored(row.text(base + 3)?).ok_or_else(|| bad("key", "not a valid idempotency key"))?;
    let fingerprint = Fingerprint(row.bytes(base + 4)?.try_into().map_err(|_| bad("fingerprint", "not 32 bytes"))?);
    let state = RecordState::from_name(row.text(base + 5)?).ok_or_else(|| bad("state", "unknown state"))?;
    let token = u64::try_from(row.i64(base + 6)?).map_err(|_| bad("token", "negative"))?;
    let response = match (written, row.opt_bytes(base + 7)?) {
        (Some(written), _) => Some(written),
        (None, Some(b)) => Some(decode_response(b).map_err(|source| StoreError::Corrupt { id: Some(id), source })?),
        (None, None) => None,
    };
    if response.is_some() != (state == RecordState::Completed) {
        return Err(bad("response", "present exactly when the state is not completed"));
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
        created_at: UnixMillis(row.i64(base + 8)?),
        started_at: UnixMillis(row.i64(base + 9)?),
        lease_expires_at: UnixMillis(row.i64(base + 10)?),
        expires_at: UnixMillis(row.i64(base + 11)?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schema_names() {
        for ok in ["idem", "_x", "a1_b2", &"a".repeat(63)] {
            assert!(validate_schema(ok).is_ok(), "{ok}");
        }
        for bad in ["", "Idem", "1a", "a-b", "a b", "a\"b", "pg_idem", "é", &"a".repeat(64), "a;drop"] {
            assert!(matches!(validate_schema(bad), Err(Error::InvalidSchema { .. })), "{bad}");
        }
    }

    #[test]
    fn statements_quote_the_schema() {
        let s = Statements::for_schema("idem_x");
        assert!(s.claim().contains("\"idem_x\".records"));
        assert!(s.sweep().contains("SKIP LOCKED"));
        assert!(s.journal_put().contains("\"idem_x\".journal"));
        assert!(s.extend().contains("t.token = $2::bigint AND t.state = 'in_flight' AND n.ms < t.expires_at"));
        assert!(s.claim().contains(FIRST_TOKEN));
        assert!(s.complete_in().contains("n.isolation IN ('read committed', 'read uncommitted')"));
    }

    #[test]
    fn quoting_doubles_quotes() {
        assert_eq!(quote_ident("a\"b"), "\"a\"\"b\"");
    }

    #[test]
    fn migrations_are_ordered_and_name_the_schema() {
        for (i, m) in MIGRATIONS.iter().enumerate() {
            assert_eq!(m.version(), i32::try_from(i + 1).unwrap());
            assert!(m.sql.contains("{schema}"));
        }
        assert_eq!(KNOWN_VERSION, 2);
        assert!(MIGRATIONS[0].sql_for("idem").contains("\"idem\".records"));
        assert!(MIGRATIONS[1].sql_for("idem").contains("REFERENCES \"idem\".records (id) ON DELETE CASCADE"));
    }
}
