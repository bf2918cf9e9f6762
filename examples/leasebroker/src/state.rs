//! The simulated infrastructure behind leasebroker: a node pool, leases and a hypervisor,
//! all kept in redb tables so they survive a restart, and counted so a test can prove that
//! no retry created anything twice.
//!
//! Each is a separate side effect with its own commit, as in a real provisioning backend:
//! a process killed between two of them leaves the first one behind. The pool and the
//! lease table are idempotent by the caller's sub-key; the hypervisor is not (each boot
//! is a new VM) but tags every VM, so a retry can find a boot it does not remember.
//!
//! These tables live in their own redb file (`--state`), whatever the idempotency store;
//! those a leak check reads (the rig's crash test, once the server is killed) are public.

use std::collections::BTreeMap;
use std::sync::Arc;

use redb::{Database, MultimapTableDefinition, ReadableDatabase, ReadableTable, TableDefinition, WriteTransaction};
use serde::{Deserialize, Serialize};

/// Worker id -> the [`Worker`], JSON (deleted ones included).
pub const WORKERS: TableDefinition<'_, &str, &[u8]> = TableDefinition::new("leasebroker_workers");
const COUNTERS: TableDefinition<'_, &str, u64> = TableDefinition::new("leasebroker_counters");
/// Pool: sub-key of the allocation -> node.
pub const NODES: TableDefinition<'_, &str, &str> = TableDefinition::new("leasebroker_nodes");
/// Leases: sub-key of the lease -> `lease-id node`.
pub const LEASES: TableDefinition<'_, &str, &str> = TableDefinition::new("leasebroker_leases");
/// Hypervisor: VM id -> `tag node`.
pub const VMS: TableDefinition<'_, &str, &str> = TableDefinition::new("leasebroker_vms");
/// Hypervisor: tag -> VM ids booted with it.
const VM_TAGS: MultimapTableDefinition<'_, &str, &str> = MultimapTableDefinition::new("leasebroker_vm_tags");

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

/// Adds one to counter `name` inside `tx`; returns the new value.
fn bump(tx: &WriteTransaction, name: &str) -> Result<u64, StateError> {
    let mut counters = tx.open_table(COUNTERS).map_err(storage)?;
    let n = counters.get(name).map_err(storage)?.map_or(0, |v| v.value()) + 1;
    counters.insert(name, n).map_err(storage)?;
    Ok(n)
}

/// The pool, leases and hypervisor. Every method fails with [`StateError::Storage`] when
/// redb does; the docs name only the other errors.
#[derive(Clone, Debug)]
pub struct Infra {
    db: Arc<Database>,
}

impl Infra {
    /// Uses `db` (creating the tables).
    pub fn new(db: Arc<Database>) -> Result<Self, StateError> {
        let tx = db.begin_write().map_err(storage)?;
        tx.open_table(WORKERS).map_err(storage)?;
        tx.open_table(COUNTERS).map_err(storage)?;
        tx.open_table(NODES).map_err(storage)?;
        tx.open_table(LEASES).map_err(storage)?;
        tx.open_table(VMS).map_err(storage)?;
        tx.open_multimap_table(VM_TAGS).map_err(storage)?;
        tx.commit().map_err(storage)?;
        Ok(Self { db })
    }

    fn write<T>(&self, f: impl FnOnce(&WriteTransaction) -> Result<T, StateError>) -> Result<T, StateError> {
        let tx = self.db.begin_write().map_err(storage)?;
        let out = f(&tx)?;
        tx.commit().map_err(storage)?;
        Ok(out)
    }

    /// The pool: allocates a node for `subkey`, or returns the node that sub-key already
    /// got (idempotent by the caller's id, like a cloud API's `ClientToken`). Counts
    /// `allocations` only for a new node.
    pub fn allocate(&self, subkey: &str) -> Result<String, StateError> {
        self.write(|tx| {
            let mut nodes = tx.open_table(NODES).map_err(storage)?;
            if let Some(node) = nodes.get(subkey).map_err(storage)? {
                return Ok(node.value().to_string());
            }
            let node = format!("node-{:05}", bump(tx, "allocations")?);
            nodes.insert(subkey, node.as_str()).map_err(storage)?;
            Ok(node)
        })
    }

    /// Writes the lease that holds `node` for `subkey`, or returns the lease that sub-key
    /// already wrote (idempotent by the caller's id). Counts `leases` only for a new lease.
    pub fn write_lease(&self, node: &str, subkey: &str) -> Result<String, StateError> {
        self.write(|tx| {
            let mut leases = tx.open_table(LEASES).map_err(storage)?;
            if let Some(v) = leases.get(subkey).map_err(storage)? {
                return Ok(v.value().split(' ').next().unwrap_or_default().to_string());
            }
            let lease = format!("lease-{:05}", bump(tx, "leases")?);
            leases.insert(subkey, format!("{lease} {node}").as_str()).map_err(storage)?;
            Ok(lease)
        })
    }

    /// The hypervisor: boots a new VM on `node`, tagged `tag`, and returns its id. NOT
    /// idempotent: every call boots another VM, as a hypervisor API that takes no caller
    /// id does. Find earlier boots with [`Infra::list_boots_by_tag`].
    ///
    /// # Errors
    /// [`StateError::Hypervisor`] when `fails` (nothing is booted); storage errors.
    pub fn boot(&self, tag: &str, node: &str, fails: bool) -> Result<String, StateError> {
        if fails {
            return Err(StateError::Hypervisor);
        }
        self.write(|tx| {
            let vm = format!("vm-{:05}", bump(tx, "boots")?);
            tx.open_table(VMS)
                .map_err(storage)?
                .insert(vm.as_str(), format!("{tag} {node}").as_str())
                .map_err(storage)?;
            tx.open_multimap_table(VM_TAGS).map_err(storage)?.insert(tag, vm.as_str()).map_err(storage)?;
            Ok(vm)
        })
    }

    /// The VMs booted with `tag`, oldest first.
    pub fn list_boots_by_tag(&self, tag: &str) -> Result<Vec<String>, StateError> {
        let tx = self.db.begin_read().map_err(storage)?;
        let tags = tx.open_multimap_table(VM_TAGS).map_err(storage)?;
        let mut out = Vec::new();
        for vm in tags.get(tag).map_err(storage)? {
            out.push(vm.map_err(storage)?.value().to_string());
        }
        Ok(out)
    }

    /// Writes the worker row for `subkey` (its id is derived from the sub-key), or returns
    /// the row that sub-key already wrote.
    pub fn put_worker(&self, subkey: &str, worker: Worker) -> Result<Worker, StateError> {
        let id = format!("wkr-{}", subkey.strip_prefix("idem-").unwrap_or(subkey).get(..16).unwrap_or(subkey));
        self.write(|tx| {
            let mut workers = tx.open_table(WORKERS).map_err(storage)?;
            if let Some(existing) = workers.get(id.as_str()).map_err(storage)? {
                return serde_json::from_slice(existing.value()).map_err(storage);
            }
            let worker = Worker { id: id.clone(), ..worker };
            let bytes = serde_json::to_vec(&worker).map_err(storage)?;
            workers.insert(id.as_str(), bytes.as_slice()).map_err(storage)?;
            Ok(worker)
        })
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
        self.write(|tx| {
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
            bump(tx, counter)?;
            Ok(w)
        })
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
