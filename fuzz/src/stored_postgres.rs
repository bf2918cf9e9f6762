//! Target `stored_postgres`: a `records` row as a hostile writer with `UPDATE` on the table,
//! or one that dropped its constraints and changed its column types, could leave it, read
//! back through the store.
//!
//! Input: the twelve record columns of idem-postgres's documented schema (id, principal,
//! endpoint, key, fingerprint, state, token, response, created_at, started_at,
//! lease_expires_at, expires_at), each a tag byte (NULL, bytes, text, bigint, boolean)
//! then its value. For each input the body builds a `PostgresStore` in a schema of its own
//! on the PostgreSQL at `IDEM_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`), which creates the table; then, on its own
//! sqlx connection, drops the table's constraints and indexes, gives each column the type
//! of its value where they differ, and inserts the row. A second store on that schema
//! (fresh connections: no statement prepared against the old column types) reads it with
//! `get`. It must answer with a record whose id is the id column and which holds a
//! response exactly when completed, or an error, never panic and never allocate without
//! bound, the same answer twice; an accepted record round-trips through its row. The
//! schema is dropped after the input.

use std::cell::{Cell, RefCell};
use std::sync::Arc;

use idem_core::codec::encode_response;
use idem_core::{ManualClock, Record, RecordId, RecordState, Store};
use idem_postgres::{Config, PostgresStore};
use sqlx::{Connection, Executor, PgConnection};

use crate::{Input, NOW, push_field, runtime, same_read};

/// The twelve record columns, in the order of the input.
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

/// A column value as the input gives it.
#[derive(Clone, Debug, PartialEq)]
enum Value {
    Null,
    Bytes(Vec<u8>),
    Text(String),
    I64(i64),
    Bool(bool),
}

impl Value {
    /// The column type that holds this value (`None`: any).
    fn sql_type(&self) -> Option<&'static str> {
        match self {
            Value::Null => None,
            Value::Bytes(_) => Some("bytea"),
            Value::Text(_) => Some("text"),
            Value::I64(_) => Some("bigint"),
            Value::Bool(_) => Some("boolean"),
        }
    }
}

fn value(input: &mut Input<'_>) -> Value {
    match input.byte() % 5 {
        0 => Value::Null,
        1 => Value::Bytes(input.field().to_vec()),
        2 => Value::Text(String::from_utf8_lossy(input.field()).into_owned()),
        3 => Value::I64(i64::from_le_bytes(input.field().try_into().unwrap_or_default())),
        _ => Value::Bool(input.byte() % 2 == 1),
    }
}

/// The runtime and the hostile writer's connection, made once per thread.
struct Session {
    rt: tokio::runtime::Runtime,
    writer: PgConnection,
    url: String,
    /// This process's schemas are `idem_fuzz_<tag>_<input>`: process id and start time.
    tag: String,
    inputs: Cell<u64>,
}

thread_local! {
    static SESSION: RefCell<Option<Session>> = const { RefCell::new(None) };
}

fn session() -> Session {
    let url =
        std::env::var("IDEM_POSTGRES_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let rt = runtime();
    let writer = rt.block_on(PgConnection::connect(&url)).unwrap_or_else(|e| {
        panic!(
            "stored_postgres needs the PostgreSQL at {url} (scripts/services starts it, or set IDEM_POSTGRES_URL): {e}"
        )
    });
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    Session { rt, writer, url, tag: format!("{}_{nanos}", std::process::id()), inputs: Cell::new(0) }
}

/// Panics only on a bug in the store's read path (see the module docs).
pub fn stored_record(data: &[u8]) {
    let mut input = Input(data);
    let values: Vec<Value> = (0..12).map(|_| value(&mut input)).collect();
    // `get` looks a record up by its 32-byte id; another id column is never found.
    let id = match &values[0] {
        Value::Bytes(b) => RecordId::from_bytes(b.as_slice().try_into().unwrap_or([0; 32])),
        _ => RecordId::from_bytes([0; 32]),
    };
    SESSION.with(|slot| {
        let mut slot = slot.borrow_mut();
        let s = slot.get_or_insert_with(session);
        let n = s.inputs.get();
        s.inputs.set(n + 1);
        let schema = format!("idem_fuzz_{}_{n}", s.tag);
        let config = || {
            Config::default()
                .with_schema(schema.clone())
                .with_clock(Arc::new(ManualClock::new(NOW)))
                .with_max_connections(1)
        };
        s.rt.block_on(async {
            let creator = PostgresStore::connect(&s.url, config()).await.expect("the store creates its schema");
            drop(creator);
            if planted(plant(&mut s.writer, &schema, &values).await) {
                let store = PostgresStore::connect(&s.url, config()).await.expect("the store opens its schema");
                let first = store.get(id).await;
                if let Ok(Some(record)) = same_read(first, &store.get(id).await) {
                    assert_eq!(Value::Bytes(record.id.as_bytes().to_vec()), values[0], "the id is the id column");
                    assert_eq!(
                        record.response.is_some(),
                        record.state == RecordState::Completed,
                        "a response iff completed"
                    );
                    if let Some(response) = &record.response {
                        let _ = response.body_bytes();
                    }
                    // In the table as planted (the store's statements stay prepared), where its
                    // columns still take the store's own types.
                    let table = format!("{schema}.records");
                    if planted(replace(&mut s.writer, &table, &columns(&record)).await) {
                        let again = store.get(id).await;
                        assert_eq!(again.ok().flatten().as_ref(), Some(&record), "an accepted record round-trips");
                    }
                }
            }
            s.writer.execute(format!("DROP SCHEMA {schema} CASCADE").as_str()).await.expect("drop schema");
        });
    });
}

/// Whether the row went in: `false` when PostgreSQL refused a value (no writer could plant
/// it); any other failure (a lost connection) fails the input rather than skip it quietly.
fn planted(result: Result<(), sqlx::Error>) -> bool {
    match result {
        Ok(()) => true,
        Err(sqlx::Error::Database(_)) => false,
        Err(e) => panic!("planting the row failed: {e}"),
    }
}

/// Reshapes `schema.records` so that it takes `values` (no constraints, no indexes, each
/// column of its value's type), then [`replace`]s its rows with them. `Err` when PostgreSQL
/// refuses a value (a NUL in text, say): no writer could plant it.
async fn plant(conn: &mut PgConnection, schema: &str, values: &[Value]) -> Result<(), sqlx::Error> {
    let table = format!("{schema}.records");
    let mut tx = conn.begin().await?;
    let constraints: Vec<(String,)> =
        sqlx::query_as("SELECT conname::text FROM pg_constraint WHERE conrelid = $1::regclass")
            .bind(&table)
            .fetch_all(&mut *tx)
            .await?;
    for (name,) in constraints {
        (&mut *tx).execute(format!("ALTER TABLE {table} DROP CONSTRAINT \"{name}\" CASCADE").as_str()).await?;
    }
    let indexes: Vec<(String,)> =
        sqlx::query_as("SELECT indexrelid::regclass::text FROM pg_index WHERE indrelid = $1::regclass")
            .bind(&table)
            .fetch_all(&mut *tx)
            .await?;
    for (name,) in indexes {
        (&mut *tx).execute(format!("DROP INDEX {name}").as_str()).await?;
    }
    let types: Vec<(String, String)> = sqlx::query_as(
        "SELECT column_name::text, data_type::text FROM information_schema.columns \
         WHERE table_schema = $1 AND table_name = 'records'",
    )
    .bind(schema)
    .fetch_all(&mut *tx)
    .await?;
    for (column, declared) in &types {
        let mut alter = format!("ALTER TABLE {table} ALTER COLUMN {column} DROP NOT NULL");
        let planted = COLUMNS.iter().position(|c| c == column).and_then(|i| values[i].sql_type());
        if let Some(wanted) = planted.filter(|t| t != declared) {
            alter.push_str(&format!(", ALTER COLUMN {column} TYPE {wanted} USING NULL"));
        }
        (&mut *tx).execute(alter.as_str()).await?;
    }
    replace(&mut tx, &table, values).await?;
    tx.commit().await
}

/// Replaces the rows of `table` with one row of `values`, leaving the table as it is.
async fn replace(conn: &mut PgConnection, table: &str, values: &[Value]) -> Result<(), sqlx::Error> {
    conn.execute(format!("DELETE FROM {table}").as_str()).await?;
    let mut params = 0;
    let placeholders: Vec<String> = values
        .iter()
        .map(|v| {
            if *v == Value::Null {
                "NULL".to_owned()
            } else {
                params += 1;
                format!("${params}")
            }
        })
        .collect();
    let sql = format!("INSERT INTO {table} ({}) VALUES ({})", COLUMNS.join(", "), placeholders.join(", "));
    let mut insert = sqlx::query(&sql).persistent(false);
    for v in values {
        insert = match v {
            Value::Null => insert,
            Value::Bytes(b) => insert.bind(b.clone()),
            Value::Text(t) => insert.bind(t.clone()),
            Value::I64(i) => insert.bind(*i),
            Value::Bool(b) => insert.bind(*b),
        };
    }
    insert.execute(conn).await.map(drop)
}

/// The columns as the store writes them for `record` (idem-postgres's
/// `migrations/0001_records.sql`).
fn columns(r: &Record) -> Vec<Value> {
    vec![
        Value::Bytes(r.id.as_bytes().to_vec()),
        Value::Bytes(r.scope.principal.as_str().as_bytes().to_vec()),
        Value::Bytes(r.scope.endpoint.as_str().as_bytes().to_vec()),
        Value::Text(r.key.as_str().to_owned()),
        Value::Bytes(r.fingerprint.as_bytes().to_vec()),
        Value::Text(r.state.as_str().to_owned()),
        Value::I64(i64::try_from(r.token.0).unwrap_or(-1)),
        r.response.as_ref().map_or(Value::Null, |resp| Value::Bytes(encode_response(resp))),
        Value::I64(r.created_at.0),
        Value::I64(r.started_at.0),
        Value::I64(r.lease_expires_at.0),
        Value::I64(r.expires_at.0),
    ]
}

/// A seed input for `record`: its row as the store writes it.
#[must_use]
pub fn seed(record: &Record) -> Vec<u8> {
    let mut out = Vec::new();
    for value in columns(record) {
        let (tag, bytes) = match value {
            // A NULL is its tag alone, as `value` reads it.
            Value::Null => {
                out.push(0);
                continue;
            }
            Value::Bytes(b) => (1, b),
            Value::Text(s) => (2, s.into_bytes()),
            Value::I64(i) => (3, i.to_le_bytes().to_vec()),
            Value::Bool(b) => {
                out.extend_from_slice(&[4, u8::from(b)]);
                continue;
            }
        };
        out.push(tag);
        push_field(&mut out, &bytes);
    }
    out
}
