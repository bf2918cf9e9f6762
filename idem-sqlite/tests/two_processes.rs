//! Several processes sharing one SQLite file race to claim the same idempotency keys:
//! every key must be claimed exactly once overall. The children start together on a fresh
//! file, so they also race through creating it and running the migrations, which pins a
//! second failure: processes opening one fresh file at once got `SQLITE_BUSY` from the
//! switch to WAL, which bypasses the busy handler. The harness is
//! `idem_conformance::racing_processes`.

use idem_sqlite::{Config, SqliteStore};

fn main() {
    idem_conformance::racing_processes::main("IDEM_SQLITE_CHILD_DB", "shared.sqlite3", |path| {
        // Small batches: the processes take the write lock in turn many times.
        SqliteStore::open(path, Config::default().with_batch(idem_sqlite::BatchConfig::default().with_max_batch(4)))
            .expect("the store opens")
    });
}
