//! A process killed with SIGKILL in the middle of group commits loses no completion,
//! journal entry, fail or reclaim it had acknowledged, hands out no fencing token twice,
//! and leaves a file that the next process opens cleanly. With deferred claims
//! (`with_durable_claims(false)`) the claims still in memory at the kill are lost and
//! their keys are claimed again with greater tokens; with durable claims none is lost. The
//! child/parent harness is `idem_conformance::killed_process`.

use std::time::Duration;

use idem_conformance::killed_process::{self, Claims};
use idem_sqlite::{Config, SqliteStore};

fn main() {
    killed_process::main_both_passes("IDEM_SQLITE_KILL_DB", "killed.sqlite3", |path, claims| {
        // Held claims stay in memory until the kill: the writer never writes them on its own.
        let config = Config::default()
            .with_durable_claims(claims == Claims::Durable)
            .with_pending_claim_age(Duration::from_secs(3600));
        SqliteStore::open(path, config).expect("the store opens")
    });
}
