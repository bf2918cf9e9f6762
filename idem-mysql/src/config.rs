//! [`Config`]: which tables a [`crate::MySqlStore`] uses, whether it migrates them, its
//! clock, and the pool [`crate::MySqlStore::connect`] builds.

use std::sync::Arc;
use std::time::Duration;

use idem_core::Clock;

use crate::sql::DEFAULT_PREFIX;

/// How a [`crate::MySqlStore`] is set up. Build with `Config::default()` and the `with_*`
/// methods.
#[derive(Clone, Debug)]
pub struct Config {
    pub(crate) prefix: String,
    pub(crate) auto_migrate: bool,
    pub(crate) clock: Option<Arc<dyn Clock>>,
    pub(crate) max_connections: usize,
    pub(crate) acquire_timeout: Duration,
}

impl Default for Config {
    /// Tables `idem_records` and `idem_schema_migrations`, migrations applied on start, the
    /// server's clock, and for [`crate::MySqlStore::connect`]: 16 connections, 5 s to get
    /// one.
    fn default() -> Self {
        Self {
            prefix: DEFAULT_PREFIX.to_owned(),
            auto_migrate: true,
            clock: None,
            max_connections: 16,
            acquire_timeout: Duration::from_secs(5),
        }
    }
}

impl Config {
    idem_core::setters! {
        /// The prefix of the table names (default `idem`: `idem_records`,
        /// `idem_schema_migrations`), in the connection's current database. A prefix rather
        /// than a database of its own because an application's MySQL account usually owns
        /// one database and may not create others. Checked when the store is built:
        /// lower-case ASCII letters, digits and `_`, at most 40 bytes (see
        /// [`crate::validate_prefix`]). One database can hold several independent stores
        /// under different prefixes.
        #[must_use]
        pub fn with_table_prefix(prefix: impl Into<String>) => prefix = prefix.into();

        /// Whether building the store applies the missing migrations (default `true`; that
        /// needs `CREATE` on the database only while migrations are missing). With `false` it
        /// only reads the migration version and fails with [`crate::Error::NotMigrated`], for
        /// accounts that may not change the schema: a deploy step runs
        /// [`crate::MySqlStore::migrate`], or the team's own tool runs [`crate::MIGRATIONS`].
        #[must_use]
        pub fn with_auto_migrate(on: bool) => auto_migrate = on;

        /// Reads time from `clock` instead of the server's clock, so tests move time by hand
        /// and run the statements production runs. Leave it unset in production: the
        /// server's clock is the one every process sharing the database agrees on.
        #[must_use]
        pub fn with_clock(clock: Arc<dyn Clock>) => clock = Some(clock);

        /// Pool size of [`crate::MySqlStore::connect`] (default 16, at least 1). A store call
        /// holds a connection for one short transaction, never across the handler.
        #[must_use]
        pub fn with_max_connections(n: usize) => max_connections = n.max(1);

        /// How long [`crate::MySqlStore::connect`]'s pool waits for a connection, opening one
        /// included (default 5 s), before the call fails with a retryable
        /// [`crate::Error::Connection`].
        #[must_use]
        pub fn with_acquire_timeout(d: Duration) => acquire_timeout = d;
    }
}
