//! The raw baselines: the same claim -> complete -> replay cycle written without the
//! library, against the same storage.
//!
//! - redb: every claim and every completion is its own durable write transaction
//!   (`Durability::Immediate`, redb's default), on the same tables and with the same
//!   record encoding (`idem_core::codec`) and rules (`idem_core::transition`).
//! - SQLite: every claim and every completion is its own `BEGIN IMMEDIATE` transaction
//!   with `synchronous = FULL` on the same schema (WAL), one connection per concurrent
//!   caller.
//! - Redis: `SET key value NX PX` to claim, `SET key value PX` to complete,
//!   `SET key value NX GET PX` to replay, through the store's own `ConnectionManager`.
//! - Postgres: the store's own claim and complete statements ([`idem_postgres::Statement`])
//!   sent by hand with sqlx through the store's own pool, without decoding rows into records.
//! - MySQL / MariaDB: the store's own transactions (`BEGIN`, `SELECT ... FOR UPDATE`, the
//!   server-clock `SELECT`, `INSERT` or `UPDATE` of every column, `COMMIT`), with the
//!   store's statement text, sent by hand with sqlx through the store's own pool, without
//!   decoding rows into records.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::transition;
use idem_core::{BoxError, ClaimOutcome, ClaimRequest, Clock, RecordState, StoredResponse, SystemClock, codec};
use idem_redb::table::{EXPIRY, RECORDS};
use redb::{Database, ReadableDatabase, ReadableTable};
use rusqlite::{Connection, OptionalExtension, TransactionBehavior, params};

use crate::workload::RETENTION;

fn fail(what: &str) -> BoxError {
    what.to_owned().into()
}

/// redb, one durable write transaction per claim and per completion.
#[derive(Clone, Debug)]
pub(crate) struct NaiveRedb {
    db: Arc<Database>,
}

impl NaiveRedb {
    /// Creates the file and both tables.
    pub(crate) fn create(path: &Path) -> Result<Self, BoxError> {
        let db = Database::create(path)?;
        let txn = db.begin_write()?;
        txn.open_table(RECORDS)?;
        txn.open_table(EXPIRY)?;
        txn.commit()?;
        Ok(Self { db: Arc::new(db) })
    }

    /// Read, decide and write in one write transaction, as an atomic claim must.
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, BoxError> {
        let db = Arc::clone(&self.db);
        tokio::task::spawn_blocking(move || {
            let txn = db.begin_write()?;
            let outcome = {
                let mut records = txn.open_table(RECORDS)?;
                let mut expiry = txn.open_table(EXPIRY)?;
                let current = match records.get(req.id().as_bytes())? {
                    Some(v) => Some(codec::decode(v.value())?),
                    None => None,
                };
                let (write, outcome) = transition::claim(current.as_ref(), &req, SystemClock.now());
                if let Some(new) = write {
                    records.insert(new.id.as_bytes(), codec::encode(&new).as_slice())?;
                    expiry.insert((new.expires_at.0, *new.id.as_bytes()), ())?;
                }
                outcome
            };
            txn.commit()?;
            Ok::<_, BoxError>(outcome)
        })
        .await?
    }

    async fn complete(
        &self,
        req: &ClaimRequest,
        token: idem_core::FencingToken,
        response: StoredResponse,
    ) -> Result<(), BoxError> {
        let (db, id) = (Arc::clone(&self.db), req.id());
        tokio::task::spawn_blocking(move || {
            let txn = db.begin_write()?;
            {
                let mut records = txn.open_table(RECORDS)?;
                let current = match records.get(id.as_bytes())? {
                    Some(v) => Some(codec::decode(v.value())?),
                    None => None,
                };
                // Completion keeps expires_at, so the expiry index does not change.
                let new = transition::complete(current.as_ref(), id, token, response, SystemClock.now())
                    .map_err(|_| fail("redb baseline: lease lost"))?;
                records.insert(new.id.as_bytes(), codec::encode(&new).as_slice())?;
            }
            txn.commit()?;
            Ok::<_, BoxError>(())
        })
        .await?
    }

    /// One cycle: claim a fresh key, complete it, claim it again and see the response.
    pub(crate) async fn cycle(
        &self,
        req: ClaimRequest,
        response: StoredResponse,
        replay: bool,
    ) -> Result<(), BoxError> {
        let ClaimOutcome::Claimed(record) = self.claim(req.clone()).await? else {
            return Err(fail("redb baseline: fresh key not claimed"));
        };
        self.complete(&req, record.token, response).await?;
        if !replay {
            return Ok(());
        }
        match self.claim(req).await? {
            ClaimOutcome::Existing { record, .. } if record.response.is_some() => Ok(()),
            _ => Err(fail("redb baseline: replay did not find the response")),
        }
    }

    /// Records in the file (a sanity check after a run).
    pub(crate) fn len(&self) -> Result<u64, BoxError> {
        use redb::ReadableTableMetadata;
        let txn = self.db.begin_read()?;
        Ok(txn.open_table(RECORDS)?.len()?)
    }
}

/// SQLite, one `BEGIN IMMEDIATE` transaction per claim and per completion, on the store's
/// schema, one connection per concurrent caller.
#[derive(Clone, Debug)]
pub(crate) struct NaiveSqlite {
    path: Arc<Path>,
    pool: Arc<Mutex<Vec<Connection>>>,
}

const SQLITE_COLUMNS: &str = "id, principal, endpoint, key, fingerprint, state, token, created_at, started_at, \
                              lease_expires_at, expires_at, response";

impl NaiveSqlite {
    /// Creates the file with the store's migrations (opening a `SqliteStore` once).
    pub(crate) fn create(path: &Path) -> Result<Self, BoxError> {
        drop(idem_sqlite::SqliteStore::open(path, idem_sqlite::Config::default())?);
        Ok(Self { path: Arc::from(path), pool: Arc::new(Mutex::new(Vec::new())) })
    }

    fn connection(&self) -> Result<Connection, BoxError> {
        // A poisoned pool only means another caller panicked mid-push; its Vec is intact.
        if let Some(conn) = self.pool.lock().unwrap_or_else(std::sync::PoisonError::into_inner).pop() {
            return Ok(conn);
        }
        let conn = Connection::open(&self.path)?;
        conn.busy_timeout(Duration::from_secs(60))?;
        conn.pragma_update(None, "synchronous", "FULL")?;
        Ok(conn)
    }

    async fn with_connection<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Connection) -> Result<T, BoxError> + Send + 'static,
    ) -> Result<T, BoxError> {
        let this = self.clone();
        tokio::task::spawn_blocking(move || {
            let mut conn = this.connection()?;
            let out = f(&mut conn);
            this.pool.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(conn);
            out
        })
        .await?
    }

    /// One cycle: claim a fresh key, complete it, claim it again and see the response.
    pub(crate) async fn cycle(
        &self,
        req: ClaimRequest,
        response: StoredResponse,
        replay: bool,
    ) -> Result<(), BoxError> {
        let encoded = encode_sqlite_response(&response);
        let claim = |req: ClaimRequest| {
            move |conn: &mut Connection| {
                let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
                let now = SystemClock.now().0;
                let found: Option<(i64, Option<Vec<u8>>)> = tx
                    .prepare_cached("SELECT expires_at, response FROM idem_records WHERE id = ?1")?
                    .query_row([&req.id().as_bytes()[..]], |row| Ok((row.get(0)?, row.get(1)?)))
                    .optional()?;
                let claimed = match found {
                    Some((expires_at, response)) if expires_at > now => Err(response),
                    _ => {
                        tx.prepare_cached(&format!(
                            "INSERT INTO idem_records ({SQLITE_COLUMNS}) \
                             VALUES (?1, ?2, ?3, ?4, ?5, 'in_flight', 1, ?6, ?6, ?7, ?8, NULL) \
                             ON CONFLICT (id) DO UPDATE SET state = 'in_flight', token = token + 1, \
                             created_at = excluded.created_at, started_at = excluded.started_at, \
                             lease_expires_at = excluded.lease_expires_at, expires_at = excluded.expires_at, \
                             response = NULL"
                        ))?
                        .execute(params![
                            &req.id().as_bytes()[..],
                            req.scope().principal.as_str(),
                            req.scope().endpoint.as_str(),
                            req.key().as_str(),
                            &req.fingerprint().as_bytes()[..],
                            now,
                            now + req.lease_ms(),
                            now + req.retention_ms(),
                        ])?;
                        Ok(())
                    }
                };
                tx.commit()?;
                Ok::<_, BoxError>(claimed)
            }
        };
        if self.with_connection(claim(req.clone())).await?.is_err() {
            return Err(fail("sqlite baseline: fresh key not claimed"));
        }
        let id = req.id();
        let completed = self
            .with_connection(move |conn| {
                let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
                let n = tx
                    .prepare_cached(
                        "UPDATE idem_records SET state = 'completed', response = ?2 \
                         WHERE id = ?1 AND token = 1 AND state = 'in_flight' AND expires_at > ?3",
                    )?
                    .execute(params![&id.as_bytes()[..], encoded, SystemClock.now().0])?;
                tx.commit()?;
                Ok::<_, BoxError>(n)
            })
            .await?;
        if completed != 1 {
            return Err(fail("sqlite baseline: lease lost"));
        }
        if !replay {
            return Ok(());
        }
        match self.with_connection(claim(req)).await? {
            Err(Some(_)) => Ok(()),
            _ => Err(fail("sqlite baseline: replay did not find the response")),
        }
    }
}

/// The `response` column as idem-sqlite writes it.
pub(crate) fn encode_sqlite_response(response: &StoredResponse) -> Vec<u8> {
    idem_core::codec::encode_response(response)
}

/// Redis, the same round trips by hand through the store's `ConnectionManager`.
#[derive(Clone)]
pub(crate) struct RedisByHand {
    conn: idem_redis::Connection,
    prefix: String,
}

impl std::fmt::Debug for RedisByHand {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisByHand").field("prefix", &self.prefix).finish_non_exhaustive()
    }
}

impl RedisByHand {
    /// Sends on `conn` (the store's own: one server, or the cluster, where each key goes to
    /// its slot's primary); keys are `prefix` + hex record id.
    pub(crate) fn new(conn: idem_redis::Connection, prefix: String) -> Self {
        Self { conn, prefix }
    }

    /// One cycle: `SET NX PX` the in-flight record, `SET PX` the completed one, then
    /// `SET NX GET PX` (a claim that finds the stored record and returns it).
    pub(crate) async fn cycle(
        &self,
        req: ClaimRequest,
        response: StoredResponse,
        replay: bool,
    ) -> Result<(), BoxError> {
        let mut conn = self.conn.clone();
        let key = format!("{}{}", self.prefix, hex(req.id().as_bytes()));
        let ms = RETENTION.as_millis() as u64;
        let now = SystemClock.now();
        let (Some(claimed), _) = transition::claim(None, &req, now) else {
            return Err(fail("redis baseline: transition refused a fresh claim"));
        };
        let ok: Option<String> = redis::cmd("SET")
            .arg(&key)
            .arg(codec::encode(&claimed))
            .arg("NX")
            .arg("PX")
            .arg(ms)
            .query_async(&mut conn)
            .await?;
        if ok.is_none() {
            return Err(fail("redis baseline: fresh key not claimed"));
        }
        let done = transition::complete(Some(&claimed), req.id(), claimed.token, response, now)
            .map_err(|_| fail("redis baseline: lease lost"))?;
        let () = redis::cmd("SET").arg(&key).arg(codec::encode(&done)).arg("PX").arg(ms).query_async(&mut conn).await?;
        if !replay {
            return Ok(());
        }
        let old: Option<Vec<u8>> = redis::cmd("SET")
            .arg(&key)
            .arg(codec::encode(&claimed))
            .arg("NX")
            .arg("GET")
            .arg("PX")
            .arg(ms)
            .query_async(&mut conn)
            .await?;
        match old.map(|b| codec::decode(&b)).transpose()? {
            Some(r) if r.state == RecordState::Completed => Ok(()),
            _ => Err(fail("redis baseline: replay did not find the response")),
        }
    }
}

/// Postgres, the store's own statements by hand through the store's pool.
#[derive(Clone, Debug)]
pub(crate) struct PostgresByHand {
    store: idem_postgres::PostgresStore,
}

impl PostgresByHand {
    /// Uses `store`'s pool and SQL text.
    pub(crate) fn new(store: &idem_postgres::PostgresStore) -> Self {
        Self { store: store.clone() }
    }

    /// The claim statement; returns its `claimed` column and the token.
    async fn claim(&self, req: &ClaimRequest) -> Result<(bool, i64), BoxError> {
        use idem_postgres::sqlx::Row as _;
        let row = idem_postgres::sqlx::query(self.store.sql(idem_postgres::Statement::Claim))
            .bind(&req.id().as_bytes()[..])
            .bind(req.scope().principal.as_str().as_bytes())
            .bind(req.scope().endpoint.as_str().as_bytes())
            .bind(req.key().as_str())
            .bind(&req.fingerprint().as_bytes()[..])
            .bind(req.lease_ms())
            .bind(req.retention_ms())
            .bind(None::<i64>)
            .fetch_one(self.store.pool())
            .await?;
        Ok((row.try_get("claimed")?, row.try_get("token")?))
    }

    /// One cycle: the claim statement, the complete statement, the claim statement again.
    pub(crate) async fn cycle(
        &self,
        req: ClaimRequest,
        response: StoredResponse,
        replay: bool,
    ) -> Result<(), BoxError> {
        let (claimed, token) = self.claim(&req).await?;
        if !claimed {
            return Err(fail("postgres baseline: fresh key not claimed"));
        }
        let encoded = idem_core::codec::encode_response(&response);
        let row = idem_postgres::sqlx::query(self.store.sql(idem_postgres::Statement::Complete))
            .bind(&req.id().as_bytes()[..])
            .bind(token)
            .bind(&encoded)
            .bind(None::<i64>)
            .fetch_optional(self.store.pool())
            .await?;
        if row.is_none() {
            return Err(fail("postgres baseline: lease lost"));
        }
        if !replay {
            return Ok(());
        }
        if self.claim(&req).await?.0 {
            return Err(fail("postgres baseline: replay claimed again"));
        }
        Ok(())
    }
}

/// Lower-case hex.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The record columns of idem-mysql's table, in the order its statements name them. Copied
/// from `idem-mysql/src/sql.rs` (`COLUMNS`, private there): keep the two in step.
pub(crate) const MYSQL_COLUMNS: [&str; 12] = [
    "id",
    "principal",
    "endpoint",
    "idem_key",
    "fingerprint",
    "state",
    "token",
    "response",
    "created_at",
    "started_at",
    "lease_expires_at",
    "expires_at",
];

/// The store's clock read, copied from `idem-mysql/src/sql.rs` (`SERVER_NOW_MS`) as
/// `idem-mysql/src/store.rs` (`MySqlStore::now`) sends it.
const MYSQL_NOW: &str =
    "SELECT CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000 AS SIGNED)";

/// The statements a claim and a completion send, with the text idem-mysql builds in
/// `Statements::for_prefix` (`idem-mysql/src/sql.rs`, private there): `lock`, `insert`,
/// `update`.
#[derive(Clone, Debug)]
pub(crate) struct MySqlStatements {
    /// The quoted records table, `` `<prefix>_records` ``.
    pub(crate) table: String,
    lock: String,
    insert: String,
    update: String,
}

impl MySqlStatements {
    pub(crate) fn for_prefix(prefix: &str) -> Self {
        let table = format!("`{prefix}_records`");
        let cols = MYSQL_COLUMNS.join(", ");
        let marks = vec!["?"; MYSQL_COLUMNS.len()].join(", ");
        let sets = MYSQL_COLUMNS[1..].iter().map(|c| format!("{c} = ?")).collect::<Vec<_>>().join(", ");
        Self {
            lock: format!("SELECT {cols} FROM {table} WHERE id = ? FOR UPDATE"),
            insert: format!("INSERT INTO {table} ({cols}) VALUES ({marks})"),
            update: format!("UPDATE {table} SET {sets} WHERE id = ?"),
            table,
        }
    }
}

/// MySQL or MariaDB, the store's transactions by hand through the store's pool: per
/// operation one pooled connection, `BEGIN` and `COMMIT` as text (as the store sends
/// them), and the locking read, the clock read and the write as prepared statements. The
/// locked row is not decoded into a record: the completion checks its `token` and `state`
/// columns, the replay its `state` column.
#[derive(Clone, Debug)]
pub(crate) struct MySqlByHand {
    pool: idem_mysql::sqlx::MySqlPool,
    sql: MySqlStatements,
}

impl MySqlByHand {
    /// Sends on `pool` (the store's own) to the tables of `prefix`.
    pub(crate) fn new(pool: idem_mysql::sqlx::MySqlPool, prefix: &str) -> Self {
        Self { pool, sql: MySqlStatements::for_prefix(prefix) }
    }

    /// One cycle: the claim's transaction (lock finds nothing, clock, `INSERT`), the
    /// completion's (lock, clock, `UPDATE`), and the replay's (lock, clock, nothing to
    /// write), each committed.
    pub(crate) async fn cycle(
        &self,
        req: ClaimRequest,
        response: StoredResponse,
        replay: bool,
    ) -> Result<(), BoxError> {
        use idem_mysql::sqlx::{self, Executor as _, Row as _};
        let record_id = req.id();
        let id = record_id.as_bytes().as_slice();
        let (principal, endpoint) =
            (req.scope().principal.as_str().as_bytes(), req.scope().endpoint.as_str().as_bytes());
        let fingerprint = req.fingerprint();
        let (key, fingerprint) = (req.key().as_str().as_bytes(), fingerprint.as_bytes().as_slice());

        // Claim.
        let mut conn = self.pool.acquire().await?;
        conn.execute(sqlx::raw_sql("BEGIN")).await?;
        let row = sqlx::query(&self.sql.lock).bind(id).fetch_optional(&mut *conn).await?;
        let now: i64 = sqlx::query_scalar(MYSQL_NOW).fetch_one(&mut *conn).await?;
        if row.is_some() {
            conn.execute(sqlx::raw_sql("ROLLBACK")).await?;
            return Err(fail("mysql baseline: fresh key not claimed"));
        }
        let token = i64::try_from(idem_core::FencingToken::first_at(idem_core::UnixMillis(now)).0)?;
        let (lease_end, expires) = (now + req.lease_ms(), now + req.retention_ms());
        sqlx::query(&self.sql.insert)
            .bind(id)
            .bind(principal)
            .bind(endpoint)
            .bind(key)
            .bind(fingerprint)
            .bind("in_flight")
            .bind(token)
            .bind(None::<Vec<u8>>)
            .bind(now)
            .bind(now)
            .bind(lease_end)
            .bind(expires)
            .execute(&mut *conn)
            .await?;
        conn.execute(sqlx::raw_sql("COMMIT")).await?;
        drop(conn);

        // Complete.
        let mut conn = self.pool.acquire().await?;
        conn.execute(sqlx::raw_sql("BEGIN")).await?;
        let row = sqlx::query(&self.sql.lock).bind(id).fetch_optional(&mut *conn).await?;
        let _now: i64 = sqlx::query_scalar(MYSQL_NOW).fetch_one(&mut *conn).await?;
        let owned = match &row {
            Some(row) => row.try_get::<i64, _>(6)? == token && row.try_get::<&str, _>(5)? == "in_flight",
            None => false,
        };
        if !owned {
            conn.execute(sqlx::raw_sql("ROLLBACK")).await?;
            return Err(fail("mysql baseline: lease lost"));
        }
        sqlx::query(&self.sql.update)
            .bind(principal)
            .bind(endpoint)
            .bind(key)
            .bind(fingerprint)
            .bind("completed")
            .bind(token)
            .bind(Some(idem_core::codec::encode_response(&response)))
            .bind(now)
            .bind(now)
            .bind(lease_end)
            .bind(expires)
            .bind(id)
            .execute(&mut *conn)
            .await?;
        conn.execute(sqlx::raw_sql("COMMIT")).await?;
        drop(conn);
        if !replay {
            return Ok(());
        }

        // Replay: the claim's transaction finds the completed row and writes nothing.
        let mut conn = self.pool.acquire().await?;
        conn.execute(sqlx::raw_sql("BEGIN")).await?;
        let row = sqlx::query(&self.sql.lock).bind(id).fetch_optional(&mut *conn).await?;
        let _now: i64 = sqlx::query_scalar(MYSQL_NOW).fetch_one(&mut *conn).await?;
        conn.execute(sqlx::raw_sql("COMMIT")).await?;
        match row {
            Some(row) if row.try_get::<&str, _>(5)? == "completed" => Ok(()),
            _ => Err(fail("mysql baseline: replay did not find the response")),
        }
    }
}
