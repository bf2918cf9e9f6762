//! `scripts/redis-cluster` (which `scripts/services` calls) as a new user meets it, on
//! private ports (7250-7255 and their bus ports 17250-17255) through
//! `IDEM_REDIS_CLUSTER_PORT`, so the shared cluster on 7000-7005 is never touched.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::Command;

const BASE: u16 = 7250;

fn script(dir: &std::path::Path, arg: Option<&str>) -> std::process::Output {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/redis-cluster");
    let mut cmd = Command::new(path);
    cmd.env_remove("IDEM_REDIS_CLUSTER_URLS")
        .env("IDEM_REDIS_CLUSTER_PORT", BASE.to_string())
        .env("IDEM_REDIS_CLUSTER_DIR", dir);
    if let Some(a) = arg {
        cmd.arg(a);
    }
    cmd.output().expect("run scripts/redis-cluster")
}

/// Stops whatever the script started, however the test ends.
struct Stop(PathBuf);

impl Drop for Stop {
    fn drop(&mut self) {
        let _ = script(&self.0, Some("--stop"));
    }
}

/// Pins: with one of the six ports (or a bus port) held by another program, the script
/// started the other five nodes around it, waited for a cluster that could never form, and
/// then advised `--reset`, which did the same again; it must refuse at once, name the
/// port, and start nothing.
///
/// Pins `docs/failures.md#redis-wait-refused-or-redirected-past-its-budget`.
#[test]
fn a_port_held_by_another_program_is_refused_by_name() {
    let dir = tempfile::Builder::new().prefix("idem-redis-cluster-script-").tempdir().expect("temp dir");
    let _stop = Stop(dir.path().to_owned());
    for held in [BASE + 3, BASE + 10_002] {
        let foreign = TcpListener::bind(("127.0.0.1", held)).expect("the test's port is free");
        for arg in [None, Some("--reset")] {
            let out = script(dir.path(), arg);
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{arg:?}: {stderr}");
            assert!(stderr.contains(&format!("port {held} is in use")), "{arg:?}: {stderr}");
            for p in BASE..BASE + 6 {
                if p != held {
                    assert!(TcpListener::bind(("127.0.0.1", p)).is_ok(), "{arg:?}: node {p} was started: {stderr}");
                }
            }
        }
        drop(foreign);
    }
}
