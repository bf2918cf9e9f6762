//! The schema name, the shipped migrations, and how they run.
//!
//! Migrations are SQL files in `migrations/`, compiled into the crate with `include_str!`
//! and applied in version order by [`crate::PostgresStore::migrate`]. Each file names the
//! schema as `{schema}`, replaced by the quoted schema name before it runs. Applied
//! versions are recorded in `<schema>.schema_migrations`; running `migrate()` again
//! applies only what is missing, and concurrent callers serialise on an advisory lock.
//! Teams that run their own migration tool can take [`MIGRATIONS`] and
//! [`Migration::sql_for`] instead.

use deadpool_postgres::Pool;

use crate::error::Error;

/// One versioned migration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Migration {
    /// Version, starting at 1, strictly increasing.
    pub version: i32,
    /// Short name (the file name without the number).
    pub name: &'static str,
    /// The SQL, with `{schema}` where the quoted schema name goes.
    pub sql: &'static str,
}

impl Migration {
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
pub(crate) async fn migrate(pool: &Pool, schema: &str) -> Result<usize, Error> {
    let mut client = pool.get().await.map_err(|source| Error::Connection { operation: "migrating", source })?;
    let tx = client.transaction().await.map_err(pg("starting the migration transaction"))?;
    match apply(&tx, schema).await {
        Ok(applied) => {
            tx.commit().await.map_err(pg("committing the migrations"))?;
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

fn pg(operation: &'static str) -> impl Fn(tokio_postgres::Error) -> Error {
    move |source| Error::Postgres { operation, source }
}

async fn apply(tx: &deadpool_postgres::Transaction<'_>, schema: &str) -> Result<usize, Error> {
    let q = quote_ident(schema);
    // Serialise concurrent migrate() calls on this schema (several replicas starting at
    // once); the lock is released at commit or rollback.
    tx.execute("SELECT pg_advisory_xact_lock(hashtext($1))", &[&format!("idem-postgres migrate {schema}")])
        .await
        .map_err(pg("taking the migration lock"))?;
    tx.batch_execute(&format!(
        "CREATE SCHEMA IF NOT EXISTS {q};
         CREATE TABLE IF NOT EXISTS {q}.schema_migrations (
             version    integer     PRIMARY KEY,
             name       text        NOT NULL,
             applied_at timestamptz NOT NULL DEFAULT now()
         );"
    ))
    .await
    .map_err(pg("creating the schema"))?;
    let found: i32 = tx
        .query_one(&format!("SELECT COALESCE(max(version), 0) FROM {q}.schema_migrations"), &[])
        .await
        .and_then(|row| row.try_get(0))
        .map_err(pg("reading applied migrations"))?;
    let known = MIGRATIONS.last().map_or(0, |m| m.version);
    if found > known {
        return Err(Error::SchemaTooNew { schema: schema.to_owned(), found, known });
    }
    let mut applied = 0;
    for m in MIGRATIONS.iter().filter(|m| m.version > found) {
        tx.batch_execute(&m.sql_for(schema)).await.map_err(pg("applying a migration"))?;
        tx.execute(
            &format!("INSERT INTO {q}.schema_migrations (version, name) VALUES ($1, $2)"),
            &[&m.version, &m.name],
        )
        .await
        .map_err(pg("recording a migration"))?;
        applied += 1;
    }
    Ok(applied)
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
    fn quoting_doubles_quotes() {
        assert_eq!(quote_ident("a\"b"), "\"a\"\"b\"");
    }

    #[test]
    fn migrations_are_ordered_and_name_the_schema() {
        for (i, m) in MIGRATIONS.iter().enumerate() {
            assert_eq!(m.version, i32::try_from(i + 1).unwrap());
            assert!(m.sql.contains("{schema}"));
        }
        assert!(MIGRATIONS[0].sql_for("idem").contains("\"idem\".records"));
        assert!(MIGRATIONS[1].sql_for("idem").contains("REFERENCES \"idem\".records (id) ON DELETE CASCADE"));
    }
}
