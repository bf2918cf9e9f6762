//! Every integration test of this crate in one binary (one link on two cores, not one per
//! file); one module per area.

mod backend;
mod common;
mod complete_in;
mod complete_in_isolation;
mod conformance;
mod conformance_pgbouncer;
mod error;
mod http;
mod inline_literals;
mod isolation;
mod pgbouncer;
mod pgbouncer_script;
mod postgres;
mod tls;
