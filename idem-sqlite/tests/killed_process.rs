//! A process killed with SIGKILL in the middle of group commits loses no completion,
//! journal entry, fail or reclaim it had acknowledged, hands out no fencing token twice,
//! and leaves a file that the next process opens cleanly. With deferred
//! claims (`with_durable_claims(false)`) the claims still in memory at the kill are lost and their keys
//! are claimed again with greater tokens; with durable claims none is lost. The
//! child/parent harness is `idem_conformance::killed_process`.

use std::time::Duration;

use idem_conformance::killed_process::{self, Claims, HELD_CLAIMS};
use idem_sqlite::{Config, SqliteStore};

const CHILD: &str = "IDEM_SQLITE_KILL_DB";
const PASS: &str = "IDEM_SQLITE_KILL_CLAIMS";

fn main() {
    let claims = match std::env::var(PASS).as_deref() {
        Ok("durable") => Claims::Durable,
        _ => Claims::Deferred,
    };
    let open = move |path: &std::path::Path| {
        // Held claims stay in memory until the kill: the writer never writes them on its own.
        let config = Config::default()
            .with_durable_claims(claims == Claims::Durable)
            .with_pending_claim_age(Duration::from_secs(3600));
        SqliteStore::open(path, config).expect("the store opens")
    };
    let report = killed_process::main(CHILD, "killed.sqlite3", claims, open);
    if std::env::var_os(CHILD).is_some() {
        return;
    }
    if claims == Claims::Durable {
        assert_eq!(report.lost_claims, 0, "{report:?}");
        return;
    }
    // The kill lands where the harness put it: after `holding` no caller writes anything
    // but claims, so every one of them is still in memory.
    assert!(report.lost_claims >= HELD_CLAIMS, "deferred claims at the kill: {report:?}");
    // The same kill with durable claims, in a second parent: nothing acknowledged is lost.
    let status =
        std::process::Command::new(std::env::current_exe().expect("test binary")).env(PASS, "durable").status();
    assert!(status.expect("run the durable-claims pass").success(), "the durable-claims pass failed");
}
