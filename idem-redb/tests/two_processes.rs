//! Two processes claimed one key on a redb file opened in `MultiWriter` mode: each kept its
//! claims in its own memory, so both answered `Claimed` with the same token. Now every
//! claim is decided inside a write transaction, which redb gives one process at a time:
//! several processes racing for the same keys on one file claim each key exactly once.
//! The harness is `idem_conformance::racing_processes`.

use std::sync::Arc;

use idem_redb::{Config, RedbStore};
use redb::ConcurrencyMode;

fn main() {
    idem_conformance::racing_processes::main("IDEM_REDB_CHILD_DB", "shared.redb", |path| {
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
