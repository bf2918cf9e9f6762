//! The SQL of the store: the schema name, the shipped migrations and how they run, the
//! text of every statement, how a statement is sent, and how a returned row becomes a
//! record.
//!
//! Migrations are SQL files in `migrations/`, compiled in with `include_str!`, naming the
//! schema as `{schema}`. Applied versions are recorded in `<schema>.schema_migrations`;
//! [`migrate`] applies only what is missing, in one transaction under an advisory lock.

use std::borrow::Cow;
use std::fmt::Write as _;

use idem_core::codec::{CodecError, decode_response};
use idem_core::{
    Endpoint, FencingToken, Fingerprint, IdempotencyKey, Principal, Receipt, Record, RecordId, RecordState, Scope,
    StoreError, UnixMillis,
};
use sqlx::postgres::{PgRow, PgValueFormat};
use sqlx::{Connection as _, PgConnection, Postgres, Row as _};

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

    /// The SQL for `schema` (a name [`validate_schema`] accepts), several statements in one
    /// string. A team running its own migration tool applies it, then records `(version,
    /// name)` in `<schema>.schema_migrations` (created by [`crate::PostgresStore::migrate`],
    /// or by hand: `version integer PRIMARY KEY, name text NOT NULL, applied_at timestamptz
    /// NOT NULL DEFAULT now()`), so that stores built without auto-migration find it.
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

/// The schema used when none is configured.
pub const DEFAULT_SCHEMA: &str = "idem";

/// Checks a schema name: 1 to 63 bytes (PostgreSQL's identifier limit), a lower-case ASCII
/// letter or `_` first, then lower-case ASCII letters, digits or `_`, and not starting
/// with `pg_` (reserved for system schemas). Lower case only, because PostgreSQL folds
/// unquoted names to lower case: a name that needs quoting to keep its case would name a
/// different schema in `psql`. The name is still always quoted in SQL.
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
pub(crate) fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// A statement parameter. Every statement names each parameter's type (`$1::bytea`), so a
/// value is one of these few shapes, bound (prepared statements) or inlined ([`inline`]).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Param<'a> {
    Bytes(&'a [u8]),
    Text(&'a str),
    I64(i64),
    OptI64(Option<i64>),
    Bool(bool),
}

/// Runs one statement on `conn` and returns its first row: prepared and cached by sqlx, or
/// (`prepared` false, for PgBouncer in transaction mode) one simple-protocol `Query`
/// message with the values inlined, so nothing outlives the statement on the server.
pub(crate) async fn query(
    conn: &mut PgConnection,
    sql: &str,
    params: &[Param<'_>],
    prepared: bool,
) -> Result<Option<PgRow>, sqlx::Error> {
    if !prepared {
        // `RawSql::fetch_optional` of sqlx 0.8 is `fetch_one`; the executor's is not.
        return sqlx::Executor::fetch_optional(conn, sqlx::raw_sql(&inline(sql, params))).await;
    }
    let mut q = sqlx::query(sql);
    for p in params {
        q = match *p {
            Param::Bytes(b) => q.bind(b),
            Param::Text(s) => q.bind(s),
            Param::I64(v) => q.bind(v),
            Param::OptI64(v) => q.bind(v),
            Param::Bool(v) => q.bind(v),
        };
    }
    q.fetch_optional(conn).await
}

/// `sql` with every `$n` replaced by the literal of `params[n - 1]`. Only hex digits,
/// decimal digits and fixed SQL reach the text, so no value can change the statement, and
/// the result does not depend on `standard_conforming_strings`: bytes and strings travel
/// hex-encoded through `decode(..., 'hex')`.
pub(crate) fn inline(sql: &str, params: &[Param<'_>]) -> String {
    let hex = |out: &mut String, b: &[u8]| {
        for byte in b {
            let _ = write!(out, "{byte:02x}");
        }
    };
    let mut out = String::with_capacity(sql.len() + 64);
    let mut rest = sql;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let digits = rest[at + 1..].bytes().take_while(u8::is_ascii_digit).count();
        let param = rest[at + 1..at + 1 + digits].parse::<usize>().ok().and_then(|n| params.get(n.checked_sub(1)?));
        match param {
            None => out.push_str(&rest[at..at + 1 + digits]),
            Some(Param::Bytes(b)) => {
                out.push_str("decode('");
                hex(&mut out, b);
                out.push_str("', 'hex')");
            }
            Some(Param::Text(t)) => {
                out.push_str("convert_from(decode('");
                hex(&mut out, t.as_bytes());
                out.push_str("', 'hex'), 'UTF8')");
            }
            Some(Param::I64(v) | Param::OptI64(Some(v))) => {
                let _ = write!(out, "({v})");
            }
            Some(Param::OptI64(None)) => out.push_str("NULL"),
            Some(Param::Bool(v)) => {
                let _ = write!(out, "{v}");
            }
        }
        rest = &rest[at + 1 + digits..];
    }
    out.push_str(rest);
    out
}

/// Whether the bookkeeping table exists is asked of the catalog, not by naming it: a failed
/// lookup by name leaves the session a cached "no such schema", which the migration that
/// follows would trust even after another process created the schema meanwhile.
const MIGRATIONS_TABLE_EXISTS: &str = "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_class AS c
    JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
    WHERE n.nspname = $1::text AND c.relname = 'schema_migrations')";

/// The highest migration recorded in `schema` (0 when it has none, or does not exist),
/// read without changing anything; refuses a schema migrated by a newer build. Simple
/// protocol only, so that it runs behind PgBouncer in transaction mode too.
async fn applied_version(conn: &mut PgConnection, schema: &str) -> Result<i32, Error> {
    const OP: &str = "reading the schema's migration version";
    let row = query(conn, MIGRATIONS_TABLE_EXISTS, &[Param::Text(schema)], false).await;
    let exists: bool = row.and_then(|r| r.map_or(Ok(false), |r| r.try_get(0))).map_err(Error::postgres(OP))?;
    if !exists {
        return Ok(0);
    }
    let sql = format!("SELECT COALESCE(max(version), 0) FROM {}.schema_migrations", quote_ident(schema));
    let row = query(conn, &sql, &[], false).await;
    let found: i32 = row.and_then(|r| r.map_or(Ok(0), |r| r.try_get(0))).map_err(Error::postgres(OP))?;
    if found > KNOWN_VERSION {
        return Err(Error::SchemaTooNew { schema: schema.to_owned(), found, known: KNOWN_VERSION });
    }
    Ok(found)
}

/// Checks, without changing anything, that `schema` is at exactly this build's migration:
/// the start-up check of a store built without auto-migration.
pub(crate) async fn check_migrated(pool: &sqlx::PgPool, schema: &str) -> Result<(), Error> {
    let mut conn = pool.acquire().await.map_err(Error::connection("reading the schema's migration version"))?;
    match applied_version(&mut conn, schema).await? {
        KNOWN_VERSION => Ok(()),
        found => Err(Error::NotMigrated { schema: schema.to_owned(), found, known: KNOWN_VERSION }),
    }
}

/// Applies the missing migrations to `schema` in one transaction; returns how many ran. A
/// schema already at this build's migration is left alone after one read, so starting a
/// store on it needs no privilege beyond using the tables.
pub(crate) async fn migrate(pool: &sqlx::PgPool, schema: &str) -> Result<usize, Error> {
    let mut conn = pool.acquire().await.map_err(Error::connection("migrating"))?;
    if applied_version(&mut conn, schema).await? == KNOWN_VERSION {
        return Ok(0);
    }
    let mut tx = conn.begin().await.map_err(Error::postgres("starting the migration transaction"))?;
    match apply(&mut tx, schema).await {
        Ok(applied) => {
            tx.commit().await.map_err(Error::postgres("committing the migrations"))?;
            Ok(applied)
        }
        Err(e) => {
            // Now rather than on drop, so the session lets go of its locks at once.
            let _ = tx.rollback().await;
            Err(e)
        }
    }
}

async fn apply(tx: &mut PgConnection, schema: &str) -> Result<usize, Error> {
    let q = quote_ident(schema);
    // Serialises concurrent migrate() calls (replicas starting together); released at
    // commit or rollback, so nothing outlives the transaction (PgBouncer-safe).
    let lock = "SELECT pg_advisory_xact_lock(hashtext($1::text))";
    let key = format!("idem-postgres migrate {schema}");
    query(tx, lock, &[Param::Text(&key)], false).await.map_err(Error::postgres("taking the migration lock"))?;
    let bookkeeping = format!(
        "CREATE SCHEMA IF NOT EXISTS {q};
         CREATE TABLE IF NOT EXISTS {q}.schema_migrations (
             version    integer     PRIMARY KEY,
             name       text        NOT NULL,
             applied_at timestamptz NOT NULL DEFAULT now()
         );"
    );
    sqlx::Executor::execute(&mut *tx, sqlx::raw_sql(&bookkeeping))
        .await
        .map_err(Error::postgres("creating the schema"))?;
    // Read again under the lock: another process may have migrated meanwhile.
    let found = applied_version(tx, schema).await?;
    let record = format!("INSERT INTO {q}.schema_migrations (version, name) VALUES ($1::integer, $2::text)");
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
            .map_err(Error::postgres("applying a migration"))?;
        query(tx, &record, &[Param::I64(i64::from(m.version)), Param::Text(m.name)], false)
            .await
            .map_err(Error::postgres("recording a migration"))?;
        applied += 1;
    }
    Ok(applied)
}

/// A statement the store runs, named for [`crate::PostgresStore::sql`]: its text for
/// `EXPLAIN`, for operators, and for benchmarks that send it by hand. Times and durations
/// are `bigint` milliseconds; ids, fingerprints, principals and endpoints `bytea` (the
/// latter two as UTF-8); the last parameter of each is the pinned time, `NULL` for the
/// server's clock. "The record columns" are `id, principal, endpoint, key, fingerprint,
/// state, token, response, created_at, started_at, lease_expires_at, expires_at`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Statement {
    /// `$1` id, `$2` principal, `$3` endpoint, `$4` key (`text`), `$5` fingerprint, `$6`
    /// lease, `$7` retention, `$8` now. Returns `inserted, claimed`, the record columns and
    /// `now`: the new claim, or the live record (`claimed` false, nothing written), or no
    /// row when the live record was committed after the statement's snapshot (then
    /// [`Statement::Read`] finds it).
    Claim,
    /// `$1` id, `$2` expected token, `$3` fingerprint, `$4` lease, `$5` retention, `$6`
    /// now. Returns the record columns and `now`, or no row.
    Reclaim,
    /// `$1` id, `$2` token, `$3` encoded response, `$4` now. Returns the record columns with
    /// `response` `NULL` (the caller has it), or no row.
    Complete,
    /// As [`Statement::Complete`], inside the caller's transaction. Returns one row: the
    /// transaction's `transaction_isolation`, then the columns of [`Statement::Complete`],
    /// all `NULL` when nothing was written (no match, or a level above READ COMMITTED, in
    /// which case the `UPDATE` never reaches the row).
    CompleteIn,
    /// `$1` id, `$2` token, `$3` lease, `$4` now. Returns the record columns, or no row.
    Extend,
    /// `$1` id, `$2` token, `$3` now. Returns the record columns, or no row.
    Fail,
    /// `$1` id, `$2` now. Returns one row: the record columns (all `NULL` when absent or
    /// expired) and `now`.
    Read,
    /// `$1` batch size, `$2` batch size + 1, `$3` now. Returns `removed, found`.
    Sweep,
    /// `$1` id, `$2` token, `$3` name (UTF-8), `$4` value, `$5` overwrite (`boolean`), `$6`
    /// now. Returns `owned` (the token holds the live in-flight record), `written`, and
    /// `existing` (the current generation's value when not written, if this statement's
    /// snapshot sees it).
    JournalPut,
    /// `$1` id, `$2` name (UTF-8), `$3` now. Returns the value of the live record's current
    /// generation, or no row.
    JournalGet,
    /// The live record after a cursor: `$1` the last id listed (empty sorts first), `$2`
    /// state name or `''` for any, `$3` latest `started_at` or `NULL`, `$4` whether to
    /// match `$5`, the principal, `$6` now. Returns one row: the record columns (all `NULL`
    /// when none is left) and `now`.
    List,
}

/// The text of every [`Statement`] for one schema, indexed by the statement.
#[derive(Clone, Debug)]
pub(crate) struct Statements([String; 11]);

impl std::ops::Index<Statement> for Statements {
    type Output = str;

    fn index(&self, s: Statement) -> &str {
        &self.0[s as usize]
    }
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
/// [`Statement::CompleteIn`] writes: READ COMMITTED, and READ UNCOMMITTED, which PostgreSQL
/// runs as READ COMMITTED.
pub(crate) const COMPLETE_IN_LEVELS: [&str; 2] = ["read committed", "read uncommitted"];

/// `NOTIFY` of `PostgresStore::settled`, committed without waiting for its WAL flush (a
/// transaction that notifies holds a database-wide lock until its commit ends).
pub(crate) const NOTIFY: &str =
    "SELECT set_config('synchronous_commit', 'off', true) IS NULL, pg_notify($1::text, $2::text) IS NULL";

/// The server's clock in whole milliseconds since the epoch (UTC).
const SERVER_NOW_MS: &str = "floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint";

/// `idem_core::FencingToken::first_at(n.ms)`, the first token of a new record generation:
/// the clock in ms, clamped to 0 ..= 2^47 - 1, shifted left by 16, at least 1.
const FIRST_TOKEN: &str = "GREATEST(LEAST(GREATEST(n.ms, 0), 140737488355327) << 16, 1)";

impl Statements {
    #[cfg(test)]
    pub(crate) fn for_schema(schema: &str) -> Self {
        Self::new(schema, true)
    }

    /// The statements on `schema`; with `notify`, complete and fail send `NOTIFY`.
    pub(crate) fn new(schema: &str, notify: bool) -> Self {
        let table = format!("{}.records", quote_ident(schema));
        let journal = format!("{}.journal", quote_ident(schema));
        let cols = |prefix: &str| COLUMNS.iter().map(|c| format!("{prefix}{c}")).collect::<Vec<_>>().join(", ");
        let (tcols, rcols) = (cols("t."), cols("r."));
        let tcols_no_response = tcols.replace("t.response", "NULL::bytea AS response");
        let now = |p: &str| format!("COALESCE({p}::bigint, {SERVER_NOW_MS})");
        // In the handler's transaction (`complete_in`), wakes the record's waiters
        // (`PostgresStore::settlements`) at its commit, on the schema's channel; a boolean
        // rather than `void`, which a driver may not decode.
        let settled = if notify {
            format!("pg_notify('{schema}', encode(t.id, 'hex')) IS NULL AS settled")
        } else {
            "NULL::boolean AS settled".to_owned()
        };
        // now + d, saturating like the pure model (a huge retention must not overflow).
        let plus = |d: &str| format!("LEAST(n.ms::numeric + {d}::bigint, 9223372036854775807)::bigint");
        // Every column but the id and the token (which the claim computes), and the claim's txid.
        let replaced = (COLUMNS.iter().filter(|c| !matches!(**c, "id" | "token")).chain(&["claim_txid"]))
            .map(|c| format!("{c} = EXCLUDED.{c}"))
            .collect::<Vec<_>>()
            .join(",\n        ");
        // The upsert writes only when there is no live row: `DO UPDATE ... WHERE expired`
        // locks a live row but leaves it unchanged (no new row version, nothing for a
        // concurrent compare-and-set to conflict with under REPEATABLE READ). The second
        // branch returns the live row as the statement's snapshot saw it; a live row
        // committed after that snapshot returns no row, and the store reads it afresh.
        let claim = format!(
            "WITH n AS (SELECT {now8} AS ms),
up AS (
    INSERT INTO {table} AS t ({cols}, claim_txid)
    SELECT $1::bytea, $2::bytea, $3::bytea, $4::text, $5::bytea, 'in_flight'::text, {FIRST_TOKEN}, NULL::bytea,
           n.ms, n.ms, {lease}, {retention}, txid_current()
    FROM n
    ON CONFLICT (id) DO UPDATE SET
        {replaced},
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
        );
        let complete = format!(
            "WITH n AS (SELECT {now4} AS ms)
UPDATE {table} AS t SET state = 'completed', response = $3::bytea
FROM n
WHERE t.id = $1::bytea AND t.token = $2::bigint AND t.state = 'in_flight' AND n.ms < t.expires_at
RETURNING {tcols_no_response}",
            now4 = now("$4"),
        );
        // The level is checked in the one-row `n`, and a record row reaches the UPDATE only
        // joined to a row of `n`: above READ COMMITTED the join is empty, so no row is
        // locked or updated, and none can raise a serialization failure.
        let complete_in = format!(
            "WITH n AS (SELECT {now4} AS ms, current_setting('transaction_isolation') AS isolation),
done AS (
    UPDATE {table} AS t SET state = 'completed', response = $3::bytea
    FROM n
    WHERE n.isolation IN ({levels})
      AND t.id = $1::bytea AND t.token = $2::bigint AND t.state = 'in_flight' AND n.ms < t.expires_at
    RETURNING {tcols_no_response}, {settled}
)
SELECT n.isolation, done.* FROM n LEFT JOIN done ON true",
            now4 = now("$4"),
            levels = COMPLETE_IN_LEVELS.map(|l| format!("'{l}'")).join(", "),
        );
        // The lease end never moves earlier, and the retention end follows it: a renewed
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
        );
        let fail = format!(
            "WITH n AS (SELECT {now3} AS ms)
UPDATE {table} AS t SET state = 'failed', response = NULL, lease_expires_at = LEAST(t.lease_expires_at, n.ms)
FROM n
WHERE t.id = $1::bytea AND t.token = $2::bigint AND t.state = 'in_flight' AND n.ms < t.expires_at
RETURNING {tcols}",
            now3 = now("$3"),
        );
        let read = format!(
            "SELECT {rcols}, n.ms AS now
FROM (SELECT {now2} AS ms) AS n
LEFT JOIN {table} AS r ON r.id = $1::bytea AND n.ms < r.expires_at",
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
        // The parent row is locked FOR SHARE until the put commits: a reclaim, complete,
        // fail or replacing claim waits for it, so the entry is written while the token
        // still owns the record (FOR SHARE re-checks the conditions on the newest row
        // version if one committed meanwhile).
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
        // One record per statement, found through the primary key from the cursor: a page
        // costs one index step per record and only single rows cross the wire.
        let list = format!(
            "SELECT {rcols}, n.ms AS now
FROM (SELECT {now6} AS ms) AS n
LEFT JOIN LATERAL (
    SELECT * FROM {table} AS t
    WHERE t.id > $1::bytea AND n.ms < t.expires_at
      AND ($2::text = '' OR t.state = $2::text)
      AND ($3::bigint IS NULL OR t.started_at <= $3::bigint)
      AND (NOT $4::boolean OR t.principal = $5::bytea)
    ORDER BY t.id
    LIMIT 1
) AS r ON true",
            now6 = now("$6"),
        );
        // In the order of `Statement`'s variants.
        Self([claim, reclaim, complete, complete_in, extend, fail, read, sweep, journal_put, journal_get, list])
    }
}

/// A token as the `bigint` column holds it. Tokens above `i64::MAX` cannot exist in the
/// table (a generation starts below 2^63 and grows by one per reclaim), so they map to -1,
/// which matches no row.
pub(crate) fn token_param(t: FencingToken) -> i64 {
    i64::try_from(t.0).unwrap_or(-1)
}

/// A value the table's constraints should have excluded: the one "does not decode" kind
/// every backend reports ([`CodecError::BadField`]).
pub(crate) fn corrupt(id: Option<RecordId>, column: &'static str, reason: impl Into<String>) -> StoreError {
    StoreError::Corrupt { id, source: CodecError::BadField { field: column, reason: reason.into() } }
}

/// Typed reads of a row's columns by index; a value of another type (or `NULL` where none
/// may be) is [`StoreError::Corrupt`], naming the record once it is known.
#[derive(Clone, Copy)]
pub(crate) struct Columns<'r> {
    pub(crate) row: &'r PgRow,
    pub(crate) id: Option<RecordId>,
}

impl<'r> Columns<'r> {
    pub(crate) fn of(row: &'r PgRow) -> Self {
        Self { row, id: None }
    }

    pub(crate) fn get<T: sqlx::Decode<'r, Postgres> + sqlx::Type<Postgres>>(
        self,
        idx: usize,
        column: &'static str,
    ) -> Result<T, StoreError> {
        self.row.try_get(idx).map_err(|e| corrupt(self.id, column, e.to_string()))
    }

    /// A `bytea` column: borrowed from the row when it came in binary (prepared
    /// statements), decoded from its hex text otherwise (simple query protocol).
    pub(crate) fn bytes(self, idx: usize, column: &'static str) -> Result<Option<Cow<'r, [u8]>>, StoreError> {
        let text = self.row.try_get_raw(idx).map_err(|e| corrupt(self.id, column, e.to_string()))?.format();
        if text == PgValueFormat::Text {
            Ok(self.get::<Option<Vec<u8>>>(idx, column)?.map(Cow::Owned))
        } else {
            Ok(self.get::<Option<&[u8]>>(idx, column)?.map(Cow::Borrowed))
        }
    }

    /// A `bytea` column that may not be `NULL`.
    pub(crate) fn some_bytes(self, idx: usize, column: &'static str) -> Result<Cow<'r, [u8]>, StoreError> {
        self.bytes(idx, column)?.ok_or_else(|| corrupt(self.id, column, "NULL"))
    }
}

/// The receipt of the record whose columns start at `base` (in [`COLUMNS`] order): its
/// token and times, without decoding the rest of the row.
pub(crate) fn receipt_at(row: &PgRow, base: usize, id: RecordId) -> Result<Receipt, StoreError> {
    let c = Columns { row, id: Some(id) };
    let token = u64::try_from(c.get::<i64>(base + 6, "token")?).map_err(|_| corrupt(Some(id), "token", "negative"))?;
    let ms = |idx, column| c.get::<i64>(idx, column).map(UnixMillis);
    Ok(Receipt {
        token: FencingToken(token),
        lease_expires_at: ms(base + 10, "lease_expires_at")?,
        expires_at: ms(base + 11, "expires_at")?,
    })
}

/// Reads the record whose columns start at `base` (in [`COLUMNS`] order).
pub(crate) fn record_at(row: &PgRow, base: usize) -> Result<Record, StoreError> {
    let raw_id = Columns::of(row).some_bytes(base, "id")?;
    let id = RecordId::from_bytes(raw_id.as_ref().try_into().map_err(|_| corrupt(None, "id", "not 32 bytes"))?);
    let c = Columns { row, id: Some(id) };
    let bad = |column, why: &str| corrupt(Some(id), column, why);
    let text =
        |idx, column| String::from_utf8(c.some_bytes(idx, column)?.into_owned()).map_err(|_| bad(column, "not UTF-8"));
    let principal = Principal::new(text(base + 1, "principal")?).map_err(|_| bad("principal", "blank"))?;
    let endpoint = Endpoint::from(text(base + 2, "endpoint")?);
    let key = IdempotencyKey::from_stored(c.get(base + 3, "key")?).ok_or_else(|| bad("key", "not a valid key"))?;
    let fingerprint = c.some_bytes(base + 4, "fingerprint")?;
    let fingerprint =
        Fingerprint::from_bytes(fingerprint.as_ref().try_into().map_err(|_| bad("fingerprint", "not 32 bytes"))?);
    let state = RecordState::from_name(c.get(base + 5, "state")?).ok_or_else(|| bad("state", "unknown state"))?;
    let token = u64::try_from(c.get::<i64>(base + 6, "token")?).map_err(|_| bad("token", "negative"))?;
    let response = match c.bytes(base + 7, "response")? {
        Some(b) => Some(decode_response(&b).map_err(|source| StoreError::Corrupt { id: Some(id), source })?),
        None => None,
    };
    if response.is_some() != (state == RecordState::Completed) {
        return Err(bad("response", "a response without the completed state, or none with it"));
    }
    let scope = Scope { principal, endpoint };
    // A row whose scope and key hash to another id (copied between rows by something with
    // write access to the table) would replay one tenant's response under another's key.
    if scope.record_id(&key) != id {
        return Err(bad("id", "the scope and key name another record"));
    }
    let ms = |idx, column| c.get::<i64>(idx, column).map(UnixMillis);
    Ok(Record {
        id,
        scope,
        key,
        fingerprint,
        state,
        token: FencingToken(token),
        response,
        created_at: ms(base + 8, "created_at")?,
        started_at: ms(base + 9, "started_at")?,
        lease_expires_at: ms(base + 10, "lease_expires_at")?,
        expires_at: ms(base + 11, "expires_at")?,
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
        assert_eq!(quote_ident("a\"b"), "\"a\"\"b\"");
    }

    #[test]
    fn statements_quote_the_schema() {
        let s = Statements::for_schema("idem_x");
        assert!(s[Statement::Claim].contains("\"idem_x\".records") && s[Statement::Claim].contains(FIRST_TOKEN));
        assert!(s[Statement::Sweep].contains("SKIP LOCKED"));
        assert!(s[Statement::JournalPut].contains("\"idem_x\".journal"));
        assert!(
            s[Statement::Extend].contains("t.token = $2::bigint AND t.state = 'in_flight' AND n.ms < t.expires_at")
        );
        assert!(s[Statement::CompleteIn].contains("n.isolation IN ('read committed', 'read uncommitted')"));
        // Each variant indexes its own text.
        assert!(s[Statement::Reclaim].contains("token = t.token + 1, response = NULL"));
        assert!(
            s[Statement::Complete].contains("state = 'completed'") && !s[Statement::Complete].contains("isolation")
        );
        assert!(s[Statement::Fail].contains("state = 'failed'"));
        assert!(s[Statement::Read].starts_with("SELECT r.id") && s[Statement::Sweep].contains("DELETE"));
        assert!(s[Statement::JournalGet].starts_with("SELECT j.value") && s[Statement::List].contains("LATERAL"));
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

    #[test]
    fn inline_writes_only_hex_and_digits() {
        let sql = "SELECT $1::bytea, $2::text, $3::bigint, $4::bigint, $5::boolean, $10, $";
        let params =
            [Param::Bytes(b"'; DROP"), Param::Text("a'b"), Param::I64(-5), Param::OptI64(None), Param::Bool(true)];
        assert_eq!(
            inline(sql, &params),
            "SELECT decode('273b2044524f50', 'hex')::bytea, convert_from(decode('612762', 'hex'), 'UTF8')::text, \
             (-5)::bigint, NULL::bigint, true::boolean, $10, $"
        );
    }
}
