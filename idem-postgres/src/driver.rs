//! The two drivers a [`crate::PostgresStore`] runs on: a deadpool pool of tokio-postgres
//! connections ([`Deadpool`], the default) and, with the `sqlx` feature, a `sqlx::PgPool`
//! ([`Sqlx`]). The store's code is written once against [`Driver`]: acquire a connection,
//! run one statement, get at most one row back as owned values.
//!
//! Every statement names the type of each parameter (`$1::bytea`), so a parameter is one of
//! a few shapes ([`Param`]) and a result column one of a few types ([`Value`]).

#![allow(
    private_interfaces,
    private_bounds,
    reason = "the sealed trait's methods take crate-private types on purpose: nothing outside the crate can name, call or implement them"
)]

use idem_core::StoreError;
use std::fmt;
use tokio_postgres::types::{ToSql, Type};

use crate::error::{Error, is_session_lost};

/// A statement parameter.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Param<'a> {
    Bytes(&'a [u8]),
    Text(&'a str),
    I64(i64),
    OptI64(Option<i64>),
    Bool(bool),
}

/// A result column, owned.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Value {
    Null,
    Bytes(Vec<u8>),
    Text(String),
    I64(i64),
    Bool(bool),
}

/// One result row, owned: the same shape whichever driver read it.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Row(pub(crate) Vec<Value>);

impl Row {
    fn at(&self, idx: usize) -> Result<&Value, StoreError> {
        self.0.get(idx).ok_or_else(|| crate::sql::corrupt(None, "row", "fewer columns than the statement returns"))
    }

    fn mismatch() -> StoreError {
        crate::sql::corrupt(None, "column", "a value of an unexpected type")
    }

    pub(crate) fn opt_bytes(&self, idx: usize) -> Result<Option<&[u8]>, StoreError> {
        match self.at(idx)? {
            Value::Null => Ok(None),
            Value::Bytes(b) => Ok(Some(b)),
            _ => Err(Self::mismatch()),
        }
    }

    pub(crate) fn bytes(&self, idx: usize) -> Result<&[u8], StoreError> {
        self.opt_bytes(idx)?.ok_or_else(Self::mismatch)
    }

    pub(crate) fn text(&self, idx: usize) -> Result<&str, StoreError> {
        match self.at(idx)? {
            Value::Text(s) => Ok(s),
            _ => Err(Self::mismatch()),
        }
    }

    pub(crate) fn i64(&self, idx: usize) -> Result<i64, StoreError> {
        match self.at(idx)? {
            Value::I64(v) => Ok(*v),
            _ => Err(Self::mismatch()),
        }
    }

    pub(crate) fn bool(&self, idx: usize) -> Result<bool, StoreError> {
        match self.at(idx)? {
            Value::Bool(v) => Ok(*v),
            _ => Err(Self::mismatch()),
        }
    }

    fn from_pg(row: &tokio_postgres::Row) -> Result<Self, tokio_postgres::Error> {
        let mut values = Vec::with_capacity(row.len());
        for (i, col) in row.columns().iter().enumerate() {
            let ty = col.type_();
            let v = if *ty == Type::BYTEA {
                row.try_get::<_, Option<Vec<u8>>>(i)?.map_or(Value::Null, Value::Bytes)
            } else if *ty == Type::INT8 {
                row.try_get::<_, Option<i64>>(i)?.map_or(Value::Null, Value::I64)
            } else if *ty == Type::BOOL {
                row.try_get::<_, Option<bool>>(i)?.map_or(Value::Null, Value::Bool)
            } else if *ty == Type::TEXT || *ty == Type::VARCHAR || *ty == Type::NAME {
                row.try_get::<_, Option<String>>(i)?.map_or(Value::Null, Value::Text)
            } else {
                // No statement of the store reads another type (`void` of a lock call).
                Value::Null
            };
            values.push(v);
        }
        Ok(Self(values))
    }
}

/// How statements are sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Protocol {
    /// Named prepared statements, cached per connection: parsed and planned once.
    Prepared,
    /// No named statement: behind PgBouncer in transaction mode (before 1.21, or without
    /// `max_prepared_statements`), where consecutive transactions of one client connection
    /// may run on different server connections.
    Unnamed,
}

pub(crate) mod sealed {
    use std::future::Future;

    use super::{Param, Protocol, Row};
    use crate::error::Error;

    /// What the store needs of a pool; not nameable outside the crate, so [`super::Driver`]
    /// cannot be implemented elsewhere.
    pub trait Sealed {
        /// A connection taken from the pool.
        type Conn: Send;

        /// Takes a connection.
        fn acquire(&self, operation: &'static str) -> impl Future<Output = Result<Self::Conn, Error>> + Send;

        /// Runs one statement and returns its first row. On an error that means the session
        /// is gone, the connection is not given back to the pool.
        fn query_opt(
            conn: &mut Option<Self::Conn>,
            operation: &'static str,
            sql: &str,
            params: &[Param<'_>],
            protocol: Protocol,
        ) -> impl Future<Output = Result<Option<Row>, Error>> + Send;

        /// Applies the missing migrations to `schema`.
        fn migrate(&self, schema: &str) -> impl Future<Output = Result<usize, Error>> + Send;

        /// Checks that `schema` is at this build's migration.
        fn check_migrated(&self, schema: &str) -> impl Future<Output = Result<(), Error>> + Send;
    }
}

/// A pool a [`crate::PostgresStore`] can run on: [`Deadpool`] or (feature `sqlx`)
/// [`Sqlx`]. Sealed: the store's statements are written for these two.
pub trait Driver: sealed::Sealed + Clone + fmt::Debug + Send + Sync + 'static {}

impl Driver for Deadpool {}
#[cfg(feature = "sqlx")]
impl Driver for Sqlx {}

/// The default driver: a `deadpool_postgres::Pool` of tokio-postgres connections (see
/// [`crate::PostgresStore::connect`] and [`crate::PostgresStore::from_pool`]).
#[derive(Clone, Debug)]
pub struct Deadpool(pub(crate) deadpool_postgres::Pool);

fn pg_params<'a>(params: &'a [Param<'a>]) -> Vec<&'a (dyn ToSql + Sync)> {
    params
        .iter()
        .map(|p| match p {
            Param::Bytes(b) => b as &(dyn ToSql + Sync),
            Param::Text(s) => s as &(dyn ToSql + Sync),
            Param::I64(v) => v as &(dyn ToSql + Sync),
            Param::OptI64(v) => v as &(dyn ToSql + Sync),
            Param::Bool(v) => v as &(dyn ToSql + Sync),
        })
        .collect()
}

fn pg_type(p: &Param<'_>) -> Type {
    match p {
        Param::Bytes(_) => Type::BYTEA,
        Param::Text(_) => Type::TEXT,
        Param::I64(_) | Param::OptI64(_) => Type::INT8,
        Param::Bool(_) => Type::BOOL,
    }
}

/// Runs `sql` as an unnamed statement on a tokio-postgres client (a pooled one or the
/// caller's transaction): parse, bind and execute in one message batch with one Sync, so
/// one round trip, and nothing outlives the statement (safe behind PgBouncer).
pub(crate) async fn pg_query_unnamed(
    client: &impl tokio_postgres::GenericClient,
    sql: &str,
    params: &[Param<'_>],
) -> Result<Option<Row>, tokio_postgres::Error> {
    let values = pg_params(params);
    let typed: Vec<(&(dyn ToSql + Sync), Type)> = values.iter().zip(params).map(|(v, p)| (*v, pg_type(p))).collect();
    let rows = client.query_typed(sql, &typed).await?;
    rows.first().map(Row::from_pg).transpose()
}

/// Runs `sql` on a pooled deadpool connection.
async fn pg_query_opt(
    client: &deadpool_postgres::Object,
    sql: &str,
    params: &[Param<'_>],
    protocol: Protocol,
) -> Result<Option<Row>, tokio_postgres::Error> {
    match protocol {
        Protocol::Prepared => {
            let stmt = client.prepare_cached(sql).await?;
            let rows = client.query(&stmt, &pg_params(params)).await?;
            rows.first().map(Row::from_pg).transpose()
        }
        Protocol::Unnamed => pg_query_unnamed(&***client, sql, params).await,
    }
}

impl sealed::Sealed for Deadpool {
    type Conn = deadpool_postgres::Object;

    async fn migrate(&self, schema: &str) -> Result<usize, Error> {
        crate::sql::migrate(&self.0, schema).await
    }

    async fn check_migrated(&self, schema: &str) -> Result<(), Error> {
        crate::sql::check_migrated(&self.0, schema).await
    }

    async fn acquire(&self, operation: &'static str) -> Result<Self::Conn, Error> {
        self.0.get().await.map_err(Error::connection(operation))
    }

    async fn query_opt(
        conn: &mut Option<Self::Conn>,
        operation: &'static str,
        sql: &str,
        params: &[Param<'_>],
        protocol: Protocol,
    ) -> Result<Option<Row>, Error> {
        let Some(client) = conn.as_ref() else {
            return Err(Error::Detached { operation });
        };
        match pg_query_opt(client, sql, params, protocol).await {
            Ok(row) => Ok(row),
            Err(e) => {
                if is_session_lost(&e) {
                    // The driver may not have noticed the close yet, and the pool's
                    // recycle check would then hand the dead connection to the next call.
                    if let Some(c) = conn.take() {
                        drop(deadpool_postgres::Object::take(c));
                    }
                }
                Err(Error::postgres(operation)(e))
            }
        }
    }
}

#[cfg(feature = "sqlx")]
pub use self::sqlx_driver::Sqlx;
#[cfg(feature = "sqlx")]
pub(crate) use self::sqlx_driver::sqlx_query_opt;

#[cfg(feature = "sqlx")]
mod sqlx_driver {
    use std::fmt::Write as _;

    use sqlx::{Column as _, Row as _, TypeInfo as _};

    use super::{Param, Protocol, Row, Value, sealed};
    use crate::error::Error;

    /// The driver of feature `sqlx`: the application's `sqlx::PgPool` (see
    /// [`crate::PostgresStore::from_sqlx`]).
    #[derive(Clone, Debug)]
    pub struct Sqlx(pub(crate) sqlx::PgPool);

    /// `sql` with every `$n` replaced by the literal of `params[n - 1]`, for the simple
    /// query protocol (one `Query` message, no statement at all). Only hex digits,
    /// decimal digits and fixed SQL reach the text, so no value can change the statement:
    /// bytes and strings travel hex-encoded through `decode(..., 'hex')`.
    pub(crate) fn inline(sql: &str, params: &[Param<'_>]) -> String {
        let literal = |p: &Param<'_>| -> String {
            let hex = |b: &[u8]| {
                let mut s = String::with_capacity(b.len() * 2);
                for byte in b {
                    let _ = write!(s, "{byte:02x}");
                }
                s
            };
            match p {
                Param::Bytes(b) => format!("decode('{}', 'hex')", hex(b)),
                Param::Text(t) => format!("convert_from(decode('{}', 'hex'), 'UTF8')", hex(t.as_bytes())),
                Param::I64(v) | Param::OptI64(Some(v)) => format!("({v})"),
                Param::OptI64(None) => "NULL".to_owned(),
                Param::Bool(v) => v.to_string(),
            }
        };
        let mut out = String::with_capacity(sql.len() + 64);
        let bytes = sql.as_bytes();
        let mut i = 0;
        while i < bytes.len() {
            if bytes[i] == b'$' {
                let start = i + 1;
                let mut end = start;
                while end < bytes.len() && bytes[end].is_ascii_digit() {
                    end += 1;
                }
                if let Some(p) =
                    sql[start..end].parse::<usize>().ok().and_then(|n| n.checked_sub(1)).and_then(|n| params.get(n))
                {
                    out.push_str(&literal(p));
                    i = end;
                    continue;
                }
            }
            let ch = sql[i..].chars().next().unwrap_or(' ');
            out.push(ch);
            i += ch.len_utf8();
        }
        out
    }

    fn value(row: &sqlx::postgres::PgRow, i: usize) -> Result<Value, sqlx::Error> {
        let name = row.column(i).type_info().name().to_owned();
        Ok(match name.as_str() {
            "BYTEA" => row.try_get::<Option<Vec<u8>>, _>(i)?.map_or(Value::Null, Value::Bytes),
            "INT8" => row.try_get::<Option<i64>, _>(i)?.map_or(Value::Null, Value::I64),
            "BOOL" => row.try_get::<Option<bool>, _>(i)?.map_or(Value::Null, Value::Bool),
            "TEXT" | "VARCHAR" | "NAME" => row.try_get::<Option<String>, _>(i)?.map_or(Value::Null, Value::Text),
            // No statement of the store reads another type (`void` of a lock call).
            _ => Value::Null,
        })
    }

    pub(crate) fn row(row: &sqlx::postgres::PgRow) -> Result<Row, sqlx::Error> {
        (0..row.len()).map(|i| value(row, i)).collect::<Result<Vec<_>, _>>().map(Row)
    }

    /// Runs `sql` on a sqlx connection (a pooled one or the caller's transaction).
    pub(crate) async fn sqlx_query_opt(
        conn: &mut sqlx::PgConnection,
        sql: &str,
        params: &[Param<'_>],
        protocol: Protocol,
    ) -> Result<Option<Row>, sqlx::Error> {
        let found = match protocol {
            Protocol::Prepared => {
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
                sqlx::Executor::fetch_optional(&mut *conn, q).await?
            }
            Protocol::Unnamed => {
                // sqlx prepares even an unnamed statement in its own round trip (Parse,
                // Describe, Sync) before binding it; behind PgBouncer in transaction mode
                // the bind may then reach another server connection. The simple query
                // protocol sends one message.
                let text = inline(sql, params);
                // `RawSql::fetch_optional` of sqlx 0.8 is `fetch_one`; the executor's is not.
                sqlx::Executor::fetch_optional(&mut *conn, sqlx::raw_sql(&text)).await?
            }
        };
        found.as_ref().map(row).transpose()
    }

    impl sealed::Sealed for Sqlx {
        type Conn = sqlx::pool::PoolConnection<sqlx::Postgres>;

        async fn migrate(&self, schema: &str) -> Result<usize, Error> {
            crate::sql::via_sqlx::migrate(&self.0, schema).await
        }

        async fn check_migrated(&self, schema: &str) -> Result<(), Error> {
            crate::sql::via_sqlx::check_migrated(&self.0, schema).await
        }

        async fn acquire(&self, operation: &'static str) -> Result<Self::Conn, Error> {
            self.0.acquire().await.map_err(Error::sqlx(operation))
        }

        async fn query_opt(
            conn: &mut Option<Self::Conn>,
            operation: &'static str,
            sql: &str,
            params: &[Param<'_>],
            protocol: Protocol,
        ) -> Result<Option<Row>, Error> {
            let Some(c) = conn.as_mut() else {
                return Err(Error::Detached { operation });
            };
            match sqlx_query_opt(c, sql, params, protocol).await {
                Ok(row) => Ok(row),
                Err(e) => {
                    if crate::error::is_session_lost_sqlx(&e)
                        && let Some(c) = conn.take()
                    {
                        // Closed rather than returned: the next call opens a fresh one.
                        drop(c.detach());
                    }
                    Err(Error::sqlx(operation)(e))
                }
            }
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn inline_writes_only_hex_and_digits() {
            let sql = "SELECT $1::bytea, $2::text, $3::bigint, $4::bigint, $5::boolean, $10";
            let params =
                [Param::Bytes(b"'; DROP"), Param::Text("a'b"), Param::I64(-5), Param::OptI64(None), Param::Bool(true)];
            let out = inline(sql, &params);
            assert_eq!(
                out,
                "SELECT decode('273b2044524f50', 'hex')::bytea, convert_from(decode('612762', 'hex'), 'UTF8')::text, \
                 (-5)::bigint, NULL::bigint, true::boolean, $10"
            );
        }
    }
}
