//! Every integration test of this crate in one binary (one link on two cores, not one per
//! file); one module per area.

mod batch;
mod conformance;
mod http;
mod sqlite;
mod table;
