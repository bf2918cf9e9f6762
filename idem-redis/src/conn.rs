//! [`Connection`]: the store's link to Redis, a single node or (feature `cluster`) a Redis
//! Cluster, and the per-node commands the start-up checks and `list` need.

use redis::aio::{ConnectionLike, ConnectionManager};
#[cfg(feature = "cluster")]
use redis::cluster_async::ClusterConnection;
#[cfg(feature = "cluster")]
use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo, SingleNodeRoutingInfo};
use redis::{Cmd, Pipeline, RedisFuture, RedisResult, Value};

/// The connection a [`crate::RedisStore`] sends its scripts on: a single node (or a primary
/// with replicas behind it) through the `redis` crate's reconnecting
/// [`ConnectionManager`], or (feature `cluster`) a Redis Cluster through its async
/// `ClusterConnection`.
///
/// Cheap to clone; clones share the same underlying connections. It implements
/// [`ConnectionLike`], so an application can send its own commands on it (a health
/// check's `PING`); on a cluster, keyless commands go where the `redis` crate routes them.
#[derive(Clone)]
#[non_exhaustive]
pub enum Connection {
    /// One Redis server (its primary, when it has replicas).
    Single(ConnectionManager),
    /// A Redis Cluster: each script goes to the primary owning its record key's slot.
    #[cfg(feature = "cluster")]
    Cluster(ClusterConnection),
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Connection::Single(_) => "Connection::Single",
            #[cfg(feature = "cluster")]
            Connection::Cluster(_) => "Connection::Cluster",
        })
    }
}

impl From<ConnectionManager> for Connection {
    fn from(conn: ConnectionManager) -> Self {
        Connection::Single(conn)
    }
}

#[cfg(feature = "cluster")]
impl From<ClusterConnection> for Connection {
    fn from(conn: ClusterConnection) -> Self {
        Connection::Cluster(conn)
    }
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Connection::Single(c) => c.req_packed_command(cmd),
            #[cfg(feature = "cluster")]
            Connection::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Connection::Single(c) => c.req_packed_commands(pipeline, offset, count),
            #[cfg(feature = "cluster")]
            Connection::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Connection::Single(c) => c.get_db(),
            #[cfg(feature = "cluster")]
            Connection::Cluster(c) => c.get_db(),
        }
    }
}

impl Connection {
    /// Whether this is a cluster connection.
    pub(crate) fn is_cluster(&self) -> bool {
        #[cfg(feature = "cluster")]
        if let Connection::Cluster(_) = self {
            return true;
        }
        false
    }

    /// Sends `cmd` to every primary: the one server, or each primary of the cluster.
    /// Returns one `(node, reply)` per primary, where a node's error reply is kept as an
    /// `Err` of its own (one node refusing `CONFIG` says nothing about the others).
    pub(crate) async fn on_every_primary(&mut self, cmd: Cmd) -> RedisResult<Vec<(String, RedisResult<Value>)>> {
        match self {
            Connection::Single(c) => {
                let reply = cmd.query_async::<Value>(c).await;
                match reply {
                    // The connection itself failed: nothing was checked.
                    Err(e) if e.kind() == redis::ErrorKind::Io => Err(e),
                    other => Ok(vec![(String::from("server"), other)]),
                }
            }
            #[cfg(feature = "cluster")]
            Connection::Cluster(c) => {
                // No response policy: the crate answers with a map of node address to reply.
                let routing = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
                let reply = c.route_command(cmd, routing).await?;
                let Value::Map(pairs) = reply else {
                    return Err((redis::ErrorKind::UnexpectedReturnType, "per-node replies are not a map").into());
                };
                Ok(pairs
                    .into_iter()
                    .map(|(node, v)| {
                        let node = match node {
                            Value::BulkString(b) => String::from_utf8_lossy(&b).into_owned(),
                            other => format!("{other:?}"),
                        };
                        let v = match v {
                            Value::ServerError(e) => Err(e.into()),
                            v => Ok(v),
                        };
                        (node, v)
                    })
                    .collect())
            }
        }
    }

    /// Every key matching the glob `pattern` on the one server, or on each primary of the
    /// cluster (a key lives on exactly one primary, so none is reported twice): `SCAN`
    /// with `MATCH` to the end of every cursor. `SCAN` never blocks the server the way
    /// `KEYS` would; a key written or removed during the scan may or may not be reported.
    pub(crate) async fn scan_every_primary(&mut self, pattern: &str) -> RedisResult<Vec<Vec<u8>>> {
        let mut keys = Vec::new();
        match self {
            Connection::Single(c) => {
                let mut cursor = 0_u64;
                loop {
                    let (next, batch): (u64, Vec<Vec<u8>>) = scan_cmd(cursor, pattern).query_async(c).await?;
                    keys.extend(batch);
                    if next == 0 {
                        break;
                    }
                    cursor = next;
                }
            }
            #[cfg(feature = "cluster")]
            Connection::Cluster(c) => {
                // Every primary as the client knows the topology: the nodes a `PING` to all
                // primaries answers from.
                for (node, _) in Connection::Cluster(c.clone()).on_every_primary(redis::cmd("PING")).await? {
                    let parsed = node.rsplit_once(':').and_then(|(h, p)| Some((h.to_owned(), p.parse::<u16>().ok()?)));
                    let Some((host, port)) = parsed else {
                        return Err((redis::ErrorKind::UnexpectedReturnType, "a node name is not host:port").into());
                    };
                    let mut cursor = 0_u64;
                    loop {
                        let routing =
                            RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress { host: host.clone(), port });
                        let reply = c.route_command(scan_cmd(cursor, pattern), routing).await?;
                        let (next, batch): (u64, Vec<Vec<u8>>) = redis::from_redis_value(reply)?;
                        keys.extend(batch);
                        if next == 0 {
                            break;
                        }
                        cursor = next;
                    }
                }
            }
        }
        Ok(keys)
    }
}

fn scan_cmd(cursor: u64, pattern: &str) -> Cmd {
    let mut cmd = redis::cmd("SCAN");
    cmd.arg(cursor).arg("MATCH").arg(pattern).arg("COUNT").arg(1_000);
    cmd
}
