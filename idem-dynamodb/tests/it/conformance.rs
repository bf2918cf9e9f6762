//! The conformance suite (every scenario, the model-based test) against the DynamoDB
//! endpoint at `IDEM_DYNAMODB_URL` (default the `moto_server` of `scripts/services`), one
//! fresh table per scenario. Fails, never skips, when the endpoint is not reachable.

use crate::common;

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use idem_core::{ManualClock, Store};

/// Each scenario gets a table of its own; a peer opens a second client on the same table.
#[derive(Default)]
struct Dynamo {
    table: Mutex<Option<String>>,
}

#[async_trait]
impl idem_conformance::Backend for Dynamo {
    async fn open(&self, clock: ManualClock) -> Arc<dyn Store> {
        let table = common::fresh_table();
        *self.table.lock().expect("table lock") = Some(table.clone());
        Arc::new(common::open(&table, Arc::new(clock)).await)
    }

    async fn open_peer(&self, _store: &Arc<dyn Store>, clock: ManualClock) -> Arc<dyn Store> {
        let table = self.table.lock().expect("table lock").clone().expect("open ran first");
        Arc::new(common::open(&table, Arc::new(clock)).await)
    }
}

idem_conformance::store_tests!(Dynamo::default());
