//! `idem check URL`: the decision table (`docs/decision-table.md`) run against a live
//! server from the outside. Each rule is a fixed list of requests, known before anything
//! is sent (so `--dry-run` can print them), and a judgement of the answers. Nothing here
//! knows idem's internals: the rules hold for any implementation of the draft, and
//! `docs/operations.md#idem-check` says which checks go beyond it and how to leave them out.

use std::fmt::Write as _;
use std::time::{Duration, SystemTime};

use clap::ValueEnum;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use serde_json::{Value, json};

use crate::Failure;

/// `idem check`'s arguments.
#[derive(Debug, clap::Args)]
pub(crate) struct CheckArgs {
    /// The operation to check, a URL that takes an `Idempotency-Key`
    /// (`http://127.0.0.1:8080/v1/workers`). Every rule runs it at least once with a fresh
    /// key: use `--dry-run` first on an operation that must not run freely.
    url: String,
    /// The operation's method.
    #[arg(long, default_value = "POST")]
    method: String,
    /// The request body: the text itself, or `@PATH` for a file's bytes.
    #[arg(long)]
    body: String,
    /// A second body the server must treat as a different request (the `mismatch` and
    /// `scope` rules). Default: for a JSON object body, that object with one more member,
    /// `"idem_check": "<run id>"`.
    #[arg(long)]
    other_body: Option<String>,
    /// A credential, as a header `NAME: VALUE` (repeat; two or more, each a different
    /// principal, for the `scope` rule). The first is used by every other rule.
    #[arg(long = "credential", value_name = "HEADER")]
    credentials: Vec<String>,
    /// A bearer token: `--credential 'Authorization: Bearer TOKEN'` (repeat).
    #[arg(long = "bearer", value_name = "TOKEN")]
    bearers: Vec<String>,
    /// A header sent on every request, `NAME: VALUE` (repeat). A JSON body gets
    /// `Content-Type: application/json` unless one is given.
    #[arg(long = "header", value_name = "HEADER")]
    headers: Vec<String>,
    /// Requests sent at once with one fresh key (the `concurrent` rule).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(2..=256))]
    racers: u16,
    /// The longest key the server accepts, bytes: `key-syntax` sends a key of this length
    /// and one a byte longer, and every other key fits in it. At least 16, so that a key
    /// still holds enough of the run id to be fresh.
    #[arg(long, default_value_t = 255, value_parser = clap::value_parser!(u16).range(16..=8192))]
    max_key_len: u16,
    /// The server runs a keyless request without idempotency instead of answering 400.
    #[arg(long)]
    key_optional: bool,
    /// Where the safe-method rule sends its GETs (default: the URL itself).
    #[arg(long)]
    safe_url: Option<String>,
    /// The header that marks a replay; `""` if the server sends none (replays are then
    /// recognised by their bytes alone).
    #[arg(long, default_value = "Idempotent-Replayed")]
    replayed_header: String,
    /// The longest `Retry-After` an in-flight 409 may ask for, seconds.
    #[arg(long, default_value_t = 60)]
    max_retry_after: u64,
    /// The longest retention `Idempotency-Key-Expires` may announce (`30d`, `1y`).
    #[arg(long, default_value = "400d", value_parser = humantime::parse_duration)]
    max_retention: Duration,
    /// Run only these rules (repeat).
    #[arg(long = "only", value_enum, value_name = "RULE")]
    only: Vec<Rule>,
    /// Leave these rules out (repeat).
    #[arg(long = "skip", value_enum, value_name = "RULE")]
    skip: Vec<Rule>,
    /// Print the requests each rule would send and how many would run the operation;
    /// send nothing.
    #[arg(long)]
    dry_run: bool,
    /// Each request's timeout.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    timeout: Duration,
}

/// The rules, in the order they run (`docs/operations.md#idem-check`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Rule {
    /// Both wire forms name one key; the longest key is accepted; malformed keys get 400.
    KeySyntax,
    /// A keyless request gets 400 (or, with `--key-optional`, runs without idempotency).
    MissingKey,
    /// A retry gets the first answer again, byte for byte, marked as a replay.
    Replay,
    /// The same key with another body gets a problem, never a replay nor a retry hint.
    Mismatch,
    /// Another principal's request with the same key is a new operation.
    Scope,
    /// Racers with one key run the operation once; the others wait or replay.
    Concurrent,
    /// GET ignores the key entirely.
    SafeMethods,
    /// `Idempotency-Key-Expires` is a future HTTP-date, the same on the replay.
    KeyExpires,
}

const ALL: [Rule; 8] = [
    Rule::KeySyntax,
    Rule::MissingKey,
    Rule::Replay,
    Rule::Mismatch,
    Rule::Scope,
    Rule::Concurrent,
    Rule::SafeMethods,
    Rule::KeyExpires,
];

impl Rule {
    fn name(self) -> &'static str {
        match self {
            Rule::KeySyntax => "key-syntax",
            Rule::MissingKey => "missing-key",
            Rule::Replay => "replay",
            Rule::Mismatch => "mismatch",
            Rule::Scope => "scope",
            Rule::Concurrent => "concurrent",
            Rule::SafeMethods => "safe-methods",
            Rule::KeyExpires => "key-expires",
        }
    }
}

/// Which body a request carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Body {
    First,
    Other,
    None,
}

/// One request of a rule: everything about it is fixed before the run.
#[derive(Clone, Debug)]
struct Req {
    method: reqwest::Method,
    safe: bool,
    /// Index into the credentials.
    credential: usize,
    /// The `Idempotency-Key` field values sent (none, one, or a repeat).
    keys: Vec<Vec<u8>>,
    body: Body,
}

/// A rule's requests: batches sent one after the other, the requests of a batch at once.
type Plan = Vec<Vec<Req>>;

/// What came back.
#[derive(Debug)]
struct Seen {
    status: u16,
    headers: HeaderMap,
    body: Vec<u8>,
}

/// The arguments, parsed and checked.
struct Setup {
    client: reqwest::Client,
    method: reqwest::Method,
    url: String,
    safe_url: String,
    first: Vec<u8>,
    other: Vec<u8>,
    credentials: Vec<(HeaderName, HeaderValue)>,
    headers: HeaderMap,
    racers: usize,
    max_key_len: usize,
    key_optional: bool,
    replayed: Option<HeaderName>,
    max_retry_after: u64,
    max_retention: Duration,
    rules: Vec<Rule>,
    /// Unique to this run, in every key, so a second run never meets the first's records.
    run: String,
    /// `--other-body` was not given: the other body is the first plus an `idem_check`
    /// member, which a server that drops unknown members cannot tell apart.
    other_derived: bool,
}

fn header_arg(flag: &str, s: &str) -> Result<(HeaderName, HeaderValue), Failure> {
    let (name, value) =
        s.split_once(':').ok_or_else(|| Failure::Usage(format!("{flag} {s:?} is not `NAME: VALUE`")))?;
    let name =
        HeaderName::try_from(name.trim()).map_err(|e| Failure::Usage(format!("{flag} {s:?}: bad header name: {e}")))?;
    let value = HeaderValue::try_from(value.trim())
        .map_err(|e| Failure::Usage(format!("{flag} {s:?}: bad header value: {e}")))?;
    Ok((name, value))
}

fn body_arg(flag: &str, s: &str) -> Result<Vec<u8>, Failure> {
    match s.strip_prefix('@') {
        Some(path) => std::fs::read(path).map_err(|e| Failure::Usage(format!("{flag} {s:?}: {e}"))),
        None => Ok(s.as_bytes().to_vec()),
    }
}

impl Setup {
    fn new(args: CheckArgs) -> Result<Self, Failure> {
        let method = reqwest::Method::from_bytes(args.method.as_bytes())
            .map_err(|_| Failure::Usage(format!("--method {:?} is not an HTTP method", args.method)))?;
        if method.is_safe() {
            return Err(Failure::Usage(format!("--method {method} is safe: the layer never looks at its key")));
        }
        for url in std::iter::once(&args.url).chain(&args.safe_url) {
            let parsed = reqwest::Url::parse(url).map_err(|e| Failure::Usage(format!("{url:?} is not a URL: {e}")))?;
            // `localhost:8080/v1/workers` parses, as scheme `localhost`: without this every
            // request would fail, and the report would blame eight rules for a typo.
            if !matches!(parsed.scheme(), "http" | "https") || parsed.host_str().is_none_or(str::is_empty) {
                return Err(Failure::Usage(format!("{url:?} is not an http:// or https:// URL with a host")));
            }
        }
        if args.timeout.is_zero() {
            return Err(Failure::Usage("--timeout 0 leaves no time for an answer".into()));
        }
        let run = format!("{:016x}", rand::random::<u64>());
        let first = body_arg("--body", &args.body)?;
        let json_body = serde_json::from_slice::<Value>(&first).ok();
        let other = match (&args.other_body, &json_body) {
            (Some(s), _) => body_arg("--other-body", s)?,
            (None, Some(Value::Object(map))) => {
                let mut map = map.clone();
                map.insert("idem_check".into(), Value::String(run.clone()));
                serde_json::to_vec(&map).map_err(|e| Failure::Usage(e.to_string()))?
            }
            (None, _) => {
                return Err(Failure::Usage(
                    "the body is not a JSON object: give --other-body, a request the server must tell apart".into(),
                ));
            }
        };
        if other == first {
            return Err(Failure::Usage("--other-body is the same as --body".into()));
        }
        let mut credentials =
            args.credentials.iter().map(|c| header_arg("--credential", c)).collect::<Result<Vec<_>, _>>()?;
        for token in &args.bearers {
            credentials.push(header_arg("--bearer", &format!("Authorization: Bearer {token}"))?);
        }
        let mut headers = HeaderMap::new();
        for h in &args.headers {
            let (name, value) = header_arg("--header", h)?;
            // A key on every request would make each rule's requests carry two fields.
            if name == "idempotency-key" {
                return Err(Failure::Usage(format!("--header {h:?}: the checker sends its own keys, one per rule")));
            }
            headers.append(name, value);
        }
        if json_body.is_some() && !headers.contains_key(reqwest::header::CONTENT_TYPE) {
            headers.insert(reqwest::header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        }
        let rules: Vec<Rule> = ALL
            .into_iter()
            .filter(|r| (args.only.is_empty() || args.only.contains(r)) && !args.skip.contains(r))
            .collect();
        if rules.is_empty() {
            return Err(Failure::Usage("--only and --skip leave no rule to run".into()));
        }
        if rules.contains(&Rule::Scope) && credentials.len() < 2 {
            return Err(Failure::Usage(
                "the scope rule needs two credentials of different principals (--credential or --bearer twice), \
                 or --skip scope"
                    .into(),
            ));
        }
        if credentials.is_empty() {
            // An API without authentication: every request is the same (anonymous) principal.
            credentials.push((reqwest::header::USER_AGENT, HeaderValue::from_static("idem-check")));
        }
        let replayed = match args.replayed_header.trim() {
            "" => None,
            name => Some(
                HeaderName::try_from(name).map_err(|e| Failure::Usage(format!("--replayed-header {name:?}: {e}")))?,
            ),
        };
        let client = reqwest::Client::builder()
            .timeout(args.timeout)
            // A 3xx is an answer to compare, never a place to go.
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| Failure::Usage(format!("cannot build the HTTP client: {e}")))?;
        Ok(Setup {
            client,
            method,
            safe_url: args.safe_url.unwrap_or_else(|| args.url.clone()),
            url: args.url,
            first,
            other,
            credentials,
            headers,
            racers: usize::from(args.racers),
            max_key_len: usize::from(args.max_key_len),
            key_optional: args.key_optional,
            replayed,
            max_retry_after: args.max_retry_after,
            max_retention: args.max_retention,
            rules,
            run,
            other_derived: args.other_body.is_none(),
        })
    }

    /// A fresh key for `rule`, `n` telling apart the keys of one rule.
    fn key(&self, rule: Rule, n: u8) -> Vec<u8> {
        self.key_within(rule, n, self.max_key_len)
    }

    /// A fresh key of at most `len` bytes: `idem-check-<run>-<rule>-<n>` when it fits, else
    /// the run id's first digits, the rule's number and `n`. Every key must fit: against a
    /// server whose keys are short, a longer one is refused for its length, so the rules
    /// that need a key accepted would fail, and a malformed key would be refused for its
    /// length rather than for the fault it carries (a pass that proves nothing).
    fn key_within(&self, rule: Rule, n: u8, len: usize) -> Vec<u8> {
        let long = format!("idem-check-{}-{}-{n}", self.run, rule.name());
        if long.len() <= len {
            return long.into_bytes();
        }
        let tail = format!("{}{n}", ALL.iter().position(|r| *r == rule).unwrap_or_default());
        let head = &self.run[..len.saturating_sub(tail.len()).min(self.run.len())];
        format!("{head}{tail}").into_bytes()
    }

    fn req(&self, credential: usize, keys: Vec<Vec<u8>>, body: Body) -> Req {
        Req { method: self.method.clone(), safe: false, credential, keys, body }
    }

    fn plan(&self, rule: Rule) -> Plan {
        let one = |key: &Vec<u8>, body| vec![self.req(0, vec![key.clone()], body)];
        match rule {
            Rule::KeySyntax => {
                let key = self.key(rule, 0);
                let mut quoted = b"\"".to_vec();
                quoted.extend_from_slice(&key);
                quoted.push(b'"');
                let mut longest = self.key(rule, 1);
                longest.resize(self.max_key_len, b'k');
                let mut too_long = longest.clone();
                too_long.push(b'k');
                // The malformed keys are no longer than the longest valid one, so that
                // their fault alone is what a server can refuse them for.
                let mut inner_space = self.key_within(rule, 2, self.max_key_len - 1);
                inner_space.insert(4, b' ');
                let mut non_ascii = self.key_within(rule, 3, self.max_key_len - 2);
                non_ascii.extend_from_slice("é".as_bytes());
                let twice = self.key(rule, 4);
                vec![
                    one(&quoted, Body::First),
                    one(&key, Body::First),
                    one(&longest, Body::First),
                    one(&too_long, Body::First),
                    one(&Vec::new(), Body::First),
                    one(&inner_space, Body::First),
                    one(&non_ascii, Body::First),
                    vec![self.req(0, vec![twice.clone(), twice], Body::First)],
                ]
            }
            Rule::MissingKey if self.key_optional => {
                vec![vec![self.req(0, vec![], Body::First)], vec![self.req(0, vec![], Body::First)]]
            }
            Rule::MissingKey => vec![vec![self.req(0, vec![], Body::First)]],
            Rule::Replay | Rule::KeyExpires => {
                let key = self.key(rule, 0);
                vec![one(&key, Body::First), one(&key, Body::First)]
            }
            Rule::Mismatch => {
                let key = self.key(rule, 0);
                vec![one(&key, Body::First), one(&key, Body::Other), one(&key, Body::First)]
            }
            Rule::Scope => {
                let key = self.key(rule, 0);
                vec![
                    one(&key, Body::First),
                    vec![self.req(1, vec![key.clone()], Body::Other)],
                    vec![self.req(1, vec![key], Body::Other)],
                ]
            }
            Rule::Concurrent => {
                let key = self.key(rule, 0);
                vec![
                    (0..self.racers).map(|_| self.req(0, vec![key.clone()], Body::First)).collect(),
                    one(&key, Body::First),
                ]
            }
            Rule::SafeMethods => {
                let key = self.key(rule, 0);
                let get = |keys: Vec<Vec<u8>>| {
                    vec![Req { method: reqwest::Method::GET, safe: true, credential: 0, keys, body: Body::None }]
                };
                vec![get(vec![]), get(vec![key.clone()]), get(vec![key]), get(vec![b"not a key".to_vec()])]
            }
        }
    }

    async fn send(&self, req: &Req) -> Result<Seen, String> {
        let url = if req.safe { &self.safe_url } else { &self.url };
        let mut headers = self.headers.clone();
        let (name, value) = &self.credentials[req.credential];
        headers.insert(name.clone(), value.clone());
        for key in &req.keys {
            let value =
                HeaderValue::from_bytes(key).map_err(|e| format!("key {:?}: {e}", String::from_utf8_lossy(key)))?;
            headers.append("idempotency-key", value);
        }
        let body = match req.body {
            Body::First => self.first.clone(),
            Body::Other => self.other.clone(),
            Body::None => Vec::new(),
        };
        let mut builder = self.client.request(req.method.clone(), url).headers(headers);
        if req.body != Body::None {
            builder = builder.body(body);
        }
        let res = builder.send().await.map_err(|e| crate::chain(&e))?;
        let status = res.status().as_u16();
        let headers = res.headers().clone();
        let body = res.bytes().await.map_err(|e| crate::chain(&e))?.to_vec();
        Ok(Seen { status, headers, body })
    }

    /// Sends a rule's batches, the requests of a batch at once. After a batch with a
    /// request that got no answer the rule has failed, so the rest is not sent: against
    /// a host that drops packets, each rule then costs one `--timeout`, not one a batch.
    async fn run(&self, plan: &Plan) -> Vec<Result<Seen, String>> {
        let mut seen = Vec::new();
        for batch in plan {
            if let Some(Err(e)) = seen.iter().find(|s: &&Result<Seen, String>| s.is_err()) {
                let e = format!("not sent, an earlier request got no answer: {e}");
                seen.extend(batch.iter().map(|_| Err(e.clone())));
                continue;
            }
            let answers = futures::future::join_all(batch.iter().map(|r| self.send(r))).await;
            seen.extend(answers);
        }
        seen
    }
}

// --- judging ---------------------------------------------------------------------------

type Verdict = Result<String, String>;

fn header<'a>(seen: &'a Seen, name: &str) -> Option<&'a str> {
    seen.headers.get(name).and_then(|v| v.to_str().ok())
}

fn is_problem(seen: &Seen) -> bool {
    header(seen, "content-type").is_some_and(|t| t.trim().to_ascii_lowercase().starts_with("application/problem+json"))
}

fn brief(seen: &Seen) -> String {
    let mut s = seen.status.to_string();
    if is_problem(seen) {
        s.push_str(" problem+json");
        if let Ok(Value::Object(p)) = serde_json::from_slice::<Value>(&seen.body)
            && let Some(Value::String(t)) = p.get("type")
        {
            let _ = write!(s, " ({})", t.rsplit(['#', '/', ':']).next().unwrap_or(t));
        }
    }
    s
}

/// A header that tells a client to retry (`retry`) or not: `Retry-After` (RFC 9110
/// §10.2.3), `x-should-retry` (Stainless-generated SDKs) or `Stripe-Should-Retry`.
fn retry_hint(seen: &Seen, retry: bool) -> Option<String> {
    if retry && seen.headers.contains_key("retry-after") {
        return Some("Retry-After".into());
    }
    let want = if retry { "true" } else { "false" };
    ["x-should-retry", "stripe-should-retry"]
        .into_iter()
        .find(|h| header(seen, h).is_some_and(|v| v.trim().eq_ignore_ascii_case(want)))
        .map(|h| format!("{h}: {want}"))
}

fn ok<'a>(seen: &'a Result<Seen, String>, what: &str) -> Result<&'a Seen, String> {
    seen.as_ref().map_err(|e| format!("{what}: no answer: {e}"))
}

fn success(seen: &Seen, what: &str) -> Result<(), String> {
    if (200..300).contains(&seen.status) {
        Ok(())
    } else {
        Err(format!("{what} got {}, not a 2xx: the checks need an operation that succeeds", brief(seen)))
    }
}

impl Setup {
    fn replayed(&self, seen: &Seen) -> bool {
        self.replayed
            .as_ref()
            .is_some_and(|h| seen.headers.get(h).is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true")))
    }

    /// `again` is `first` replayed: same status, body, `Location`, `Content-Type` and
    /// `ETag`, marked as a replay.
    fn is_replay_of(&self, again: &Seen, first: &Seen, what: &str) -> Result<(), String> {
        if again.status != first.status {
            return Err(format!("{what} got {}, the first answer was {}", brief(again), first.status));
        }
        if again.body != first.body {
            return Err(format!(
                "{what} got {} with a different body ({} bytes, the first {} bytes)",
                again.status,
                again.body.len(),
                first.body.len()
            ));
        }
        // The same bytes under another Content-Type are another representation: a replay
        // that loses the stored headers (or adds a generic type) decodes differently.
        for name in ["Location", "Content-Type", "ETag"] {
            if header(again, name) != header(first, name) {
                return Err(format!(
                    "{what}: {name} {:?}, the first answer's {:?}",
                    header(again, name),
                    header(first, name)
                ));
            }
        }
        if let Some(h) = &self.replayed
            && !self.replayed(again)
        {
            return Err(format!("{what} has the first answer's bytes but no `{h}: true`"));
        }
        Ok(())
    }

    fn fresh(&self, seen: &Seen, what: &str) -> Result<(), String> {
        success(seen, what)?;
        if self.replayed(seen) {
            return Err(format!("{what} (a new key) is marked as a replay"));
        }
        Ok(())
    }

    /// A refused key or request: 400 (or 422 for a malformed key), a problem body.
    fn refused(seen: &Seen, what: &str, statuses: &[u16]) -> Result<(), String> {
        if statuses.contains(&seen.status) && is_problem(seen) {
            Ok(())
        } else {
            Err(format!("{what} got {}, expected {statuses:?} with application/problem+json", brief(seen)))
        }
    }

    /// `Retry-After` as delay-seconds or an HTTP-date (RFC 9110 §10.2.3), in seconds.
    fn retry_after(seen: &Seen) -> Option<u64> {
        let v = header(seen, "retry-after")?.trim();
        if let Ok(secs) = v.parse::<u64>() {
            return Some(secs);
        }
        let at = httpdate::parse_http_date(v).ok()?;
        Some(at.duration_since(SystemTime::now()).map_or(0, |d| d.as_secs()))
    }

    fn judge(&self, rule: Rule, seen: &[Result<Seen, String>]) -> Verdict {
        match rule {
            Rule::KeySyntax => {
                let quoted = ok(&seen[0], "the sf-string key")?;
                self.fresh(quoted, "the sf-string key `\"K\"`")?;
                self.is_replay_of(ok(&seen[1], "the bare key")?, quoted, "the bare key `K` after `\"K\"`")?;
                self.fresh(ok(&seen[2], "the longest key")?, &format!("a {}-byte key", self.max_key_len))?;
                let bad = [
                    (3, format!("a {}-byte key", self.max_key_len + 1)),
                    (4, "an empty key".to_owned()),
                    (5, "a key with a space inside".to_owned()),
                    (6, "a key with a non-ASCII byte".to_owned()),
                    (7, "two Idempotency-Key fields".to_owned()),
                ];
                for (i, what) in &bad {
                    Self::refused(ok(&seen[*i], what)?, what, &[400, 422])?;
                }
                Ok(format!(
                    "\"K\" and K name one key; a {}-byte key runs; {} bytes, empty, inner space, non-ASCII and two fields get {}",
                    self.max_key_len,
                    self.max_key_len + 1,
                    brief(ok(&seen[3], "")?)
                ))
            }
            Rule::MissingKey if self.key_optional => {
                let (a, b) = (ok(&seen[0], "a keyless request")?, ok(&seen[1], "a second keyless request")?);
                if a.status == 400 {
                    return Err(format!(
                        "a keyless request got {}: keys are required on this server, leave out --key-optional",
                        brief(a)
                    ));
                }
                self.fresh(a, "a keyless request")?;
                self.fresh(b, "a second keyless request")?;
                if header(a, "location").is_some() && header(a, "location") == header(b, "location") {
                    return Err(format!("two keyless requests got one Location {:?}: merged", header(a, "location")));
                }
                Ok(format!("two keyless requests ran apart ({} and {})", a.status, b.status))
            }
            Rule::MissingKey => {
                let a = ok(&seen[0], "a keyless request")?;
                if (200..300).contains(&a.status) {
                    return Err(format!(
                        "a keyless request ran ({}), expected 400: if keys are optional on this server, give \
                         --key-optional",
                        a.status
                    ));
                }
                Self::refused(a, "a keyless request", &[400])?;
                Ok(format!("a keyless request got {}", brief(a)))
            }
            Rule::Replay => {
                let first = ok(&seen[0], "the first request")?;
                self.fresh(first, "the first request")?;
                self.is_replay_of(ok(&seen[1], "the retry")?, first, "the retry")?;
                Ok(format!(
                    "the retry got {} again, {} body bytes and Location {} identical{}",
                    first.status,
                    first.body.len(),
                    header(first, "location").unwrap_or("(none)"),
                    self.replayed.as_ref().map_or(String::new(), |h| format!(", `{h}: true`"))
                ))
            }
            Rule::Mismatch => {
                let first = ok(&seen[0], "the first request")?;
                self.fresh(first, "the first request")?;
                let other = ok(&seen[1], "the same key with another body")?;
                let what = "the same key with another body";
                if self.replayed(other) || (other.status == first.status && other.body == first.body) {
                    let hint = if self.other_derived {
                        " (if the server drops unknown JSON members, the derived other body is the same \
                         request to it: give --other-body)"
                    } else {
                        ""
                    };
                    return Err(format!("{what} got the first request's answer replayed ({}){hint}", other.status));
                }
                Self::refused(other, what, &[400, 409, 422])?;
                if let Some(hint) = retry_hint(other, true) {
                    return Err(format!(
                        "{what} got {} with {hint}: a client would retry a request that can never succeed",
                        brief(other)
                    ));
                }
                self.is_replay_of(
                    ok(&seen[2], "the first body again")?,
                    first,
                    "the first body again, after the mismatch",
                )?;
                let stop = match retry_hint(other, false) {
                    Some(hint) => format!(", {hint}"),
                    // Stainless- and Stripe-style SDKs retry a bare 409 on their own.
                    None if other.status == 409 => ", no retry hint (SDKs that retry any 409 will)".to_owned(),
                    None => String::new(),
                };
                Ok(format!("another body got {} without Retry-After{stop}; the first body still replays", brief(other)))
            }
            Rule::Scope => {
                let first = ok(&seen[0], "the first principal's request")?;
                self.fresh(first, "the first principal's request")?;
                let second = ok(&seen[1], "the second principal's request with the same key")?;
                let what = "the second principal's request with the same key";
                // Equal bytes tell a replay only when the server marks none: a server that
                // marks its replays may answer every operation with one body (a 202
                // `{"status":"accepted"}`), so its unmarked answer ran.
                let same_bytes = second.status == first.status && second.body == first.body;
                if self.replayed(second) || (self.replayed.is_none() && same_bytes) {
                    return Err(format!(
                        "{what} got the first principal's answer ({}): keys are not scoped by principal",
                        second.status
                    ));
                }
                self.fresh(second, what).map_err(|e| format!("{e}: keys are not scoped by principal"))?;
                if header(first, "location").is_some() && header(first, "location") == header(second, "location") {
                    return Err(format!("{what} got the first principal's Location: keys are not scoped by principal"));
                }
                self.is_replay_of(ok(&seen[2], "its retry")?, second, "the second principal's retry")?;
                Ok(format!(
                    "the second principal's request ran ({}), and its retry replays its own answer",
                    second.status
                ))
            }
            Rule::Concurrent => self.judge_racers(seen),
            Rule::SafeMethods => {
                let plain = ok(&seen[0], "a GET without a key")?;
                for (i, what) in [(1, "a keyed GET"), (2, "the keyed GET again"), (3, "a GET with a malformed key")] {
                    let s = ok(&seen[i], what)?;
                    if s.status != plain.status {
                        return Err(format!(
                            "{what} got {}, a GET without a key {}: the key was looked at",
                            brief(s),
                            plain.status
                        ));
                    }
                    if self.replayed(s) || s.headers.contains_key("idempotency-key-expires") {
                        return Err(format!("{what} carries idempotency headers: a safe method was recorded"));
                    }
                }
                Ok(format!(
                    "GET answered {} with a key, without one and with a malformed one, never as a replay",
                    plain.status
                ))
            }
            Rule::KeyExpires => {
                let first = ok(&seen[0], "the first request")?;
                self.fresh(first, "the first request")?;
                // A server that keeps no record yet stamps the header on every answer would
                // announce the same date twice within a second: only a replay proves a record.
                let again = ok(&seen[1], "the retry")?;
                self.is_replay_of(again, first, "the retry")?;
                let Some(value) = header(first, "idempotency-key-expires") else {
                    return Err("the first answer has no Idempotency-Key-Expires".into());
                };
                let at = httpdate::parse_http_date(value)
                    .map_err(|_| format!("Idempotency-Key-Expires {value:?} is not an HTTP-date (RFC 9110 §5.6.7)"))?;
                let now = SystemTime::now();
                let ahead =
                    at.duration_since(now).map_err(|_| format!("Idempotency-Key-Expires {value:?} has passed"))?;
                if ahead > self.max_retention {
                    return Err(format!(
                        "Idempotency-Key-Expires {value:?} is {} ahead, more than --max-retention",
                        humantime::format_duration(Duration::from_secs(ahead.as_secs()))
                    ));
                }
                if header(again, "idempotency-key-expires") != Some(value) {
                    return Err(format!(
                        "the replay's Idempotency-Key-Expires is {:?}, the first answer's {value:?}",
                        header(again, "idempotency-key-expires")
                    ));
                }
                Ok(format!(
                    "{value} ({} ahead), the same on the replay",
                    humantime::format_duration(Duration::from_secs(ahead.as_secs()))
                ))
            }
        }
    }

    /// Exactly one racer ran the operation; each other one waited (409 in flight, with a
    /// sane `Retry-After`) or got its answer replayed; a later retry replays it too.
    fn judge_racers(&self, seen: &[Result<Seen, String>]) -> Verdict {
        let (racers, last) = seen.split_at(self.racers);
        let racers = racers.iter().map(|s| ok(s, "a racer")).collect::<Result<Vec<_>, _>>()?;
        let ran: Vec<&&Seen> = racers.iter().filter(|s| (200..300).contains(&s.status) && !self.replayed(s)).collect();
        let winner = match ran.as_slice() {
            [one] => **one,
            [] => {
                let all: Vec<String> = racers.iter().map(|s| brief(s)).collect();
                return Err(format!("no racer ran the operation: {}", all.join(", ")));
            }
            many => {
                let locations: Vec<&str> = many.iter().filter_map(|s| header(s, "location")).collect();
                // Without a replay marker, equal bytes are indistinguishable from a replay.
                let distinct =
                    many.iter().any(|s| s.body != many[0].body || header(s, "location") != header(many[0], "location"));
                if self.replayed.is_some() || distinct {
                    return Err(format!(
                        "{} of {} racers with one key ran the operation{}",
                        many.len(),
                        racers.len(),
                        if locations.is_empty() {
                            String::new()
                        } else {
                            format!(" (Location {})", locations.join(", "))
                        }
                    ));
                }
                *many[0]
            }
        };
        let (mut waited, mut replayed) = (0, 0);
        for s in &racers {
            if std::ptr::eq(*s, winner) {
                continue;
            }
            if s.status == 409 {
                if !is_problem(s) {
                    return Err(format!("a racer got 409 without a problem body ({})", brief(s)));
                }
                if let Some(hint) = retry_hint(s, false) {
                    return Err(format!(
                        "a racer got 409 in flight with {hint}: its client gives up on an operation that will succeed"
                    ));
                }
                match Self::retry_after(s) {
                    None => {
                        return Err(format!(
                            "a racer got {} without Retry-After: its client cannot tell when to retry",
                            brief(s)
                        ));
                    }
                    Some(0) => {
                        return Err("a racer got 409 with Retry-After: 0: its client retries at once, in a loop".into());
                    }
                    Some(n) if n > self.max_retry_after => {
                        return Err(format!("a racer got 409 with Retry-After: {n}, more than --max-retry-after"));
                    }
                    Some(_) => waited += 1,
                }
            } else {
                self.is_replay_of(s, winner, "a racer")?;
                replayed += 1;
            }
        }
        self.is_replay_of(ok(&last[0], "the retry after the race")?, winner, "the retry after the race")?;
        Ok(format!(
            "{} racers: 1 ran ({}), {waited} got 409 with Retry-After, {replayed} got the replay; the retry after replays",
            racers.len(),
            winner.status
        ))
    }
}

// --- the run and its report --------------------------------------------------------------

/// Writes `text` to stdout in one piece. A reader that went away (`| head`) is no
/// failure and no panic, as `println!` would make it: the exit code still says whether
/// the rules passed.
fn emit(text: &str) {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(text.as_bytes()).and_then(|()| out.flush());
}

/// `idem check`: whether every rule passed (the report is printed either way).
pub(crate) async fn check(args: CheckArgs, json_out: bool) -> Result<bool, Failure> {
    let dry_run = args.dry_run;
    let setup = Setup::new(args)?;
    let plans: Vec<(Rule, Plan)> = setup.rules.iter().map(|&r| (r, setup.plan(r))).collect();
    let requests: usize = plans.iter().map(|(_, p)| p.iter().map(Vec::len).sum::<usize>()).sum();
    let head = format!("{} {}", setup.method, setup.url);
    if dry_run {
        setup.dry_run(&plans, requests, json_out);
        return Ok(true);
    }
    let mut rows = Vec::new();
    for (rule, plan) in &plans {
        let seen = setup.run(plan).await;
        rows.push((*rule, setup.judge(*rule, &seen)));
    }
    let failed = rows.iter().filter(|(_, v)| v.is_err()).count();
    if json_out {
        let rules: Vec<Value> = rows
            .iter()
            .map(|(r, v)| match v {
                Ok(saw) => json!({"rule": r.name(), "passed": true, "saw": saw}),
                Err(saw) => json!({"rule": r.name(), "passed": false, "saw": saw}),
            })
            .collect();
        emit(&format!(
            "{}\n",
            json!({"url": setup.url, "method": setup.method.as_str(), "requests": requests, "passed": failed == 0, "rules": rules})
        ));
    } else {
        let mut text = format!("idem check {head}: {} rules, {requests} requests\n", rows.len());
        for (rule, v) in &rows {
            let (mark, saw) = match v {
                Ok(s) => ("PASS", s),
                Err(s) => ("FAIL", s),
            };
            let _ = writeln!(text, "{mark}  {:<13} {saw}", rule.name());
        }
        let _ = writeln!(text, "{} passed, {failed} failed", rows.len() - failed);
        emit(&text);
    }
    Ok(failed == 0)
}

impl Setup {
    /// Whether a conforming server runs the operation for `req`, given the requests before
    /// it: the first use of a valid key by its principal, or a keyless request the server
    /// runs without idempotency.
    fn runs(&self, req: &Req, used: &mut Vec<(usize, Vec<u8>)>) -> bool {
        if req.safe {
            return false;
        }
        let key = match req.keys.as_slice() {
            [] => return self.key_optional,
            [one] => one.strip_prefix(b"\"").and_then(|k| k.strip_suffix(b"\"")).unwrap_or(one),
            _ => return false,
        };
        let valid = (1..=self.max_key_len).contains(&key.len()) && key.iter().all(|b| (0x21..=0x7e).contains(b));
        if !valid || used.iter().any(|(c, k)| *c == req.credential && k == key) {
            return false;
        }
        used.push((req.credential, key.to_vec()));
        true
    }

    /// `--dry-run`: every request, in order, with what it would send; credentials by
    /// number and header name, never their values.
    fn dry_run(&self, plans: &[(Rule, Plan)], requests: usize, json_out: bool) {
        let mut used = Vec::new();
        let mut rows = Vec::new();
        for (rule, plan) in plans {
            for (batch_no, batch) in plan.iter().enumerate() {
                for req in batch {
                    let runs = self.runs(req, &mut used);
                    let keys: Vec<String> = req.keys.iter().map(|k| String::from_utf8_lossy(k).into_owned()).collect();
                    rows.push(json!({
                        "rule": rule.name(),
                        "batch": batch_no,
                        "at_once": batch.len(),
                        "method": req.method.as_str(),
                        "url": if req.safe { &self.safe_url } else { &self.url },
                        "credential": req.credential + 1,
                        "credential_header": self.credentials[req.credential].0.as_str(),
                        "idempotency_keys": keys,
                        "body": match req.body { Body::First => "body", Body::Other => "other", Body::None => "none" },
                        "runs_operation": runs,
                    }));
                }
            }
        }
        let operations = rows.iter().filter(|r| r["runs_operation"] == true).count();
        if json_out {
            emit(&format!("{}\n", json!({"dry_run": true, "requests": rows, "operations": operations})));
            return;
        }
        let mut text = format!(
            "idem check {} {} --dry-run: {requests} requests; a conforming server runs the operation {operations} times\n",
            self.method, self.url
        );
        for r in &rows {
            let keys = match r["idempotency_keys"].as_array().map(Vec::as_slice) {
                Some([]) | None => "no key".to_owned(),
                Some(keys) => keys
                    .iter()
                    .map(|k| format!("Idempotency-Key: {}", k.as_str().unwrap_or_default()))
                    .collect::<Vec<_>>()
                    .join(", "),
            };
            let at_once = r["at_once"].as_u64().unwrap_or(1);
            let _ = writeln!(
                text,
                "{:<13} {} {}  credential #{} ({}), {keys}, body: {}{}{}",
                r["rule"].as_str().unwrap_or_default(),
                r["method"].as_str().unwrap_or_default(),
                r["url"].as_str().unwrap_or_default(),
                r["credential"],
                r["credential_header"].as_str().unwrap_or_default(),
                r["body"].as_str().unwrap_or_default(),
                if at_once > 1 { format!(", {at_once} at once") } else { String::new() },
                if r["runs_operation"] == true { "  [runs the operation]" } else { "" },
            );
        }
        emit(&text);
    }
}
