//! The create variant whose worker row lives in PostgreSQL, next to the idempotency
//! records: `POST /v1/pg/workers`, served by the `leasebroker-pg` binary.
//!
//! The handler inserts the worker row in its own transaction on the application's
//! `sqlx::PgPool`. How the record is completed is the point of the variant
//! ([`Completion`]):
//! - [`Completion::Transactional`]: the handler stores its response with
//!   `PostgresStore::complete_in` inside that transaction, commits, and tells the layer
//!   ([`ResponseCaching::CompletedByHandler`]). The row and the stored response commit
//!   together: a crash at any point leaves both or neither, and the retry replays the
//!   stored response or runs again on a clean slate.
//! - [`Completion::Separate`]: the handler commits its row and the layer completes the
//!   record afterwards, as for any other store. A crash between the two leaves the row and
//!   an in-flight record, and the retry (after the lease) inserts a second row.
//!
//! The claim is never inside the handler's transaction: the layer claims through the
//! store's own statement before the handler starts, so no transaction is held open while
//! the claim waits or the handler works on something else.
//!
//! Crash points ([`crate::crash::PG_POINTS`]) sit inside the transaction, right after its
//! commit, and after the layer.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Router};
use idem_core::{Policy, StoreError, StoredResponse};
use idem_http::{IdempotencyContext, IdempotencyLayer, ResponseCaching};
use idem_postgres::PostgresStore;
use idem_postgres::sqlx::{self, PgPool};

use crate::crash::CrashPlan;

/// How the handler's row and the record's completion commit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Completion {
    /// In one transaction (`PostgresStore::complete_in`): both or neither.
    Transactional,
    /// The handler commits, then the layer completes: a crash between them runs the
    /// handler again after the lease.
    Separate,
}

/// What the handler needs: the application's pool, the store on it, the mode, the crash
/// points.
#[derive(Clone, Debug)]
pub struct PgWorkers {
    pool: PgPool,
    store: PostgresStore,
    table: String,
    completion: Completion,
    crash: CrashPlan,
}

/// The worker table in `schema` (the store's schema: one database, one schema).
#[must_use]
pub fn table(schema: &str) -> String {
    format!("\"{schema}\".pg_workers")
}

impl PgWorkers {
    /// Builds the store on `pool` in `schema` (migrating it) and creates the worker table.
    /// The table has no unique constraint on the operation on purpose: only the
    /// idempotency record stands between a retry and a second row.
    ///
    /// # Errors
    /// When the store cannot be built or the table created.
    pub async fn open(
        pool: PgPool,
        schema: &str,
        completion: Completion,
        crash: CrashPlan,
    ) -> Result<Self, Box<dyn std::error::Error + Send + Sync>> {
        let store =
            PostgresStore::from_pool(pool.clone(), idem_postgres::Config::default().with_schema(schema)).await?;
        let table = table(schema);
        sqlx::raw_sql(&format!(
            "CREATE TABLE IF NOT EXISTS {table} (
                 id         bigserial   PRIMARY KEY,
                 op         text        NOT NULL,
                 created_at timestamptz NOT NULL DEFAULT now()
             )"
        ))
        .execute(&pool)
        .await?;
        Ok(Self { pool, store, table, completion, crash })
    }

    /// The router: `POST /v1/pg/workers` behind the idempotency layer on this store.
    pub fn router(self, policy: Policy) -> Router {
        let layer = IdempotencyLayer::new(Arc::new(self.store.clone())).with_policy(policy);
        let crash = self.crash;
        Router::new()
            .route("/v1/pg/workers", post(create))
            .route_layer(layer)
            .layer(middleware::from_fn_with_state(crash, after_response))
            .with_state(Arc::new(self))
    }
}

async fn after_response(State(crash): State<CrashPlan>, req: Request, next: Next) -> Response {
    let res = next.run(req).await;
    if res.status().is_success() {
        crash.point("pg_after_response").await;
    }
    res
}

fn problem(status: StatusCode, detail: &str) -> Response {
    let body = serde_json::json!({ "type": "about:blank", "status": status.as_u16(), "detail": detail });
    (status, [(header::CONTENT_TYPE, "application/problem+json")], body.to_string()).into_response()
}

fn unavailable(e: &dyn std::fmt::Display) -> Response {
    tracing::error!(error = %e, "pg create failed; rolled back");
    problem(StatusCode::SERVICE_UNAVAILABLE, "the database is unavailable; retry with the same key")
}

/// `POST /v1/pg/workers`: one worker row per operation, `201 {"id":N,"op":KEY}`.
async fn create(State(app): State<Arc<PgWorkers>>, Extension(ctx): Extension<IdempotencyContext>) -> Response {
    let op = ctx.key().as_str().to_owned();
    let mut tx = match app.pool.begin().await {
        Ok(tx) => tx,
        Err(e) => return unavailable(&e),
    };
    let id: i64 = match sqlx::query_scalar(&format!("INSERT INTO {} (op) VALUES ($1) RETURNING id", app.table))
        .bind(&op)
        .fetch_one(&mut *tx)
        .await
    {
        Ok(id) => id,
        Err(e) => return unavailable(&e),
    };
    app.crash.point("pg_after_insert").await;
    let body = serde_json::json!({ "id": id, "op": op }).to_string().into_bytes();
    let content_type = ("content-type".to_owned(), b"application/json".to_vec());
    let transactional = app.completion == Completion::Transactional;
    if transactional {
        let stored = StoredResponse::new(201, vec![content_type], body.clone());
        match app.store.complete_in(&mut tx, ctx.record_id(), ctx.token(), stored).await {
            Ok(_) => {}
            // Another attempt owns the record now: this attempt's row must not commit.
            Err(e @ StoreError::LeaseLost { .. }) => {
                let _ = tx.rollback().await;
                tracing::warn!(error = %e, "lease lost before completion; rolled back");
                return problem(StatusCode::CONFLICT, "another attempt of this operation owns it now");
            }
            Err(e) => return unavailable(&e),
        }
    }
    app.crash.point("pg_before_commit").await;
    if let Err(e) = tx.commit().await {
        return unavailable(&e);
    }
    app.crash.point("pg_after_commit").await;
    let json = [(header::CONTENT_TYPE, "application/json")];
    if transactional {
        (StatusCode::CREATED, json, Extension(ResponseCaching::CompletedByHandler), body).into_response()
    } else {
        (StatusCode::CREATED, json, body).into_response()
    }
}
