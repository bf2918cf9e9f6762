#![doc = include_str!("../README.md")]
//!
//! # What it guarantees
//! [`RedisStore`] implements [`idem_core::Store`] with:
//!
//! - **one hash per record** at `<prefix>{<record id hex>}`. The braces make the record id
//!   the Redis Cluster hash tag: everything about a record is one key, and any companion
//!   key would share its slot, so nothing ever spans slots;
//! - **Lua compare-and-set** for claim, reclaim, complete, extend and fail. Each script
//!   reads the record, checks the fencing token, state and lease, and writes, all in one atomic step,
//!   following the rules of `idem_core::transition` exactly. A write whose token is no
//!   longer current changes nothing and returns [`idem_core::StoreError::LeaseLost`]. The
//!   scripts are loaded at start-up and run by SHA (`EVALSHA`); after a `NOSCRIPT` reply
//!   (the server restarted or failed over and forgot them) the store loads the script and
//!   sends the call again;
//! - **native expiry**: `PEXPIREAT` at the record's `expires_at` (ms). No sweeper is needed.
//!   [`idem_core::Store::sweep`] reports zero. A record past `expires_at` counts as absent
//!   at once, even if Redis has not removed the key yet. An optional
//!   [grace](Config::with_expiry_grace) keeps the key a little longer, so a record
//!   claimed again soon after it expired continues its fencing-token sequence (token + 1)
//!   whatever the clock did meanwhile;
//! - **fencing tokens unique across record generations**, from the server's clock, so a
//!   record that left Redis (native expiry, eviction, a restart without persistence, a
//!   failover that lost it) never hands its tokens to the next claim of its key (below);
//! - **lease renewal** ([`idem_core::Store::extend`], `extend.lua`): compare-and-set on the
//!   token like complete, moving `lease_expires_at` forward and `expires_at` with it when
//!   the new lease passes it; the key's native expiry then moves too (to the new
//!   `expires_at` plus the grace);
//! - **the server's clock**: every script reads `TIME`, so application servers with skewed
//!   clocks still agree on when a lease ends. Tests replace it with
//!   [`Config::with_clock`];
//! - **start-up checks** on the server, or on every primary of a cluster: `maxmemory-policy`
//!   (an evicting policy can drop an in-flight claim and let a duplicate run; see
//!   [`EvictionCheck`], safe setting `maxmemory-policy noeviction`) and persistence (a
//!   server without AOF or RDB, or with `appendfsync no`, loses claims on a restart; see
//!   [`PersistenceCheck`] for what each setting loses);
//! - an optional `WAIT` for replicas after claim, reclaim, extend and complete, pipelined
//!   with the script on the same connection ([`ReplicaAck`] says what it does and does not
//!   guarantee on failover). A claim whose `WAIT` falls short is released before the call
//!   fails, so no claim is left that nobody owns;
//! - **a single node or a Redis Cluster** ([`RedisStore::connect_cluster`]; section "Redis
//!   Cluster" below);
//! - the per-record journal of resumable handlers ([`idem_core::Store::journal_put`]) as
//!   fields of the record's own hash, so entries live and die with their record;
//! - a key prefix on every key it writes. It never calls `KEYS`, `SCAN` or `FLUSH*`.
//!
//! Build it with [`RedisStore::connect`] (a URL), [`RedisStore::connect_cluster`] (a list
//! of cluster node URLs) or [`RedisStore::from_connection`] (the application's own
//! `redis::aio::ConnectionManager` or `redis::cluster_async::ClusterConnection`, see
//! [`Connection`]), and a [`Config`] from `Config::default()` and its `with_*` methods.
//!
//! # Fencing tokens and the server's clock
//! A claim of an absent record gets [`idem_core::FencingToken::first_at`] of the script's
//! `TIME`: the clock in ms shifted left by 16 bits (computed in Lua as two exact 32-bit
//! halves, since the value, about 2^57 today, is past the 2^53 a Lua number holds exactly).
//! A claim that replaces an expired record still present takes the larger of its token + 1
//! and that value; a reclaim adds 1. So the tokens of a new generation of a key are above
//! every token of every earlier generation, including generations whose key Redis already
//! dropped, as long as two conditions hold:
//!
//! - **the server's clock does not step back past a generation's life**: the new claim's
//!   `TIME` must read a later millisecond than the earlier generation's claim did. A clock
//!   that never steps back guarantees it for every generation that lived past the
//!   millisecond it was claimed in (native expiry never removes a key before its
//!   `expires_at`, and a claim that finds an expired key still present continues its
//!   token). A step back (an NTP step, a restart on a host whose clock was set back)
//!   breaks it for generations claimed within the step before it: the next generation of
//!   such a key may get lower tokens. A late owner still passes the fence only on an
//!   equal token, that is when both claims read the very same millisecond (or the new
//!   generation was reclaimed 65,536 times per millisecond of the step);
//! - **no generation is reclaimed 65,536 times per millisecond it lived** (the 16 low bits
//!   are the reclaims' room).
//!
//! **Failover**: after a failover the scripts read the new primary's `TIME`. A record the
//! replica had received keeps its token, and a claim that replaces it takes its token + 1
//! whatever the clocks say. A record the failover lost (replication is asynchronous, see
//! [`ReplicaAck`]) is claimed again on the new primary's clock: if that clock is D ms
//! behind the old primary's, a record claimed on the old primary in the last D ms before
//! the failover can come back with a lower token (fenced unless it lands on the lost
//! claim's very millisecond, as above), and every lease on the new primary ends D ms late
//! (or early, with a clock ahead). Keep primaries and replicas on NTP, with a skew far
//! below a lease. A restart without persistence is the same case with the host's own clock.
//!
//! [`Config::with_clock`] replaces `TIME` for tests; the same rules apply to its readings.
//!
//! # Record layout
//! Format 2: a hash with two fields plus journal entries. The scripts decide on the
//! 74-byte header alone and carry the rest along unparsed, so a claim is one `HSETNX` and a
//! complete one `HGET` and one `HSET`, which keeps their server time low.
//!
//! | hash field | value |
//! |---|---|
//! | `h` | the header (74 bytes, below), then scope and idempotency key: `0x01` then postcard of (principal, endpoint, key) |
//! | `r` | completed records only: `0x01` then postcard of [`idem_core::StoredResponse`] |
//! | `j:<name>` | journal entry `name` of a resumable handler (a step's result, an intent's state), raw |
//!
//! | header bytes | value |
//! |---|---|
//! | 0 | layout version, `2` |
//! | 1 | state: `1` in flight, `2` completed, `3` failed |
//! | 2..10 | fencing token, u64 big-endian |
//! | 10..18, 18..26, 26..34, 34..42 | `created_at`, `started_at`, `lease_expires_at`, `expires_at`: ms since the Unix epoch, u64 big-endian (at most `i64::MAX`) |
//! | 42..74 | fingerprint, 32 raw bytes |
//!
//! Redis strings are binary-safe, so header values and bodies round-trip byte for byte.
//! Lua numbers are doubles and would round timestamps and tokens past 2^53, so the scripts
//! read and write 64-bit values as two exact 32-bit halves (`struct` `>I4I4`), add them
//! half by half with saturation, and compare fencing tokens as bytes. A deadline past 2^53 ms
//! (about the year 287,000) leaves the key without a native expiry; every script still
//! treats the record as gone at its `expires_at`. Reading a record checks that its
//! principal, endpoint and key hash to the id in its key name. A record that does not
//! decode is [`idem_core::StoreError::Corrupt`]. It is never silently overwritten. (A
//! hash without an `h` field is not a record: a claim adds its header to it.)
//!
//! # Operating it
//! - Needs Redis 7.0+ or Valkey 7.2+: the scripts carry Redis 7 flags (`#!lua`), which make
//!   the server refuse any key outside the record's slot, refuse writes up front on a
//!   replica or when memory is full, and let the read-only scripts run anyway.
//! - Run with `maxmemory-policy noeviction`. With an evicting policy and a `maxmemory`
//!   limit, [`RedisStore::connect`] refuses to start by default. Where `CONFIG` is disabled
//!   (many managed services), it logs a warning and starts.
//! - Run with AOF (`appendonly yes`, `appendfsync everysec` or `always`). A restart of a
//!   server without persistence loses every claim and stored response, and retries then
//!   run again. The start-up check flags it; by default it only warns
//!   ([`PersistenceCheck::Warn`], reasons there), [`PersistenceCheck::Refuse`] refuses.
//! - Errors: connection refused, reset or timed out, and `READONLY`, `LOADING`,
//!   `TRYAGAIN`, `CLUSTERDOWN`, `MASTERDOWN`, `BUSY`, `OOM`, `NOREPLICAS` are retryable
//!   ([`idem_core::StoreError::is_retryable`]). The HTTP layer answers them with 503 and
//!   `Retry-After`.
//! - Reconnection: the store keeps one multiplexed connection that reconnects on its own.
//!   A connection that died while idle (server restart, idle timeout) is noticed by the
//!   next command. A `get` is then sent once more; a claim, reclaim, complete, extend or
//!   fail is never sent twice, because whether the first attempt ran is unknown, so that
//!   one call fails with a retryable error and the next one uses the new connection. A
//!   killed connection never leaves half a record: each script runs whole or not at all.
//!
//! # Redis Cluster
//! [`RedisStore::connect_cluster`] takes the URLs of one or more nodes (the rest of the
//! topology is discovered) and uses the `redis` crate's async cluster client; an
//! application with its own `ClusterConnection` passes it to [`RedisStore::from_connection`]
//! (build it with [`cluster_builder`], which turns the crate's own retries off).
//!
//! - **Routing**: each operation is one script on one key, the record's, so it goes to the
//!   primary that owns the slot of the record id (the hash tag). No operation spans two
//!   slots: the `#!lua` flags make Redis refuse any other key inside a script, and the only
//!   other commands sent with a script (`WAIT`, `ASKING`) have no key.
//! - **Resharding**: while a slot migrates, a record still on the old owner is served
//!   there; one already moved is answered `ASK node` and the store sends `ASKING` and the
//!   script to the importing node; after the move the stale slot map meets `MOVED node`
//!   and the store sends the call there while the crate refreshes its map. At most five
//!   redirects per call. A script runs whole on exactly one node, so a migration never
//!   splits a record or runs a script twice.
//! - **Scripts**: loaded on every primary at start-up; a node that answers `NOSCRIPT` (a
//!   promoted replica, a new node, a `SCRIPT FLUSH`) gets the same call again as `EVAL`
//!   with the source, which runs it and leaves it cached on that node.
//! - **No resend after a connection error**: the `redis` crate's cluster client resends a
//!   command after a dropped connection by default. For a write whose first send may have
//!   run, the resend turns an unknown outcome into a wrong one: a claim finds its own claim
//!   and answers "in flight" (as if another request held it), a complete finds its own
//!   completion and answers "lease lost". The store keeps the single-node rule instead (a
//!   write is never sent twice; the call fails retryably and says the write may have
//!   happened). Its cluster client is built with `retries(0)` and
//!   follows only the redirects that say the script did not run (`MOVED`, `ASK`,
//!   `NOSCRIPT`). `CLUSTERDOWN`, `TRYAGAIN`, `READONLY` (a write that reached a demoted
//!   primary), `MASTERDOWN`, `LOADING` and connection errors fail the call retryably (503
//!   with `Retry-After` at the HTTP layer); the client's retry lands on the new topology.
//! - **Start-up checks** (`maxmemory-policy`, persistence) and `SCRIPT LOAD` run on every
//!   primary; a refusal names the node. [`RedisStore::connect`] (a single-node URL)
//!   pointed at a node of a Cluster with several primaries refuses to start
//!   ([`Error::Config`]): it would reach only that node's slots (a one-primary cluster,
//!   owning every slot, works on a single connection).
//! - **Redirect budget**: a call that meets more than five `MOVED`/`ASK` in a row (a slot
//!   moving again and again) fails retryably; the script did not run.
//! - **Time** is the `TIME` of the record's primary. Keep the nodes on NTP: after a
//!   failover a record's next `TIME` comes from its new primary (see "Failover" above).
//! - **`WAIT` on a cluster** goes in the same pipeline as the script, to the same primary,
//!   and counts that primary's replicas. What a failover can lose:
//!   - *manual failover* (`CLUSTER FAILOVER` on a replica): the replica catches up with its
//!     primary before it takes over, so nothing is lost, with or without `WAIT`;
//!   - *forced failover* (the primary dies; its replica is elected after
//!     `cluster-node-timeout`): without `WAIT`, writes the replica had not received are
//!     gone: a completed record may come back in flight or absent (a retry then runs the
//!     handler again) and a claim may vanish (two holders). With `WAIT 1` and one replica
//!     per primary, every write whose call returned `Ok` was on the replica that is
//!     promoted, so no acknowledged claim, renewal or completion is lost; with several
//!     replicas per primary, ask `WAIT` for all of them (the cluster promotes the replica
//!     with the most data, but only `WAIT n` of `n` makes that one an acknowledging one);
//!   - a `WAIT` shortfall: the call fails retryably; a claim or reclaim is first released
//!     (marked failed under its own token, reclaimable at once by the retry); a complete
//!     stays on the primary (a retry replays it or, if a failover lost it, runs again).
//!
//!   `tests/cluster_faults.rs` measures both failovers with and without `WAIT 1`; the
//!   numbers are in RELIABILITY.md ("Redis Cluster").
//!
//! # Testing and benchmarks
//! `cargo test -p idem-redis` runs the conformance suite (every scenario and the model
//! test) against the Redis at `IDEM_REDIS_URL` (default `redis://127.0.0.1:6379`), each
//! scenario under a fresh random prefix. It fails, with the command to start one, when
//! that Redis is down:
//! `redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no`.
//! Tests that need a differently configured server (an evicting policy, `CONFIG`
//! disabled, a replica) or that stall or kill connections or restart the server start
//! private `redis-server` processes on free ports, so `redis-server` must be on `PATH`.
//! Each runs in a temporary directory of its own, so a replica's sync or a cluster node
//! never writes an RDB or `nodes.conf` file into the crate.
//! `tests/cluster.rs` runs the same conformance suite and model test on the Redis Cluster
//! at `IDEM_REDIS_CLUSTER_URLS` (default the six nodes, three primaries and three
//! replicas, that `scripts/redis-cluster` starts on 127.0.0.1:7000-7005; `scripts/services`
//! calls it), failing when it is not there; `tests/cluster_faults.rs` starts private
//! clusters (7010-7015, 7030-7035, 7040-7045) for slot migration, failovers and a
//! connection killed after a claim ran.
//! `cargo bench -p idem-redis --bench throughput` compares claim + complete against the
//! same two round trips written by hand (`SET NX`, `SET`); `BENCHMARKS.md` has the
//! ratios. A script costs several times a `SET` of Redis' single thread; most of it is
//! the floor of any script that reads the clock, reads the record and writes it.
//!
//! # Layout
//! - `src/config.rs`: [`Config`], [`EvictionCheck`], [`PersistenceCheck`], [`ReplicaAck`].
//! - `src/conn.rs`: [`Connection`] (single node or cluster) and commands sent to every
//!   primary.
//! - `src/store.rs`: [`RedisStore`] and its [`idem_core::Store`] impl: the claim path and
//!   every other operation, one script call each.
//! - `src/script.rs`: loading and calling the scripts (and, on a cluster, following
//!   `MOVED`/`ASK`/`NOSCRIPT`), their replies, and the record bytes
//!   they read and write (header, scope, response).
//! - `src/error.rs`: [`Error`] and its retry classification.
//! - `src/scripts/*.lua`: the scripts (`common.lua` is prepended to each, `arith.lua` to
//!   `reclaim`, `extend` and `fail`): `claim`, `reclaim`, `complete`, `extend`, `fail`,
//!   `get`, `journal_put`, `journal_get`.
//! - `tests/conformance.rs`: the shared conformance suite; `tests/redis.rs` and
//!   `tests/connection_kill.rs`: Redis-specific behaviour; `tests/cluster.rs` and
//!   `tests/cluster_faults.rs`: the suite on a cluster, resharding and failovers.

mod config;
mod conn;
mod error;
#[doc(hidden)]
pub mod fuzzing;
mod script;
mod store;

pub use config::{Config, DEFAULT_PREFIX, EvictionCheck, PersistenceCheck, ReplicaAck};
pub use conn::Connection;
pub use error::Error;
pub use store::{RedisStore, cluster_builder};

/// The `redis` crate this store is built on, for building a [`Connection`] of the same
/// version ([`redis::aio::ConnectionManager`], [`redis::cluster_async::ClusterConnection`]).
pub use redis;
