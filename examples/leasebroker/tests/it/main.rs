//! Every integration test of this crate in one binary (one link on two cores, not one per
//! file); one module per area.

mod e2e;
// PostgreSQL and MariaDB servers, private redis-server and PostgreSQL clusters: live servers.
#[cfg(feature = "live-tests")]
mod stalled_store;
#[cfg(feature = "live-tests")]
mod tx_crash;
