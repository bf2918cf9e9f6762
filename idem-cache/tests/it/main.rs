//! Every integration test of idem-cache in one binary: the conformance suite against the
//! cache in front of the memory store, and (feature `live-tests`) in front of live Redis
//! and PostgreSQL; and what the cache answers, counted at the store behind it.

mod cache;
mod conformance;
