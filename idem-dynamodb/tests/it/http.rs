//! The HTTP scenarios (`idem_conformance::http_tests!`: lease renewal, tenant isolation,
//! response shapes, sealed responses) on [`DynamoStore`] against the endpoint at
//! `IDEM_DYNAMODB_URL`, one fresh table per scenario, with raw access through the store's
//! client: the raw bytes are the record item's `i_resp` attribute; a spoiled record has an
//! unknown state in `i_st`.

use crate::common;

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use idem_core::{ManualClock, RecordId, Store};
use idem_dynamodb::DynamoStore;
use idem_dynamodb::aws_sdk_dynamodb::primitives::Blob;
use idem_dynamodb::aws_sdk_dynamodb::types::AttributeValue;

/// Opens each scenario's store on a fresh table.
#[derive(Default)]
struct Dynamo {
    last: Mutex<Option<DynamoStore>>,
}

impl Dynamo {
    fn store(&self) -> DynamoStore {
        self.last.lock().expect("lock").as_ref().expect("open ran first").clone()
    }
}

fn key(id: RecordId) -> std::collections::HashMap<String, AttributeValue> {
    [("pk".to_owned(), AttributeValue::S(id.to_hex())), ("sk".to_owned(), AttributeValue::S("r".to_owned()))].into()
}

async fn set(store: &DynamoStore, id: RecordId, update: &str, value: AttributeValue) {
    store
        .client()
        .update_item()
        .table_name(store.table())
        .set_key(Some(key(id)))
        .update_expression(update)
        .expression_attribute_values(":v", value)
        .send()
        .await
        .expect("UpdateItem");
}

#[async_trait]
impl idem_conformance::Backend for Dynamo {
    async fn open(&self, clock: ManualClock) -> Arc<dyn Store> {
        let store = common::open(&common::fresh_table(), Arc::new(clock)).await;
        *self.last.lock().expect("lock") = Some(store.clone());
        Arc::new(store)
    }

    async fn read_stored(&self, _store: &Arc<dyn Store>, id: RecordId) -> Option<Vec<u8>> {
        let store = self.store();
        let out = store
            .client()
            .get_item()
            .table_name(store.table())
            .set_key(Some(key(id)))
            .consistent_read(true)
            .send()
            .await
            .expect("GetItem");
        match out.item?.remove("i_resp")? {
            AttributeValue::B(b) => Some(b.into_inner()),
            other => panic!("i_resp is not binary: {other:?}"),
        }
    }

    async fn overwrite_stored(&self, _store: &Arc<dyn Store>, id: RecordId, bytes: Vec<u8>) -> bool {
        set(&self.store(), id, "SET i_resp = :v REMOVE i_rz", AttributeValue::B(Blob::new(bytes))).await;
        true
    }

    async fn corrupt_stored(&self, _store: &Arc<dyn Store>, id: RecordId) -> bool {
        set(&self.store(), id, "SET i_st = :v", AttributeValue::S("bogus".to_owned())).await;
        true
    }
}

idem_conformance::http_tests!(Dynamo::default());
