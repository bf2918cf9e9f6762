//! [`Connection`]: the store's link to Redis, a single node or a Redis Cluster, and the
//! per-node commands the start-up checks need.

use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo};
use redis::{Cmd, Pipeline, RedisFuture, RedisResult, Value};

/// The connection a [`crate::RedisStore`] sends its scripts on: a single node (or a primary
/// with replicas behind it) through the `redis` crate's reconnecting
/// [`ConnectionManager`], or a Redis Cluster through its async [`ClusterConnection`].
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
    Cluster(ClusterConnection),
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Connection::Single(_) => "Connection::Single",
            Connection::Cluster(_) => "Connection::Cluster",
        })
    }
}

impl From<ConnectionManager> for Connection {
    fn from(conn: ConnectionManager) -> Self {
        Connection::Single(conn)
    }
}

impl From<ClusterConnection> for Connection {
    fn from(conn: ClusterConnection) -> Self {
        Connection::Cluster(conn)
    }
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Connection::Single(c) => c.req_packed_command(cmd),
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
            Connection::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Connection::Single(c) => c.get_db(),
            Connection::Cluster(c) => c.get_db(),
        }
    }
}

impl Connection {
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
}
