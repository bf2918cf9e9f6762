//! Crash points inside the create handler, for the crash test: at an armed point the
//! server stops dead, as a process killed by the kernel would.
//!
//! At a point that fires, the server prints `CRASHPOINT <name>` on stdout and then either
//! blocks that handler forever, waiting for the test to send SIGKILL (the default: the
//! kill is a real `kill -9` from outside), or calls [`std::process::abort`]
//! (`--crash-abort`, for a run without a supervisor). Either way nothing after the point
//! runs: no journal write, no `complete`, no `fail`, no response.

use std::io::Write;

use rand::Rng;

/// The crash points, in the order a create request passes them.
pub const POINTS: [&str; 8] = [
    // Claimed, nothing done yet.
    "before_allocate",
    // The node is allocated (and journalled); no lease.
    "after_allocate",
    // The lease is written (and journalled); the boot intent is not yet recorded.
    "after_lease",
    // The boot intent is journalled `pending`; the hypervisor has not been called.
    "before_boot",
    // The hypervisor booted the VM; the intent is still `pending` (only reconcile can tell).
    "after_boot",
    // The intent is `done(vm)`; no worker row.
    "after_boot_recorded",
    // The worker row is written; the response is not stored.
    "after_worker",
    // The response is stored (the record completed); it never reaches the client.
    "after_completion",
];

/// The crash points of the create variant whose worker row lives in PostgreSQL
/// ([`crate::pgworkers`]), in the order a request passes them. `any` does not arm them: they
/// are armed by name.
pub const PG_POINTS: [&str; 4] = [
    // Inside the handler's transaction: the worker row is inserted, nothing committed.
    "pg_after_insert",
    // Inside the handler's transaction: the record's completion is written too (in
    // transactional mode), nothing committed.
    "pg_before_commit",
    // Right after the handler's commit: the worker row (and, in transactional mode, the
    // stored response) is durable; the layer has not run after the handler yet.
    "pg_after_commit",
    // The response left the handler; in separate mode the layer has just completed.
    "pg_after_response",
];

/// Bit of point `name` in [`CrashPlan`]'s mask: [`POINTS`] take bits 0-7, [`PG_POINTS`]
/// bits 8-11.
fn bit(name: &str) -> Option<u16> {
    let i =
        POINTS.iter().position(|n| *n == name).or_else(|| PG_POINTS.iter().position(|n| *n == name).map(|i| i + 8))?;
    Some(1 << i)
}

/// Which points are armed, how often they fire, and how.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CrashPlan {
    /// Bit `i` arms `POINTS[i]`; bit `8 + i` arms `PG_POINTS[i]`.
    armed: u16,
    /// Probability in `0.0..=1.0` that an armed point fires when a request passes it.
    pub rate: f64,
    /// Abort the process instead of blocking for an outside SIGKILL.
    pub abort: bool,
}

impl CrashPlan {
    /// Parses `name[,name…]` or `any`, e.g. `after_lease,after_boot`.
    ///
    /// # Errors
    /// An unknown point name.
    pub fn parse(points: &str, rate: f64, abort: bool) -> Result<Self, String> {
        let mut armed = 0u16;
        for p in points.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            if p == "any" {
                armed = (1 << POINTS.len()) - 1;
            } else {
                armed |= bit(p).ok_or_else(|| {
                    format!(
                        "unknown crash point {p:?}: use any or one of {}, {}",
                        POINTS.join(", "),
                        PG_POINTS.join(", ")
                    )
                })?;
            }
        }
        Ok(Self { armed, rate: rate.clamp(0.0, 1.0), abort })
    }

    /// Whether any point is armed.
    #[must_use]
    pub fn is_armed(&self) -> bool {
        self.armed != 0 && self.rate > 0.0
    }

    /// Passes point `name`: returns at once unless it is armed and fires; then never
    /// returns.
    pub async fn point(&self, name: &str) {
        let Some(bit) = bit(name) else { return };
        let fires = self.armed & bit != 0 && rand::rng().random_bool(self.rate);
        if !fires {
            return;
        }
        {
            let mut out = std::io::stdout().lock();
            // Best effort: if stdout is gone the crash still happens.
            let _ = writeln!(out, "CRASHPOINT {name}");
            let _ = out.flush();
        }
        if self.abort {
            std::process::abort();
        }
        std::future::pending::<()>().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_arms_named_points_and_refuses_unknown_ones() {
        let p = CrashPlan::parse("after_lease, after_boot", 1.0, false).unwrap();
        assert!(p.is_armed());
        assert_eq!(p.armed, 0b1_0100);
        assert_eq!(CrashPlan::parse("any", 0.5, true).unwrap().armed, 0xff);
        assert!(!CrashPlan::parse("", 1.0, false).unwrap().is_armed());
        assert!(!CrashPlan::parse("any", 0.0, false).unwrap().is_armed());
        assert!(CrashPlan::parse("after_lunch", 1.0, false).unwrap_err().contains("after_lunch"));
    }

    #[tokio::test]
    async fn an_unarmed_point_returns() {
        let p = CrashPlan::parse("after_lease", 1.0, false).unwrap();
        p.point("before_allocate").await;
        p.point("not_a_point").await;
    }
}
