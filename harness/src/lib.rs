//! # idem-harness
//!
//! The chaos, crash and storm rig run against the leasebroker demo
//! (`examples/leasebroker`): retry storms that count what the server really did, faults
//! on real stores, and SIGKILLs of the server mid-request. Not published; the demo stays
//! what a newcomer reads.
//!
//! - `idem-harness serve`: the demo's server (`leasebroker serve`'s flags) plus what only
//!   the rig uses: the firmware route ([`firmware`]), fault flags (`--drop-rate`,
//!   `--hold-ms`, `--hypervisor-fail-rate`, `--lease-renewal`, `--bmc`) and crash points
//!   ([`crash`], `--crash-at`), which `tests/crash.rs` uses to SIGKILL it mid-request.
//! - `idem-harness storm --target URL`: the storm against a running server ([`storm`]).
//! - `idem-harness chaos`: the storm while faults hit real stores ([`chaos`]).
//!
//! # Layout
//! - [`storm`]: the retry-storm driver.
//! - [`firmware`]: `POST /v1/workers/{id}/firmware`, a handler many leases long, served
//!   next to the demo's routes.
//! - [`bmc`]: the simulated BMCs the firmware route flashes, in a redb file of their own.
//! - [`crash`]: the create handler's crash points, armed by `serve --crash-at`.
//! - [`chaos`]: the chaos run: the storm while faults hit the store or the server, on
//!   private servers it starts and cleans up itself ([`chaos::servers`]).

pub mod bmc;
pub mod chaos;
pub mod crash;
pub mod firmware;
pub mod storm;
