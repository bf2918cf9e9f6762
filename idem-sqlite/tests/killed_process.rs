//! A process killed with SIGKILL in the middle of group commits loses no write it had
//! acknowledged, claims included, hands out no fencing token twice, and leaves a file the
//! next process opens cleanly: outcomes are sent only after their batch committed. The
//! child/parent harness is `idem_conformance::killed_process`, shared with every
//! file-backed store.

use idem_sqlite::{Config, SqliteStore};

fn main() {
    idem_conformance::killed_process::main("IDEM_SQLITE_KILL_DB", "killed.sqlite3", |path| {
        SqliteStore::open(path, Config::default()).expect("the store opens")
    });
}
