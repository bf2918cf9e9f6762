//! The shared conformance suite (every scenario and the model-based test) through PgBouncer
//! in transaction mode (`scripts/pgbouncer`, port 6401): statements over the simple query
//! protocol with inlined values, no startup options.
//! No server: every test fails with the command that starts one.

use crate::backend;
use crate::common;

idem_conformance::store_tests!(backend::Postgres::new(common::Via::PgBouncer));
