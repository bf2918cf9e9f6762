//! [`Config`]: which schema a [`crate::PostgresStore`] uses, whether it migrates it, its
//! clock, how it sends statements, and the pool [`crate::PostgresStore::connect`] builds.

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
    pub(crate) isolation_pin: bool,
    pub(crate) prepared_statements: bool,
    pub(crate) listen: bool,
}

impl Default for Config {
    /// Schema `idem`, migrations applied on start, the server's clock, prepared statements,
    /// no `LISTEN`, and for [`crate::PostgresStore::connect`]: 16
    /// connections, 5 s to get one, READ COMMITTED pinned.
    fn default() -> Self {
        Self {
            schema: DEFAULT_SCHEMA.to_owned(),
            auto_migrate: true,
            clock: None,
            max_connections: 16,
            acquire_timeout: Duration::from_secs(5),
            isolation_pin: true,
            prepared_statements: true,
            listen: false,
        }
    }
}

impl Config {
    idem_core::setters! {
        /// The schema holding the tables (default `idem`). Checked when the store is built:
        /// lower-case ASCII letters, digits and `_`, at most 63 bytes, not `pg_*` (see
        /// [`crate::validate_schema`]). One database can hold several independent stores in
        /// different schemas.
        #[must_use]
        pub fn with_schema(schema: impl Into<String>) => schema = schema.into();

        /// Whether building the store applies the missing migrations (default `true`; that
        /// needs `CREATE` on the database only while migrations are missing). With `false` it
        /// only reads the schema's version and fails with [`crate::Error::NotMigrated`], for
        /// roles that may not change the schema: a deploy step runs
        /// [`crate::PostgresStore::migrate`], or the team's own tool runs [`crate::MIGRATIONS`].
        #[must_use]
        pub fn with_auto_migrate(on: bool) => auto_migrate = on;

        /// Reads time from `clock` instead of the server's `clock_timestamp()`, passed to each
        /// statement as a parameter (`COALESCE($n, <server now>)`), so tests run the statements
        /// production runs. Leave it unset in production: the server's clock is the one every
        /// process sharing the database agrees on.
        #[must_use]
        pub fn with_clock(clock: Arc<dyn Clock>) => clock = Some(clock);

        /// Whether [`crate::PostgresStore::connect`] pins READ COMMITTED on its connections
        /// (default `true`) with the startup option
        /// `-c default_transaction_isolation=read\ committed`, after any `options` of the URL.
        /// Turn it off behind a pooler that refuses the `options` startup parameter (PgBouncer,
        /// unless `ignore_startup_parameters` lists it). The store stays correct at any level;
        /// contended records then cost retries.
        #[must_use]
        pub fn with_isolation_pin(on: bool) => isolation_pin = on;

        /// Whether statements are prepared once per connection and sent by name (default
        /// `true`: parsed and planned once, one round trip). Turn it off behind PgBouncer in
        /// transaction mode before 1.21 (or with `max_prepared_statements = 0`), where a
        /// statement prepared on one server connection is unknown to the next: each statement
        /// then goes over the simple query protocol, values inlined as hex and decimal
        /// literals (sqlx would prepare even an unnamed statement in a round trip of its own,
        /// and PgBouncer may switch server connections in between).
        #[must_use]
        pub fn with_prepared_statements(on: bool) => prepared_statements = on;

        /// Pool size of [`crate::PostgresStore::connect`] (default 16, at least 1). A store
        /// call holds a connection for one statement (two on a lost compare-and-set), never
        /// across the handler.
        #[must_use]
        pub fn with_max_connections(n: usize) => max_connections = n.max(1);

        /// How long [`crate::PostgresStore::connect`]'s pool waits for a connection, opening
        /// one included (default 5 s), before the call fails with a retryable
        /// [`crate::Error::Connection`]. A refused connection is retried until then, so a
        /// server that is starting up is waited for.
        #[must_use]
        pub fn with_acquire_timeout(d: Duration) => acquire_timeout = d;

        /// Whether complete and fail send `NOTIFY` (a statement after each) and a duplicate
        /// waiting for a record (`with_in_flight_wait` of idem-http) is woken by `LISTEN` on
        /// one connection of its own, outside the pool, opened when the first duplicate waits
        /// (default `false`: waiters poll). Only where that connection reaches a session of its
        /// own: behind a pooler in transaction mode (PgBouncer), the notifications reach server
        /// connections other clients are using, whose statements then fail. What it costs:
        /// `docs/contract.md#waking-a-waiting-duplicate`.
        #[must_use]
        pub fn with_listen(on: bool) => listen = on;
    }
}
