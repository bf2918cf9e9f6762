//! The table: its key schema, creating it ([`migrate`]) and checking it ([`check`]).
//!
//! One table, on-demand capacity, no index: hash key `pk` (string), range key `sk`
//! (string), TTL on the attribute `i_ttl`.

use std::time::Duration;

use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::error::BuildError;
use aws_sdk_dynamodb::types::{
    AttributeDefinition, BillingMode, KeySchemaElement, KeyType, ScalarAttributeType, TableStatus,
    TimeToLiveSpecification,
};

use crate::error::Error;
use crate::item::{PK, SK, TTL};

/// A builder refused input the store made: a bug here, reported rather than a panic.
pub(crate) fn built(operation: &'static str) -> impl Fn(BuildError) -> Error {
    move |e| Error::Sdk { operation, code: None, message: e.to_string(), retryable: false }
}

/// Creates `table` when missing (on-demand capacity, `pk`/`sk` string keys), waits until
/// it is `ACTIVE`, turns on TTL on `i_ttl`, and checks an existing table's key schema.
/// Idempotent; safe from several processes at once. Returns whether it created the table.
pub(crate) async fn migrate(client: &Client, table: &str) -> Result<bool, Error> {
    const OP: &str = "creating the table";
    let key = |name: &str, kind: KeyType| {
        KeySchemaElement::builder().attribute_name(name).key_type(kind).build().map_err(built(OP))
    };
    let def = |name: &str| {
        AttributeDefinition::builder()
            .attribute_name(name)
            .attribute_type(ScalarAttributeType::S)
            .build()
            .map_err(built(OP))
    };
    let created = client
        .create_table()
        .table_name(table)
        .billing_mode(BillingMode::PayPerRequest)
        .key_schema(key(PK, KeyType::Hash)?)
        .key_schema(key(SK, KeyType::Range)?)
        .attribute_definitions(def(PK)?)
        .attribute_definitions(def(SK)?)
        .send()
        .await;
    let created = match created {
        Ok(_) => true,
        Err(e) => {
            let e = Error::sdk(OP, &e);
            if e.code() != Some("ResourceInUseException") {
                return Err(e);
            }
            false
        }
    };
    wait_active(client, table).await?;
    const TTL_OP: &str = "turning on the table's TTL";
    let spec = TimeToLiveSpecification::builder().enabled(true).attribute_name(TTL).build().map_err(built(TTL_OP))?;
    if let Err(e) = client.update_time_to_live().table_name(table).time_to_live_specification(spec).send().await {
        // Already on (DynamoDB answers a ValidationException saying so).
        let e = Error::sdk(TTL_OP, &e);
        let on = client
            .describe_time_to_live()
            .table_name(table)
            .send()
            .await
            .ok()
            .and_then(|d| d.time_to_live_description().and_then(|t| t.attribute_name().map(|a| a == TTL)))
            .unwrap_or(false);
        if !on {
            return Err(e);
        }
    }
    Ok(created)
}

/// Checks that `table` exists, is active (waiting while it is being created) and has the
/// store's key schema.
pub(crate) async fn check(client: &Client, table: &str) -> Result<(), Error> {
    wait_active(client, table).await
}

async fn wait_active(client: &Client, table: &str) -> Result<(), Error> {
    const OP: &str = "describing the table";
    for _ in 0..300 {
        let d = client.describe_table().table_name(table).send().await.map_err(|e| Error::sdk(OP, &e))?;
        let Some(t) = d.table() else {
            return Err(Error::Table { table: table.to_owned(), reason: "DescribeTable returned no table".into() });
        };
        let keys: Vec<(&str, &KeyType)> = t.key_schema().iter().map(|k| (k.attribute_name(), k.key_type())).collect();
        if keys.len() != 2 || !keys.contains(&(PK, &KeyType::Hash)) || !keys.contains(&(SK, &KeyType::Range)) {
            return Err(Error::Table {
                table: table.to_owned(),
                reason: format!("key schema {keys:?}, expected hash key {PK:?} and range key {SK:?} (both strings)"),
            });
        }
        match t.table_status() {
            Some(TableStatus::Active) | None => return Ok(()),
            Some(TableStatus::Creating | TableStatus::Updating) => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Some(other) => {
                return Err(Error::Table { table: table.to_owned(), reason: format!("table status {other:?}") });
            }
        }
    }
    Err(Error::Table { table: table.to_owned(), reason: "still not ACTIVE after 60 s".into() })
}
