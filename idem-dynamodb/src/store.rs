//! [`DynamoStore`]: the [`Store`] contract as conditional writes on DynamoDB items.
//!
//! Every write is one conditional `PutItem`/`UpdateItem` (or, for a journal entry, one
//! `TransactWriteItems` with a condition check on the record), so DynamoDB's per-item
//! atomicity gives the contract's; the condition is the rule of the pure transition
//! (`idem_core::transition`) it stands for. A refused write returns the item as it was
//! (`ReturnValuesOnConditionCheckFailure = ALL_OLD`), which is the refusal's answer
//! (`Existing`, `Conflict`, `LeaseLost`) without a second read. Where a rule takes a
//! maximum or minimum that an update expression cannot (`fail`, `extend`, `reclaim`), the
//! write names its branch in the condition (`i_le > :now` or not) and a refusal that only
//! picked the wrong branch runs again on the branch the returned item says.
//!
//! Every write carries a fresh nonce (`i_w`): when the SDK resends a write whose first
//! send landed, the resend is refused and the returned item carries this call's own
//! nonce, which the store reads as its own success, never as someone else's claim.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::operation::delete_item::DeleteItemError;
use aws_sdk_dynamodb::operation::put_item::PutItemError;
use aws_sdk_dynamodb::operation::transact_write_items::TransactWriteItemsError;
use aws_sdk_dynamodb::operation::update_item::UpdateItemError;
use aws_sdk_dynamodb::types::{
    AttributeValue, ConditionCheck, Put, ReturnValue, ReturnValuesOnConditionCheckFailure, TransactWriteItem,
};
use idem_core::store::MAX_JOURNAL_NAME;
use idem_core::time::duration_ms;
use idem_core::transition::{self, is_reclaimable};
use idem_core::{
    Capabilities, ClaimOutcome, ClaimRequest, Clock, FencingToken, JournalWrite, ListFilter, Listing, Receipt,
    ReclaimOutcome, ReclaimRequest, Record, RecordId, RecordState, Store, StoreError, StoredResponse, SweepOutcome,
    UnixMillis,
};

use crate::config::Config;
use crate::error::Error;
use crate::item::{
    self, EXPIRES, GEN, Head, Item, LEASE, MAX_JOURNAL_VALUE, PART_BYTES, PARTS, RESPONSE, RESPONSE_LZ4,
    RESPONSE_PARTS, RESPONSE_PARTS_ID, RESPONSE_PARTS_KIND, SK_RECORD, STATE, StoredForm, TOKEN, TTL, VALUE, WRITE, b,
    decode_record, get_bytes, get_i64, get_token, journal_key, n, record_item, record_key, s, ttl_secs, write_nonce,
};
use crate::table::built;

/// How often a write runs again after a refusal that only picked the wrong branch, or a
/// transaction that collided with another one.
const ATTEMPTS: usize = 16;

/// Items a sweep's scan reads per page.
const SCAN_PAGE: i32 = 1_000;

const IN_FLIGHT: &str = "in_flight";

/// An idempotency [`Store`] in one DynamoDB table (see the crate docs and
/// `docs/dynamodb.md`). Cheap to clone (shares the client).
#[derive(Clone, Debug)]
pub struct DynamoStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    client: Client,
    table: String,
    clock: Arc<dyn Clock>,
    grace_secs: i64,
}

/// What a conditional write did.
enum Written {
    /// Applied; the item the write asked for (new or old).
    Yes(Item),
    /// Refused by its condition; the item as it was (`None`: no item, or not returned).
    Refused(Option<Item>),
}

/// Expression attribute values.
#[derive(Default)]
struct Vals(HashMap<String, AttributeValue>);

impl Vals {
    fn with(mut self, name: &str, v: AttributeValue) -> Self {
        self.0.insert(name.to_owned(), v);
        self
    }
}

fn nonce() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

impl DynamoStore {
    /// Builds a client from the environment (credentials, region, retries as the AWS SDK
    /// loads them: environment variables, profile files, web identity, ECS and EC2
    /// metadata), over a hyper HTTPS client on rustls with ring, with
    /// [`Config::with_endpoint_url`] and [`Config::with_region`] when set, then builds the store as
    /// [`DynamoStore::from_client`] does.
    ///
    /// # Errors
    /// Those of [`DynamoStore::from_client`].
    pub async fn connect(config: Config) -> Result<Self, Error> {
        use aws_smithy_http_client::tls::{Provider, rustls_provider::CryptoMode};
        let http =
            aws_smithy_http_client::Builder::new().tls_provider(Provider::Rustls(CryptoMode::Ring)).build_https();
        let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest()).http_client(http);
        if let Some(url) = &config.endpoint_url {
            loader = loader.endpoint_url(url);
        }
        if let Some(region) = &config.region {
            loader = loader.region(aws_config::Region::new(region.clone()));
        }
        let sdk = loader.load().await;
        Self::from_client(Client::new(&sdk), config).await
    }

    /// Builds the store on the team's own SDK configuration (its credentials, region,
    /// retry and timeout settings, endpoint and HTTP client). An `SdkConfig` loaded without
    /// an HTTP client (`aws-config` without its `default-https-client` feature) needs one
    /// set (`SdkConfig::to_builder().http_client(...)`).
    ///
    /// # Errors
    /// Those of [`DynamoStore::from_client`].
    pub async fn from_sdk_config(sdk: &aws_config::SdkConfig, config: Config) -> Result<Self, Error> {
        Self::from_client(Client::new(sdk), config).await
    }

    /// Builds the store on the team's own client. Creates the table when missing
    /// ([`DynamoStore::migrate`]), or with [`Config::with_auto_migrate`] off only checks it.
    ///
    /// # Errors
    /// [`Error::Table`] when the table is missing (without auto-migrate) or has another
    /// key schema; [`Error::Sdk`] when DynamoDB cannot be reached or refuses
    /// (retryable or not, [`Error::is_retryable`]).
    pub async fn from_client(client: Client, config: Config) -> Result<Self, Error> {
        if config.auto_migrate {
            crate::table::migrate(&client, &config.table).await?;
        } else {
            crate::table::check(&client, &config.table).await?;
        }
        tracing::info!(
            backend = "dynamodb",
            table = %config.table,
            auto_migrate = config.auto_migrate,
            ttl_grace_secs = config.grace_secs(),
            server_clock = false,
            "idem-dynamodb: store settings"
        );
        let grace_secs = config.grace_secs();
        let inner = Inner { client, table: config.table, clock: config.clock, grace_secs };
        Ok(Self { inner: Arc::new(inner) })
    }

    /// Creates `table` when missing (on-demand capacity; hash key `pk`, range key `sk`,
    /// both strings), waits until it is active, turns on TTL on the attribute `i_ttl`, and
    /// checks an existing table's key schema. Idempotent, safe from several processes at
    /// once, and runnable by a deploy step before any store exists. Returns whether it
    /// created the table.
    ///
    /// # Errors
    /// [`Error::Table`] for a table with another key schema, [`Error::Sdk`] otherwise.
    pub async fn migrate(client: &Client, table: &str) -> Result<bool, Error> {
        crate::table::migrate(client, table).await
    }

    /// The client (shared with every clone of this store).
    #[must_use]
    pub fn client(&self) -> &Client {
        &self.inner.client
    }

    /// The table name.
    #[must_use]
    pub fn table(&self) -> &str {
        &self.inner.table
    }

    fn now(&self) -> UnixMillis {
        self.inner.clock.now()
    }

    /// Record `id`'s item, read with strong consistency.
    async fn read_item(&self, id: RecordId) -> Result<Option<Item>, StoreError> {
        self.read_key(record_key(id), "reading a record").await
    }

    async fn read_key(&self, key: Item, operation: &'static str) -> Result<Option<Item>, StoreError> {
        let out = self
            .inner
            .client
            .get_item()
            .table_name(&self.inner.table)
            .set_key(Some(key))
            .consistent_read(true)
            .send()
            .await
            .map_err(|e| Error::sdk(operation, &e))?;
        Ok(out.item)
    }

    /// The live record `id` at `now`.
    async fn read(&self, id: RecordId, now: UnixMillis) -> Result<Option<Record>, StoreError> {
        match self.read_item(id).await? {
            Some(item) if Head::of(&item, id)?.is_live(now) => Ok(Some(self.full_record(&item, id).await?)),
            Some(_) => Ok(None),
            None => Ok(None),
        }
    }

    /// Decodes a record item, reading its response's part items when it has them.
    async fn full_record(&self, item: &Item, id: RecordId) -> Result<Record, StoreError> {
        let Some(AttributeValue::N(count)) = item.get(RESPONSE_PARTS) else { return decode_record(item, id) };
        let sid = Some(id);
        let count: usize =
            count.parse().map_err(|_| item::corrupt(sid, RESPONSE_PARTS, format!("not a count: {count:?}")))?;
        let w = item::get_str(item, sid, RESPONSE_PARTS_ID)?.to_owned();
        let lz4 = match item::get_str(item, sid, RESPONSE_PARTS_KIND)? {
            "lz4" => true,
            "raw" => false,
            other => return Err(item::corrupt(sid, RESPONSE_PARTS_KIND, format!("unknown kind {other:?}"))),
        };
        let token = get_token(item, sid, TOKEN)?;
        let mut bytes = Vec::new();
        for i in 0..count {
            let part = self
                .read_key(item::response_part_key(id, token, &w, i), "reading a response part")
                .await?
                .ok_or_else(|| item::corrupt(sid, RESPONSE_PARTS, format!("part {i} of {count} is missing")))?;
            bytes.extend_from_slice(get_bytes(&part, sid, VALUE)?.unwrap_or_default());
        }
        let mut whole = item.clone();
        whole.remove(RESPONSE_PARTS);
        whole.insert((if lz4 { RESPONSE_LZ4 } else { RESPONSE }).to_owned(), b(bytes));
        decode_record(&whole, id)
    }

    /// A conditional `UpdateItem` of record `id`.
    async fn update(
        &self,
        operation: &'static str,
        id: RecordId,
        update: &str,
        condition: &str,
        vals: Vals,
        returns: ReturnValue,
    ) -> Result<Written, StoreError> {
        let sent = self
            .inner
            .client
            .update_item()
            .table_name(&self.inner.table)
            .set_key(Some(record_key(id)))
            .update_expression(update)
            .condition_expression(condition)
            .set_expression_attribute_values(Some(vals.0))
            .return_values(returns)
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .send()
            .await;
        match sent {
            Ok(out) => Ok(Written::Yes(out.attributes.unwrap_or_default())),
            Err(e) => match e.as_service_error() {
                Some(UpdateItemError::ConditionalCheckFailedException(c)) => Ok(Written::Refused(c.item.clone())),
                _ => Err(Error::sdk(operation, &e).into()),
            },
        }
    }

    /// The item a refusal returned, or (when DynamoDB returned none) the item read now.
    async fn refused_item(&self, id: RecordId, returned: Option<Item>) -> Result<Option<Item>, StoreError> {
        match returned {
            Some(item) if !item.is_empty() => Ok(Some(item)),
            _ => self.read_item(id).await,
        }
    }

    /// `complete` with the response inline in the record item, under `attr`.
    async fn complete_inline(
        &self,
        id: RecordId,
        token: FencingToken,
        attr: &'static str,
        bytes: Vec<u8>,
    ) -> Result<Result<Receipt, StoreError>, StoreError> {
        let other = if attr == RESPONSE { RESPONSE_LZ4 } else { RESPONSE };
        let remove = format!("{other}, {RESPONSE_PARTS}, {RESPONSE_PARTS_ID}, {RESPONSE_PARTS_KIND}");
        self.complete_with(id, token, &format!("{attr} = :r"), &remove, Vals::default().with(":r", b(bytes))).await
    }

    /// `complete` with a response already in its stored form.
    async fn complete_with(
        &self,
        id: RecordId,
        token: FencingToken,
        set: &str,
        remove: &str,
        extra: Vals,
    ) -> Result<Result<Receipt, StoreError>, StoreError> {
        const OP: &str = "completing a record";
        let now = self.now();
        let w = nonce();
        let update = format!("SET {STATE} = :c, {set}, {WRITE} = :w REMOVE {remove}");
        let condition = format!("{TOKEN} = :t AND {STATE} = :if AND {EXPIRES} > :now");
        let vals = extra
            .with(":c", s(RecordState::Completed.as_str()))
            .with(":w", s(&w))
            .with(":t", n(token.0))
            .with(":if", s(IN_FLIGHT))
            .with(":now", n(now.0));
        let sent = self
            .inner
            .client
            .update_item()
            .table_name(&self.inner.table)
            .set_key(Some(record_key(id)))
            .update_expression(update)
            .condition_expression(condition)
            .set_expression_attribute_values(Some(vals.0))
            // The item before: the times a receipt reports (completion keeps them), without
            // sending the response back.
            .return_values(ReturnValue::AllOld)
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .send()
            .await;
        let written = match sent {
            Ok(out) => Written::Yes(out.attributes.unwrap_or_default()),
            Err(e) => match e.as_service_error() {
                Some(UpdateItemError::ConditionalCheckFailedException(c)) => Written::Refused(c.item.clone()),
                _ => {
                    let e = Error::sdk(OP, &e);
                    return Ok(Err(e.into()));
                }
            },
        };
        Ok(match written {
            Written::Yes(old) => {
                let h = Head::of(&old, id)?;
                Ok(Receipt { token, lease_expires_at: h.lease_expires_at, expires_at: h.expires_at })
            }
            Written::Refused(old) => match self.refused_item(id, old).await? {
                Some(old) if write_nonce(&old) == Some(w.as_str()) => {
                    let h = Head::of(&old, id)?;
                    Ok(Receipt { token, lease_expires_at: h.lease_expires_at, expires_at: h.expires_at })
                }
                Some(old) => {
                    let h = Head::of(&old, id)?;
                    Err(StoreError::LeaseLost { id, presented: token, current: h.is_live(now).then_some(h.token) })
                }
                None => Err(StoreError::LeaseLost { id, presented: token, current: None }),
            },
        })
    }

    /// Journal entry `name` of generation `generation` of record `id`: `Ok(None)` when
    /// there is none, `Err(())` inside when its parts were read across an overwrite (read
    /// again).
    async fn read_entry(
        &self,
        id: RecordId,
        name: &str,
        generation: FencingToken,
    ) -> Result<Result<Option<(Vec<u8>, String)>, ()>, StoreError> {
        const OP: &str = "reading a journal entry";
        let Some(main) = self.read_key(journal_key(id, name, 0), OP).await? else {
            return Ok(Ok(None));
        };
        let sid = Some(id);
        if get_token(&main, sid, GEN)? != generation {
            return Ok(Ok(None));
        }
        let w = write_nonce(&main).unwrap_or_default().to_owned();
        let parts = usize::try_from(get_i64(&main, sid, PARTS)?).unwrap_or(0).max(1);
        let mut value = get_bytes(&main, sid, VALUE)?.unwrap_or_default().to_vec();
        for i in 1..parts {
            let Some(part) = self.read_key(journal_key(id, name, i), OP).await? else {
                return Ok(Err(()));
            };
            if write_nonce(&part) != Some(w.as_str()) {
                return Ok(Err(()));
            }
            value.extend_from_slice(get_bytes(&part, sid, VALUE)?.unwrap_or_default());
        }
        Ok(Ok(Some((value, w))))
    }

    /// Deletes record `id`'s journal entries of generations up to `generation`, and the
    /// response parts written with tokens up to `token`.
    async fn delete_entries(
        &self,
        id: RecordId,
        generation: FencingToken,
        token: FencingToken,
    ) -> Result<(), StoreError> {
        self.delete_beside(id, "j#", GEN, generation).await?;
        self.delete_beside(id, "p#", TOKEN, token).await
    }

    /// Deletes the items of record `id`'s partition whose sort key starts with `prefix` and
    /// whose `attr` is at most `bound` (each delete conditional on it).
    async fn delete_beside(
        &self,
        id: RecordId,
        prefix: &str,
        attr: &str,
        bound: FencingToken,
    ) -> Result<(), StoreError> {
        const OP: &str = "deleting an expired record's journal entries";
        let mut start = None;
        loop {
            let out = self
                .inner
                .client
                .query()
                .table_name(&self.inner.table)
                .key_condition_expression("pk = :pk AND begins_with(sk, :j)")
                .expression_attribute_values(":pk", item::pk(id))
                .expression_attribute_values(":j", s(prefix))
                .projection_expression(format!("pk, sk, {attr}"))
                .consistent_read(true)
                .set_exclusive_start_key(start)
                .send()
                .await
                .map_err(|e| Error::sdk(OP, &e))?;
            for entry in out.items() {
                let key: Item = entry
                    .iter()
                    .filter(|(k, _)| k.as_str() == item::PK || k.as_str() == item::SK)
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect();
                let sent = self
                    .inner
                    .client
                    .delete_item()
                    .table_name(&self.inner.table)
                    .set_key(Some(key))
                    .condition_expression(format!("{attr} <= :g"))
                    .expression_attribute_values(":g", n(bound.0))
                    .send()
                    .await;
                if let Err(e) = sent
                    && !matches!(e.as_service_error(), Some(DeleteItemError::ConditionalCheckFailedException(_)))
                {
                    return Err(Error::sdk(OP, &e).into());
                }
            }
            match out.last_evaluated_key {
                Some(k) => start = Some(k),
                None => return Ok(()),
            }
        }
    }

    /// Every record item, page by page.
    async fn scan_records(
        &self,
        operation: &'static str,
        filter: &str,
        vals: Vals,
        projection: Option<String>,
        mut each: impl FnMut(&Item) -> Result<bool, StoreError>,
    ) -> Result<bool, StoreError> {
        let mut start = None;
        loop {
            let out = self
                .inner
                .client
                .scan()
                .table_name(&self.inner.table)
                .filter_expression(filter)
                .set_expression_attribute_values(Some(vals.0.clone()))
                .set_projection_expression(projection.clone())
                .consistent_read(true)
                .limit(SCAN_PAGE)
                .set_exclusive_start_key(start)
                .send()
                .await
                .map_err(|e| Error::sdk(operation, &e))?;
            for it in out.items() {
                if !each(it)? {
                    return Ok(true);
                }
            }
            match out.last_evaluated_key {
                Some(k) => start = Some(k),
                None => return Ok(false),
            }
        }
    }
}

/// The receipt of a written record item.
fn receipt(item: &Item, id: RecordId) -> Result<Receipt, StoreError> {
    let h = Head::of(item, id)?;
    Ok(Receipt { token: h.token, lease_expires_at: h.lease_expires_at, expires_at: h.expires_at })
}

#[async_trait]
impl Store for DynamoStore {
    /// One conditional `PutItem` of the new generation: applies when no item exists or
    /// the stored one is past `expires_at` with a smaller token; a refusal returns the
    /// stored item, which is the `Existing` answer. An expired record whose token is not
    /// below the new one (a zero-length generation in the same millisecond) is replaced by
    /// a second put conditional on its token.
    async fn claim(&self, req: ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        const OP: &str = "claiming a record";
        let now = self.now();
        let id = req.id();
        let mut current: Option<Record> = None;
        for _ in 0..ATTEMPTS {
            let (write, outcome) = transition::claim(current.as_ref(), &req, now);
            let Some(record) = write else { return Ok(outcome) };
            let w = nonce();
            let item = record_item(&record, record.token, &w, self.inner.grace_secs);
            let mut vals = Vals::default().with(":now", n(now.0));
            let condition = match &current {
                None => {
                    vals = vals.with(":tok", n(record.token.0));
                    format!("attribute_not_exists(pk) OR ({EXPIRES} <= :now AND {TOKEN} < :tok)")
                }
                Some(old) => {
                    vals = vals.with(":old", n(old.token.0));
                    format!("{TOKEN} = :old AND {EXPIRES} <= :now")
                }
            };
            let sent = self
                .inner
                .client
                .put_item()
                .table_name(&self.inner.table)
                .set_item(Some(item))
                .condition_expression(condition)
                .set_expression_attribute_values(Some(vals.0))
                .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
                .send()
                .await;
            let returned = match sent {
                Ok(_) => return Ok(outcome),
                Err(e) => match e.as_service_error() {
                    Some(PutItemError::ConditionalCheckFailedException(c)) => c.item.clone(),
                    _ => return Err(Error::sdk(OP, &e).into()),
                },
            };
            match self.refused_item(id, returned).await? {
                // This call's own put, sent again by the SDK after the first send landed.
                Some(old) if write_nonce(&old) == Some(w.as_str()) => return Ok(outcome),
                Some(old) => {
                    if Head::of(&old, id)?.is_live(now) {
                        return Ok(ClaimOutcome::Existing { record: self.full_record(&old, id).await?, now });
                    }
                    // Expired: only its token matters to the next generation, so a parted
                    // response (which a sweep may be deleting) is not read.
                    current = Some(item::decode_expired(&old, id)?);
                }
                None => current = None,
            }
        }
        Err(Error::Contention { operation: OP }.into())
    }

    /// One conditional `UpdateItem`: the token, fingerprint, liveness and state of
    /// [`is_reclaimable`], plus the branch of `expires_at = max(expires_at, now +
    /// retention)` (`i_ex < :e` sets it, `i_ex >= :e` keeps it).
    async fn reclaim(&self, req: ReclaimRequest) -> Result<ReclaimOutcome, StoreError> {
        const OP: &str = "reclaiming a record";
        let now = self.now();
        let id = req.id;
        let lease_end = now.0.saturating_add(req.lease_ms());
        let retain_end = UnixMillis(now.0.saturating_add(req.retention_ms()));
        let mut raise = true;
        for _ in 0..ATTEMPTS {
            let w = nonce();
            let mut vals = Vals::default()
                .with(":if", s(IN_FLIGHT))
                .with(":failed", s(RecordState::Failed.as_str()))
                .with(":next", n(req.expected.next().0))
                .with(":now", n(now.0))
                .with(":le", n(lease_end))
                .with(":w", s(&w))
                .with(":exp", n(req.expected.0))
                .with(":fp", b(req.fingerprint.as_bytes().to_vec()))
                .with(":e", n(retain_end.0));
            let mut update = format!(
                "SET {STATE} = :if, {TOKEN} = :next, {st} = :now, {LEASE} = :le, {WRITE} = :w",
                st = item::STARTED
            );
            if raise {
                update.push_str(&format!(", {EXPIRES} = :e, {TTL} = :ttl"));
                vals = vals.with(":ttl", n(ttl_secs(retain_end, self.inner.grace_secs)));
            }
            update.push_str(&format!(" REMOVE {RESPONSE}, {RESPONSE_LZ4}"));
            let condition = format!(
                "{TOKEN} = :exp AND {fp} = :fp AND {EXPIRES} > :now AND ({STATE} = :failed OR ({STATE} = :if AND \
                 {LEASE} <= :now)) AND {EXPIRES} {op} :e",
                fp = item::FINGERPRINT,
                op = if raise { "<" } else { ">=" }
            );
            match self.update(OP, id, &update, &condition, vals, ReturnValue::AllNew).await? {
                Written::Yes(new) => return Ok(ReclaimOutcome::Reclaimed(decode_record(&new, id)?)),
                Written::Refused(old) => match self.refused_item(id, old).await? {
                    Some(old) if write_nonce(&old) == Some(w.as_str()) => {
                        return Ok(ReclaimOutcome::Reclaimed(decode_record(&old, id)?));
                    }
                    Some(old) if !Head::of(&old, id)?.is_live(now) => {
                        return Ok(ReclaimOutcome::Conflict { current: None, now });
                    }
                    Some(old) => {
                        let r = self.full_record(&old, id).await?;
                        if !is_reclaimable(&r, &req, now) {
                            let current = Some(r).filter(|r| !r.is_expired(now));
                            return Ok(ReclaimOutcome::Conflict { current, now });
                        }
                        raise = r.expires_at < retain_end;
                    }
                    None => return Ok(ReclaimOutcome::Conflict { current: None, now }),
                },
            }
        }
        Err(Error::Contention { operation: OP }.into())
    }

    /// One conditional `UpdateItem` on the token (in flight, live). A response whose
    /// encoding is over the item budget is stored LZ4-compressed, or, if that is still too
    /// large, completed as not retained (see the crate docs).
    async fn complete(
        &self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Receipt, StoreError> {
        let first = match item::stored_form(&response) {
            StoredForm::Inline(attr, bytes) => self.complete_inline(id, token, attr, bytes).await?,
            StoredForm::Parts { lz4, bytes } => {
                // The parts first, under a fresh nonce and this token, then the record's
                // conditional update naming them: a refused completion leaves parts nobody
                // names, which the record's sweep deletes.
                let w = nonce();
                let count = bytes.len().div_ceil(PART_BYTES).max(1);
                for (i, part) in bytes.chunks(PART_BYTES).enumerate() {
                    let mut it = item::response_part_key(id, token, &w, i);
                    it.insert(TOKEN.to_owned(), n(token.0));
                    it.insert(VALUE.to_owned(), b(part.to_vec()));
                    self.inner
                        .client
                        .put_item()
                        .table_name(&self.inner.table)
                        .set_item(Some(it))
                        .send()
                        .await
                        .map_err(|e| Error::sdk("writing a response part", &e))?;
                }
                let extra = Vals::default()
                    .with(":rp", n(count))
                    .with(":rw", s(&w))
                    .with(":rk", s(if lz4 { "lz4" } else { "raw" }));
                let set = format!("{RESPONSE_PARTS} = :rp, {RESPONSE_PARTS_ID} = :rw, {RESPONSE_PARTS_KIND} = :rk");
                self.complete_with(id, token, &set, &format!("{RESPONSE}, {RESPONSE_LZ4}"), extra).await?
            }
        };
        match first {
            Err(StoreError::Unavailable { message, .. })
                if message.contains("ValidationException") && message.to_ascii_lowercase().contains("size") =>
            {
                // The item with its response is over DynamoDB's limit after all (a very
                // long scope): keep the status only, so the handler's completion stands.
                tracing::warn!(
                    "idem-dynamodb: the record with its response is over the item size limit; completed as not retained"
                );
                let bare = idem_core::codec::encode_response(&item::not_retained(&response, false));
                self.complete_inline(id, token, RESPONSE, bare).await?
            }
            other => other,
        }
    }

    /// One conditional `UpdateItem` on the token (in flight, live), on the branch of
    /// `lease_expires_at = min(lease_expires_at, now)`.
    async fn fail(&self, id: RecordId, token: FencingToken) -> Result<Receipt, StoreError> {
        const OP: &str = "marking a record failed";
        let now = self.now();
        let mut lower = true;
        for _ in 0..ATTEMPTS {
            let w = nonce();
            let vals = Vals::default()
                .with(":f", s(RecordState::Failed.as_str()))
                .with(":w", s(&w))
                .with(":t", n(token.0))
                .with(":if", s(IN_FLIGHT))
                .with(":now", n(now.0));
            let update = if lower {
                format!("SET {STATE} = :f, {WRITE} = :w, {LEASE} = :now")
            } else {
                format!("SET {STATE} = :f, {WRITE} = :w")
            };
            let condition = format!(
                "{TOKEN} = :t AND {STATE} = :if AND {EXPIRES} > :now AND {LEASE} {op} :now",
                op = if lower { ">" } else { "<=" }
            );
            match self.update(OP, id, &update, &condition, vals, ReturnValue::AllNew).await? {
                Written::Yes(new) => return receipt(&new, id),
                Written::Refused(old) => match self.refused_item(id, old).await? {
                    Some(old) if write_nonce(&old) == Some(w.as_str()) => return receipt(&old, id),
                    Some(old) => {
                        let h = Head::of(&old, id)?;
                        if !h.owned_by(token, now) {
                            let current = h.is_live(now).then_some(h.token);
                            return Err(StoreError::LeaseLost { id, presented: token, current });
                        }
                        lower = h.lease_expires_at > now;
                    }
                    None => return Err(StoreError::LeaseLost { id, presented: token, current: None }),
                },
            }
        }
        Err(Error::Contention { operation: OP }.into())
    }

    /// One conditional `UpdateItem` on the token (in flight, live), on the branch of
    /// `lease_expires_at = max(lease_expires_at, now + lease_ttl)` and `expires_at =
    /// max(expires_at, lease_expires_at)`.
    async fn extend(&self, id: RecordId, token: FencingToken, lease_ttl: Duration) -> Result<Receipt, StoreError> {
        const OP: &str = "extending a lease";
        let now = self.now();
        let lease_end = UnixMillis(now.0.saturating_add(duration_ms(lease_ttl)));
        // (moves the lease, moves expires_at): retention is usually longer than a lease.
        let mut branch = (true, false);
        for _ in 0..ATTEMPTS {
            let w = nonce();
            let mut vals = Vals::default()
                .with(":w", s(&w))
                .with(":t", n(token.0))
                .with(":if", s(IN_FLIGHT))
                .with(":now", n(now.0))
                .with(":l", n(lease_end.0));
            let owner = format!("{TOKEN} = :t AND {STATE} = :if AND {EXPIRES} > :now");
            let (update, condition) = match branch {
                (true, true) => {
                    vals = vals.with(":ttl", n(ttl_secs(lease_end, self.inner.grace_secs)));
                    (
                        format!("SET {LEASE} = :l, {EXPIRES} = :l, {TTL} = :ttl, {WRITE} = :w"),
                        format!("{owner} AND {LEASE} < :l AND {EXPIRES} < :l"),
                    )
                }
                (true, false) => {
                    (format!("SET {LEASE} = :l, {WRITE} = :w"), format!("{owner} AND {LEASE} < :l AND {EXPIRES} >= :l"))
                }
                (false, _) => (format!("SET {WRITE} = :w"), format!("{owner} AND {LEASE} >= :l")),
            };
            match self.update(OP, id, &update, &condition, vals, ReturnValue::AllNew).await? {
                Written::Yes(new) => return receipt(&new, id),
                Written::Refused(old) => match self.refused_item(id, old).await? {
                    Some(old) if write_nonce(&old) == Some(w.as_str()) => return receipt(&old, id),
                    Some(old) => {
                        let h = Head::of(&old, id)?;
                        if !h.owned_by(token, now) {
                            let current = h.is_live(now).then_some(h.token);
                            return Err(StoreError::LeaseLost { id, presented: token, current });
                        }
                        branch = (h.lease_expires_at < lease_end, h.expires_at < lease_end);
                    }
                    None => return Err(StoreError::LeaseLost { id, presented: token, current: None }),
                },
            }
        }
        Err(Error::Contention { operation: OP }.into())
    }

    /// A strongly consistent `GetItem`; an item past `expires_at` is absent, whether or
    /// not DynamoDB's TTL has removed it yet.
    async fn get(&self, id: RecordId) -> Result<Option<Record>, StoreError> {
        self.read(id, self.now()).await
    }

    /// A strongly consistent scan for record items past `expires_at` (page by page until
    /// `limit + 1` are found or the table ends), then for each: its journal entries of that
    /// generation or older (each delete conditional on its generation), then the record
    /// (conditional on its token and on still being expired, so a claim that replaced it
    /// in the meantime stays whole).
    async fn sweep(&self, limit: usize) -> Result<SweepOutcome, StoreError> {
        const OP: &str = "sweeping expired records";
        let now = self.now();
        let mut found: Vec<(RecordId, FencingToken, FencingToken)> = Vec::new();
        let vals = Vals::default().with(":r", s(SK_RECORD)).with(":now", n(now.0));
        let filter = format!("sk = :r AND {EXPIRES} <= :now");
        let projection = Some(format!("pk, {TOKEN}, {GEN}"));
        self.scan_records(OP, &filter, vals, projection, |it| {
            let id = item::item_id(it)?;
            found.push((id, get_token(it, Some(id), TOKEN)?, get_token(it, Some(id), GEN)?));
            Ok(found.len() <= limit)
        })
        .await?;
        let more = found.len() > limit;
        found.truncate(limit);
        let mut removed = 0;
        for (id, token, generation) in found {
            self.delete_entries(id, generation, token).await?;
            let sent = self
                .inner
                .client
                .delete_item()
                .table_name(&self.inner.table)
                .set_key(Some(record_key(id)))
                .condition_expression(format!("{TOKEN} = :t AND {EXPIRES} <= :now"))
                .expression_attribute_values(":t", n(token.0))
                .expression_attribute_values(":now", n(now.0))
                .send()
                .await;
            match sent {
                Ok(_) => removed += 1,
                Err(e) if matches!(e.as_service_error(), Some(DeleteItemError::ConditionalCheckFailedException(_))) => {
                }
                Err(e) => return Err(Error::sdk(OP, &e).into()),
            }
        }
        Ok(SweepOutcome { removed, more })
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities { backend: "dynamodb", shared: true, journal: true, list: true, ..Capabilities::NONE }
    }

    /// A strongly consistent scan of every record item, filtered and ordered here
    /// ([`ListFilter::select`]): the cost is the table's size, for operators only.
    async fn list(&self, filter: ListFilter) -> Result<Listing, StoreError> {
        const OP: &str = "listing records";
        let now = self.now();
        let mut items = Vec::new();
        let vals = Vals::default().with(":r", s(SK_RECORD));
        self.scan_records(OP, "sk = :r", vals, None, |it| {
            items.push((item::item_id(it)?, it.clone()));
            Ok(true)
        })
        .await?;
        let mut records = Vec::new();
        for (id, it) in items {
            if Head::of(&it, id)?.is_live(now) {
                records.push(self.full_record(&it, id).await?);
            }
        }
        Ok(filter.select(records, now))
    }

    /// One `TransactWriteItems`: a condition check that the caller's token is the record's
    /// current in-flight claim, and the entry's items (first write wins unless
    /// `overwrite`: the put is conditional on no entry of this generation).
    async fn journal_put(
        &self,
        id: RecordId,
        token: FencingToken,
        name: &str,
        value: Vec<u8>,
        overwrite: bool,
    ) -> Result<JournalWrite, StoreError> {
        const OP: &str = "writing a journal entry";
        if name.is_empty() || name.len() > MAX_JOURNAL_NAME {
            return Err(StoreError::unavailable(
                "dynamodb",
                format!("journal entry names are 1 to {MAX_JOURNAL_NAME} bytes, not {}", name.len()),
                false,
                Error::JournalValueTooLarge { len: name.len(), limit: MAX_JOURNAL_NAME },
            ));
        }
        if value.len() > MAX_JOURNAL_VALUE {
            return Err(Error::JournalValueTooLarge { len: value.len(), limit: MAX_JOURNAL_VALUE }.into());
        }
        let parts: Vec<&[u8]> = if value.is_empty() { vec![&[][..]] } else { value.chunks(PART_BYTES).collect() };
        for attempt in 0..ATTEMPTS {
            let now = self.now();
            let generation = match self.read_item(id).await? {
                Some(it) => {
                    let h = Head::of(&it, id)?;
                    if !h.owned_by(token, now) {
                        let current = h.is_live(now).then_some(h.token);
                        return Err(StoreError::LeaseLost { id, presented: token, current });
                    }
                    h.generation
                }
                None => return Err(StoreError::LeaseLost { id, presented: token, current: None }),
            };
            let w = nonce();
            let check = ConditionCheck::builder()
                .table_name(&self.inner.table)
                .set_key(Some(record_key(id)))
                .condition_expression(format!("{TOKEN} = :t AND {STATE} = :if AND {EXPIRES} > :now"))
                .expression_attribute_values(":t", n(token.0))
                .expression_attribute_values(":if", s(IN_FLIGHT))
                .expression_attribute_values(":now", n(now.0))
                .build()
                .map_err(built(OP))?;
            let mut items = vec![TransactWriteItem::builder().condition_check(check).build()];
            for (i, part) in parts.iter().enumerate() {
                let mut entry = journal_key(id, name, i);
                entry.insert(GEN.to_owned(), n(generation.0));
                entry.insert(WRITE.to_owned(), s(&w));
                entry.insert(VALUE.to_owned(), b(part.to_vec()));
                if i == 0 {
                    entry.insert(PARTS.to_owned(), n(parts.len()));
                }
                let mut put = Put::builder().table_name(&self.inner.table).set_item(Some(entry));
                if i == 0 && !overwrite {
                    put = put
                        .condition_expression(format!("attribute_not_exists(pk) OR {GEN} <> :g"))
                        .expression_attribute_values(":g", n(generation.0));
                }
                items.push(TransactWriteItem::builder().put(put.build().map_err(built(OP))?).build());
            }
            let sent = self
                .inner
                .client
                .transact_write_items()
                .set_transact_items(Some(items))
                .client_request_token(w.clone())
                .send()
                .await;
            let e = match sent {
                Ok(_) => return Ok(JournalWrite::Written),
                Err(e) => e,
            };
            let Some(TransactWriteItemsError::TransactionCanceledException(c)) = e.as_service_error() else {
                return Err(Error::sdk(OP, &e).into());
            };
            let codes: Vec<&str> = c.cancellation_reasons().iter().map(|r| r.code().unwrap_or("None")).collect();
            if codes.first() == Some(&"ConditionalCheckFailed") {
                // The record changed since it was read: read it again (the refusal names
                // the token it holds now).
                continue;
            }
            if codes.get(1) == Some(&"ConditionalCheckFailed") {
                match self.read_entry(id, name, generation).await? {
                    Ok(Some((_, ew))) if ew == w => return Ok(JournalWrite::Written),
                    Ok(Some((v, _))) => return Ok(JournalWrite::Exists(v)),
                    Ok(None) | Err(()) => continue,
                }
            }
            if codes.contains(&"TransactionConflict") {
                tokio::time::sleep(Duration::from_millis(1 + attempt as u64 * 2)).await;
                continue;
            }
            return Err(Error::sdk(OP, &e).into());
        }
        Err(Error::Contention { operation: OP }.into())
    }

    /// Strongly consistent reads of the record and then of the entry, which counts only
    /// when it belongs to the record's current generation.
    async fn journal_get(&self, id: RecordId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        for _ in 0..ATTEMPTS {
            let now = self.now();
            let generation = match self.read_item(id).await? {
                Some(it) => {
                    let h = Head::of(&it, id)?;
                    if !h.is_live(now) {
                        return Ok(None);
                    }
                    h.generation
                }
                None => return Ok(None),
            };
            if let Ok(found) = self.read_entry(id, name, generation).await? {
                return Ok(found.map(|(v, _)| v));
            }
        }
        Err(Error::Contention { operation: "reading a journal entry" }.into())
    }
}
