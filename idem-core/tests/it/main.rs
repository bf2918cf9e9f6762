//! Every integration test of this crate in one binary (one link on two cores, not one per
//! file); one module per area.

mod codec;
mod fingerprint;
#[cfg(all(feature = "group-commit", feature = "test-util"))]
mod group_commit;
mod key;
mod policy;
mod resume;
mod scope;
mod seal;
