//! Metric handles registered once and kept, so a request increments counters and records
//! histograms without building a `metrics::Key` or looking one up in the recorder's registry
//! (`metrics::counter!` with labels does both on every call: label allocations, a hash, a
//! lock). Measured in BENCHMARKS.md ("Observability overhead").
//!
//! Handles belong to the recorder that was current when they were registered. The cache
//! remembers that recorder and starts afresh when another one is current (a recorder
//! installed after the first request, a thread-local test recorder), so a request never
//! counts into a recorder that is no longer the application's.
//!
//! Every handle is registered on its first use, never ahead: a series appears in the
//! exporter when it first happens, as it did with the macros.
//!
//! Limits, both about thread-local recorders (`metrics::with_local_recorder`, used by
//! tests), not the global one an application installs: recorders are told apart by
//! address, so a local recorder dropped and replaced by another at the same address keeps
//! the first one's handles (build a layer per test); and a handle is registered under the
//! recorder current when it is first used, which is another one if that first use runs on
//! a thread without the local recorder.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use arc_swap::{ArcSwap, ArcSwapOption};
use metrics::{Counter, Histogram, SharedString};

use crate::observe::{DecisionKind, Outcome, StoreOp};

/// Endpoints kept in the cache at most. Past it (endpoints named by concrete paths rather
/// than route templates, e.g. without axum's `MatchedPath`), each request registers its
/// handles again, as the macros would: correct, only slower, and the cache cannot grow
/// without bound.
const MAX_ENDPOINTS: usize = 1024;

/// Handles of type `T`, registered with the recorder that is current: one generation per
/// recorder.
///
/// Read without a lock or a reference count (`arc_swap`): a request on one core writes
/// nothing that the other cores read, where an `RwLock` or an `Arc` clone would move the
/// same cache line between them on every store call (measured: most of what the metrics
/// cost over sockets before this cache).
#[derive(Debug)]
pub(crate) struct MetricsCache<T> {
    current: ArcSwapOption<Generation<T>>,
}

impl<T> Default for MetricsCache<T> {
    fn default() -> Self {
        Self { current: ArcSwapOption::empty() }
    }
}

/// The handles registered with one recorder (by address).
#[derive(Debug)]
struct Generation<T> {
    recorder: usize,
    handles: T,
}

/// The recorder the metrics go to now, by address: the handles registered with it are
/// valid while it stays current.
fn current_recorder() -> usize {
    metrics::with_recorder(|r| std::ptr::from_ref(r).cast::<()>() as usize)
}

impl<T: Default> MetricsCache<T> {
    /// `f` of the handles for the recorder current on this thread.
    pub(crate) fn with<R>(&self, f: impl FnOnce(&T) -> R) -> R {
        let recorder = current_recorder();
        {
            let current = self.current.load();
            if let Some(g) = current.as_ref()
                && g.recorder == recorder
            {
                return f(&g.handles);
            }
        }
        // Another recorder is current (or none was seen yet): start a generation for it.
        // Two threads may race here; the loser's handles are used once and dropped.
        let made = Arc::new(Generation { recorder, handles: T::default() });
        self.current.store(Some(Arc::clone(&made)));
        f(&made.handles)
    }
}

/// The endpoint counters of one layer, by endpoint.
#[derive(Debug, Default)]
pub(crate) struct Endpoints {
    endpoints: ArcSwap<HashMap<Arc<str>, Arc<EndpointMetrics>>>,
    /// The endpoint asked for last: axum applies a layer to each route on its own, so a
    /// layer's requests usually name one endpoint, found here with one string compare
    /// instead of a hash and a map lookup.
    last: ArcSwapOption<EndpointMetrics>,
}

impl Endpoints {
    /// The handles labelled with `endpoint`.
    pub(crate) fn endpoint(&self, endpoint: &str) -> Arc<EndpointMetrics> {
        if let Some(m) = self.last.load().as_ref()
            && &*m.name == endpoint
        {
            return Arc::clone(m);
        }
        let found = self.lookup(endpoint);
        self.last.store(Some(Arc::clone(&found)));
        found
    }

    fn lookup(&self, endpoint: &str) -> Arc<EndpointMetrics> {
        if let Some(m) = self.endpoints.load().get(endpoint) {
            return Arc::clone(m);
        }
        let label: Arc<str> = Arc::from(endpoint);
        let made = Arc::new(EndpointMetrics::new(Arc::clone(&label)));
        if self.endpoints.load().len() >= MAX_ENDPOINTS {
            // Full: no copy of the map per request for endpoints it will never hold.
            return made;
        }
        // Copy on write: a new endpoint is rare (one per route and recorder), reads are not.
        self.endpoints.rcu(|map| {
            let mut map = HashMap::clone(map);
            if map.len() < MAX_ENDPOINTS {
                map.entry(Arc::clone(&label)).or_insert_with(|| Arc::clone(&made));
            }
            map
        });
        self.endpoints.load().get(endpoint).map_or(made, Arc::clone)
    }
}

const DECISIONS: usize = DecisionKind::ALL.len();
const OUTCOMES: usize = Outcome::ALL.len();

/// The counters labelled with one endpoint.
#[derive(Debug)]
pub(crate) struct EndpointMetrics {
    name: Arc<str>,
    label: SharedString,
    decisions: [OnceLock<Counter>; DECISIONS],
    outcomes: [OnceLock<Counter>; OUTCOMES],
    fail_open: OnceLock<Counter>,
    renewals: OnceLock<Counter>,
    lease_lost: OnceLock<Counter>,
    not_retained: OnceLock<Counter>,
}

impl EndpointMetrics {
    fn new(label: Arc<str>) -> Self {
        Self {
            label: SharedString::from_shared(Arc::clone(&label)),
            name: label,
            decisions: std::array::from_fn(|_| OnceLock::new()),
            outcomes: std::array::from_fn(|_| OnceLock::new()),
            fail_open: OnceLock::new(),
            renewals: OnceLock::new(),
            lease_lost: OnceLock::new(),
            not_retained: OnceLock::new(),
        }
    }

    /// `idem_decisions_total{decision, endpoint}`.
    pub(crate) fn decision(&self, decision: DecisionKind) -> &Counter {
        self.decisions[decision as usize].get_or_init(|| {
            metrics::counter!("idem_decisions_total", "decision" => decision.as_str(), "endpoint" => self.label.clone())
        })
    }

    /// `idem_outcomes_total{outcome, endpoint}`.
    pub(crate) fn outcome(&self, outcome: Outcome) -> &Counter {
        self.outcomes[outcome as usize].get_or_init(|| {
            metrics::counter!("idem_outcomes_total", "outcome" => outcome.as_str(), "endpoint" => self.label.clone())
        })
    }

    /// `idem_fail_open_total{endpoint}`.
    pub(crate) fn fail_open(&self) -> &Counter {
        self.fail_open.get_or_init(|| metrics::counter!("idem_fail_open_total", "endpoint" => self.label.clone()))
    }

    /// `idem_lease_renewals_total{endpoint}`.
    pub(crate) fn renewals(&self) -> &Counter {
        self.renewals.get_or_init(|| metrics::counter!("idem_lease_renewals_total", "endpoint" => self.label.clone()))
    }

    /// `idem_lease_lost_total{endpoint}`.
    pub(crate) fn lease_lost(&self) -> &Counter {
        self.lease_lost.get_or_init(|| metrics::counter!("idem_lease_lost_total", "endpoint" => self.label.clone()))
    }

    /// `idem_bodies_not_retained_total{endpoint}`.
    pub(crate) fn not_retained(&self) -> &Counter {
        self.not_retained
            .get_or_init(|| metrics::counter!("idem_bodies_not_retained_total", "endpoint" => self.label.clone()))
    }
}

/// The store call handles of one layer's store (one backend: the `backend` label is the
/// same on every call).
#[derive(Debug, Default)]
pub(crate) struct StoreMetrics {
    calls: [OnceLock<Histogram>; StoreOp::COUNT],
    /// Index: operation, then retryable (1) or not (0).
    errors: [[OnceLock<Counter>; 2]; StoreOp::COUNT],
}

impl StoreMetrics {
    /// `idem_store_call_seconds{backend, operation}`.
    pub(crate) fn call(&self, backend: &'static str, op: StoreOp) -> &Histogram {
        self.calls[op as usize].get_or_init(
            || metrics::histogram!("idem_store_call_seconds", "backend" => backend, "operation" => op.as_str()),
        )
    }

    /// `idem_store_errors_total{backend, operation, retryable}`.
    pub(crate) fn error(&self, backend: &'static str, op: StoreOp, retryable: bool) -> &Counter {
        self.errors[op as usize][usize::from(retryable)].get_or_init(|| {
            let retryable = if retryable { "true" } else { "false" };
            metrics::counter!(
                "idem_store_errors_total",
                "backend" => backend, "operation" => op.as_str(), "retryable" => retryable
            )
        })
    }
}
