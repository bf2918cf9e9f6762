//! The create variant whose worker row lives in the SQL database that holds the
//! idempotency records (PostgreSQL, or MySQL/MariaDB): `POST /v1/sql/workers`, served by
//! the `leasebroker-sql` binary.
//!
//! The handler inserts the worker row in its own transaction on the application's sqlx
//! pool. How the record is completed is the point of the variant ([`Completion`]):
//! - [`Completion::Transactional`]: the handler stores its response with the store's
//!   `complete_in` (`PostgresStore::complete_in`, `MySqlStore::complete_in`) inside that
//!   transaction, commits, and tells the layer ([`ResponseCaching::CompletedByHandler`]).
//!   The row and the stored response commit together: a crash at any point leaves both or
//!   neither, and the retry replays the stored response or runs again on a clean slate.
//! - [`Completion::Separate`]: the handler commits its row and the layer completes the
//!   record afterwards, as for any other store. A crash between the two leaves the row and
//!   an in-flight record, and the retry (after the lease) inserts a second row.
//!
//! The claim is never inside the handler's transaction: the layer claims through the
//! store's own statements before the handler starts, so no transaction is held open while
//! the claim waits or the handler works on something else.
//!
//! Crash points ([`crate::crash::TX_POINTS`]) sit inside the transaction, right after its
//! commit, and after the layer.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Router};
use idem_core::{Policy, Receipt, Store, StoreError, StoredResponse};
use idem_http::{IdempotencyContext, IdempotencyLayer, ResponseCaching};
use idem_mysql::MySqlStore;
use idem_mysql::sqlx::MySqlPool;
use idem_postgres::PostgresStore;
use idem_postgres::sqlx::{self, PgPool};

use crate::crash::CrashPlan;

/// How the handler's row and the record's completion commit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Completion {
    /// In one transaction (the store's `complete_in`): both or neither.
    Transactional,
    /// The handler commits, then the layer completes: a crash between them runs the
    /// handler again after the lease.
    Separate,
}

/// The database: its pool and the store on it.
#[derive(Clone, Debug)]
enum Db {
    Postgres { pool: PgPool, store: PostgresStore },
    MySql { pool: MySqlPool, store: MySqlStore },
}

/// What the handler needs: the database, the worker table, the mode, the crash points.
#[derive(Clone, Debug)]
pub struct SqlWorkers {
    db: Db,
    table: String,
    completion: Completion,
    crash: CrashPlan,
}

/// The worker table of `namespace`: the store's schema on PostgreSQL, its table prefix
/// (in the connection's database) on MySQL.
#[must_use]
pub fn table(url: &str, namespace: &str) -> String {
    if is_mysql(url) { format!("`{namespace}_workers`") } else { format!("\"{namespace}\".sql_workers") }
}

/// Whether `url` names a MySQL or MariaDB server (else PostgreSQL).
#[must_use]
pub fn is_mysql(url: &str) -> bool {
    url.starts_with("mysql://") || url.starts_with("mariadb://")
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl SqlWorkers {
    /// Connects to `url` (`postgres://…`, or `mysql://…`/`mariadb://…`), builds the store
    /// in `namespace` (a Postgres schema, or a MySQL table prefix; migrating it) on the
    /// application's pool, and creates the worker table. The table has no unique
    /// constraint on the operation on purpose: only the idempotency record stands between
    /// a retry and a second row.
    ///
    /// # Errors
    /// When the database cannot be reached, the store built or the table created.
    pub async fn open(url: &str, namespace: &str, completion: Completion, crash: CrashPlan) -> Result<Self, BoxError> {
        let table = table(url, namespace);
        let db = if is_mysql(url) {
            // The store refuses a pool whose sessions do not run at READ COMMITTED.
            let url = url.replacen("mariadb://", "mysql://", 1);
            let pool = idem_mysql::sqlx::mysql::MySqlPoolOptions::new()
                .max_connections(8)
                .after_connect(|conn, _| Box::pin(idem_mysql::pin_read_committed(conn)))
                .connect(&url)
                .await?;
            let config = idem_mysql::Config::default().with_table_prefix(namespace);
            let store = MySqlStore::from_pool(pool.clone(), config).await?;
            idem_mysql::sqlx::raw_sql(&format!(
                "CREATE TABLE IF NOT EXISTS {table} (
                     id         BIGINT      NOT NULL AUTO_INCREMENT PRIMARY KEY,
                     op         VARCHAR(255) NOT NULL,
                     created_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)
                 ) ENGINE = InnoDB"
            ))
            .execute(&pool)
            .await?;
            Db::MySql { pool, store }
        } else {
            let pool = sqlx::postgres::PgPoolOptions::new().max_connections(8).connect(url).await?;
            let config = idem_postgres::Config::default().with_schema(namespace);
            let store = PostgresStore::from_pool(pool.clone(), config).await?;
            sqlx::raw_sql(&format!(
                "CREATE TABLE IF NOT EXISTS {table} (
                     id         bigserial   PRIMARY KEY,
                     op         text        NOT NULL,
                     created_at timestamptz NOT NULL DEFAULT now()
                 )"
            ))
            .execute(&pool)
            .await?;
            Db::Postgres { pool, store }
        };
        Ok(Self { db, table, completion, crash })
    }

    /// The router: `POST /v1/sql/workers` behind the idempotency layer on this store.
    pub fn router(self, policy: Policy) -> Router {
        let store: Arc<dyn Store> = match &self.db {
            Db::Postgres { store, .. } => Arc::new(store.clone()),
            Db::MySql { store, .. } => Arc::new(store.clone()),
        };
        let layer = IdempotencyLayer::new(store).with_policy(policy);
        let crash = self.crash;
        Router::new()
            .route("/v1/sql/workers", post(create))
            .route_layer(layer)
            .layer(middleware::from_fn_with_state(crash, after_response))
            .with_state(Arc::new(self))
    }
}

async fn after_response(State(crash): State<CrashPlan>, req: Request, next: Next) -> Response {
    let res = next.run(req).await;
    if res.status().is_success() {
        crash.point("tx_after_response").await;
    }
    res
}

fn problem(status: StatusCode, detail: &str) -> Response {
    let body = serde_json::json!({ "type": "about:blank", "status": status.as_u16(), "detail": detail });
    (status, [(header::CONTENT_TYPE, "application/problem+json")], body.to_string()).into_response()
}

fn unavailable(e: &dyn std::fmt::Display) -> Response {
    tracing::error!(error = %e, "sql create failed; rolled back");
    problem(StatusCode::SERVICE_UNAVAILABLE, "the database is unavailable; retry with the same key")
}

/// The handler's transaction on either database: insert the worker row, complete the
/// record in it when transactional, commit, with the crash points between. One body for
/// both drivers, whose transaction types differ; `$insert` gives the new row's id.
macro_rules! create_in {
    ($app:expr, $ctx:expr, $pool:expr, $store:expr, |$tx:ident, $op:ident| $insert:expr) => {{
        let $op = $ctx.key().as_str().to_owned();
        let mut $tx = match $pool.begin().await {
            Ok(tx) => tx,
            Err(e) => return unavailable(&e),
        };
        let id: i64 = match $insert {
            Ok(id) => id,
            Err(e) => return unavailable(&e),
        };
        $app.crash.point("tx_after_insert").await;
        let body = serde_json::json!({ "id": id, "op": $op }).to_string().into_bytes();
        if $app.completion == Completion::Transactional {
            let stored = StoredResponse::new(201, vec![("content-type".to_owned(), b"application/json".to_vec())], body.clone());
            let done = $store.complete_in(&mut $tx, $ctx.record_id(), $ctx.token(), stored).await;
            if let Some(refused) = refusal(done) {
                let _ = $tx.rollback().await;
                return refused;
            }
        }
        $app.crash.point("tx_before_commit").await;
        if let Err(e) = $tx.commit().await {
            return unavailable(&e);
        }
        body
    }};
}

/// The answer when `complete_in` failed (the transaction then rolls back), else `None`.
fn refusal(done: Result<Receipt, StoreError>) -> Option<Response> {
    match done {
        Ok(_) => None,
        // Another attempt owns the record now: this attempt's row must not commit.
        Err(e @ StoreError::LeaseLost { .. }) => {
            tracing::warn!(error = %e, "lease lost before completion; rolled back");
            Some(problem(StatusCode::CONFLICT, "another attempt of this operation owns it now"))
        }
        Err(e) => Some(unavailable(&e)),
    }
}

/// `POST /v1/sql/workers`: one worker row per operation, `201 {"id":N,"op":KEY}`.
async fn create(State(app): State<Arc<SqlWorkers>>, Extension(ctx): Extension<IdempotencyContext>) -> Response {
    let body = match &app.db {
        Db::Postgres { pool, store } => create_in!(app, ctx, pool, store, |tx, op| {
            sqlx::query_scalar(&format!("INSERT INTO {} (op) VALUES ($1) RETURNING id", app.table))
                .bind(&op)
                .fetch_one(&mut *tx)
                .await
        }),
        Db::MySql { pool, store } => create_in!(app, ctx, pool, store, |tx, op| {
            // No `RETURNING` on MySQL: the connection's last AUTO_INCREMENT value.
            idem_mysql::sqlx::query(&format!("INSERT INTO {} (op) VALUES (?)", app.table))
                .bind(&op)
                .execute(&mut *tx)
                .await
                .map(|done| i64::try_from(done.last_insert_id()).unwrap_or(i64::MAX))
        }),
    };
    app.crash.point("tx_after_commit").await;
    let json = [(header::CONTENT_TYPE, "application/json")];
    if app.completion == Completion::Transactional {
        (StatusCode::CREATED, json, Extension(ResponseCaching::CompletedByHandler), body).into_response()
    } else {
        (StatusCode::CREATED, json, body).into_response()
    }
}
