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
    pub(crate) isolation_pin: bool,
    pub(crate) prepared_statements: bool,
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
            isolation_pin: true,
            prepared_statements: true,
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

    /// Whether [`crate::PostgresStore::connect`] pins READ COMMITTED on the connections it
    /// opens (default `true`): each carries the startup option `-c
    /// default_transaction_isolation=read\ committed`, whatever the role's or database's
    /// default. Turn it off for a server or proxy that refuses the `options` startup
    /// parameter (PgBouncer before 1.20 does, unless its `ignore_startup_parameters` lists
    /// `options`, which then drops it). The store stays correct without it (see the crate
    /// docs, "Isolation").
    #[must_use]
    pub fn with_isolation_pin(mut self, on: bool) -> Self {
        self.isolation_pin = on;
        self
    }

    /// Whether statements are prepared once per connection and then sent by name (default
    /// `true`: one round trip, parsed and planned once). Turn it off behind PgBouncer in
    /// transaction mode before 1.21 (or with `max_prepared_statements = 0`), where a named
    /// statement prepared on one server connection is unknown to the next: each statement
    /// is then sent unnamed, still in one round trip (deadpool: parse, bind and execute of
    /// the unnamed statement in one batch; sqlx: the simple query protocol, values inlined
    /// as hex and decimal literals), and parsed and planned on every call.
    #[must_use]
    pub fn with_prepared_statements(mut self, on: bool) -> Self {
        self.prepared_statements = on;
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
