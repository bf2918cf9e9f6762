//! Every integration test of this crate in one binary (one link on two cores, not one per
//! file); one module per area.

// Faults on Redis and PostgreSQL servers of its own: needs the servers installed.
#[cfg(feature = "live-tests")]
mod chaos;
mod crash;
mod storm;
