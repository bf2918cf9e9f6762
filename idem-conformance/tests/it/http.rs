//! The HTTP scenarios (`http_tests!`) against the in-memory reference store, with raw
//! access: a wrapper keeps planted bytes for a record's stored response (decoded on every
//! read, as a store that keeps bytes would) or spoils a record, so the scenarios that
//! write behind the store's back run on memory too.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use idem_conformance::{Forward, Forwarding};
use idem_core::codec::{CodecError, decode_response, encode_response};
use idem_core::{
    ClaimOutcome, ClaimRequest, FencingToken, ManualClock, MemoryStore, Receipt, ReclaimOutcome, ReclaimRequest,
    Record, RecordId, Store, StoreError, StoredResponse,
};

/// What was written behind the store's back for one record.
#[derive(Debug)]
enum Planted {
    /// The stored response's bytes.
    Response(Vec<u8>),
    /// Another part of the record does not decode.
    Spoiled,
}

/// A memory store whose records can carry planted bytes.
#[derive(Debug)]
struct WithBytes {
    inner: MemoryStore,
    planted: Mutex<HashMap<RecordId, Planted>>,
}

impl WithBytes {
    /// The record as a store that keeps bytes would read it.
    fn read(&self, record: Record) -> Result<Record, StoreError> {
        let corrupt = |source: CodecError| StoreError::Corrupt { id: Some(record.id), source };
        match self.planted.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get(&record.id) {
            None => Ok(record),
            Some(Planted::Spoiled) => Err(corrupt(CodecError::Empty)),
            Some(Planted::Response(bytes)) => {
                let response = decode_response(bytes).map_err(corrupt)?;
                Ok(Record { response: Some(response), ..record })
            }
        }
    }

    /// A write replaced the record: what was planted is gone.
    fn replaced(&self, id: RecordId) {
        self.planted.lock().unwrap().remove(&id);
    }
}

#[async_trait]
impl Forward for WithBytes {
    fn inner(&self) -> &dyn Store {
        &self.inner
    }
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        match self.inner.claim(req).await? {
            ClaimOutcome::Claimed(record) => {
                self.replaced(record.id);
                Ok(ClaimOutcome::Claimed(record))
            }
            ClaimOutcome::Existing { record, now } => Ok(ClaimOutcome::Existing { record: self.read(record)?, now }),
        }
    }
    async fn reclaim(&self, req: ReclaimRequest) -> Result<ReclaimOutcome, StoreError> {
        match self.inner.reclaim(req).await? {
            ReclaimOutcome::Reclaimed(record) => {
                self.replaced(record.id);
                Ok(ReclaimOutcome::Reclaimed(record))
            }
            ReclaimOutcome::Conflict { current, now } => {
                Ok(ReclaimOutcome::Conflict { current: current.map(|r| self.read(r)).transpose()?, now })
            }
        }
    }
    async fn complete(
        &self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Receipt, StoreError> {
        let receipt = self.inner.complete(id, token, response).await?;
        self.replaced(id);
        Ok(receipt)
    }
    async fn get(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        self.inner.get(id).await?.map(|r| self.read(r)).transpose()
    }
}

/// The memory backend with raw access (see the module docs).
#[derive(Default)]
struct MemoryWithBytes {
    last: Mutex<Option<Arc<Forwarding<WithBytes>>>>,
}

impl MemoryWithBytes {
    fn last(&self) -> Arc<Forwarding<WithBytes>> {
        self.last.lock().unwrap().clone().expect("open ran first")
    }
}

#[async_trait]
impl idem_conformance::Backend for MemoryWithBytes {
    async fn open(&self, clock: ManualClock) -> Arc<dyn Store> {
        let store = Arc::new(Forwarding(WithBytes {
            inner: MemoryStore::with_clock(Arc::new(clock)),
            planted: Mutex::default(),
        }));
        *self.last.lock().unwrap() = Some(Arc::clone(&store));
        store
    }

    async fn read_stored(&self, _store: &Arc<dyn Store>, id: RecordId) -> Option<Vec<u8>> {
        let store = self.last();
        if let Some(Planted::Response(bytes)) = store.planted.lock().unwrap().get(&id) {
            return Some(bytes.clone());
        }
        let record = store.inner.get(id).await.expect("get").expect("the record is there");
        Some(encode_response(record.response.as_ref().expect("a stored response")))
    }

    async fn overwrite_stored(&self, _store: &Arc<dyn Store>, id: RecordId, bytes: Vec<u8>) -> bool {
        self.last().planted.lock().unwrap().insert(id, Planted::Response(bytes));
        true
    }

    async fn corrupt_stored(&self, _store: &Arc<dyn Store>, id: RecordId) -> bool {
        self.last().planted.lock().unwrap().insert(id, Planted::Spoiled);
        true
    }
}

idem_conformance::http_tests!(MemoryWithBytes::default());

/// Every HTTP scenario written is a scenario run: a `pub async fn` taking an `HttpEnv` in
/// `src/http/` that `http_tests!` does not call would silently never run on any backend.
#[test]
fn every_http_scenario_is_listed_in_the_macro() {
    use std::collections::BTreeSet;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src").join("http");
    let mut written = BTreeSet::new();
    for group in ["lease", "isolation", "shapes", "sealed"] {
        let text = std::fs::read_to_string(dir.join(format!("{group}.rs"))).expect("group file");
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("pub async fn ")
                && let Some((name, args)) = rest.split_once('(')
                && args.contains(": HttpEnv")
            {
                written.insert(format!("{group}::{name}"));
            }
        }
    }
    let text = std::fs::read_to_string(dir.join("mod.rs")).expect("mod.rs");
    let listed: BTreeSet<_> = text
        .lines()
        .filter_map(|l| l.trim().strip_prefix("=> ")?.split_once('(').map(|(path, _)| path.to_owned()))
        .collect();
    let unlisted: Vec<_> = written.difference(&listed).collect();
    assert!(unlisted.is_empty(), "HTTP scenarios written but never run: {unlisted:?}");
    let unknown: Vec<_> = listed.difference(&written).collect();
    assert!(unknown.is_empty(), "listed but not found: {unknown:?}");
    assert_eq!(written.len(), 31, "{written:?}");
}
