//! The shared conformance suite (every scenario and the model-based test) on an application's `sqlx::PgPool` (`PostgresStore::from_sqlx`), straight to PostgreSQL.
//! No server: every test fails with the command that starts one.

#[path = "common/backend.rs"]
mod backend;
mod common;

idem_conformance::store_tests!(backend::Postgres::new(common::Kind::Sqlx, common::Via::Direct));
