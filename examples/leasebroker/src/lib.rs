//! # leasebroker
//!
//! A small provisioning API (the seed article's example) protected by idem: clients
//! create workers from a simulated pool, reboot and delete them, and retry through lost
//! responses without ever creating a phantom worker.
//!
//! - `leasebroker demo`: starts the server on a temporary redb file with faults on, sends
//!   it creates from retrying clients, prints the counts, and exits non-zero on any
//!   phantom.
//! - `leasebroker serve`: the server (`--store redb:PATH | sqlite:PATH | redis://… |
//!   postgres://… | memory`). The rig in `harness/` (`idem-harness`) runs it under
//!   faults, SIGKILLs and retry storms.
//!
//! # Layout
//! - [`state`]: the simulated pool, leases and hypervisor, in redb tables.
//! - [`app`]: the axum router, the idempotency layer on it, the fault layer; the create
//!   handler's side effects run as resumable steps and an intent.
//! - [`crash`]: crash points inside the create handler and the SQL variant, armed by
//!   the rig's crash tests.
//! - [`server`]: opening the store and running the server.
//! - [`openapi`]: the OpenAPI document served at `/openapi.json`.
//! - [`serve`]: `leasebroker serve`'s flags, shared with the rig's `serve`.
//! - [`sqlworkers`]: the create variant whose worker row lives in PostgreSQL or MySQL and
//!   whose record completes in the handler's own transaction (binary `leasebroker-sql`).

pub mod app;
pub mod crash;
pub mod openapi;
pub mod serve;
pub mod server;
pub mod sqlworkers;
pub mod state;

/// The rig's private servers (`harness/src/chaos/servers.rs`), where `tests/stalled_store.rs` imports them.
#[doc(hidden)]
#[path = "../../../harness/src/chaos"]
pub mod chaos {
    pub mod servers;
}
