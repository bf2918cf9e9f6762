//! The shared conformance suite (every scenario and the model-based test) against the real
//! PostgreSQL at `IDEM_POSTGRES_URL` (default `postgres://postgres@127.0.0.1:5432/test`).
//! Each scenario runs in its own `idem_test_*` schema, dropped when the scenario's last
//! store handle goes. No server: every test fails with the command that starts one.
//! `conformance_pgbouncer.rs` runs the same suite through PgBouncer.

use crate::backend;
use crate::common;

idem_conformance::store_tests!(backend::Postgres::new(common::Via::Direct));
