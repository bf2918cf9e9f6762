//! Target `layer`: hostile requests through the idempotency layer, each checked against the
//! decision table. Uses only `idem_http`'s public API.
//!
//! The fuzzer's bytes become a layer configuration and a sequence of operations on one
//! memory store (the reference model's engine) under a manual clock: requests with
//! arbitrary methods, paths, header sets (repeated, oversized, non-UTF-8 values, several
//! `Idempotency-Key` fields, odd principals) and bodies; clock moves; claims by "another
//! process" that leave records in flight. For every request the expected outcome is worked
//! out first, independently, from the decision table (`docs/decision-table.md`) and the
//! record the store holds before the request, then compared with what the layer did. It
//! panics when:
//! - the handler ran with an `IdempotencyContext` whose claim the store does not hold (no
//!   in-flight record with that token), or without a context where the request was keyed;
//! - the handler ran (or did not) where the table says otherwise;
//! - a replay differs from the stored response, or a refusal has the wrong status;
//! - anything in the layer panics.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Method, Request, Response};
use http_body_util::{BodyExt, Full};
use idem_core::{
    ClaimRequest, Endpoint, Fingerprint, IdempotencyKey, ManualClock, MemoryStore, RecordId, RecordState, RequestParts,
    Scope, Store, StoredBody, UnixMillis,
};
use tower::{Layer, Service, ServiceExt};

use idem_http::{IdempotencyContext, IdempotencyLayer, KeyRequirement, MismatchStatus, MissingPrincipal, PROBLEM_JSON};

/// The header the fuzz target's resolver reads the principal from.
const TENANT: &str = "x-tenant";

/// Reads the fuzzer's bytes; zeros once they run out.
struct Input<'a>(&'a [u8]);

impl<'a> Input<'a> {
    fn byte(&mut self) -> u8 {
        let Some((&b, rest)) = self.0.split_first() else { return 0 };
        self.0 = rest;
        b
    }

    fn bytes(&mut self, max: usize) -> &'a [u8] {
        let len = usize::from(self.byte()).min(max).min(self.0.len());
        let (out, rest) = self.0.split_at(len);
        self.0 = rest;
        out
    }

    fn pick<T: Copy>(&mut self, from: &[T]) -> T {
        from[usize::from(self.byte()) % from.len()]
    }
}

/// What the handler saw: for each run, the claim it was given, and whether the store held it.
#[derive(Default)]
struct Runs {
    count: usize,
    /// Set by the handler when its context named a claim the store does not hold.
    unclaimed: Option<String>,
    /// The record id the last run's context named (`None`: it ran without one).
    context: Option<RecordId>,
}

struct Setup {
    key_required: bool,
    skip_missing_principal: bool,
    max_key_len: usize,
    max_body: usize,
    mismatch: u16,
    fingerprint_headers: Vec<&'static str>,
    lease: Duration,
    max_fields: usize,
    max_header_bytes: usize,
}

const NAMES: [&str; 10] = [
    "idempotency-key",
    "idempotency-key",
    TENANT,
    "content-type",
    "content-length",
    "x-a",
    "set-cookie",
    "authorization",
    "connection",
    "x-other",
];
const VALUES: [&[u8]; 10] =
    [b"k1", b"\"k1\"", b"tenant-a", b"tenant-b", b"application/json", b"", b"   ", b"\"\"", b"3", b"application/grpc"];
const PATHS: [&str; 4] = ["/v1/orders", "/v1/orders?x=1", "/v1/workers/7/reboot", "/"];
const METHODS: [&str; 6] = ["POST", "POST", "PUT", "PATCH", "DELETE", "GET"];
const STATUSES: [u16; 7] = [200, 201, 204, 400, 409, 429, 500];

/// Panics only when the layer breaks a rule listed in the module docs.
pub fn layer(data: &[u8]) {
    let mut input = Input(data);
    let setup = Setup {
        key_required: input.byte() % 2 == 0,
        skip_missing_principal: input.byte() % 4 == 0,
        max_key_len: 1 + usize::from(input.byte() % 40),
        max_body: usize::from(input.byte() % 48),
        mismatch: input.pick(&[409, 422, 400]),
        fingerprint_headers: if input.byte() % 2 == 0 { vec!["content-type"] } else { vec!["content-type", "x-a"] },
        lease: Duration::from_secs(1 + u64::from(input.byte() % 10)),
        max_fields: 1 + usize::from(input.byte() % 4),
        max_header_bytes: 8 + usize::from(input.byte()),
    };
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
    runtime.block_on(run(&setup, &mut input));
}

async fn run(setup: &Setup, input: &mut Input<'_>) {
    let clock = ManualClock::new(UnixMillis(1_764_460_800_000));
    let store = Arc::new(MemoryStore::with_clock(Arc::new(clock.clone())));
    let mut policy = idem_http::Policy::default();
    (policy.lease_ttl, policy.retention) = (setup.lease, setup.lease * 3);
    let layer = IdempotencyLayer::new(store.clone())
        .with_policy(policy)
        .with_key_requirement(if setup.key_required { KeyRequirement::Required } else { KeyRequirement::Optional })
        .with_missing_principal(if setup.skip_missing_principal {
            MissingPrincipal::SkipIdempotency
        } else {
            MissingPrincipal::Reject
        })
        .with_max_key_len(setup.max_key_len)
        .with_max_request_body(setup.max_body)
        .with_mismatch_status(match setup.mismatch {
            422 => MismatchStatus::UnprocessableContent,
            400 => MismatchStatus::BadRequest,
            _ => MismatchStatus::Conflict,
        })
        .with_fingerprint_headers(setup.fingerprint_headers.iter().copied())
        .with_max_fingerprint_headers(setup.max_fields, setup.max_header_bytes)
        .with_principal_resolver(|parts: &http::request::Parts| {
            parts.headers.get(TENANT).and_then(|v| v.to_str().ok()).map(str::to_owned)
        });

    let runs = Arc::new(Mutex::new(Runs::default()));
    let status = Arc::new(Mutex::new(200u16));
    let handler = tower::service_fn({
        let (runs, status, store) = (runs.clone(), status.clone(), store.clone());
        move |req: Request<Full<Bytes>>| {
            let (runs, status, store) = (runs.clone(), status.clone(), store.clone());
            async move {
                let ctx = req.extensions().get::<IdempotencyContext>().cloned();
                let mut problem = None;
                if let Some(ctx) = &ctx {
                    match store.get(ctx.record_id()).await {
                        Ok(Some(r)) if r.state == RecordState::InFlight && r.token == ctx.token() => {}
                        other => problem = Some(format!("handler ran on {:?} holding {:?}", other, ctx.token())),
                    }
                }
                {
                    let mut runs = runs.lock().expect("runs");
                    runs.count += 1;
                    runs.context = ctx.as_ref().map(IdempotencyContext::record_id);
                    if runs.unclaimed.is_none() {
                        runs.unclaimed = problem;
                    }
                }
                let code = *status.lock().expect("status");
                let res = Response::builder()
                    .status(code)
                    .header("set-cookie", "s=1")
                    .body(Full::new(Bytes::from(format!("ran {code}"))))
                    .expect("a response");
                Ok::<_, std::convert::Infallible>(res)
            }
        }
    });
    let mut service = layer.layer(handler);

    for _ in 0..24 {
        if input.0.is_empty() {
            break;
        }
        match input.byte() % 8 {
            0 => clock.advance(Duration::from_millis(u64::from(input.byte()) * 100)),
            1 => {
                // Another process claims a key and is still running (or died): an in-flight record.
                let principal = input.pick(&["tenant-a", "tenant-b"]);
                let path = input.pick(&PATHS);
                let key = input.pick(&["k1", "k2"]);
                let scope = Scope::new(principal, Endpoint::new("POST", path.split('?').next().unwrap_or("/")))
                    .expect("a principal");
                let key = IdempotencyKey::parse(key.as_bytes()).expect("a key");
                let claim =
                    ClaimRequest::new(scope, key, Fingerprint::of_bytes(b"other"), setup.lease, setup.lease * 3);
                let _ = store.claim(claim).await;
            }
            _ => {
                *status.lock().expect("status") = input.pick(&STATUSES);
                let req = request(input);
                let expected = expect(setup, &req, &store, &clock).await;
                let before = runs.lock().expect("runs").count;
                let res = service.ready().await.expect("ready").call(req).await.expect("infallible");
                let (parts, body) = res.into_parts();
                let body = body.collect().await.map(|b| b.to_bytes());
                let runs = runs.lock().expect("runs");
                if let Some(problem) = &runs.unclaimed {
                    panic!("a handler ran without holding its claim: {problem}");
                }
                let ran = runs.count > before;
                check(&expected, ran, runs.context, parts.status.as_u16(), &parts.headers, body.ok());
            }
        }
    }
}

/// Builds one request from the fuzzer's bytes.
fn request(input: &mut Input<'_>) -> Request<Full<Bytes>> {
    let method = if input.byte().is_multiple_of(16) {
        Method::from_bytes(input.bytes(12)).unwrap_or(Method::POST)
    } else {
        Method::from_bytes(input.pick(&METHODS).as_bytes()).unwrap_or(Method::POST)
    };
    let mut req = Request::builder().method(method).uri(input.pick(&PATHS));
    for _ in 0..input.byte() % 8 {
        let name = input.pick(&NAMES);
        let value = match input.byte() % 4 {
            0 => input.bytes(80).to_vec(),
            1 => vec![b'k'; usize::from(input.byte())],
            _ => input.pick(&VALUES).to_vec(),
        };
        if let (Ok(n), Ok(v)) = (HeaderName::from_bytes(name.as_bytes()), HeaderValue::from_bytes(&value)) {
            req = req.header(n, v);
        }
    }
    let body = input.bytes(64).to_vec();
    req.body(Full::new(Bytes::from(body))).unwrap_or_else(|_| Request::new(Full::new(Bytes::new())))
}

/// What the decision table says a request gets.
#[derive(Debug)]
enum Expected {
    /// Passed through without a claim (safe method, no key on an optional endpoint, no
    /// principal with `SkipIdempotency`).
    PassThrough,
    /// Refused before any claim, with this status.
    Refused(u16),
    /// Claimed (or reclaimed): the handler runs with a context naming this record (the
    /// hash of the request's own principal, endpoint and key, never another tenant's).
    Run(RecordId),
    /// In flight elsewhere: 409, no run.
    InFlight,
    /// A different request used the key first.
    Mismatch(u16),
    /// A completed record: the stored status (and body, when retained), no run.
    Replay(u16, Option<Vec<u8>>),
    /// The layer's answer is a gRPC translation (its status and body are not compared),
    /// but the handler runs exactly when the table says: never for a refusal (`None`),
    /// and as the wrapped expectation says otherwise.
    Grpc(Option<Box<Expected>>),
}

async fn expect(setup: &Setup, req: &Request<Full<Bytes>>, store: &MemoryStore, clock: &ManualClock) -> Expected {
    if req.method().is_safe() {
        return Expected::PassThrough;
    }
    let headers = req.headers();
    let grpc = headers.get("content-type").is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
    let keys: Vec<_> = headers.get_all("idempotency-key").iter().collect();
    let key = match keys.as_slice() {
        [] if setup.key_required => return refused_or_grpc(grpc, 400),
        [] => return Expected::PassThrough,
        [one] => match IdempotencyKey::parse_with_limit(one.as_bytes(), setup.max_key_len) {
            Ok(key) => key,
            Err(_) => return refused_or_grpc(grpc, 400),
        },
        _ => return refused_or_grpc(grpc, 400),
    };
    let principal = match headers.get(TENANT).and_then(|v| v.to_str().ok()) {
        None if setup.skip_missing_principal => return Expected::PassThrough,
        None => return refused_or_grpc(grpc, 401),
        // A blank principal is never a shared bucket, and never skips idempotency.
        Some(p) if p.trim().is_empty() => return refused_or_grpc(grpc, 401),
        Some(p) => p.to_owned(),
    };
    let fp_fields: Vec<usize> = setup
        .fingerprint_headers
        .iter()
        .flat_map(|name| headers.get_all(*name).iter().map(move |v| name.len() + v.len()))
        .collect();
    if fp_fields.len() > setup.max_fields || fp_fields.iter().sum::<usize>() > setup.max_header_bytes {
        return refused_or_grpc(grpc, 431);
    }
    let declared = headers.get("content-length").and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    let body = req.body().clone().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    if declared.is_some_and(|n| n > setup.max_body as u64) || body.len() > setup.max_body {
        return refused_or_grpc(grpc, 413);
    }
    let fp_headers: Vec<(&str, &[u8])> = setup
        .fingerprint_headers
        .iter()
        .flat_map(|name| headers.get_all(*name).iter().map(move |v| (*name, v.as_bytes())))
        .collect();
    let fingerprint = Fingerprint::of(&RequestParts {
        method: req.method().as_str(),
        path: req.uri().path(),
        query: req.uri().query(),
        headers: &fp_headers,
        body: &body,
    });
    let scope = Scope::new(principal, Endpoint::new(req.method().as_str(), req.uri().path())).expect("not blank");
    let record = store.get(scope.record_id(&key)).await.expect("the memory store answers");
    let table = table(setup, scope.record_id(&key), record, &fingerprint, clock);
    if grpc { Expected::Grpc(Some(Box::new(table))) } else { table }
}

/// The decision table's row for `record` (the one the store holds before the request).
fn table(
    setup: &Setup,
    id: RecordId,
    record: Option<idem_core::Record>,
    fingerprint: &Fingerprint,
    clock: &ManualClock,
) -> Expected {
    let Some(record) = record else { return Expected::Run(id) };
    if record.fingerprint != *fingerprint {
        return Expected::Mismatch(setup.mismatch);
    }
    match record.state {
        RecordState::InFlight if clock.now_ms() < record.lease_expires_at.0 => Expected::InFlight,
        RecordState::InFlight | RecordState::Failed => Expected::Run(id),
        RecordState::Completed => {
            let stored = record.response.expect("a completed record holds its response");
            let body = match &stored.body {
                StoredBody::NotRetained { .. } => None,
                _ => stored.body_bytes().ok().flatten().map(|b| b.to_vec()),
            };
            Expected::Replay(stored.status, body)
        }
    }
}

fn refused_or_grpc(grpc: bool, status: u16) -> Expected {
    if grpc { Expected::Grpc(None) } else { Expected::Refused(status) }
}

fn check(
    expected: &Expected,
    ran: bool,
    context: Option<RecordId>,
    status: u16,
    headers: &http::HeaderMap,
    body: Option<Bytes>,
) {
    let replayed = headers.get("idempotent-replayed").is_some_and(|v| v == "true");
    let with_context = context.is_some();
    match expected {
        Expected::PassThrough => assert!(ran && !with_context, "{expected:?}: ran {ran}, context {with_context}"),
        Expected::Run(id) => assert!(ran && context == Some(*id), "{expected:?}: ran {ran}, context {context:?}"),
        // A refusal runs nothing; past the claim, the handler runs (with its context) exactly
        // where the table says, whatever the gRPC translation of the answer looks like.
        Expected::Grpc(None) => assert!(!ran, "{expected:?}: the handler ran"),
        Expected::Grpc(Some(table)) => match **table {
            Expected::Run(id) => {
                assert!(ran && context == Some(id), "{expected:?}: ran {ran}, context {context:?}");
            }
            _ => assert!(!ran, "{expected:?}: the handler ran"),
        },
        Expected::Refused(code) | Expected::Mismatch(code) => {
            assert!(!ran, "{expected:?}: the handler ran");
            assert_eq!(status, *code, "{expected:?}");
            let problem = headers.get("content-type").is_some_and(|v| v == PROBLEM_JSON);
            assert!(problem, "{expected:?}: a refusal carries a problem body");
        }
        Expected::InFlight => {
            assert!(!ran, "{expected:?}: the handler ran");
            assert_eq!(status, 409, "{expected:?}");
            assert!(headers.contains_key("retry-after"), "an in-flight 409 carries Retry-After");
        }
        Expected::Replay(code, stored) => {
            assert!(!ran, "{expected:?}: the handler ran");
            assert_eq!(status, *code, "{expected:?}");
            assert!(replayed, "a replay says Idempotent-Replayed: true");
            if let (Some(stored), Some(body)) = (stored, body) {
                assert_eq!(&body[..], &stored[..], "a replay repeats the stored body");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: RecordId = RecordId::from_bytes([0xa; 32]);
    const B: RecordId = RecordId::from_bytes([0xb; 32]);

    // Pins: the oracle accepted a run under any claim the store held, so a layer that ran
    // one tenant's request under another record (a principal normalised into another
    // tenant's, say) passed whenever that record was in flight.
    #[test]
    #[should_panic(expected = "context Some")]
    fn oracle_catches_a_run_under_another_record() {
        check(&Expected::Run(A), true, Some(B), 201, &http::HeaderMap::new(), None);
    }

    // Pins: the `layer` target's oracle for gRPC requests was `!ran || with_context ||
    // !replayed`, which a handler run without a claim (no context, no replay header)
    // passed, so the fuzzer could not catch that on any gRPC input.
    #[test]
    #[should_panic(expected = "ran true, context None")]
    fn grpc_oracle_catches_a_run_without_a_claim() {
        let headers = http::HeaderMap::new();
        check(&Expected::Grpc(Some(Box::new(Expected::Run(A)))), true, None, 200, &headers, None);
    }

    #[test]
    #[should_panic(expected = "the handler ran")]
    fn grpc_oracle_catches_a_run_on_a_refused_request() {
        check(&Expected::Grpc(None), true, None, 200, &http::HeaderMap::new(), None);
    }

    #[test]
    #[should_panic(expected = "the handler ran")]
    fn grpc_oracle_catches_a_run_where_the_table_replays() {
        let expected = Expected::Grpc(Some(Box::new(Expected::Replay(200, None))));
        check(&expected, true, Some(A), 200, &http::HeaderMap::new(), None);
    }

    #[test]
    fn grpc_oracle_accepts_what_the_table_says() {
        let headers = http::HeaderMap::new();
        check(&Expected::Grpc(Some(Box::new(Expected::Run(A)))), true, Some(A), 200, &headers, None);
        check(&Expected::Run(A), true, Some(A), 201, &headers, None);
        check(&Expected::Grpc(Some(Box::new(Expected::InFlight))), false, None, 200, &headers, None);
        check(&Expected::Grpc(None), false, None, 200, &headers, None);
    }
}
