//! The SQLite tables as the record-table seam: [`SqliteTable`] inside the writer's
//! `BEGIN IMMEDIATE` transaction, [`SqliteView`] on a read connection.
//!
//! One row of `idem_records` per record, one column per field (times as INTEGER ms since
//! the epoch, the response as [`idem_core::codec::encode_response`] bytes); one row of
//! `idem_journal` per journal entry. The expiry index is the SQL index
//! `idem_records_expires` on `expires_at`, which SQLite keeps at one entry per row by
//! itself, so [`RecordTable::write`] is one upsert, [`RecordTable::create`] one insert (and
//! a read only when it meets a row) and [`RecordTable::expired`] a range scan of that
//! index. Every write is one statement: a statement SQLite refuses is undone on its own
//! and leaves the transaction usable, unless SQLite rolled the whole transaction back
//! (disk full, I/O error, `RAISE(ROLLBACK)`), which [`RecordTable::is_poisoned`] reports.

use idem_core::codec::decode_response;
use idem_core::{
    Endpoint, Expired, FencingToken, Fingerprint, IdempotencyKey, ListFilter, Listing, Principal, Record, RecordId,
    RecordRead, RecordState, RecordTable, Scope, StoreError, UnixMillis, codec,
};
use rusqlite::types::ValueRef;
use rusqlite::{Connection, OptionalExtension, Row, Transaction, params};

use crate::error::Error;

const SELECT_RECORD: &str = "SELECT id, principal, endpoint, key, fingerprint, state, token, created_at, started_at, \
                             lease_expires_at, expires_at, response FROM idem_records WHERE id = ?1";

/// A first claim: written only where no row has the id (`changes() == 0` otherwise).
const INSERT_RECORD: &str = "INSERT INTO idem_records (id, principal, endpoint, key, fingerprint, state, token, \
     created_at, started_at, lease_expires_at, expires_at, response) \
     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12) ON CONFLICT (id) DO NOTHING";

const UPSERT_RECORD: &str = "INSERT INTO idem_records (id, principal, endpoint, key, fingerprint, state, token, \
     created_at, started_at, lease_expires_at, expires_at, response) \
     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12) \
     ON CONFLICT (id) DO UPDATE SET principal = excluded.principal, endpoint = excluded.endpoint, \
     key = excluded.key, fingerprint = excluded.fingerprint, state = excluded.state, token = excluded.token, \
     created_at = excluded.created_at, started_at = excluded.started_at, \
     lease_expires_at = excluded.lease_expires_at, expires_at = excluded.expires_at, response = excluded.response";

/// Oldest expiry first, through the index `idem_records_expires`.
pub(crate) const SELECT_EXPIRED: &str =
    "SELECT id, expires_at FROM idem_records WHERE expires_at <= ?1 ORDER BY expires_at LIMIT ?2";

/// A page of [`idem_core::Store::list`], by primary key from the cursor (`?2`, an empty
/// blob sorts before every id); `NULL` in `?3`..`?5` leaves that condition out.
const LIST_RECORDS: &str = "SELECT id, principal, endpoint, key, fingerprint, state, token, created_at, started_at, \
     lease_expires_at, expires_at, response FROM idem_records \
     WHERE expires_at > ?1 AND id > ?2 AND (?3 IS NULL OR state = ?3) AND (?4 IS NULL OR started_at <= ?4) \
     AND (?5 IS NULL OR principal = ?5) ORDER BY id LIMIT ?6";

const DELETE_RECORD: &str = "DELETE FROM idem_records WHERE id = ?1";

const SELECT_JOURNAL: &str = "SELECT value FROM idem_journal WHERE record_id = ?1 AND name = ?2";

const UPSERT_JOURNAL: &str = "INSERT INTO idem_journal (record_id, name, value) VALUES (?1, ?2, ?3) \
                              ON CONFLICT (record_id, name) DO UPDATE SET value = excluded.value";

const DELETE_JOURNAL: &str = "DELETE FROM idem_journal WHERE record_id = ?1";

/// Point reads on a read connection (outside a transaction each read is its own
/// snapshot; inside one, all of them read the same).
#[derive(Debug)]
pub(crate) struct SqliteView<'c> {
    conn: &'c Connection,
}

impl<'c> SqliteView<'c> {
    pub(crate) fn new(conn: &'c Connection) -> Self {
        Self { conn }
    }
}

impl RecordRead for SqliteView<'_> {
    fn read(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        read_record(self.conn, id)
    }

    fn journal_read(&self, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        read_journal(self.conn, id, name)
    }

    /// One statement: a range of the primary key from the cursor.
    fn list(&self, filter: &ListFilter, now: UnixMillis) -> Result<Listing, StoreError> {
        list(self.conn, filter, now)
    }
}

/// The tables inside one write transaction of the writer connection.
#[derive(Debug)]
pub(crate) struct SqliteTable<'t, 'c> {
    tx: &'t Transaction<'c>,
    /// A write of a record with this key panics (the panic recovery test).
    #[cfg(test)]
    pub(crate) panic_on_key: Option<&'t str>,
}

impl<'t, 'c> SqliteTable<'t, 'c> {
    pub(crate) fn new(tx: &'t Transaction<'c>) -> Self {
        Self {
            tx,
            #[cfg(test)]
            panic_on_key: None,
        }
    }
}

impl RecordRead for SqliteTable<'_, '_> {
    fn read(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        read_record(self.tx, id)
    }

    fn journal_read(&self, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        read_journal(self.tx, id, name)
    }
}

impl SqliteTable<'_, '_> {
    /// Runs `sql` (an insert of every column) with `record`'s columns; the rows it changed.
    fn put(&self, sql: &str, record: &Record) -> Result<usize, StoreError> {
        #[cfg(test)]
        assert!(self.panic_on_key != Some(record.key.as_str()), "planted panic in the SQLite table");
        let token = i64::try_from(record.token.0).map_err(|_| {
            Error::invalid_record(record.id, "token", format!("{} does not fit an INTEGER", record.token))
        })?;
        let response = record.response.as_ref().map(codec::encode_response);
        let changed = self
            .tx
            .prepare_cached(sql)
            .and_then(|mut stmt| {
                stmt.execute(params![
                    &record.id.as_bytes()[..],
                    record.scope.principal.as_str(),
                    record.scope.endpoint.as_str(),
                    record.key.as_str(),
                    &record.fingerprint.as_bytes()[..],
                    record.state.as_str(),
                    token,
                    record.created_at.0,
                    record.started_at.0,
                    record.lease_expires_at.0,
                    record.expires_at.0,
                    response,
                ])
            })
            .map_err(Error::sqlite("write record"))?;
        Ok(changed)
    }
}

impl RecordTable for SqliteTable<'_, '_> {
    fn write(&mut self, _old: Option<&Record>, new: &Record) -> Result<(), StoreError> {
        self.put(UPSERT_RECORD, new).map(drop)
    }

    /// One insert that does nothing on a conflict; the row is read only when there was
    /// one.
    fn create(&mut self, new: &Record) -> Result<Option<Record>, StoreError> {
        if self.put(INSERT_RECORD, new)? == 1 {
            return Ok(None);
        }
        match read_record(self.tx, new.id)? {
            Some(stored) => Ok(Some(stored)),
            // No row written and none found: a trigger swallowed the insert (RAISE(IGNORE)).
            None => Err(StoreError::unavailable(
                crate::error::BACKEND,
                "the insert of a claim neither wrote a row nor met one",
                false,
                "insert ignored",
            )),
        }
    }

    fn expired(&mut self, now: UnixMillis, limit: usize) -> Result<Vec<Expired>, StoreError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows: Vec<(Vec<u8>, i64)> = self
            .tx
            .prepare_cached(SELECT_EXPIRED)
            .and_then(|mut stmt| stmt.query_map(params![now.0, limit], |row| Ok((row.get(0)?, row.get(1)?)))?.collect())
            .map_err(Error::sqlite("find expired records"))?;
        rows.into_iter()
            .map(|(id, expires_at)| {
                let id = RecordId::from_bytes(bytes32(&id, "id", &id)?);
                Ok(Expired { expires_at: UnixMillis(expires_at), id })
            })
            .collect()
    }

    fn remove(&mut self, expired: Expired) -> Result<(), StoreError> {
        // The trigger idem_records_delete_journal deletes the record's journal with it.
        self.tx
            .prepare_cached(DELETE_RECORD)
            .and_then(|mut stmt| stmt.execute([&expired.id.as_bytes()[..]]))
            .map_err(Error::sqlite("delete record"))?;
        Ok(())
    }

    fn journal_write(&mut self, id: RecordId, name: &str, value: &[u8]) -> Result<(), StoreError> {
        self.tx
            .prepare_cached(UPSERT_JOURNAL)
            .and_then(|mut stmt| stmt.execute(params![&id.as_bytes()[..], name, value]))
            .map_err(Error::sqlite("write journal"))?;
        Ok(())
    }

    fn journal_clear(&mut self, id: RecordId) -> Result<(), StoreError> {
        self.tx
            .prepare_cached(DELETE_JOURNAL)
            .and_then(|mut stmt| stmt.execute([&id.as_bytes()[..]]))
            .map_err(Error::sqlite("delete journal"))?;
        Ok(())
    }

    fn is_poisoned(&self) -> bool {
        // Some failures (disk full, I/O error, RAISE(ROLLBACK)) make SQLite roll the whole
        // transaction back; the connection is then in autocommit mode again, and what the
        // batch wrote before is gone.
        self.tx.is_autocommit()
    }
}

fn read_record(conn: &Connection, id: RecordId) -> Result<Option<Record>, StoreError> {
    let mut stmt = conn.prepare_cached(SELECT_RECORD).map_err(Error::sqlite("prepare read"))?;
    let row = stmt
        .query_row([&id.as_bytes()[..]], |row| Ok(from_row(row)))
        .optional()
        .map_err(Error::sqlite("read record"))?;
    row.transpose()
}

/// One page of live records matching `filter` at `now`, in id order.
pub(crate) fn list(conn: &Connection, filter: &ListFilter, now: UnixMillis) -> Result<Listing, StoreError> {
    let after: &[u8] = filter.after.as_ref().map_or(&[], |id| &id.as_bytes()[..]);
    let probe = i64::try_from(filter.limit).unwrap_or(i64::MAX).saturating_add(1);
    let mut stmt = conn.prepare_cached(LIST_RECORDS).map_err(Error::sqlite("prepare list"))?;
    let rows = stmt
        .query_map(
            params![
                now.0,
                after,
                filter.state.map(|s| s.as_str()),
                filter.started_before.map(|t| t.0),
                filter.principal.as_ref().map(|p| p.as_str()),
                probe
            ],
            |row| Ok(from_row(row)),
        )
        .map_err(Error::sqlite("list records"))?;
    let mut page = Vec::new();
    for row in rows {
        page.push(row.map_err(Error::sqlite("list records"))??);
    }
    let more = page.len() > filter.limit;
    page.truncate(filter.limit);
    Ok(Listing::new(now, page, more))
}

fn read_journal(conn: &Connection, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
    let value = conn
        .prepare_cached(SELECT_JOURNAL)
        .and_then(|mut stmt| stmt.query_row(params![&id.as_bytes()[..], name], |row| row.get(0)).optional())
        .map_err(Error::sqlite("read journal"))?;
    Ok(value)
}

fn bytes32(id: &[u8], column: &'static str, value: &[u8]) -> Result<[u8; 32], Error> {
    value.try_into().map_err(|_| Error::invalid_row(id, column, format!("{} bytes, expected 32", value.len())))
}

pub(crate) fn from_row(row: &Row<'_>) -> Result<Record, StoreError> {
    // A value of the wrong SQL type is a damaged row (corrupt, naming its column); any
    // other error reading the row is the driver's (kept as the source).
    const COLUMNS: [&str; 12] = [
        "id",
        "principal",
        "endpoint",
        "key",
        "fingerprint",
        "state",
        "token",
        "created_at",
        "started_at",
        "lease_expires_at",
        "expires_at",
        "response",
    ];
    let raw_id: &[u8] = match row.get_ref(0).map_err(Error::sqlite("read record"))? {
        ValueRef::Blob(bytes) => bytes,
        _ => return Err(Error::invalid_row(&[], "id", "not a blob").into()),
    };
    let read = |i: usize| {
        move |e: rusqlite::Error| match e {
            rusqlite::Error::InvalidColumnType(..)
            | rusqlite::Error::FromSqlConversionFailure(..)
            | rusqlite::Error::IntegralValueOutOfRange(..) => Error::invalid_row(raw_id, COLUMNS[i], e.to_string()),
            other => Error::sqlite("read record")(other),
        }
    };
    let id = RecordId::from_bytes(bytes32(raw_id, "id", raw_id)?);
    let text = |i: usize| row.get::<_, String>(i).map_err(read(i));
    let int = |i: usize| row.get::<_, i64>(i).map_err(read(i));

    let principal = Principal::new(text(1)?).map_err(|_| Error::invalid_row(raw_id, "principal", "blank principal"))?;
    let key = IdempotencyKey::from_stored(&text(3)?)
        .ok_or_else(|| Error::invalid_row(raw_id, "key", "not a valid idempotency key"))?;
    let fingerprint: Vec<u8> = row.get(4).map_err(read(4))?;
    let fingerprint = Fingerprint::from_bytes(bytes32(raw_id, "fingerprint", &fingerprint)?);
    let state_name = text(5)?;
    let state = RecordState::from_name(&state_name)
        .ok_or_else(|| Error::invalid_row(raw_id, "state", format!("unknown state {state_name:?}")))?;
    let token = u64::try_from(int(6)?).map_err(|_| Error::invalid_row(raw_id, "token", "negative"))?;
    let response = match row.get_ref(11).map_err(read(11))? {
        ValueRef::Null => None,
        ValueRef::Blob(bytes) => {
            Some(decode_response(bytes).map_err(|source| StoreError::Corrupt { id: Some(id), source })?)
        }
        _ => return Err(Error::invalid_row(raw_id, "response", "neither a blob nor NULL").into()),
    };
    let scope = Scope { principal, endpoint: Endpoint::from(text(2)?) };
    // A row whose scope and key hash to another id (copied between rows by something with
    // write access to the file) would replay one tenant's response under another's key.
    if scope.record_id(&key) != id {
        return Err(Error::invalid_row(raw_id, "id", "the scope and key name another record").into());
    }
    Ok(Record {
        id,
        scope,
        key,
        fingerprint,
        state,
        token: FencingToken(token),
        response,
        created_at: UnixMillis(int(7)?),
        started_at: UnixMillis(int(8)?),
        lease_expires_at: UnixMillis(int(9)?),
        expires_at: UnixMillis(int(10)?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sweep_finds_expired_records_by_a_range_scan_of_the_expiry_index() {
        //! A sweep that scanned the whole table would cost time in proportion to every
        //! record kept, not to the expired ones it removes.
        let dir = tempfile::tempdir().expect("dir");
        let mut conn = Connection::open(dir.path().join("plan.sqlite3")).expect("open");
        crate::sql::migrate(&mut conn).expect("migrate");
        let plan: Vec<String> = conn
            .prepare(&format!("EXPLAIN QUERY PLAN {SELECT_EXPIRED}"))
            .and_then(|mut s| s.query_map(params![0, 10], |r| r.get::<_, String>(3))?.collect())
            .expect("plan");
        let plan = plan.join("; ");
        assert!(plan.contains("USING INDEX idem_records_expires (expires_at<?)"), "{plan}");
        assert!(!plan.contains("SCAN") && !plan.contains("TEMP B-TREE"), "{plan}");
    }
}
