//! [`Config`]: which schema a [`crate::PostgresStore`] uses, whether it migrates it, its
//! clock and its pool settings.

use std::sync::Arc;
use std::time::Duration;

use idem_core::Clock;

use crate::sql::DEFAULT_SCHEMA;

/// How a [`crate::PostgresStore`] is set up. Build with `Config::default()` and the
/// `with_*` methods.
#[derive(Clone, Debug)]
pub struct Config {
    pub(crate) schema: String,
    pub(crate) auto_migrate: bool,
    pub(crate) clock: Option<Arc<dyn Clock>>,
    pub(crate) max_connections: usize,
    pub(crate) acquire_timeout: Duration,
    pub(crate) connect_timeout: Duration,
}

impl Default for Config {
    /// Schema `idem`, migrations applied on start, the server's clock, 16 connections, 5 s
    /// to acquire one, 5 s to open one.
    fn default() -> Self {
        Self {
            schema: DEFAULT_SCHEMA.to_owned(),
            auto_migrate: true,
            clock: None,
            max_connections: 16,
            acquire_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
        }
    }
}

impl Config {
    /// The schema holding the `records` table (default `idem`). Checked when the store is
    /// built: lower-case ASCII letters, digits and `_`, at most 63 bytes, not `pg_*` (see
    /// [`crate::validate_schema`]). One database can hold several independent stores in
    /// different schemas.
    #[must_use]
    pub fn with_schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// Whether building the store applies the missing migrations (default `true`). When
    /// migrations are missing, applying them needs the `CREATE` privilege on the database;
    /// a schema already at this build's migration is only read.
    ///
    /// With `false`, building the store only reads the schema's migration version and
    /// fails with [`crate::Error::NotMigrated`] when migrations are missing: for servers
    /// whose database role may not change the schema. Migrations then run elsewhere, from
    /// a deploy step that builds a store with this left on (or calls
    /// [`crate::PostgresStore::migrate`]), or from the team's own tool
    /// ([`crate::MIGRATIONS`]).
    #[must_use]
    pub fn with_auto_migrate(mut self, on: bool) -> Self {
        self.auto_migrate = on;
        self
    }

    /// Reads time from `clock` instead of the server's `clock_timestamp()`. Without it (the
    /// default) every statement reads the server's clock, which every process sharing the
    /// database agrees on: leave it unset in production. For tests: the conformance suite
    /// passes its `ManualClock`, whose reading goes to each statement as a parameter.
    #[must_use]
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = Some(clock);
        self
    }

    /// Pool size for [`crate::PostgresStore::connect`] (default 16 connections). Each
    /// in-flight store call holds one connection for one statement, never across the
    /// handler.
    #[must_use]
    pub fn with_max_connections(mut self, n: usize) -> Self {
        self.max_connections = n.max(1);
        self
    }

    /// How long a call waits for a free pooled connection before failing with a
    /// retryable error (default 5 s; for [`crate::PostgresStore::connect`]).
    #[must_use]
    pub fn with_acquire_timeout(mut self, d: Duration) -> Self {
        self.acquire_timeout = d;
        self
    }

    /// How long opening a connection may take (default 5 s; a `connect_timeout` in the
    /// URL wins; for [`crate::PostgresStore::connect`]).
    #[must_use]
    pub fn with_connect_timeout(mut self, d: Duration) -> Self {
        self.connect_timeout = d;
        self
    }
}
