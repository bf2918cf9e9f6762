//! The simulated infrastructure behind leasebroker: a node pool, leases, a hypervisor and
//! the nodes' baseboard management controllers (BMCs), all kept in redb tables so they
//! survive a restart, and counted so a test can prove that no retry created or flashed
//! anything twice.
//!
//! Each is a separate side effect with its own commit, as in a real provisioning backend:
//! a process killed between two of them leaves the first one behind. The pool and the
//! lease table are idempotent by the caller's sub-key; the hypervisor is not (each boot
//! is a new VM) but tags every VM, so a retry can find a boot it does not remember. The
//! BMC is the least forgiving: a second flash started while one runs bricks the node. It
//! comes in two generations:
//!
//! - the **blind** BMC ([`Infra::start_flash`], [`Infra::finish_flash`]) takes no caller
//!   id and cannot be asked what it is doing, as older BMCs' update APIs;
//! - the **task** BMC ([`Infra::start_flash_task`], [`Infra::flash_task`],
//!   [`Infra::finish_flash_task`]) works like a Redfish `UpdateService` with a task
//!   monitor: a flash is a task named by the caller's id, and anyone can ask for the task
//!   later, from another process too. The flash runs on the BMC, not in the caller: its
//!   end time is fixed when it starts, and it ends when the clock passes it whether or not
//!   the caller still lives.
//!
//! These tables live in their own redb file (`--state`), whatever the idempotency store.

use std::collections::BTreeMap;
use std::sync::Arc;

use redb::{Database, MultimapTableDefinition, ReadableDatabase, ReadableTable, TableDefinition, WriteTransaction};
use serde::{Deserialize, Serialize};

const WORKERS: TableDefinition<'_, &str, &[u8]> = TableDefinition::new("leasebroker_workers");
const COUNTERS: TableDefinition<'_, &str, u64> = TableDefinition::new("leasebroker_counters");
/// Pool: sub-key of the allocation -> node.
const NODES: TableDefinition<'_, &str, &str> = TableDefinition::new("leasebroker_nodes");
/// Leases: sub-key of the lease -> `lease-id node`.
const LEASES: TableDefinition<'_, &str, &str> = TableDefinition::new("leasebroker_leases");
/// Hypervisor: VM id -> `tag node`.
const VMS: TableDefinition<'_, &str, &str> = TableDefinition::new("leasebroker_vms");
/// Hypervisor: tag -> VM ids booted with it.
const VM_TAGS: MultimapTableDefinition<'_, &str, &str> = MultimapTableDefinition::new("leasebroker_vm_tags");
/// BMC: node -> flashes running on it now.
const FLASHING: TableDefinition<'_, &str, u64> = TableDefinition::new("leasebroker_bmc_flashing");
/// BMC: node -> `image version` of the firmware its last clean flash installed.
const FIRMWARE: TableDefinition<'_, &str, &str> = TableDefinition::new("leasebroker_bmc_firmware");
/// BMC: bricked node -> number of the flash that bricked it.
const BRICKED: TableDefinition<'_, &str, u64> = TableDefinition::new("leasebroker_bmc_bricked");
/// Task BMC: task id (the caller's tag) -> the task, JSON ([`FlashTask`]).
const FLASH_TASKS: TableDefinition<'_, &str, &[u8]> = TableDefinition::new("leasebroker_bmc_tasks");
/// Task BMC: node -> end of the latest task flash started on it, Unix ms.
const FLASH_UNTIL: TableDefinition<'_, &str, u64> = TableDefinition::new("leasebroker_bmc_flash_until");

/// A flash task of the task BMC: what it flashes, where, and when it ends.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct FlashTask {
    /// The task id: the tag the caller started it with.
    pub id: String,
    /// The node flashed.
    pub node: String,
    /// Number of this flash among every flash the BMCs started (1-based).
    pub number: u64,
    /// What it installs.
    pub firmware: FirmwareSpec,
    /// When it started, Unix ms.
    pub started_at_ms: u64,
    /// When it ends, Unix ms (fixed at the start: the BMC flashes on its own).
    pub ends_at_ms: u64,
}

/// What [`Infra::finish_flash_task`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FlashProgress {
    /// Still flashing until this Unix ms.
    Running {
        /// End of the flash, Unix ms.
        ends_at_ms: u64,
    },
    /// Done: the firmware is installed.
    Done(Flash),
}

/// The wall clock, Unix ms: the BMC's clock, shared by every process on this machine.
#[must_use]
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

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

/// What the client asks for in `POST /v1/workers/{id}/firmware`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct FirmwareSpec {
    /// Firmware image, e.g. `bmc-firmware`.
    pub image: String,
    /// Version to install, e.g. `2.4.1`.
    pub version: String,
}

/// A flash the BMC finished.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Flash {
    /// The node flashed.
    pub node: String,
    /// Number of this flash among every flash the BMCs started (1-based).
    pub number: u64,
    /// What was installed.
    pub firmware: FirmwareSpec,
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
    /// Firmware flashes the BMCs started (a flash refused because its node was already
    /// bricked is not counted).
    pub flashes: u64,
    /// Nodes bricked by a flash started while another flash of the same node ran.
    pub bricked: u64,
}

/// Everything the simulated infrastructure holds, for a leak check: every node, lease and
/// VM should belong to exactly one worker.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Inventory {
    /// Allocated nodes: (allocation sub-key, node).
    pub nodes: Vec<(String, String)>,
    /// Leases: (lease sub-key, lease, node).
    pub leases: Vec<(String, String, String)>,
    /// Booted VMs: (VM, tag, node).
    pub vms: Vec<(String, String, String)>,
    /// Every worker row, deleted ones included.
    pub workers: Vec<Worker>,
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
    /// The node's BMC is bricked: a second flash was started while one ran. Permanent
    /// until someone recovers the node by hand.
    #[error("{node} is bricked: a second firmware flash started while one was running")]
    Bricked {
        /// The node.
        node: String,
    },
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
        tx.open_table(NODES).map_err(storage)?;
        tx.open_table(LEASES).map_err(storage)?;
        tx.open_table(VMS).map_err(storage)?;
        tx.open_multimap_table(VM_TAGS).map_err(storage)?;
        tx.open_table(FLASHING).map_err(storage)?;
        tx.open_table(FIRMWARE).map_err(storage)?;
        tx.open_table(BRICKED).map_err(storage)?;
        tx.open_table(FLASH_TASKS).map_err(storage)?;
        tx.open_table(FLASH_UNTIL).map_err(storage)?;
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
    ///
    /// # Errors
    /// Storage errors.
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
    ///
    /// # Errors
    /// Storage errors.
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
    ///
    /// # Errors
    /// Storage errors.
    pub fn list_boots_by_tag(&self, tag: &str) -> Result<Vec<String>, StateError> {
        let tx = self.db.begin_read().map_err(storage)?;
        let tags = tx.open_multimap_table(VM_TAGS).map_err(storage)?;
        let mut out = Vec::new();
        for vm in tags.get(tag).map_err(storage)? {
            out.push(vm.map_err(storage)?.value().to_string());
        }
        Ok(out)
    }

    /// The BMC of `node`: starts flashing `firmware` and returns the flash's number; the
    /// caller waits out the flash time and then calls [`Infra::finish_flash`]. NOT
    /// idempotent, as a BMC's update API is not: it takes no caller id, every call starts
    /// another flash (counted in `flashes`), and a flash started while another one of the
    /// same node runs bricks the node (counted in `bricked`; the flash still counts as
    /// started, and both running flashes end in [`StateError::Bricked`]).
    ///
    /// # Errors
    /// [`StateError::Bricked`] when the node is already bricked (no flash starts); storage
    /// errors.
    pub fn start_flash(&self, node: &str) -> Result<u64, StateError> {
        self.write(|tx| {
            if tx.open_table(BRICKED).map_err(storage)?.get(node).map_err(storage)?.is_some() {
                return Err(StateError::Bricked { node: node.to_string() });
            }
            let number = bump(tx, "flashes")?;
            let mut flashing = tx.open_table(FLASHING).map_err(storage)?;
            let running = flashing.get(node).map_err(storage)?.map_or(0, |v| v.value());
            if running > 0 {
                tx.open_table(BRICKED).map_err(storage)?.insert(node, number).map_err(storage)?;
                bump(tx, "bricked")?;
            }
            flashing.insert(node, running + 1).map_err(storage)?;
            Ok(number)
        })
    }

    /// Ends flash `number` of `node` (started by [`Infra::start_flash`]) and installs
    /// `firmware`, unless the node was bricked meanwhile.
    ///
    /// # Errors
    /// [`StateError::Bricked`] when the node is bricked (the flash still ends: it no
    /// longer counts as running); storage errors.
    pub fn finish_flash(&self, node: &str, number: u64, firmware: FirmwareSpec) -> Result<Flash, StateError> {
        // The end of the flash is committed before a bricked node is reported, so the
        // error does not roll it back.
        let bricked = self.write(|tx| {
            let mut flashing = tx.open_table(FLASHING).map_err(storage)?;
            let running = flashing.get(node).map_err(storage)?.map_or(0, |v| v.value());
            if running > 1 {
                flashing.insert(node, running - 1).map_err(storage)?;
            } else {
                flashing.remove(node).map_err(storage)?;
            }
            if tx.open_table(BRICKED).map_err(storage)?.get(node).map_err(storage)?.is_some() {
                return Ok(true);
            }
            let installed = format!("{} {}", firmware.image, firmware.version);
            tx.open_table(FIRMWARE).map_err(storage)?.insert(node, installed.as_str()).map_err(storage)?;
            Ok(false)
        })?;
        if bricked {
            return Err(StateError::Bricked { node: node.to_string() });
        }
        Ok(Flash { node: node.to_string(), number, firmware })
    }

    /// The task BMC of `node`: starts flashing `firmware` as task `id` (the caller's tag),
    /// for `flash_ms`, and returns the task. Like the blind BMC it is not idempotent: a
    /// second call with the same id starts another flash (counted in `flashes`), and a
    /// flash started while another one of the same node runs (blind or task) bricks the
    /// node (counted in `bricked`). What makes it safe is [`Infra::flash_task`]: a caller
    /// that does not know whether it started the task asks first.
    ///
    /// # Errors
    /// [`StateError::Bricked`] when the node is already bricked (no flash starts); storage
    /// errors.
    pub fn start_flash_task(
        &self,
        node: &str,
        id: &str,
        firmware: FirmwareSpec,
        flash_ms: u64,
    ) -> Result<FlashTask, StateError> {
        self.write(|tx| {
            if tx.open_table(BRICKED).map_err(storage)?.get(node).map_err(storage)?.is_some() {
                return Err(StateError::Bricked { node: node.to_string() });
            }
            let number = bump(tx, "flashes")?;
            let now = unix_ms();
            let mut until = tx.open_table(FLASH_UNTIL).map_err(storage)?;
            let task_running = until.get(node).map_err(storage)?.is_some_and(|v| v.value() > now);
            let blind_running =
                tx.open_table(FLASHING).map_err(storage)?.get(node).map_err(storage)?.is_some_and(|v| v.value() > 0);
            if task_running || blind_running {
                tx.open_table(BRICKED).map_err(storage)?.insert(node, number).map_err(storage)?;
                bump(tx, "bricked")?;
            }
            let task = FlashTask {
                id: id.to_string(),
                node: node.to_string(),
                number,
                firmware,
                started_at_ms: now,
                ends_at_ms: now.saturating_add(flash_ms),
            };
            let latest = until.get(node).map_err(storage)?.map_or(0, |v| v.value());
            until.insert(node, latest.max(task.ends_at_ms)).map_err(storage)?;
            let bytes = serde_json::to_vec(&task).map_err(storage)?;
            tx.open_table(FLASH_TASKS).map_err(storage)?.insert(id, bytes.as_slice()).map_err(storage)?;
            Ok(task)
        })
    }

    /// The task BMC's task monitor: task `id`, if a flash was ever started with it.
    ///
    /// # Errors
    /// Storage errors.
    pub fn flash_task(&self, id: &str) -> Result<Option<FlashTask>, StateError> {
        let tx = self.db.begin_read().map_err(storage)?;
        let tasks = tx.open_table(FLASH_TASKS).map_err(storage)?;
        let Some(bytes) = tasks.get(id).map_err(storage)? else {
            return Ok(None);
        };
        serde_json::from_slice(bytes.value()).map(Some).map_err(storage)
    }

    /// Where task `id` stands: running until its end, or done, in which case its firmware
    /// is installed (idempotent: asking again installs the same version again).
    ///
    /// # Errors
    /// [`StateError::NotFound`] for an unknown task; [`StateError::Bricked`] once the task
    /// ended on a node that a second flash bricked; storage errors.
    pub fn finish_flash_task(&self, id: &str) -> Result<FlashProgress, StateError> {
        let task = self.flash_task(id)?.ok_or(StateError::NotFound)?;
        if unix_ms() < task.ends_at_ms {
            return Ok(FlashProgress::Running { ends_at_ms: task.ends_at_ms });
        }
        let bricked = self.write(|tx| {
            if tx.open_table(BRICKED).map_err(storage)?.get(task.node.as_str()).map_err(storage)?.is_some() {
                return Ok(true);
            }
            let installed = format!("{} {}", task.firmware.image, task.firmware.version);
            tx.open_table(FIRMWARE)
                .map_err(storage)?
                .insert(task.node.as_str(), installed.as_str())
                .map_err(storage)?;
            Ok(false)
        })?;
        if bricked {
            return Err(StateError::Bricked { node: task.node });
        }
        Ok(FlashProgress::Done(Flash { node: task.node, number: task.number, firmware: task.firmware }))
    }

    /// Writes the worker row for `subkey` (its id is derived from the sub-key), or returns
    /// the row that sub-key already wrote.
    ///
    /// # Errors
    /// Storage errors.
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

    /// Every node, lease, VM and worker.
    ///
    /// # Errors
    /// Storage errors.
    pub fn inventory(&self) -> Result<Inventory, StateError> {
        let tx = self.db.begin_read().map_err(storage)?;
        let mut inv = Inventory::default();
        for e in tx.open_table(NODES).map_err(storage)?.iter().map_err(storage)? {
            let (k, v) = e.map_err(storage)?;
            inv.nodes.push((k.value().to_string(), v.value().to_string()));
        }
        for e in tx.open_table(LEASES).map_err(storage)?.iter().map_err(storage)? {
            let (k, v) = e.map_err(storage)?;
            let (lease, node) = v.value().split_once(' ').unwrap_or((v.value(), ""));
            inv.leases.push((k.value().to_string(), lease.to_string(), node.to_string()));
        }
        for e in tx.open_table(VMS).map_err(storage)?.iter().map_err(storage)? {
            let (k, v) = e.map_err(storage)?;
            let (tag, node) = v.value().split_once(' ').unwrap_or((v.value(), ""));
            inv.vms.push((k.value().to_string(), tag.to_string(), node.to_string()));
        }
        for e in tx.open_table(WORKERS).map_err(storage)?.iter().map_err(storage)? {
            let (_, v) = e.map_err(storage)?;
            inv.workers.push(serde_json::from_slice(v.value()).map_err(storage)?);
        }
        Ok(inv)
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
            flashes: get("flashes")?,
            bricked: get("bricked")?,
        })
    }
}
