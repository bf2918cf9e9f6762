//! Every integration test of this crate in one binary (one link on two cores, not one per
//! file); one module per area.

mod broken;
mod decision_table;
mod engine;
mod fuzz_corpus;
mod http;
mod memory;
mod planted;
mod registry;
