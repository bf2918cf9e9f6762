//! Every integration test of this crate in one binary (one link on two cores, not one per
//! file); one module per area.

mod cluster;
mod cluster_faults;
mod cluster_nodes;
mod cluster_script;
mod common;
mod conformance;
mod connection_kill;
mod error;
mod http;
mod replica_shortfall;
mod store;
