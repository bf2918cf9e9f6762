//! A process killed with SIGKILL in the middle of group commits loses nothing it had
//! acknowledged, not even the deferred claims (committed with `synchronous = NORMAL`, which
//! only an operating-system crash or a power loss can take back), hands out no fencing
//! token twice, and leaves a file the next process opens cleanly. The child/parent
//! harness is `idem_conformance::killed_process`, shared with every file-backed store; its
//! last 32 claims are killed between the claim and the first durable write after it.

use idem_conformance::killed_process::{self, Claims};
use idem_sqlite::{Config, SqliteStore};

fn main() {
    let report = killed_process::main("IDEM_SQLITE_KILL_DB", "killed.sqlite3", Claims::Deferred, |path| {
        SqliteStore::open(path, Config::default()).expect("the store opens")
    });
    if std::env::var_os("IDEM_SQLITE_KILL_DB").is_none() {
        assert_eq!(report.lost_claims, 0, "a process crash lost a NORMAL commit: {report:?}");
    }
}
