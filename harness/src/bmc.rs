//! The nodes' simulated baseboard management controllers (BMCs), behind the rig's firmware
//! route ([`crate::firmware`]): flashes kept in a redb file of their own (next to the
//! demo's infra state) so they survive a restart, and counted so a test can prove that no
//! retry flashed anything twice.
//!
//! A BMC is the least forgiving side effect: a second flash started while one runs bricks
//! the node. It comes in two generations:
//!
//! - the **blind** BMC ([`Bmcs::start_flash`], [`Bmcs::finish_flash`]) takes no caller
//!   id and cannot be asked what it is doing, as older BMCs' update APIs;
//! - the **task** BMC ([`Bmcs::start_flash_task`], [`Bmcs::flash_task`],
//!   [`Bmcs::finish_flash_task`]) works like a Redfish `UpdateService` with a task
//!   monitor: a flash is a task named by the caller's id, and anyone can ask for the task
//!   later, from another process too. The flash runs on the BMC, not in the caller: its
//!   end time is fixed when it starts, and it ends when the clock passes it whether or not
//!   the caller still lives.

use std::sync::Arc;

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition, WriteTransaction};
use serde::{Deserialize, Serialize};

const COUNTERS: TableDefinition<'_, &str, u64> = TableDefinition::new("leasebroker_bmc_counters");
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

/// What [`Bmcs::finish_flash_task`] found.
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

/// Counts of what the BMCs did (`GET /admin/bmc`).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct BmcStats {
    /// Firmware flashes the BMCs started (a flash refused because its node was already
    /// bricked is not counted).
    pub flashes: u64,
    /// Nodes bricked by a flash started while another flash of the same node ran.
    pub bricked: u64,
}

/// Why a BMC call failed.
#[derive(Debug, thiserror::Error)]
pub enum BmcError {
    /// redb failed.
    #[error("BMC storage: {0}")]
    Storage(String),
    /// No such flash task.
    #[error("no such flash task")]
    NotFound,
    /// The node's BMC is bricked: a second flash was started while one ran. Permanent
    /// until someone recovers the node by hand.
    #[error("{node} is bricked: a second firmware flash started while one was running")]
    Bricked {
        /// The node.
        node: String,
    },
}

fn storage(e: impl std::fmt::Display) -> BmcError {
    BmcError::Storage(e.to_string())
}

/// Adds one to counter `name` inside `tx`; returns the new value.
fn bump(tx: &WriteTransaction, name: &str) -> Result<u64, BmcError> {
    let mut counters = tx.open_table(COUNTERS).map_err(storage)?;
    let n = counters.get(name).map_err(storage)?.map_or(0, |v| v.value()) + 1;
    counters.insert(name, n).map_err(storage)?;
    Ok(n)
}

/// The BMCs of every node.
#[derive(Clone, Debug)]
pub struct Bmcs {
    db: Arc<Database>,
}

impl Bmcs {
    /// Uses `db` (creating the tables).
    ///
    /// # Errors
    /// [`BmcError::Storage`] when the tables cannot be created.
    pub fn new(db: Arc<Database>) -> Result<Self, BmcError> {
        let tx = db.begin_write().map_err(storage)?;
        tx.open_table(COUNTERS).map_err(storage)?;
        tx.open_table(FLASHING).map_err(storage)?;
        tx.open_table(FIRMWARE).map_err(storage)?;
        tx.open_table(BRICKED).map_err(storage)?;
        tx.open_table(FLASH_TASKS).map_err(storage)?;
        tx.open_table(FLASH_UNTIL).map_err(storage)?;
        tx.commit().map_err(storage)?;
        Ok(Self { db })
    }

    fn write<T>(&self, f: impl FnOnce(&WriteTransaction) -> Result<T, BmcError>) -> Result<T, BmcError> {
        let tx = self.db.begin_write().map_err(storage)?;
        let out = f(&tx)?;
        tx.commit().map_err(storage)?;
        Ok(out)
    }

    /// The BMC of `node`: starts flashing `firmware` and returns the flash's number; the
    /// caller waits out the flash time and then calls [`Bmcs::finish_flash`]. NOT
    /// idempotent, as a BMC's update API is not: it takes no caller id, every call starts
    /// another flash (counted in `flashes`), and a flash started while another one of the
    /// same node runs bricks the node (counted in `bricked`; the flash still counts as
    /// started, and both running flashes end in [`BmcError::Bricked`]).
    ///
    /// # Errors
    /// [`BmcError::Bricked`] when the node is already bricked (no flash starts); storage
    /// errors.
    pub fn start_flash(&self, node: &str) -> Result<u64, BmcError> {
        self.write(|tx| {
            if tx.open_table(BRICKED).map_err(storage)?.get(node).map_err(storage)?.is_some() {
                return Err(BmcError::Bricked { node: node.to_string() });
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

    /// Ends flash `number` of `node` (started by [`Bmcs::start_flash`]) and installs
    /// `firmware`, unless the node was bricked meanwhile.
    ///
    /// # Errors
    /// [`BmcError::Bricked`] when the node is bricked (the flash still ends: it no
    /// longer counts as running); storage errors.
    pub fn finish_flash(&self, node: &str, number: u64, firmware: FirmwareSpec) -> Result<Flash, BmcError> {
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
            return Err(BmcError::Bricked { node: node.to_string() });
        }
        Ok(Flash { node: node.to_string(), number, firmware })
    }

    /// The task BMC of `node`: starts flashing `firmware` as task `id` (the caller's tag),
    /// for `flash_ms`, and returns the task. Like the blind BMC it is not idempotent: a
    /// second call with the same id starts another flash (counted in `flashes`), and a
    /// flash started while another one of the same node runs (blind or task) bricks the
    /// node (counted in `bricked`). What makes it safe is [`Bmcs::flash_task`]: a caller
    /// that does not know whether it started the task asks first.
    ///
    /// # Errors
    /// [`BmcError::Bricked`] when the node is already bricked (no flash starts); storage
    /// errors.
    pub fn start_flash_task(
        &self,
        node: &str,
        id: &str,
        firmware: FirmwareSpec,
        flash_ms: u64,
    ) -> Result<FlashTask, BmcError> {
        self.write(|tx| {
            if tx.open_table(BRICKED).map_err(storage)?.get(node).map_err(storage)?.is_some() {
                return Err(BmcError::Bricked { node: node.to_string() });
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
    pub fn flash_task(&self, id: &str) -> Result<Option<FlashTask>, BmcError> {
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
    /// [`BmcError::NotFound`] for an unknown task; [`BmcError::Bricked`] once the task
    /// ended on a node that a second flash bricked; storage errors.
    pub fn finish_flash_task(&self, id: &str) -> Result<FlashProgress, BmcError> {
        let task = self.flash_task(id)?.ok_or(BmcError::NotFound)?;
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
            return Err(BmcError::Bricked { node: task.node });
        }
        Ok(FlashProgress::Done(Flash { node: task.node, number: task.number, firmware: task.firmware }))
    }

    /// Counts.
    ///
    /// # Errors
    /// Storage errors.
    pub fn stats(&self) -> Result<BmcStats, BmcError> {
        let tx = self.db.begin_read().map_err(storage)?;
        let counters = tx.open_table(COUNTERS).map_err(storage)?;
        let get = |n: &str| -> Result<u64, BmcError> { Ok(counters.get(n).map_err(storage)?.map_or(0, |v| v.value())) };
        Ok(BmcStats { flashes: get("flashes")?, bricked: get("bricked")? })
    }
}
