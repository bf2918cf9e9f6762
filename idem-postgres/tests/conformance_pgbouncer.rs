//! The shared conformance suite (every scenario and the model-based test) on the deadpool pool, through PgBouncer in transaction mode (`scripts/pgbouncer`, port 6401;
//! unnamed statements, no startup options).
//! No server: every test fails with the command that starts one.

#[path = "common/backend.rs"]
mod backend;
mod common;

idem_conformance::store_tests!(backend::Postgres::new(common::Kind::Deadpool, common::Via::PgBouncer));
