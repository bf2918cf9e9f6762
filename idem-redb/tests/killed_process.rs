//! A process killed with SIGKILL in the middle of group commits loses no completion,
//! journal entry, fail or reclaim it had acknowledged, hands out no fencing token twice,
//! and leaves a file that the next process opens (redb repairs it on open). With deferred
//! claims (the default) the claims acknowledged after the last durable commit are lost,
//! and their keys are claimed again with greater tokens; with durable claims none is lost.
//! The child/parent harness is `idem_conformance::killed_process`.

use idem_conformance::killed_process::{self, Claims, HELD_CLAIMS};
use idem_redb::{Config, RedbStore};

fn main() {
    let claims = match std::env::var("IDEM_REDB_KILL_CLAIMS").as_deref() {
        Ok("durable") => Claims::Durable,
        _ => Claims::Deferred,
    };
    let open = move |path: &std::path::Path| {
        let config = Config::default().with_durable_claims(claims == Claims::Durable);
        RedbStore::open(path, config).expect("the store opens")
    };
    let report = killed_process::main("IDEM_REDB_KILL_DB", "killed.redb", claims, open);
    if std::env::var_os("IDEM_REDB_KILL_DB").is_some() {
        return;
    }
    if claims == Claims::Durable {
        assert_eq!(report.lost_claims, 0, "{report:?}");
        return;
    }
    // The kill lands where the harness put it: redb keeps a `Durability::None` commit
    // only once a durable one follows, so every claim after `holding` is gone.
    assert!(report.lost_claims >= HELD_CLAIMS, "deferred claims after the last durable commit: {report:?}");
    // The same kill with durable claims, in a second parent: nothing acknowledged is lost.
    let status = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .env("IDEM_REDB_KILL_CLAIMS", "durable")
        .status()
        .expect("run the durable-claims pass");
    assert!(status.success(), "the durable-claims pass failed");
}
