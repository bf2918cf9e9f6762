//! Crash points inside the handlers, for the rig's crash tests: at an armed point the
//! server stops dead, as a process killed by the kernel would. The create handler's points
//! are listed by the rig that arms them (`idem-harness serve --crash-at`).
//!
//! At a point that fires, the server prints `CRASHPOINT <name>` on stdout and then either
//! blocks that handler forever, waiting for the test to send SIGKILL (the default: the
//! kill is a real `kill -9` from outside), or calls [`std::process::abort`]
//! (`--crash-abort`, for a run without a supervisor). Either way nothing after the point
//! runs: no journal write, no `complete`, no `fail`, no response.

use std::io::Write;

use rand::Rng;

/// The crash points of the create variant whose worker row lives in the SQL database
/// ([`crate::sqlworkers`]), in the order a request passes them.
pub const TX_POINTS: [&str; 4] = [
    // Inside the handler's transaction: the worker row is inserted, nothing committed.
    "tx_after_insert",
    // Inside the handler's transaction: the record's completion is written too (in
    // transactional mode), nothing committed.
    "tx_before_commit",
    // Right after the handler's commit: the worker row (and, in transactional mode, the
    // stored response) is durable; the layer has not run after the handler yet.
    "tx_after_commit",
    // The response left the handler; in separate mode the layer has just completed.
    "tx_after_response",
];

/// Which points are armed, how often they fire, and how.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CrashPlan {
    /// The points the plan knows, in the order a request passes them.
    points: &'static [&'static str],
    /// Bit `i` arms `points[i]`.
    armed: u16,
    /// Probability in `0.0..=1.0` that an armed point fires when a request passes it.
    pub rate: f64,
    /// Abort the process instead of blocking for an outside SIGKILL.
    pub abort: bool,
}

impl CrashPlan {
    /// Parses `name[,name…]` of [`TX_POINTS`], e.g. `tx_after_commit`.
    ///
    /// # Errors
    /// An unknown point name.
    pub fn parse(points: &str, rate: f64, abort: bool) -> Result<Self, String> {
        Self::parse_in(&TX_POINTS, points, rate, abort)
    }

    /// Parses `name[,name…]` of `known` (at most 16 points), or `any` for all of them.
    ///
    /// # Errors
    /// An unknown point name.
    pub fn parse_in(known: &'static [&'static str], points: &str, rate: f64, abort: bool) -> Result<Self, String> {
        let mut armed = 0u16;
        for p in points.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            armed |= match known.iter().position(|n| *n == p) {
                Some(i) => 1 << i,
                None if p == "any" => (0..known.len().min(16)).fold(0, |all, i| all | 1 << i),
                None => return Err(format!("unknown crash point {p:?}: use any or one of {}", known.join(", "))),
            };
        }
        Ok(Self { points: known, armed, rate: rate.clamp(0.0, 1.0), abort })
    }

    /// The armed points, in order.
    pub fn armed(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.points.iter().enumerate().filter(|(i, _)| self.armed & (1 << i) != 0).map(|(_, n)| *n)
    }

    /// Whether any point is armed.
    #[must_use]
    pub fn is_armed(&self) -> bool {
        self.armed != 0 && self.rate > 0.0
    }

    /// Passes point `name`: returns at once unless it is armed and fires; then never
    /// returns.
    pub async fn point(&self, name: &str) {
        let Some(i) = self.points.iter().position(|n| *n == name) else { return };
        let fires = self.armed & (1 << i) != 0 && rand::rng().random_bool(self.rate);
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
