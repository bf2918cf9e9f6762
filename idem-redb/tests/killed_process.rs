//! A process killed with SIGKILL in the middle of group commits loses no write it had
//! acknowledged, claims included, hands out no fencing token twice, and leaves a file that
//! the next process opens (redb repairs it on open): the writer answers a caller only
//! after the batch holding its write committed. The child/parent harness is
//! `idem_conformance::killed_process`.

use idem_redb::{Config, RedbStore};

fn main() {
    idem_conformance::killed_process::main("IDEM_REDB_KILL_DB", "killed.redb", |path| {
        RedbStore::open(path, Config::default()).expect("the store opens")
    });
}
