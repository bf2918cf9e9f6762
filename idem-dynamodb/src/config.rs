//! [`Config`]: the table a [`crate::DynamoStore`] uses, whether it creates it, its clock,
//! the TTL grace and, for [`crate::DynamoStore::connect`], an endpoint and region override.

use std::sync::Arc;
use std::time::Duration;

use idem_core::{Clock, SystemClock};

/// The default table name.
pub const DEFAULT_TABLE: &str = "idem";

/// How a [`crate::DynamoStore`] is set up. Build with `Config::default()` and the
/// `with_*` methods.
#[derive(Clone, Debug)]
pub struct Config {
    pub(crate) table: String,
    pub(crate) auto_migrate: bool,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) ttl_grace: Duration,
    pub(crate) endpoint_url: Option<String>,
    pub(crate) region: Option<String>,
}

impl Default for Config {
    /// Table `idem`, created on start when missing, the system clock, one hour of TTL
    /// grace, the SDK's own endpoint resolution.
    fn default() -> Self {
        Self {
            table: DEFAULT_TABLE.to_owned(),
            auto_migrate: true,
            clock: Arc::new(SystemClock),
            ttl_grace: Duration::from_secs(3_600),
            endpoint_url: None,
            region: None,
        }
    }
}

impl Config {
    /// The table holding records and journal entries (default `idem`). One table per
    /// store: several independent stores use several tables.
    #[must_use]
    pub fn with_table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// Whether building the store creates the table (and turns on its TTL) when it is
    /// missing (default `true`; that needs `dynamodb:CreateTable`,
    /// `dynamodb:UpdateTimeToLive` and `dynamodb:DescribeTable`). With `false` the store
    /// only describes the table and fails with [`crate::Error::Table`] when it is missing
    /// or has another key schema: the table then comes from infrastructure as code, as
    /// `docs/dynamodb.md` describes it.
    #[must_use]
    pub fn with_auto_migrate(mut self, on: bool) -> Self {
        self.auto_migrate = on;
        self
    }

    /// The clock every `now` is read from (default [`SystemClock`]). DynamoDB has no clock
    /// a condition expression can read, so leases and retention are judged on the clocks
    /// of the processes sharing the table: keep them in sync (NTP or chrony, as for SQLite
    /// shared over a network file system); `docs/dynamodb.md` says what a skew does.
    #[must_use]
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// How long after `expires_at` DynamoDB's TTL may delete a record item (default one
    /// hour; whole seconds). The store judges expiry itself, on its clock; the TTL is only
    /// the clean-up, and the grace keeps it from deleting a record that a process whose
    /// clock runs behind still counts as live.
    #[must_use]
    pub fn with_ttl_grace(mut self, grace: Duration) -> Self {
        self.ttl_grace = grace;
        self
    }

    /// The endpoint [`crate::DynamoStore::connect`] talks to instead of the region's
    /// (e.g. `http://127.0.0.1:5005` for a local emulator). Ignored by
    /// [`crate::DynamoStore::from_client`], whose client already has its endpoint.
    #[must_use]
    pub fn with_endpoint_url(mut self, url: impl Into<String>) -> Self {
        self.endpoint_url = Some(url.into());
        self
    }

    /// The region [`crate::DynamoStore::connect`] uses instead of the environment's
    /// (`AWS_REGION`, the profile's): a store URL that names its region, such as the demo's
    /// `dynamodb://TABLE?region=R`, needs no environment. Ignored by
    /// [`crate::DynamoStore::from_client`].
    #[must_use]
    pub fn with_region(mut self, region: impl Into<String>) -> Self {
        self.region = Some(region.into());
        self
    }

    /// The table name.
    #[must_use]
    pub fn table(&self) -> &str {
        &self.table
    }

    pub(crate) fn grace_secs(&self) -> i64 {
        i64::try_from(self.ttl_grace.as_secs()).unwrap_or(i64::MAX)
    }
}
