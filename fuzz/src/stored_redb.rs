//! Target `stored_redb`: the bytes a hostile writer with write access to the file left as the
//! value of a record id in idem-redb's records table, read back through the store.
//!
//! Input: a 32-byte record id, then the value bytes. They are written with redb's own API
//! into the table `idem_records` (32-byte id -> encoded record, the layout idem-redb
//! documents) of an in-memory `Database`, which then backs a `RedbStore`
//! ([`RedbStore::from_database`]). `get` of that id must answer with a record of that id or a
//! typed [`StoreError::Corrupt`] naming it, never panic and never allocate without bound;
//! `list` must not panic either; an accepted record round-trips through its encoding.

use std::sync::Arc;

use idem_core::{ListFilter, ManualClock, Record, RecordId, Store, StoreError, codec};
use idem_redb::{Config, RedbStore};
use redb::backends::InMemoryBackend;
use redb::{Database, TableDefinition};

use crate::{NOW, runtime, same_read};

/// idem-redb's records table: record id -> one format-version byte, then postcard.
const RECORDS: TableDefinition<'static, &'static [u8; 32], &'static [u8]> = TableDefinition::new("idem_records");

/// Panics only on a bug in the store's read path (see the module docs).
pub fn stored_record(data: &[u8]) {
    let Some((id, bytes)) = data.split_first_chunk::<32>() else { return };
    let id = RecordId::from_bytes(*id);
    let store = planted(id, bytes);
    let rt = runtime();
    let first = rt.block_on(store.get(id));
    match same_read(first, &rt.block_on(store.get(id))) {
        Ok(Some(record)) => {
            assert_eq!(record.id, id, "a record is only returned under its own id");
            if let Some(response) = &record.response {
                // A hostile compressed body: a typed error, bounded, never a panic.
                let _ = response.body_bytes();
            }
            let again = rt.block_on(planted(id, &codec::encode(&record)).get(id));
            assert_eq!(again.ok().flatten().as_ref(), Some(&record), "an accepted record round-trips");
        }
        // Expired at the store's clock: absent, whatever its bytes.
        Ok(None) => {}
        Err(e) => assert!(matches!(e, StoreError::Corrupt { id: Some(i), .. } if i == id), "untyped error {e:?}"),
    }
    let listed = rt.block_on(store.list(ListFilter::new(10)));
    if let Ok(listing) = listed {
        assert!(listing.records.iter().all(|r| r.id == id), "a listing names only records of their own id");
    }
}

/// A store on an in-memory database whose records table holds `bytes` at `id`.
fn planted(id: RecordId, bytes: &[u8]) -> RedbStore {
    let db = Database::builder().create_with_backend(InMemoryBackend::new()).expect("an in-memory redb database");
    let txn = db.begin_write().expect("a write transaction");
    txn.open_table(RECORDS).expect("the records table").insert(id.as_bytes(), bytes).expect("insert");
    txn.commit().expect("commit");
    let config = Config::default().with_clock(Arc::new(ManualClock::new(NOW)));
    RedbStore::from_database(Arc::new(db), config).expect("the store starts on the database")
}

/// A seed input for `record`: its id, then its encoding as the store writes it.
#[must_use]
pub fn seed(record: &Record) -> Vec<u8> {
    let mut out = record.id.as_bytes().to_vec();
    out.extend_from_slice(&codec::encode(record));
    out
}
