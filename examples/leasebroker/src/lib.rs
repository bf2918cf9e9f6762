//! # leasebroker
//!
//! A small provisioning API (the seed article's example) protected by idem: clients
//! create workers from a simulated pool, reboot and delete them, and retry through lost
//! responses without ever creating a phantom worker.
//!
//! - `leasebroker demo`: starts the server on a temporary redb file with faults on, runs
//!   a retry storm against it, prints the table, and exits non-zero on any phantom.
//! - `leasebroker serve`: the server (`--store redb:PATH | sqlite:PATH | redis://… |
//!   postgres://… | memory`); `--crash-at POINTS` arms crash points inside the create
//!   handler ([`crash`]), which `tests/crash.rs` uses to SIGKILL it mid-request.
//! - `leasebroker storm --target URL`: the storm against a running server.
//! - `leasebroker chaos`: the storm while faults hit real stores ([`chaos`]).
//!
//! # Layout
//! - [`state`]: the simulated pool, leases and hypervisor, in redb tables.
//! - [`app`]: the axum router, the idempotency layer on it, the fault layer; the create
//!   handler's side effects run as resumable steps and an intent.
//! - [`crash`]: crash points inside the create handler (`serve --crash-at`).
//! - [`server`]: opening the store and running the server.
//! - [`storm`]: the retry-storm driver.
//! - [`pgworkers`]: the create variant whose worker row lives in PostgreSQL and whose
//!   record completes in the handler's own transaction (binary `leasebroker-pg`).
//! - [`chaos`]: the chaos run (`leasebroker chaos`): the storm while faults hit the store
//!   or the server, on private servers it starts and cleans up itself.

pub mod app;
pub mod chaos;
pub mod crash;
pub mod pgworkers;
pub mod server;
pub mod state;
pub mod storm;
