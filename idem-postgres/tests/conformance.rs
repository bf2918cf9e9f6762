//! The shared conformance suite (every scenario and the model-based test) against the real
//! PostgreSQL at `IDEM_POSTGRES_URL` (default `postgres://postgres@127.0.0.1:5432/test`),
//! on the default deadpool pool. Each scenario runs in its own `idem_test_*` schema,
//! dropped when the scenario's last store handle goes. No server: every test fails with
//! the command that starts one. `conformance_sqlx.rs`, `conformance_pgbouncer.rs` and
//! `conformance_pgbouncer_sqlx.rs` run the same suite on a sqlx pool and through PgBouncer.

#[path = "common/backend.rs"]
mod backend;
mod common;

idem_conformance::store_tests!(backend::Postgres::new(common::Kind::Deadpool, common::Via::Direct));
