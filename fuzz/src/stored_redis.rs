//! Target `stored_redis`: a record's hash as a hostile writer with `HSET` on the shared Redis
//! could leave it, read back through the store.
//!
//! Input: a 32-byte record id, then the hash fields `h` (header, then scope and key) and `r`
//! (the response) of that record, each a presence byte, a length and bytes. The body writes
//! them with `HSET` at the store's key for that id ([`RedisStore::record_key`]) on the Redis
//! at `IDEM_REDIS_URL` (default `redis://127.0.0.1:6379`), under a key prefix of its own,
//! and reads them with `get`, which runs the `get` script and decodes its reply. It must
//! answer with a record that lives at that id (its scope and key hash to it) and holds a
//! response exactly when completed, or a typed [`StoreError::Corrupt`] naming the id; never
//! panic, never allocate without bound, give the same answer twice. An accepted record
//! round-trips through its fields. Every key it writes is deleted after the input (and
//! expires within a minute regardless).

use std::cell::RefCell;
use std::sync::Arc;

use idem_core::codec::encode_response;
use idem_core::{ManualClock, Record, RecordId, RecordState, Store, StoreError};
use idem_redis::{Config, RedisStore};
use redis::Commands;

use crate::{Input, NOW, push_field, runtime, same_read};

/// The store, its runtime and a plain connection of the hostile writer, made once per
/// thread: connecting runs the store's start-up checks and loads its scripts.
struct Session {
    rt: tokio::runtime::Runtime,
    store: RedisStore,
    writer: redis::Connection,
}

thread_local! {
    static SESSION: RefCell<Option<Session>> = const { RefCell::new(None) };
}

fn url() -> String {
    std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

fn unreachable<T>(url: &str, e: impl std::fmt::Display) -> T {
    panic!("stored_redis needs the Redis at {url} (scripts/services starts it, or set IDEM_REDIS_URL): {e}")
}

fn session() -> Session {
    let url = url();
    let rt = runtime();
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let config = Config::default()
        .with_prefix(format!("idem-fuzz:{}-{nanos}:", std::process::id()))
        .with_clock(Arc::new(ManualClock::new(NOW)));
    let store = rt.block_on(RedisStore::connect(&url, config)).unwrap_or_else(|e| unreachable(&url, e));
    let writer =
        redis::Client::open(url.as_str()).and_then(|c| c.get_connection()).unwrap_or_else(|e| unreachable(&url, e));
    Session { rt, store, writer }
}

/// Reads a hash field: absent when the presence byte is even.
fn field(input: &mut Input<'_>) -> Option<Vec<u8>> {
    let present = input.byte() % 2 == 1;
    let bytes = input.field();
    present.then(|| bytes.to_vec())
}

/// Panics only on a bug in the store's read path (see the module docs).
pub fn stored_record(data: &[u8]) {
    let Some((id, rest)) = data.split_first_chunk::<32>() else { return };
    let id = RecordId::from_bytes(*id);
    let mut input = Input(rest);
    let (h, r) = (field(&mut input), field(&mut input));
    SESSION.with(|slot| {
        let mut slot = slot.borrow_mut();
        let s = slot.get_or_insert_with(session);
        let key = s.store.record_key(id);
        plant(&mut s.writer, &key, h, r);
        let first = s.rt.block_on(s.store.get(id));
        let read = same_read(first, &s.rt.block_on(s.store.get(id)));
        if let Ok(Some(record)) = &read {
            check(record, id);
            let (h, r) = fields(record);
            plant(&mut s.writer, &key, Some(h), r);
            let again = s.rt.block_on(s.store.get(id));
            assert_eq!(again.ok().flatten().as_ref(), Some(record), "an accepted record round-trips");
        }
        let _: () = s.writer.del(&key).expect("DEL");
        if let Err(e) = read {
            assert!(matches!(e, StoreError::Corrupt { id: Some(i), .. } if i == id), "untyped error {e:?}");
        }
    });
}

fn check(record: &Record, id: RecordId) {
    assert_eq!(record.id, id);
    let derived =
        RecordId::derive(record.scope.principal.as_str(), record.scope.endpoint.as_str(), record.key.as_str());
    assert_eq!(derived, id, "a record is only returned at the id its scope and key hash to");
    assert_eq!(record.response.is_some(), record.state == RecordState::Completed, "a response iff completed");
    if let Some(response) = &record.response {
        let _ = response.body_bytes();
    }
}

/// Replaces the hash at `key` with fields `h` and `r` (each only when present).
fn plant(writer: &mut redis::Connection, key: &str, h: Option<Vec<u8>>, r: Option<Vec<u8>>) {
    let mut pipe = redis::pipe();
    pipe.atomic().del(key).ignore();
    for (name, value) in [("h", h), ("r", r)] {
        if let Some(value) = value {
            pipe.hset(key, name, value).ignore();
        }
    }
    // A safety net: the body deletes the key itself once read.
    pipe.pexpire(key, 60_000).ignore();
    let _: () = pipe.query(writer).expect("HSET");
}

/// Header format byte and state bytes of field `h` (idem-redis crate docs, "Record layout").
const HEADER_FORMAT: u8 = 2;
/// Format byte of the scope and key after the header.
const SCOPE_FORMAT: u8 = 1;

/// Fields `h` and `r` as the store writes them for `record`: the 74-byte header (format,
/// state, token, created_at, started_at, lease_expires_at, expires_at as big-endian u64,
/// fingerprint), then `0x01` and postcard of (principal, endpoint, key); the response.
fn fields(r: &Record) -> (Vec<u8>, Option<Vec<u8>>) {
    let state = match r.state {
        RecordState::InFlight => 1,
        RecordState::Completed => 2,
        RecordState::Failed => 3,
    };
    let mut h = vec![HEADER_FORMAT, state];
    h.extend_from_slice(&r.token.0.to_be_bytes());
    for t in [r.created_at, r.started_at, r.lease_expires_at, r.expires_at] {
        h.extend_from_slice(&u64::try_from(t.0).unwrap_or(0).to_be_bytes());
    }
    h.extend_from_slice(r.fingerprint.as_bytes());
    let scope = (r.scope.principal.as_str(), r.scope.endpoint.as_str(), r.key.as_str());
    let h = postcard::to_extend(&scope, [h, vec![SCOPE_FORMAT]].concat()).expect("postcard");
    (h, r.response.as_ref().map(encode_response))
}

/// A seed input for `record`: its id and hash fields as the store writes them.
#[must_use]
pub fn seed(record: &Record) -> Vec<u8> {
    let (h, r) = fields(record);
    let mut out = record.id.as_bytes().to_vec();
    for field in [Some(h), r] {
        out.push(u8::from(field.is_some()));
        push_field(&mut out, &field.unwrap_or_default());
    }
    out
}
