//! The task BMC (`state::Infra::start_flash_task` and its task monitor) on a real redb
//! file: what the firmware route's reconcile relies on. A flash started by a caller that
//! then dies is found by its id from a new process (the database reopened), keeps running
//! on its own until its end time, and is then done; a second flash of a node while one
//! runs bricks it, as on the blind BMC. The whole route under a SIGKILL of the server is
//! the chaos short pass's app-kill row (`tests/chaos.rs`).

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use leasebroker::state::{FirmwareSpec, FlashProgress, Infra, StateError};

fn open(path: &Path) -> Infra {
    Infra::new(Arc::new(redb::Database::create(path).unwrap())).unwrap()
}

fn firmware() -> FirmwareSpec {
    FirmwareSpec { image: "bmc-firmware".into(), version: "2.4.1".into() }
}

/// Polls the task monitor until the task is done; the bound only turns a hang into a
/// failure.
fn wait_done(infra: &Infra, id: &str) -> Result<FlashProgress, StateError> {
    let give_up = Instant::now() + Duration::from_secs(30);
    loop {
        match infra.finish_flash_task(id)? {
            FlashProgress::Running { .. } => {
                assert!(Instant::now() < give_up, "task {id} never ended");
                std::thread::sleep(Duration::from_millis(20));
            }
            done @ FlashProgress::Done(_) => return Ok(done),
        }
    }
}

/// A flash whose caller died had no trace a retry could find (the blind BMC), so the retry
/// flashed again: the task BMC must answer for it, from a reopened database, by its id.
#[test]
fn a_flash_outlives_its_caller_and_is_found_by_its_id_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.redb");
    let started = {
        let infra = open(&path);
        assert_eq!(infra.flash_task("idem-a").unwrap(), None, "no task before the start");
        let task = infra.start_flash_task("node-00001", "idem-a", firmware(), 300).unwrap();
        assert_eq!(task.ends_at_ms - task.started_at_ms, 300);
        task
        // The caller and its database handle are gone here, as after a SIGKILL.
    };
    let infra = open(&path);
    assert_eq!(infra.flash_task("idem-a").unwrap(), Some(started.clone()), "the task monitor knows the flash");
    assert_eq!(infra.flash_task("idem-b").unwrap(), None, "another id is another operation");
    let FlashProgress::Done(flash) = wait_done(&infra, "idem-a").unwrap() else { unreachable!() };
    assert_eq!((flash.node.as_str(), flash.number, flash.firmware), ("node-00001", started.number, firmware()));
    // Asking again is a read: still done, nothing flashed again.
    assert!(matches!(infra.finish_flash_task("idem-a").unwrap(), FlashProgress::Done(_)));
    let stats = infra.stats().unwrap();
    assert_eq!((stats.flashes, stats.bricked), (1, 0));
}

/// The task BMC is no more forgiving than the blind one: what protects a node is asking
/// before flashing, not the BMC. A second flash started while one runs bricks the node.
#[test]
fn a_second_flash_of_a_running_node_bricks_it() {
    let dir = tempfile::tempdir().unwrap();
    let infra = open(&dir.path().join("state.redb"));
    infra.start_flash_task("node-00002", "idem-first", firmware(), 5_000).unwrap();
    infra.start_flash_task("node-00002", "idem-second", firmware(), 100).unwrap();
    let stats = infra.stats().unwrap();
    assert_eq!((stats.flashes, stats.bricked), (2, 1));
    assert!(matches!(wait_done(&infra, "idem-second"), Err(StateError::Bricked { .. })));
    assert!(matches!(
        infra.start_flash_task("node-00002", "idem-third", firmware(), 100),
        Err(StateError::Bricked { .. })
    ));
    // A flash of another node after the first one ended is fine.
    infra.start_flash_task("node-00003", "idem-other", firmware(), 50).unwrap();
    assert!(matches!(wait_done(&infra, "idem-other").unwrap(), FlashProgress::Done(_)));
}
