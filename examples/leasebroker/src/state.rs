//! The simulated infrastructure behind leasebroker: a node pool, leases and a hypervisor,
//! all kept in redb tables so they survive a restart, and counted so a test can prove
//! that no retry created anything twice.
//!
//! When the idempotency store is redb, these tables live in the same file as the records.

use std::collections::BTreeMap;
use std::sync::Arc;

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};

const WORKERS: TableDefinition<'_, &str, &[u8]> = TableDefinition::new("leasebroker_workers");
const COUNTERS: TableDefinition<'_, &str, u64> = TableDefinition::new("leasebroker_counters");

/// What the client asks for in `POST /v1/workers`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct WorkerSpec {
    /// Image to boot, e.g. `worker-base:2025.11`.
    pub image: String,
    /// vCPUs.
    pub cpu: u32,
    /// Memory, GiB.
    pub memory_gb: u32,
    /// Free-form labels.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

/// A worker as the API returns it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Worker {
    /// `wkr-…`.
    pub id: String,
    /// The principal that created it.
    pub owner: String,
    /// The pool node it runs on.
    pub node: String,
    /// The lease that holds the node.
    pub lease: String,
    /// The VM the hypervisor booted.
    pub vm: String,
    /// The requested spec.
    pub spec: WorkerSpec,
    /// `booting` or `deleted`.
    pub state: String,
    /// Reboots performed.
    pub reboots: u64,
}

/// Counts of everything the simulated infrastructure did.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Stats {
    /// Workers that exist (not deleted).
    pub workers: u64,
    /// Nodes allocated from the pool.
    pub allocations: u64,
    /// Leases written.
    pub leases: u64,
    /// VMs booted.
    pub boots: u64,
    /// Reboots performed.
    pub reboots: u64,
    /// Workers deleted.
    pub deletes: u64,
}

/// Why a domain operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// redb failed.
    #[error("state storage: {0}")]
    Storage(String),
    /// No such worker for this principal.
    #[error("no such worker")]
    NotFound,
    /// The simulated hypervisor refused to boot (fault injection).
    #[error("hypervisor failed to boot the VM")]
    Hypervisor,
}

fn storage(e: impl std::fmt::Display) -> StateError {
    StateError::Storage(e.to_string())
}

/// The pool, leases and hypervisor.
#[derive(Clone, Debug)]
pub struct Infra {
    db: Arc<Database>,
}

impl Infra {
    /// Uses `db` (creating the tables).
    ///
    /// # Errors
    /// [`StateError::Storage`] when the tables cannot be created.
    pub fn new(db: Arc<Database>) -> Result<Self, StateError> {
        let tx = db.begin_write().map_err(storage)?;
        tx.open_table(WORKERS).map_err(storage)?;
        tx.open_table(COUNTERS).map_err(storage)?;
        tx.commit().map_err(storage)?;
        Ok(Self { db })
    }

    /// Allocates a node, writes its lease and boots a VM, in one redb transaction: a boot
    /// failure leaves nothing allocated (the retry starts clean).
    ///
    /// # Errors
    /// [`StateError::Hypervisor`] when `boot_fails`; storage errors.
    pub fn create(&self, owner: &str, spec: WorkerSpec, boot_fails: bool) -> Result<Worker, StateError> {
        let tx = self.db.begin_write().map_err(storage)?;
        let worker = {
            let mut counters = tx.open_table(COUNTERS).map_err(storage)?;
            let mut bump = |name: &str| -> Result<u64, StateError> {
                let n = counters.get(name).map_err(storage)?.map_or(0, |v| v.value()) + 1;
                counters.insert(name, n).map_err(storage)?;
                Ok(n)
            };
            let node = bump("allocations")?;
            let lease = bump("leases")?;
            if boot_fails {
                // Dropping the transaction uncommitted releases the node and the lease.
                return Err(StateError::Hypervisor);
            }
            let vm = bump("boots")?;
            let id = format!("wkr-{}", &uuid::Uuid::new_v4().simple().to_string()[..10]);
            let worker = Worker {
                id,
                owner: owner.to_string(),
                node: format!("node-{node:05}"),
                lease: format!("lease-{lease:05}"),
                vm: format!("vm-{vm:05}"),
                spec,
                state: "booting".into(),
                reboots: 0,
            };
            let mut workers = tx.open_table(WORKERS).map_err(storage)?;
            let bytes = serde_json::to_vec(&worker).map_err(storage)?;
            workers.insert(worker.id.as_str(), bytes.as_slice()).map_err(storage)?;
            worker
        };
        tx.commit().map_err(storage)?;
        Ok(worker)
    }

    /// The worker `id` if `owner` owns it and it is not deleted.
    ///
    /// # Errors
    /// [`StateError::NotFound`]; storage errors.
    pub fn get(&self, owner: &str, id: &str) -> Result<Worker, StateError> {
        let tx = self.db.begin_read().map_err(storage)?;
        let workers = tx.open_table(WORKERS).map_err(storage)?;
        let w = workers.get(id).map_err(storage)?.ok_or(StateError::NotFound)?;
        let w: Worker = serde_json::from_slice(w.value()).map_err(storage)?;
        if w.owner != owner || w.state == "deleted" {
            return Err(StateError::NotFound);
        }
        Ok(w)
    }

    fn update(&self, owner: &str, id: &str, f: impl FnOnce(&mut Worker), counter: &str) -> Result<Worker, StateError> {
        let tx = self.db.begin_write().map_err(storage)?;
        let w = {
            let mut workers = tx.open_table(WORKERS).map_err(storage)?;
            let mut w: Worker = {
                let g = workers.get(id).map_err(storage)?.ok_or(StateError::NotFound)?;
                serde_json::from_slice(g.value()).map_err(storage)?
            };
            if w.owner != owner || w.state == "deleted" {
                return Err(StateError::NotFound);
            }
            f(&mut w);
            let bytes = serde_json::to_vec(&w).map_err(storage)?;
            workers.insert(id, bytes.as_slice()).map_err(storage)?;
            let mut counters = tx.open_table(COUNTERS).map_err(storage)?;
            let n = counters.get(counter).map_err(storage)?.map_or(0, |v| v.value()) + 1;
            counters.insert(counter, n).map_err(storage)?;
            w
        };
        tx.commit().map_err(storage)?;
        Ok(w)
    }

    /// Reboots the worker's VM.
    ///
    /// # Errors
    /// [`StateError::NotFound`]; storage errors.
    pub fn reboot(&self, owner: &str, id: &str) -> Result<Worker, StateError> {
        self.update(owner, id, |w| w.reboots += 1, "reboots")
    }

    /// Deletes the worker (releases its lease).
    ///
    /// # Errors
    /// [`StateError::NotFound`]; storage errors.
    pub fn delete(&self, owner: &str, id: &str) -> Result<Worker, StateError> {
        self.update(owner, id, |w| w.state = "deleted".into(), "deletes")
    }

    /// Counts.
    ///
    /// # Errors
    /// Storage errors.
    pub fn stats(&self) -> Result<Stats, StateError> {
        let tx = self.db.begin_read().map_err(storage)?;
        let counters = tx.open_table(COUNTERS).map_err(storage)?;
        let get =
            |n: &str| -> Result<u64, StateError> { Ok(counters.get(n).map_err(storage)?.map_or(0, |v| v.value())) };
        let workers = tx.open_table(WORKERS).map_err(storage)?;
        let mut live = 0;
        for entry in workers.iter().map_err(storage)? {
            let (_, v) = entry.map_err(storage)?;
            let w: Worker = serde_json::from_slice(v.value()).map_err(storage)?;
            if w.state != "deleted" {
                live += 1;
            }
        }
        Ok(Stats {
            workers: live,
            allocations: get("allocations")?,
            leases: get("leases")?,
            boots: get("boots")?,
            reboots: get("reboots")?,
            deletes: get("deletes")?,
        })
    }
}
