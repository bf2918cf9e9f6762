//! Tests that run this binary again as child processes, so they need a `main` of their own
//! (`harness = false`). Each run is the parent of both tests, or one child of one of them:
//!
//! - **A killed process**: a process killed with SIGKILL in the middle of group commits
//!   loses no write it had acknowledged, claims included, hands out no fencing token twice,
//!   and leaves a file that the next process opens (redb repairs it on open): the writer
//!   answers a caller only after the batch holding its write committed
//!   (`idem_conformance::killed_process`).
//! - **Two processes**: two processes claimed one key on a redb file opened in
//!   `MultiWriter` mode: each kept its claims in its own memory, so both answered `Claimed`
//!   with the same token. Now every claim is decided inside a write transaction, which redb
//!   gives one process at a time: several processes racing for the same keys on one file
//!   claim each key exactly once (`idem_conformance::racing_processes`).

use std::sync::Arc;

use idem_redb::{Config, RedbStore};
use redb::ConcurrencyMode;

const KILL_ENV: &str = "IDEM_REDB_KILL_DB";
const RACE_ENV: &str = "IDEM_REDB_CHILD_DB";

fn main() {
    if std::env::var_os(RACE_ENV).is_none() {
        idem_conformance::killed_process::main(KILL_ENV, "killed.redb", |path| {
            RedbStore::open(path, Config::default()).expect("the store opens")
        });
        if std::env::var_os(KILL_ENV).is_some() {
            return;
        }
    }
    idem_conformance::racing_processes::main(RACE_ENV, "shared.redb", |path| {
        let db = redb::Database::builder()
            .set_concurrency_mode(ConcurrencyMode::MultiWriter)
            .create(path)
            .expect("the file opens in MultiWriter mode");
        RedbStore::from_database(
            Arc::new(db),
            Config::default().with_batch(idem_redb::BatchConfig::default().with_max_batch(4)),
        )
        .expect("the store opens")
    });
}
