#![doc = include_str!("../README.md")]
//!
//! # What it guarantees
//! [`RedisStore`] implements [`idem_core::Store`]: one hash per record, each write one Lua
//! compare-and-set on the fencing token, retention as the key's native expiry (no
//! sweeper), time and a new generation's first fencing token from the server's `TIME`,
//! start-up checks of eviction ([`EvictionCheck`]) and persistence ([`PersistenceCheck`]),
//! an optional `WAIT` for replicas ([`ReplicaAck`]). What each script guarantees, the record
//! layout on the server, fencing tokens across clock steps and failovers, operating notes,
//! Redis Cluster (routing, resharding, what a failover loses) and how the tests run:
//! `docs/redis.md`. This backend beside the others: `docs/contract.md#redis-and-valkey`;
//! the failures its tests pin: `docs/failures.md`.
//!
//! # Features
//! | feature | default | what it adds | what it costs |
//! |---|---|---|---|
//! | `cluster` | off | Redis Cluster: `RedisStore::connect_cluster`, `cluster_builder`, `Connection::Cluster` (an application's own `ClusterConnection` for [`RedisStore::from_connection`]), and the cluster paths of every call (`MOVED`/`ASK`/`NOSCRIPT` on another node, checks on every primary) | the `redis` crate's `cluster-async` feature (its cluster client, plus `crc16`, `rand` and `log`); about 180 lines here |
//!
//! Without `cluster`, [`RedisStore::connect`] still refuses a node of a Cluster with several
//! primaries ([`Error::Config`]): it would reach only that node's slots.
//!
//! # Layout
//! - `src/config.rs`: [`Config`], [`EvictionCheck`], [`PersistenceCheck`], [`ReplicaAck`], [`Shortfall`].
//! - `src/conn.rs`: [`Connection`] (single node or, with `cluster`, a cluster) and commands
//!   sent to every primary.
//! - `src/store.rs`: [`RedisStore`] and its [`idem_core::Store`] impl: the claim path and
//!   every other operation, one script call each.
//! - `src/replicas.rs`: each primary's replicas held against [`ReplicaAck`], and the
//!   `WAIT` (or the [`Shortfall`] refusal) each write gets.
//! - `src/script.rs`: loading and calling the scripts (and, on a cluster, following
//!   `MOVED`/`ASK`/`NOSCRIPT`), their replies, and the record bytes
//!   they read and write (header, scope, response).
//! - `src/error.rs`: [`Error`] and its retry classification.
//! - `src/scripts/*.lua`: the scripts (`common.lua` is prepended to each, `arith.lua` to
//!   `reclaim`, `extend` and `fail`): `claim`, `reclaim`, `complete`, `extend`, `fail`,
//!   `get`, `journal_put`, `journal_get`.
//! - `tests/it/`: the integration tests, one module per area (`docs/testing.md`; the test
//!   behind each failure: `docs/failures.md`).

mod config;
mod conn;
mod error;
mod replicas;
mod script;
mod store;

pub use config::{Config, DEFAULT_PREFIX, EvictionCheck, PersistenceCheck, ReplicaAck, Shortfall};
pub use conn::Connection;
pub use error::Error;
pub use store::RedisStore;
#[cfg(feature = "cluster")]
pub use store::cluster_builder;

/// The `redis` crate this store is built on, for building a [`Connection`] of the same
/// version ([`redis::aio::ConnectionManager`], or with `cluster` a
/// `redis::cluster_async::ClusterConnection`).
pub use redis;
