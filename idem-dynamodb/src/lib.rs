#![doc = include_str!("../README.md")]
//!
//! # What it guarantees
//! [`DynamoStore`] implements [`idem_core::Store`] on one DynamoDB table: one item per
//! record, every write one conditional write on the fencing token (a journal write one
//! transaction with a condition check on the record), every read strongly consistent.
//! DynamoDB has no clock a condition can read, so every `now` comes from the store's
//! [`idem_core::Clock`] ([`Config::with_clock`], the system clock by default): the
//! processes sharing a table must keep their clocks in sync. The item layout, the
//! condition behind each operation, expiry (the store's own comparison, DynamoDB's TTL as
//! the clean-up, and [`idem_core::Store::sweep`]), the 400 KB item limit (large responses go to part items beside the record), SDK retries, the
//! clock-sync bound and running it locally: `docs/dynamodb.md`.
//!
//! # Features
//! None of its own. What the dependency costs: the official `aws-sdk-dynamodb` and
//! `aws-config` (credential providers for environment, profiles, web identity, ECS and EC2
//! metadata; no SSO, no `credential_process`) and the smithy runtime under them, about 150
//! crates in all, the largest build of any idem store. Their default HTTPS client (rustls
//! on aws-lc-rs, a C and assembly build) is off: [`DynamoStore::connect`] builds a hyper
//! client on rustls with ring, which the workspace already builds. An application that
//! passes its own client ([`DynamoStore::from_client`], [`DynamoStore::from_sdk_config`])
//! picks its own.
//!
//! # Layout
//! - `src/store.rs`: [`DynamoStore`], its constructors, and the [`idem_core::Store`]
//!   impl: each operation's condition expression and how a refusal is answered.
//! - `src/item.rs`: the item layout (attribute names, record and journal items, the
//!   response's stored form under the item limit) and decoding.
//! - `src/table.rs`: the table's key schema, creating it and checking it.
//! - `src/config.rs`: [`Config`].
//! - `src/error.rs`: [`Error`] and which failures are retryable.
//! - `tests/it/conformance.rs`: the shared conformance suite (every scenario, the model
//!   test) against a DynamoDB endpoint (`moto_server` from `scripts/services` by default);
//!   `tests/it/http.rs`: the HTTP scenarios; `tests/it/resend.rs`: a write whose answer was
//!   lost and which the SDK sent again reads as the caller's own; `tests/it/store.rs`: the
//!   application's own `SdkConfig` with an endpoint override, missing tables and other key
//!   schemas.

mod config;
mod error;
mod item;
mod store;
mod table;

pub use config::{Config, DEFAULT_TABLE};
pub use error::Error;
pub use item::MAX_JOURNAL_VALUE;
pub use store::DynamoStore;

/// The SDK's configuration loader, for an [`aws_config::SdkConfig`] of the same version.
pub use aws_config;
/// The SDK this store is built on, for building a [`aws_sdk_dynamodb::Client`] of the same
/// version.
pub use aws_sdk_dynamodb;
