//! Store URLs: which backend, where, and the settings a deployment may have changed
//! (Redis key prefix, Postgres schema). Parsing is pure; [`StoreUrl::connect`] opens the
//! store without creating or migrating anything.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use idem_core::Store;

/// A parsed `--store` URL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum StoreUrl {
    /// `redb:///path/file.redb` (or `redb:relative/path`).
    Redb(PathBuf),
    /// `sqlite:///path/file.db` (or `sqlite:relative/path`).
    Sqlite(PathBuf),
    /// `redis://host:port[/db][?prefix=P]` (and `rediss://`): the URL handed to the
    /// driver, without our own options.
    Redis {
        /// The driver's URL.
        url: String,
        /// The key prefix (`idem:` unless the deployment changed it).
        prefix: Option<String>,
    },
    /// `redis-cluster://host:port[,host:port...][?prefix=P]`.
    RedisCluster {
        /// Seed nodes as `redis://host:port`.
        nodes: Vec<String>,
        /// The key prefix.
        prefix: Option<String>,
    },
    /// `postgres://...` or `postgresql://...` with `?schema=S` taken out (every other
    /// parameter is the driver's).
    Postgres {
        /// The driver's URL.
        url: String,
        /// The schema holding the records (`idem` unless the deployment changed it).
        schema: Option<String>,
    },
    /// `mysql://...` or `mariadb://...` with `?prefix=P` taken out (every other parameter is
    /// the driver's).
    MySql {
        /// The driver's URL.
        url: String,
        /// The table prefix (`idem` unless the deployment changed it).
        prefix: Option<String>,
    },
    /// `dynamodb://TABLE[?endpoint=URL&region=R]`: credentials, and the region unless
    /// given, from the AWS environment.
    DynamoDb {
        /// The table holding the records.
        table: String,
        /// An endpoint instead of the region's (a local emulator).
        endpoint: Option<String>,
        /// The region instead of the environment's.
        region: Option<String>,
    },
}

/// Why a URL cannot be used: exit code 2.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum UrlError {
    /// The scheme is none of the known ones.
    #[error(
        "unknown store URL {0:?}: use redb:///PATH, sqlite:///PATH, redis://HOST:PORT[/DB], \
         redis-cluster://HOST:PORT[,HOST:PORT...], postgres://USER@HOST/DB, mysql://USER@HOST/DB, \
         or dynamodb://TABLE"
    )]
    Scheme(String),
    /// Something after the scheme is wrong.
    #[error("bad store URL {url:?}: {reason}")]
    Bad {
        /// The URL as given.
        url: String,
        /// What is wrong.
        reason: String,
    },
}

fn bad(url: &str, reason: impl Into<String>) -> UrlError {
    UrlError::Bad { url: url.to_owned(), reason: reason.into() }
}

/// Splits `rest` at `?` and takes out `name=value` (our option); returns the rest
/// without it (other parameters stay for the driver) and the value.
fn take_option(url: &str, rest: &str, name: &str) -> Result<(String, Option<String>), UrlError> {
    let Some((base, query)) = rest.split_once('?') else {
        return Ok((rest.to_owned(), None));
    };
    let mut value = None;
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some((k, v)) if k == name => {
                if v.is_empty() {
                    return Err(bad(url, format!("{name}= is empty")));
                }
                value = Some(v.to_owned());
            }
            _ => kept.push(pair),
        }
    }
    let rebuilt = if kept.is_empty() { base.to_owned() } else { format!("{base}?{}", kept.join("&")) };
    Ok((rebuilt, value))
}

/// `redb:///abs/path`, `redb:rel/path`: the path, which must be non-empty and carry no
/// query (the embedded stores have no settings a deployment renames).
fn file_path(url: &str, rest: &str) -> Result<PathBuf, UrlError> {
    let path = rest.strip_prefix("//").unwrap_or(rest);
    if path.contains('?') {
        return Err(bad(url, "file stores take no options"));
    }
    if path.is_empty() {
        return Err(bad(url, "no file path"));
    }
    Ok(PathBuf::from(path))
}

impl std::str::FromStr for StoreUrl {
    type Err = UrlError;

    fn from_str(url: &str) -> Result<Self, UrlError> {
        let Some((scheme, rest)) = url.split_once(':') else {
            return Err(UrlError::Scheme(url.to_owned()));
        };
        match scheme {
            "redb" => Ok(StoreUrl::Redb(file_path(url, rest)?)),
            "sqlite" => Ok(StoreUrl::Sqlite(file_path(url, rest)?)),
            "redis" | "rediss" => {
                let (driver_url, prefix) = take_option(url, url, "prefix")?;
                let host = rest.strip_prefix("//").unwrap_or("");
                if host.is_empty() || host.starts_with(['/', '?']) {
                    return Err(bad(url, "no host"));
                }
                check_prefix(url, prefix.as_deref())?;
                Ok(StoreUrl::Redis { url: driver_url, prefix })
            }
            "redis-cluster" => {
                let rest = rest.strip_prefix("//").ok_or_else(|| bad(url, "expected redis-cluster://HOST:PORT"))?;
                let (hosts, prefix) = take_option(url, rest, "prefix")?;
                if hosts.contains('?') {
                    return Err(bad(url, "the only cluster option is prefix=P"));
                }
                let nodes = hosts
                    .split(',')
                    .map(str::trim)
                    .filter(|h| !h.is_empty())
                    .map(|h| match h.rsplit_once(':').map(|(host, port)| (host, port.parse::<u16>())) {
                        Some((host, Ok(_))) if !host.is_empty() => Ok(format!("redis://{h}")),
                        _ => Err(bad(url, format!("cluster node {h:?} is not HOST:PORT"))),
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                if nodes.is_empty() {
                    return Err(bad(url, "no cluster node"));
                }
                check_prefix(url, prefix.as_deref())?;
                Ok(StoreUrl::RedisCluster { nodes, prefix })
            }
            "postgres" | "postgresql" => {
                let (driver_url, schema) = take_option(url, url, "schema")?;
                if let Some(schema) = &schema {
                    idem_postgres::validate_schema(schema).map_err(|e| bad(url, e.to_string()))?;
                }
                Ok(StoreUrl::Postgres { url: driver_url, schema })
            }
            "mysql" | "mariadb" => {
                let (driver_url, prefix) = take_option(url, url, "prefix")?;
                if let Some(prefix) = &prefix {
                    idem_mysql::validate_prefix(prefix).map_err(|e| bad(url, e.to_string()))?;
                }
                Ok(StoreUrl::MySql { url: driver_url, prefix })
            }
            "dynamodb" => dynamodb(url, rest),
            _ => Err(UrlError::Scheme(url.to_owned())),
        }
    }
}

/// `dynamodb://TABLE[?endpoint=URL&region=R]`. The table name follows DynamoDB's rule
/// (3 to 255 of `A-Z a-z 0-9 _ . -`), so a typo is a usage error, not a remote one.
fn dynamodb(url: &str, rest: &str) -> Result<StoreUrl, UrlError> {
    let rest = rest.strip_prefix("//").ok_or_else(|| bad(url, "expected dynamodb://TABLE"))?;
    let (table, query) = rest.split_once('?').unwrap_or((rest, ""));
    let valid = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-');
    if !(3..=255).contains(&table.len()) || !table.chars().all(valid) {
        return Err(bad(url, "a table name is 3 to 255 of A-Z a-z 0-9 _ . -"));
    }
    let (mut endpoint, mut region) = (None, None);
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("endpoint", v)) if v.starts_with("http://") || v.starts_with("https://") => {
                endpoint = Some(v.to_owned());
            }
            Some(("region", v)) if !v.is_empty() => region = Some(v.to_owned()),
            _ => return Err(bad(url, format!("{pair:?}: the options are endpoint=http(s)://… and region=R"))),
        }
    }
    Ok(StoreUrl::DynamoDb { table: table.to_owned(), endpoint, region })
}

/// The Redis store refuses braces in a prefix (they delimit the cluster hash tag); say so
/// as a URL error rather than a connection error.
fn check_prefix(url: &str, prefix: Option<&str>) -> Result<(), UrlError> {
    match prefix {
        Some(p) if p.contains(['{', '}']) => Err(bad(url, "the prefix must not contain `{` or `}`")),
        _ => Ok(()),
    }
}

/// Why the store could not be opened: exit code 2 when the target does not exist (a
/// typo in the path), 3 otherwise (the server is down, refuses, the schema is missing).
#[derive(Debug, thiserror::Error)]
pub(crate) enum OpenError {
    /// A file store's path does not exist: the CLI never creates a store.
    #[error("no store file at {0}: the CLI never creates one (check the path)")]
    NoFile(PathBuf),
    /// This build left the backend out (a cargo feature).
    #[cfg_attr(feature = "dynamodb", allow(dead_code, reason = "every backend is built in"))]
    #[error("this idem was built without {0} support: install it with `--features {0}`")]
    Unsupported(&'static str),
    /// The backend refused.
    #[error("cannot open the {backend} store: {source}")]
    Backend {
        /// Which backend.
        backend: &'static str,
        /// The store crate's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

fn backend(backend: &'static str) -> impl FnOnce(Box<dyn std::error::Error + Send + Sync>) -> OpenError {
    move |source| OpenError::Backend { backend, source }
}

fn existing(path: &Path) -> Result<PathBuf, OpenError> {
    if path.is_file() { Ok(path.to_owned()) } else { Err(OpenError::NoFile(path.to_owned())) }
}

impl StoreUrl {
    /// Opens the store as an operator's tool: no file is created, no schema migrated (an
    /// older or newer schema is an error), the Redis start-up checks only warn.
    pub(crate) async fn connect(&self) -> Result<Arc<dyn Store>, OpenError> {
        match self {
            StoreUrl::Redb(path) => {
                let path = existing(path)?;
                let store = tokio::task::spawn_blocking(move || {
                    idem_redb::RedbStore::open(&path, idem_redb::Config::default())
                })
                .await
                .map_err(|e| backend("redb")(e.into()))?
                .map_err(|e| backend("redb")(e.into()))?;
                Ok(Arc::new(store))
            }
            StoreUrl::Sqlite(path) => {
                let path = existing(path)?;
                let config = idem_sqlite::Config::default().with_auto_migrate(false);
                let store = tokio::task::spawn_blocking(move || idem_sqlite::SqliteStore::open(&path, config))
                    .await
                    .map_err(|e| backend("sqlite")(e.into()))?
                    .map_err(|e| backend("sqlite")(e.into()))?;
                Ok(Arc::new(store))
            }
            StoreUrl::Redis { url, prefix } => {
                let store = idem_redis::RedisStore::connect(url, redis_config(prefix.as_deref()))
                    .await
                    .map_err(|e| backend("redis")(e.into()))?;
                Ok(Arc::new(store))
            }
            StoreUrl::RedisCluster { nodes, prefix } => {
                let store = idem_redis::RedisStore::connect_cluster(nodes, redis_config(prefix.as_deref()))
                    .await
                    .map_err(|e| backend("redis-cluster")(e.into()))?;
                Ok(Arc::new(store))
            }
            StoreUrl::Postgres { url, schema } => {
                let mut config = idem_postgres::Config::default().with_auto_migrate(false).with_max_connections(2);
                if let Some(schema) = schema {
                    config = config.with_schema(schema);
                }
                let store = idem_postgres::PostgresStore::connect(url, config)
                    .await
                    .map_err(|e| backend("postgres")(e.into()))?;
                Ok(Arc::new(store))
            }
            StoreUrl::MySql { url, prefix } => {
                let mut config = idem_mysql::Config::default().with_auto_migrate(false).with_max_connections(2);
                if let Some(prefix) = prefix {
                    config = config.with_table_prefix(prefix);
                }
                let store =
                    idem_mysql::MySqlStore::connect(url, config).await.map_err(|e| backend("mysql")(e.into()))?;
                Ok(Arc::new(store))
            }
            #[cfg(not(feature = "dynamodb"))]
            StoreUrl::DynamoDb { .. } => Err(OpenError::Unsupported("dynamodb")),
            #[cfg(feature = "dynamodb")]
            StoreUrl::DynamoDb { table, endpoint, region } => {
                let mut config = idem_dynamodb::Config::default().with_table(table).with_auto_migrate(false);
                if let Some(endpoint) = endpoint {
                    config = config.with_endpoint_url(endpoint);
                }
                if let Some(region) = region {
                    config = config.with_region(region);
                }
                let store =
                    idem_dynamodb::DynamoStore::connect(config).await.map_err(|e| backend("dynamodb")(e.into()))?;
                Ok(Arc::new(store))
            }
        }
    }
}

/// The CLI reads and releases records; it must work on a server whose eviction policy the
/// application's own start-up refuses, so that check only warns here.
fn redis_config(prefix: Option<&str>) -> idem_redis::Config {
    let config = idem_redis::Config::default().with_eviction_check(idem_redis::EvictionCheck::Warn);
    match prefix {
        Some(p) => config.with_prefix(p),
        None => config,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<StoreUrl, UrlError> {
        s.parse()
    }

    #[test]
    fn file_urls_take_absolute_and_relative_paths() {
        assert_eq!(parse("redb:///var/lib/idem.redb"), Ok(StoreUrl::Redb("/var/lib/idem.redb".into())));
        assert_eq!(parse("sqlite:///tmp/x.db"), Ok(StoreUrl::Sqlite("/tmp/x.db".into())));
        assert_eq!(parse("sqlite:data/x.db"), Ok(StoreUrl::Sqlite("data/x.db".into())));
        assert!(matches!(parse("redb://"), Err(UrlError::Bad { .. })));
        assert!(matches!(parse("sqlite:///x.db?table=t"), Err(UrlError::Bad { .. })));
    }

    #[test]
    fn redis_prefix_is_ours_and_the_rest_goes_to_the_driver() {
        assert_eq!(
            parse("redis://127.0.0.1:6379/2?prefix=tenant7:idem:&protocol=resp3"),
            Ok(StoreUrl::Redis {
                url: "redis://127.0.0.1:6379/2?protocol=resp3".into(),
                prefix: Some("tenant7:idem:".into())
            })
        );
        assert_eq!(parse("redis://h:1"), Ok(StoreUrl::Redis { url: "redis://h:1".into(), prefix: None }));
        assert!(matches!(parse("redis://h:1?prefix=a{b}"), Err(UrlError::Bad { .. })));
        assert!(matches!(parse("redis://"), Err(UrlError::Bad { .. })));
    }

    #[test]
    fn mysql_prefix_is_ours_and_checked() {
        assert_eq!(
            parse("mysql://root@127.0.0.1:3306/test?prefix=billing&ssl-mode=disabled"),
            Ok(StoreUrl::MySql {
                url: "mysql://root@127.0.0.1:3306/test?ssl-mode=disabled".into(),
                prefix: Some("billing".into())
            })
        );
        assert_eq!(parse("mariadb://u@h/db"), Ok(StoreUrl::MySql { url: "mariadb://u@h/db".into(), prefix: None }));
        assert!(matches!(parse("mysql://u@h/db?prefix=Bad-Name"), Err(UrlError::Bad { .. })));
    }

    #[test]
    fn cluster_urls_list_nodes() {
        assert_eq!(
            parse("redis-cluster://127.0.0.1:7000,127.0.0.1:7001?prefix=p:"),
            Ok(StoreUrl::RedisCluster {
                nodes: vec!["redis://127.0.0.1:7000".into(), "redis://127.0.0.1:7001".into()],
                prefix: Some("p:".into())
            })
        );
        assert!(matches!(parse("redis-cluster://127.0.0.1"), Err(UrlError::Bad { .. })));
        assert!(matches!(parse("redis-cluster://"), Err(UrlError::Bad { .. })));
        assert!(matches!(parse("redis-cluster://h:1?wait=2"), Err(UrlError::Bad { .. })));
    }

    #[test]
    fn postgres_schema_is_ours_and_checked() {
        assert_eq!(
            parse("postgresql://u@h/db?schema=billing_idem&sslmode=disable"),
            Ok(StoreUrl::Postgres {
                url: "postgresql://u@h/db?sslmode=disable".into(),
                schema: Some("billing_idem".into())
            })
        );
        assert!(matches!(parse("postgres://u@h/db?schema=a;drop"), Err(UrlError::Bad { .. })));
    }

    #[test]
    fn dynamodb_table_endpoint_and_region() {
        assert_eq!(
            parse("dynamodb://idem?endpoint=http://127.0.0.1:5005&region=eu-west-1"),
            Ok(StoreUrl::DynamoDb {
                table: "idem".into(),
                endpoint: Some("http://127.0.0.1:5005".into()),
                region: Some("eu-west-1".into())
            })
        );
        assert_eq!(
            parse("dynamodb://prod.idem-records_2"),
            Ok(StoreUrl::DynamoDb { table: "prod.idem-records_2".into(), endpoint: None, region: None })
        );
        for url in ["dynamodb:idem", "dynamodb://ab", "dynamodb://a/b", "dynamodb://idem?endpoint=127.0.0.1:5005"] {
            assert!(matches!(parse(url), Err(UrlError::Bad { .. })), "{url}");
        }
        assert!(matches!(parse("dynamodb://idem?consistent=false"), Err(UrlError::Bad { .. })));
    }

    #[test]
    fn unknown_schemes_and_memory_are_refused() {
        assert!(matches!(parse("memory:"), Err(UrlError::Scheme(_))));
        assert!(matches!(parse("mongodb://h/db"), Err(UrlError::Scheme(_))));
        assert!(matches!(parse("/tmp/x.redb"), Err(UrlError::Scheme(_))));
    }
}
