//! `scripts/pgbouncer` itself, on private ports (7401, 7402): it must refuse a port some
//! other process holds, and start (then leave alone) its own PgBouncer.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Command, Output};

fn script(port: u16) -> Output {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/pgbouncer");
    Command::new("bash")
        .arg(path)
        .env("IDEM_PGBOUNCER_PORT", port.to_string())
        .env_remove("IDEM_PGBOUNCER_URL")
        .output()
        .expect("run scripts/pgbouncer")
}

// Pins: scripts/pgbouncer took any listener on its port for its PgBouncer and exited 0, so
// the PgBouncer suites would run against whatever held the port (or fail far from the cause).
#[test]
fn a_port_held_by_another_process_is_refused_by_name() {
    let _held = TcpListener::bind("127.0.0.1:7401").expect("bind 127.0.0.1:7401");
    let out = script(7401);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the script accepted a port it does not own: {stderr}");
    assert!(stderr.contains("did not start"), "the refusal names the cause: {stderr}");
}

// Pins: a second run (scripts/services on every test run) must find its own PgBouncer and
// leave it alone, not start a second one or fail.
#[test]
fn its_own_pgbouncer_is_started_once_and_then_left_alone() {
    let dir = PathBuf::from("/tmp/idem-pgbouncer-7402");
    let first = script(7402);
    assert!(first.status.success(), "start: {}", String::from_utf8_lossy(&first.stderr));
    let again = script(7402);
    let pid = std::fs::read_to_string(dir.join("pgbouncer.pid")).expect("pid file");
    let pid = pid.trim().to_owned();
    // Stop it before asserting, so a failure leaves nothing running.
    let _ = Command::new("kill").arg(&pid).status();
    for _ in 0..50 {
        if !PathBuf::from(format!("/proc/{pid}")).exists() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(again.status.success(), "second run: {}", String::from_utf8_lossy(&again.stderr));
}
