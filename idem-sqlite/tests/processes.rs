//! Tests that run this binary again as child processes, so they need a `main` of their own
//! (`harness = false`). Each run is the parent of both tests, or one child of one of them:
//!
//! - **A killed process**: a process killed with SIGKILL in the middle of group commits
//!   loses no write it had acknowledged, claims included, hands out no fencing token twice,
//!   and leaves a file the next process opens cleanly: outcomes are sent only after their
//!   batch committed (`idem_conformance::killed_process`, shared with every file-backed
//!   store).
//! - **Racing processes**: several processes sharing one SQLite file race to claim the same
//!   idempotency keys: every key must be claimed exactly once overall. The children start
//!   together on a fresh file, so they also race through creating it and running the
//!   migrations, which pins a second failure: processes opening one fresh file at once got
//!   `SQLITE_BUSY` from the switch to WAL, which bypasses the busy handler
//!   (`idem_conformance::racing_processes`).

use idem_sqlite::{Config, SqliteStore};

const KILL_ENV: &str = "IDEM_SQLITE_KILL_DB";
const RACE_ENV: &str = "IDEM_SQLITE_CHILD_DB";

fn main() {
    if std::env::var_os(RACE_ENV).is_none() {
        idem_conformance::killed_process::main(KILL_ENV, "killed.sqlite3", |path| {
            SqliteStore::open(path, Config::default()).expect("the store opens")
        });
        if std::env::var_os(KILL_ENV).is_some() {
            return;
        }
    }
    idem_conformance::racing_processes::main(RACE_ENV, "shared.sqlite3", |path| {
        // Small batches: the processes take the write lock in turn many times.
        SqliteStore::open(path, Config::default().with_batch(idem_sqlite::BatchConfig::default().with_max_batch(4)))
            .expect("the store opens")
    });
}
