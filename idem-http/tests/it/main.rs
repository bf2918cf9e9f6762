//! idem-http's integration tests, one module per subject, in one test binary. The layer
//! runs on a memory store here (behind injected faults where a test needs them); the
//! scenarios that run on every backend (lease renewal, tenant isolation, response shapes,
//! sealed responses) live in `idem_conformance::http` and run from each store crate.
//!
//! Two tests measure the process's peak resident memory and so run in binaries of their
//! own: `tests/memory.rs` and `tests/memory_small_frames.rs` (with `tests/rss/mod.rs`).

mod canonical;
mod common;
mod completed_by_handler;
mod completion_outage;
mod cors;
mod deadlines;
mod decision_table;
mod failure_catalogue;
mod grpc_streams;
mod headers_and_hints;
mod keys;
mod lease_deadline;
mod limits;
mod observability;
mod principal;
mod response_edges;
mod resumable;
mod sealed;
mod socket;
mod sources;
mod test_vectors;
mod wake;
