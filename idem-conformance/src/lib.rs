//! # idem-conformance
//!
//! The suite every [`Store`] must pass, ours and yours. A backend implements [`Backend`]
//! (how to open a store on fresh storage with a clock the test owns) and writes one line:
//!
//! ```ignore
//! idem_conformance::store_tests!(MyBackend::new());
//! ```
//!
//! which expands into one named `#[tokio::test]` per scenario.
//!
//! # Layout
//! - [`Backend`], [`Env`]: how a scenario gets its store and clock.
//! - [`scenarios`]: the named scenarios, plain `pub async fn(Env)`.
//! - [`store_tests!`]: the macro.

use std::sync::Arc;

use async_trait::async_trait;
use idem_core::{ManualClock, Store};

pub mod scenarios;

/// How the suite opens stores of one backend.
#[async_trait]
pub trait Backend: Send + Sync + 'static {
    /// Opens a store on storage that no other scenario uses (a fresh file, a fresh key
    /// prefix, a fresh schema), timed by `clock`: the store must read `clock` for every
    /// `now`, including stores that use the server's clock in production.
    async fn open(&self, clock: ManualClock) -> Arc<dyn Store>;

    /// Opens a second, independent handle on the same storage as `store` (another
    /// connection, another process-level instance), used by the scenarios where two API
    /// servers share one backend. The default returns the same handle, which is right for
    /// embedded stores that allow one opener per file.
    async fn open_peer(&self, store: &Arc<dyn Store>, clock: ManualClock) -> Arc<dyn Store> {
        let _ = clock;
        Arc::clone(store)
    }
}

/// What a scenario runs against.
#[derive(Clone)]
pub struct Env {
    /// The store under test.
    pub store: Arc<dyn Store>,
    /// The store's clock; scenarios move it instead of sleeping.
    pub clock: ManualClock,
    /// A random namespace for this scenario: every principal it uses starts with it, so
    /// scenarios never touch each other's (or a user's) records on a shared server.
    pub namespace: String,
    backend: Arc<dyn Backend>,
}

impl std::fmt::Debug for Env {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Env").field("store", &self.store).field("namespace", &self.namespace).finish_non_exhaustive()
    }
}

impl Env {
    /// Opens a fresh store of `backend` with a manual clock started at the current wall
    /// time (plausible timestamps, so native expiry on a real server behaves).
    pub async fn open(backend: Arc<dyn Backend>) -> Self {
        let clock = ManualClock::starting_now();
        let store = backend.open(clock.clone()).await;
        let namespace = format!("conformance-{}", uuid::Uuid::new_v4().simple());
        Self { store, clock, namespace, backend }
    }

    /// A second handle on the same storage (see [`Backend::open_peer`]).
    pub async fn peer(&self) -> Arc<dyn Store> {
        self.backend.open_peer(&self.store, self.clock.clone()).await
    }

    /// A principal inside this scenario's namespace.
    #[must_use]
    pub fn principal(&self, name: &str) -> String {
        format!("{}/{name}", self.namespace)
    }
}

/// Expands into one `#[tokio::test]` per scenario for the backend built by `$backend`
/// (an expression evaluated once per test).
#[macro_export]
macro_rules! store_tests {
    ($backend:expr) => {
        $crate::__for_each_scenario!($crate::__store_test, $backend);
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __store_test {
    ($backend:expr, $group:ident :: $name:ident) => {
        #[::tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn $name() {
            let backend: ::std::sync::Arc<dyn $crate::Backend> = ::std::sync::Arc::new($backend);
            let env = $crate::Env::open(backend).await;
            $crate::scenarios::$group::$name(env).await;
        }
    };
}
