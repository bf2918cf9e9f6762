//! What the commands print: text for people, one JSON document for scripts
//! (`docs/operations.md#json-output` lists every field). Times are ms since the Unix
//! epoch (UTC) with an RFC 3339 rendering in text; durations are ms.

use std::process::ExitCode;
use std::time::{Duration, UNIX_EPOCH};

use idem_core::seal::{SEALED_HEADER, SEALED_STATUS};
use idem_core::{Listing, Record, RecordState, StoredBody, SweepOutcome, UnixMillis};
use serde_json::{Value, json};

use crate::Failure;

/// Where and how results go.
#[derive(Debug)]
pub(crate) struct Output {
    /// One JSON document on stdout instead of text.
    pub(crate) json: bool,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn rfc3339(t: UnixMillis) -> String {
    u64::try_from(t.0).map_or_else(
        |_| format!("{} ms", t.0),
        |ms| humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(ms)).to_string(),
    )
}

/// `(status, header count, body bytes (None: unknown), retained, trailer count)`.
fn response_summary(record: &Record) -> Option<(u16, usize, Option<u64>, bool, usize)> {
    let response = record.response.as_ref()?;
    let (len, retained) = match &response.body {
        StoredBody::Identity(b) => (Some(b.len() as u64), true),
        StoredBody::Lz4 { len, .. } => (Some(*len), true),
        StoredBody::NotRetained { len } => (*len, false),
    };
    Some((response.status, response.headers.len(), len, retained, response.trailers.len()))
}

/// The key id of a sealed response (`idem_core::seal`: status 0 and one `idem-sealed:
/// v1;<key id>` header). The CLI holds no sealing key, so status, headers and body stay
/// unknown; without this a sealed response would read as "status 0, 1 header".
fn sealed_key_id(record: &Record) -> Option<u32> {
    let response = record.response.as_ref()?;
    if response.status != SEALED_STATUS {
        return None;
    }
    let (_, value) = response.headers.iter().find(|(name, _)| name == SEALED_HEADER)?;
    std::str::from_utf8(value).ok()?.strip_prefix("v1;")?.parse().ok()
}

/// The `response` object of a record's JSON.
fn response_json(record: &Record) -> Value {
    let Some((status, headers, body_bytes, retained, trailers)) = response_summary(record) else {
        return Value::Null;
    };
    match sealed_key_id(record) {
        Some(key_id) => json!({
            "status": null,
            "headers": null,
            "body_bytes": body_bytes,
            "body_retained": true,
            "trailers": null,
            "sealed": { "key_id": key_id },
        }),
        None => json!({
            "status": status,
            "headers": headers,
            "body_bytes": body_bytes,
            "body_retained": retained,
            "trailers": trailers,
            "sealed": null,
        }),
    }
}

/// A record as JSON, with lease and age measured at `now`.
pub(crate) fn record_json(record: &Record, now: UnixMillis) -> Value {
    let in_flight = record.state == RecordState::InFlight;
    json!({
        "record_id": record.id.to_hex(),
        "principal": record.scope.principal.as_str(),
        "endpoint": record.scope.endpoint.as_str(),
        "key": record.key.as_str(),
        "state": record.state.as_str(),
        "token": record.token.0,
        "fingerprint": hex(record.fingerprint.as_bytes()),
        "created_at_ms": record.created_at.0,
        "started_at_ms": record.started_at.0,
        "age_ms": now.0.saturating_sub(record.started_at.0).max(0),
        "lease_expires_at_ms": record.lease_expires_at.0,
        "lease_remaining_ms": if in_flight { now.millis_until(record.lease_expires_at) } else { 0 },
        "lease_live": record.lease_is_fresh(now),
        "expires_at_ms": record.expires_at.0,
        "response": response_json(record),
    })
}

fn record_text(record: &Record, now: UnixMillis) -> String {
    let mut s = String::new();
    let mut line = |k: &str, v: String| s.push_str(&format!("{k:<15}{v}\n"));
    line("record id", record.id.to_hex());
    line("principal", record.scope.principal.as_str().to_owned());
    line("endpoint", record.scope.endpoint.as_str().to_owned());
    line("key", record.key.as_str().to_owned());
    line("state", record.state.as_str().to_owned());
    line("token", record.token.0.to_string());
    line("fingerprint", hex(record.fingerprint.as_bytes()));
    line("created", rfc3339(record.created_at));
    line(
        "started",
        format!("{} ({} ms ago)", rfc3339(record.started_at), now.0.saturating_sub(record.started_at.0).max(0)),
    );
    let lease = match record.state {
        RecordState::InFlight if record.lease_is_fresh(now) => {
            format!("live, {} ms left", now.millis_until(record.lease_expires_at))
        }
        RecordState::InFlight => {
            format!("EXPIRED {} ms ago (stuck: release it)", record.lease_expires_at.millis_until(now))
        }
        _ => "ended".to_owned(),
    };
    line("lease until", format!("{} ({lease})", rfc3339(record.lease_expires_at)));
    line("retained until", format!("{} ({} ms left)", rfc3339(record.expires_at), now.millis_until(record.expires_at)));
    match (response_summary(record), sealed_key_id(record)) {
        (None, _) => line("response", "none".to_owned()),
        (Some((_, _, len, _, _)), Some(key_id)) => {
            let len = len.map_or_else(String::new, |n| format!(", {n} bytes sealed"));
            line("response", format!("sealed with key {key_id} (status, headers and body encrypted{len})"));
        }
        (Some((status, headers, len, retained, trailers)), None) => {
            let body = match (len, retained) {
                (Some(n), true) => format!("{n} bytes"),
                (Some(n), false) => format!("{n} bytes, not retained"),
                (None, false) => "not retained".to_owned(),
                (None, true) => "retained".to_owned(),
            };
            line("response", format!("{status}, {headers} headers, body {body}, {trailers} trailers"));
        }
    }
    s
}

/// Counts for `stats`.
#[derive(Debug, Default)]
pub(crate) struct Counts {
    now: Option<UnixMillis>,
    in_flight: u64,
    in_flight_expired: u64,
    completed: u64,
    failed: u64,
    oldest_in_flight: Option<(UnixMillis, String)>,
}

impl Counts {
    /// Adds one page.
    pub(crate) fn add(&mut self, page: &Listing) {
        self.now = Some(page.now);
        for r in &page.records {
            match r.state {
                RecordState::InFlight => {
                    self.in_flight += 1;
                    if !r.lease_is_fresh(page.now) {
                        self.in_flight_expired += 1;
                    }
                    if self.oldest_in_flight.as_ref().is_none_or(|(t, _)| r.started_at < *t) {
                        self.oldest_in_flight = Some((r.started_at, r.id.to_hex()));
                    }
                }
                RecordState::Completed => self.completed += 1,
                RecordState::Failed => self.failed += 1,
            }
        }
    }

    fn json(&self) -> Value {
        let now = self.now.unwrap_or_default();
        json!({
            "now_ms": now.0,
            "records": self.in_flight + self.completed + self.failed,
            "in_flight": self.in_flight,
            "in_flight_lease_expired": self.in_flight_expired,
            "completed": self.completed,
            "failed": self.failed,
            "oldest_in_flight": self.oldest_in_flight.as_ref().map(|(t, id)| json!({
                "record_id": id,
                "started_at_ms": t.0,
                "age_ms": now.0.saturating_sub(t.0).max(0),
            })),
        })
    }
}

impl Output {
    fn print(&self, json: &Value, text: impl FnOnce() -> String) {
        if self.json {
            println!("{json}");
        } else {
            print!("{}", text());
        }
    }

    /// `inspect`.
    pub(crate) fn record(&self, record: &Record, now: UnixMillis) {
        self.print(&json!({ "now_ms": now.0, "record": record_json(record, now) }), || record_text(record, now));
    }

    /// `list`: text sorted oldest attempt first; JSON in the store's (record id) order.
    pub(crate) fn listing(&self, listing: &Listing) {
        let now = listing.now;
        let next_after = if listing.more { listing.records.last().map(|r| r.id.to_hex()) } else { None };
        let json = json!({
            "now_ms": now.0,
            "count": listing.records.len(),
            "more": listing.more,
            "next_after": next_after,
            "records": listing.records.iter().map(|r| record_json(r, now)).collect::<Vec<_>>(),
        });
        self.print(&json, || {
            let mut rows: Vec<&Record> = listing.records.iter().collect();
            rows.sort_by_key(|r| (r.started_at, r.id));
            let mut s = format!(
                "{:<64}  {:<9}  {:>10}  {:>12}  {}\n",
                "RECORD ID", "STATE", "AGE MS", "LEASE MS", "SCOPE / KEY"
            );
            for r in rows {
                let lease = if r.state == RecordState::InFlight {
                    let left = now.millis_until(r.lease_expires_at);
                    if left == 0 { "expired".to_owned() } else { left.to_string() }
                } else {
                    "-".to_owned()
                };
                s.push_str(&format!(
                    "{:<64}  {:<9}  {:>10}  {:>12}  {} {} {}\n",
                    r.id.to_hex(),
                    r.state.as_str(),
                    now.0.saturating_sub(r.started_at.0).max(0),
                    lease,
                    r.scope.principal.as_str(),
                    r.scope.endpoint.as_str(),
                    r.key.as_str()
                ));
            }
            s.push_str(&format!("{} records", listing.records.len()));
            if let Some(next) = &next_after {
                s.push_str(&format!("; more match: --after {next}"));
            }
            s.push('\n');
            s
        });
    }

    /// `release` succeeded (or there was nothing to release).
    pub(crate) fn released(&self, record: &Record, now: UnixMillis, forced: bool, note: &str) {
        let json = json!({
            "released": record.state == RecordState::Failed,
            "forced": forced,
            "note": note,
            "record": record_json(record, now),
        });
        self.print(&json, || format!("{note}\n{}", record_text(record, now)));
    }

    /// `sweep`.
    pub(crate) fn sweep(&self, outcome: SweepOutcome, native_expiry: bool) {
        let json = json!({ "removed": outcome.removed, "more": outcome.more, "native_expiry": native_expiry });
        self.print(&json, || {
            let mut s = format!("removed {} expired records", outcome.removed);
            if outcome.more {
                s.push_str("; more remain, run sweep again");
            }
            if native_expiry {
                s.push_str(" (this store expires records natively; there is nothing to sweep)");
            }
            s.push('\n');
            s
        });
    }

    /// `stats`.
    pub(crate) fn stats(&self, counts: &Counts, replicas: Option<&crate::replicas::Replicas>) {
        let mut json = counts.json();
        if let Some(r) = replicas {
            json["replicas"] = r.json();
        }
        self.print(&json, || {
            let mut s = format!(
                "records       {}\nin_flight     {} ({} with an expired lease)\ncompleted     {}\nfailed        {}\n",
                json["records"], counts.in_flight, counts.in_flight_expired, counts.completed, counts.failed
            );
            match &json["oldest_in_flight"] {
                Value::Null => s.push_str("oldest in-flight: none\n"),
                oldest => s.push_str(&format!(
                    "oldest in-flight: {} started {} ms ago\n",
                    oldest["record_id"].as_str().unwrap_or_default(),
                    oldest["age_ms"]
                )),
            }
            s.push_str(&replicas.map(crate::replicas::Replicas::text).unwrap_or_default());
            s
        });
    }

    /// Prints a failure: one line on stderr, and with `--json` a JSON document on stdout.
    pub(crate) fn fail(&self, failure: &Failure, code: u8) -> ExitCode {
        if self.json {
            println!(
                "{}",
                json!({ "error": { "kind": failure.kind(), "message": failure.to_string(), "exit_code": code } })
            );
        }
        eprintln!("idem: {failure}");
        ExitCode::from(code)
    }
}
