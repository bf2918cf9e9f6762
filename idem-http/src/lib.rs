//! # idem-http
//!
//! Tower middleware that makes retried HTTP requests safe: a client sends an
//! `Idempotency-Key` with a request that changes something, and every retry of it with the
//! same key gets the first attempt's response instead of doing the work again
//! (draft-ietf-httpapi-idempotency-key-header, Stripe's semantics). Records live in any
//! [`idem_core::Store`]; every setting is a method of [`IdempotencyLayer`] (see
//! [Settings](#settings)), and what a retry gets is [`idem_core::decide`]'s decision.
//!
//! ```
//! use std::sync::Arc;
//! use axum::{Router, body::Body, http::{Request, StatusCode}, routing::post};
//! use idem_core::MemoryStore;
//! use idem_http::IdempotencyLayer;
//! use tower::ServiceExt;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let app = Router::new()
//!     .route("/v1/workers", post(|| async {
//!         (StatusCode::CREATED, [("location", "/v1/workers/7")], r#"{"id":7}"#)
//!     }))
//!     .layer(IdempotencyLayer::new(Arc::new(MemoryStore::new())));
//!
//! let request = || Request::post("/v1/workers")
//!     .header("authorization", "Bearer token-of-ml-eval")
//!     .header("idempotency-key", "7c3f5d1e-91a4")
//!     .header("content-type", "application/json")
//!     .body(Body::from(r#"{"size":"large"}"#))
//!     .unwrap();
//!
//! let first = app.clone().oneshot(request()).await.unwrap();
//! assert_eq!(first.status(), StatusCode::CREATED);
//! let retry = app.oneshot(request()).await.unwrap();
//! assert_eq!(retry.status(), StatusCode::CREATED);
//! assert_eq!(retry.headers()["location"], "/v1/workers/7");
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//! # }
//! ```
//!
//! # Settings
//! Every setting is a `with_*` method of [`IdempotencyLayer`], so an application names
//! only this crate (and its store). They come in two kinds:
//! - **Record rules**: how long a record lives and what it stores: retention, lease TTL,
//!   the 4xx statuses that are not stored, the largest stored body (bytes), the
//!   compression threshold (bytes), the response header deny list. They are an
//!   [`idem_core::Policy`] (re-exported here as [`Policy`]), because they describe the
//!   record whatever front end writes it; the layer's `with_retention`, `with_lease_ttl`,
//!   `with_uncacheable_4xx`, `with_max_stored_body`, `with_compress_over` and
//!   `with_header_deny_list` set one rule each, [`IdempotencyLayer::with_policy`] all of
//!   them at once.
//! - **Requests and answers**: how this layer reads a request and answers it: key
//!   requirement and longest key (bytes), principal resolver and what a missing principal
//!   gets, largest buffered request body (bytes), fingerprinted headers and fingerprint
//!   mode, mismatch status, store failure mode, where the handler runs, lease renewal,
//!   the in-flight `Retry-After` cap, the bounded wait and the store deadlines. Their types live
//!   in [`config`]; they are HTTP's business, not the record's, so [`idem_core::Policy`]
//!   does not carry them.
//!
//! Durations are [`std::time::Duration`]; sizes are in bytes. The table of defaults is on
//! [`IdempotencyLayer`].
//!
//! # What a request gets
//! Safe methods (GET, HEAD, OPTIONS, TRACE; RFC 9110 §9.2.1) pass through untouched. For
//! every other method:
//!
//! | request | response |
//! |---|---|
//! | no `Idempotency-Key` | 400 `missing-idempotency-key` ([`KeyRequirement::Required`], default), or the handler runs and nothing is stored ([`KeyRequirement::Optional`]) |
//! | empty, blank, longer than `max_key_len` bytes, non-ASCII or malformed key | 400 `invalid-idempotency-key` |
//! | two or more `Idempotency-Key` fields, equal or not | 400 `duplicate-idempotency-key` |
//! | no principal | 401 `missing-principal` with the resolver's `WWW-Authenticate` challenge ([`MissingPrincipal::Reject`], default), or run unprotected ([`MissingPrincipal::SkipIdempotency`]) |
//! | body over `max_request_body` | 413 `body-too-large`; nothing claimed |
//! | new key | claim, run the handler, store the response, return it |
//! | same request, first attempt still running | 409 `in-flight` + `Retry-After`: the remaining lease clamped to [1 s, 2 s] ([`IdempotencyLayer::with_in_flight_retry_after`] sets the cap); or, opt-in, a bounded wait for the first attempt's outcome ([`IdempotencyLayer::with_in_flight_wait`]) |
//! | same request, first attempt's lease expired, or it failed | reclaim by compare-and-set; the winner runs the handler |
//! | same request, completed | replay: stored status, headers, body + `Idempotent-Replayed: true` |
//! | different request (method, path, query, fingerprinted headers, body) | the layer's mismatch status ([`MismatchStatus`], 409 default) `mismatch`; never retry |
//! | the record changed under the request three times in a row | 409 `busy` + `Retry-After: 1` |
//! | store unreachable | 503 `store-unavailable` + `Retry-After: 1`, handler not run ([`StoreFailureMode::FailClosed`], default); or the handler runs unprotected and a warning is logged ([`StoreFailureMode::FailOpen`]) |
//! | record that does not decode (`StoreError::Corrupt`, on every backend), or a completed record whose stored response does not decode | 503 `store-unavailable` + `x-should-retry: false`, logged as an error, in both failure modes (running again could repeat a completed operation) |
//!
//! Every response about an existing record (run, replay, in flight, mismatch) carries
//! [`IDEMPOTENCY_KEY_EXPIRES`], a non-standard field with the HTTP-date until which the key
//! is retained. A handler's response that the store could not keep (still out when the
//! completion retries end, or the lease lost to another attempt) is returned as it is,
//! marked [`IDEMPOTENT_STORED`]` false`: a retry of the key will not replay it. All problem
//! bodies are RFC 9457 `application/problem+json` ([`problem`]).
//!
//! # Keys
//! The key is parsed by [`idem_core::IdempotencyKey::parse_with_limit`] with the layer's
//! `max_key_len` (default 255 bytes, [`IdempotencyLayer::with_max_key_len`]): a bare token or an RFC 8941 sf-string (`"abc"` and
//! `abc` are the same key), visible ASCII only, case-sensitive. Whitespace inside the key
//! is refused, never trimmed; the optional whitespace around a field value (RFC 9110 §5.5)
//! is not part of the value, so ` K` on the wire is the key `K` (hyper strips it before the
//! layer sees the request anyway). Non-ASCII keys are refused, so Unicode normalisation
//! forms can never merge. The header name is matched case-insensitively.
//!
//! Two or more `Idempotency-Key` fields are a 400 even when they carry the same value: the
//! field is a single item (draft §2.1), and a repeated field means a broken client or
//! proxy, which the server reports rather than guesses around.
//!
//! # Scope and fingerprint
//! The record is scoped by (principal, endpoint). The principal comes from a
//! [`PrincipalResolver`] (default [`BearerToken`]). The endpoint is the method plus axum's
//! route template (`POST /v1/workers/{id}/reboot`) when the request went through an axum
//! `Router` (feature `axum`, on by default, reads `MatchedPath`); otherwise the method plus
//! the concrete path, so resolved path parameters are then part of the scope. The
//! fingerprint always covers the method, raw path, query, the layer's fingerprinted
//! headers (default `content-type`, [`IdempotencyLayer::with_fingerprint_headers`]) and the
//! raw body bytes (or, opt-in, their canonical JSON form,
//! [`IdempotencyLayer::with_fingerprint_mode`]): a key reused on another resource is a
//! mismatch, never someone else's replay.
//!
//! With axum, put the layer on the router with `Router::layer` (or `route_layer`), as in the
//! example above: axum sets `MatchedPath` before route middleware runs. A layer wrapped
//! around the whole `Router` from outside (`IdempotencyLayer::layer(router)`, or a
//! `ServiceBuilder` in front of it) runs before routing and scopes by concrete path.
//!
//! # After the handler
//! The layer looks at the handler's response head first, then, before the response is
//! returned to the client:
//! - status cacheable per [`idem_core::Policy::is_cacheable`] (2xx, 303, and 4xx except
//!   401, 403, 408, 409, 423, 425, 429): the body is read up to `max_stored_body + 1`
//!   bytes ([Streamed and large responses](#streamed-and-large-responses)). A body that
//!   ends within the limit is stored: `complete` with the status, the kept headers
//!   ([Stored headers](#stored-headers)), the body (LZ4 over `compress_over`) and the
//!   trailers. A longer, endless or streaming body completes the record as not retained
//!   (status and kept headers, no body) and then streams through; a replay answers a
//!   `response-not-retained` problem with the original status and `Location`;
//! - anything else (5xx, 1xx, 3xx other than 303, uncacheable 4xx, a gRPC status that is
//!   not lasting, see [`grpc`]): `fail`, so the retry runs again; the body is not read by
//!   the layer at all and streams through;
//! - a handler may override the status rule for one response with the [`ResponseCaching`]
//!   response extension (never to store a 5xx);
//! - the handler returns an error, panics, or its body fails while the layer reads it:
//!   `fail`. A panic is re-raised after the write; a body failure answers 500
//!   `response-body-failed`. A body that fails after it started streaming (the record is
//!   already complete, not retained) ends the client's response early; the retry gets
//!   the `response-not-retained` problem;
//! - the client disconnects mid-handler: see [Where the handler runs](#where-the-handler-runs).
//!
//! 303 See Other is stored because it is how a server answers a POST whose work is done
//! and whose result lives elsewhere (post/redirect/get); the other 3xx say the request was
//! not processed here (301, 302, 307, 308 send it elsewhere, 300 asks the client to choose,
//! 304 answers a conditional GET), so a retry runs again.
//!
//! # Streamed and large responses
//! Memory per request is bounded whatever the response size: the layer holds at most
//! `max_stored_body` bytes plus the one frame that crossed it. It stops buffering, records
//! the response as completed and not retained, and passes everything read so far and the
//! rest of the body straight to the client when:
//! - the body passes `max_stored_body` bytes (or its declared length is larger);
//! - the response's media type is a streaming one (default `text/event-stream`,
//!   [`IdempotencyLayer::with_streaming_content_types`]): at once, before any of its body;
//! - the body is still open 500 ms after the head ([`IdempotencyLayer::with_buffer_deadline`]):
//!   chunked progress, a long poll.
//!
//! The record completes before the first byte leaves, so a retry of a streamed operation,
//! during the stream or after it, never runs the handler again: it gets the
//! `response-not-retained` problem with the original status and `Location` (and, over
//! gRPC, `ALREADY_EXISTS`). A client that must be able to fetch the result again should be
//! sent a `Location` to read it from.
//!
//! # Stored headers
//! A record keeps every response header (and trailer) except the hop-by-hop ones (RFC 9110
//! §7.6.1), those a response's own `Connection` field names, and the deny list: default
//! `set-cookie` and `date`; [`IdempotencyLayer::with_header_deny_list`] adds to it, and
//! only [`IdempotencyLayer::with_header_deny_list_replaced`] drops a default.
//!
//! # Trailers and gRPC
//! Trailers are stored with the body and replayed after it. A gRPC service behind the layer
//! (the key in `idempotency-key` metadata) gets back its message and `grpc-status` on a
//! retry; the layer's own answers to a gRPC request are gRPC statuses, not problem bodies.
//! The mapping, and which gRPC outcomes are stored, are in [`grpc`]; `examples/grpc` runs
//! a tonic service behind the layer.
//!
//! # Retry hints
//! The layer's own answers carry `x-should-retry: false` when retrying with the same key
//! cannot help (mismatch, key and principal errors, a too large request, a not-retained
//! replay, a record that does not decode) and `x-should-retry: true` when it can (in flight,
//! busy, store unavailable): generated SDKs that retry every 409 stop at a mismatch at
//! once. `Stripe-Should-Retry` is opt-in. See [`hints`] and
//! [`IdempotencyLayer::with_retry_hints`].
//!
//! When `complete` or `fail` is refused with `LeaseLost` (the lease ran out, renewal off or
//! refused, and a retry reclaimed the record), the response still goes to this client and
//! a warning is logged; the newer attempt owns the record. When `complete` fails for any other store error, the
//! response is still returned (the work is done; hiding it would only provoke a retry) and
//! an error is logged; the record stays in flight until its lease ends, then a retry
//! reclaims it and the handler runs again. Handlers whose side effects must not repeat even
//! then should key them with sub-keys derived from [`IdempotencyContext`].
//!
//! Marking a record failed lets a retry run the handler again. That is only safe when the
//! handler's side effects are transactional with its response, or keyed downstream by a
//! stable sub-key (see [Resumable handlers](#resumable-handlers)).
//!
//! # Where the handler runs
//! A server drops a request's response future when its client goes away, and everything
//! that future owns is cancelled at its next await point. [`HandlerExecution`] decides
//! whether the handler is among those things.
//!
//! [`HandlerExecution::Detached`] (default): after a successful claim or reclaim, the
//! handler call, the reading of its response body and the `complete`/`fail` write are work
//! that outlives the response future: polled in place while the client waits, moved to a
//! `tokio::spawn`ed task only when the response future is dropped first. A disconnect does
//! not reach the handler: the work finishes, its response is stored, and the client's
//! retry gets 409 `in-flight` while it runs, then the replay. The handler runs once. A panic
//! marks the record failed inside the work and is re-raised from the response future if it
//! is still alive; a moved task cancelled by runtime shutdown marks the record failed
//! through its drop guard, or the lease frees it.
//!
//! Detached is the default because infrastructure handlers do their work in steps whose
//! effects outlive a cancelled future: a `spawn_blocking` transaction that allocates a node
//! runs to its commit whatever happens to the future awaiting it, and a handler stopped
//! between two downstream calls has made the first. Cancelled inline, such a handler leaves
//! the side effect behind and the record failed, so the retry runs it again: two nodes for
//! one request, the second one a phantom nobody tracks.
//!
//! [`HandlerExecution::Inline`] (`IdempotencyLayer::with_handler_execution`) runs the
//! handler inside the response future, like any tower middleware: a disconnect cancels it
//! at its next await point, a drop guard marks the record failed (spawning the write on the
//! tokio runtime), and a retry runs the handler again. Use it only for handlers that are
//! safe to cancel and repeat (side effects transactional with the response, or keyed
//! downstream by a sub-key from [`IdempotencyContext`]), or that need task-locals, which
//! detached work loses when it moves to its own task. Either way the wrapped service must be `Clone + Send +
//! 'static` with `Send` futures and bodies, as axum's are.
//!
//! # Lease renewal
//! A claim holds its record for the lease TTL. While the handler runs, the layer renews
//! that lease ([`LeaseRenewal`], default every lease / 3): a fenced
//! [`idem_core::Store::extend`] that moves the lease to the store's `now` + the lease TTL,
//! and only while this attempt still holds the claim. The renewal is timed with tokio
//! timers and polled together with the handler's work, so it stops when the handler ends
//! (returns, errors, panics, or is cancelled) and dies with its process; under
//! [`HandlerExecution::Detached`] it moves with the work when the client goes away.
//!
//! A renewal that fails transiently is retried with a short backoff while the lease still
//! has time, and so is one the store reports unavailable without retry (a full disk): the
//! store may recover while the handler runs on. One refused with `LeaseLost` (the lease ran out, say the process was paused
//! longer than the lease, and a retry reclaimed the record) stops renewing and tells the
//! handler: [`IdempotencyContext::lease_lost`] resolves, [`IdempotencyContext::is_lease_lost`]
//! turns true, [`Resumable`] steps and intents refuse to start
//! ([`StepError::LeaseLost`]), and a warning is logged. The handler should stop before its
//! next side effect; if it returns anyway, its response goes to its client but the store
//! refuses to record it (the write is fenced by the fencing token), so the newer attempt's
//! outcome is the one every retry replays.
//!
//! ## Picking the lease
//! - **Seconds, not the longest operation.** With renewal on, the lease only has to outlast
//!   the gap between two renewals plus a store hiccup; a 30-minute firmware flash under a
//!   10 s lease is renewed every 3.3 s and stays claimed from start to end.
//! - **A dead holder is detected within one lease.** A killed process stops renewing; its
//!   lease ends at most one lease TTL after its last renewal, and the next retry reclaims
//!   the record. A long lease only makes that wait longer.
//! - **Not shorter than a stall you want to survive.** A process paused (GC, VM
//!   migration, a stopped container) longer than the lease loses its claim; the retry
//!   that reclaims runs the handler again, and the paused one is fenced when it resumes.
//!   Pick the lease above the pauses you expect: 10 to 30 s suits most services.
//! - **Renewal off?** Then the lease must exceed the slowest handler, and a dead holder
//!   blocks its key for that long ([`LeaseRenewal::Off`] is for stores without `extend` or
//!   for handlers that are always short).
//!
//! Renewal costs one store write per running handler per interval: at the default
//! (lease / 3), a 10 s lease adds 0.3 writes per second per running handler, nothing for
//! handlers shorter than one interval.
//!
//! # In-flight answers
//! A retry that finds the first attempt still running gets 409 `in-flight` with
//! `Retry-After` = the remaining lease, at least 1 s and at most the cap (default 2 s,
//! [`IdempotencyLayer::with_in_flight_retry_after`]). Under renewal the remaining lease says
//! nothing about when the outcome will be stored, so the answer is a poll interval: the
//! client (such as `idem-client`) asks again within seconds and gets the replay soon after
//! the response is stored.
//!
//! Opt-in, [`IdempotencyLayer::with_in_flight_wait`]`(Some(limit))` lets the duplicate wait
//! instead: the layer reads the record again after short pauses (20 ms doubling to 500 ms)
//! for up to `limit`, holding no connection or lock in between, and answers the replay once
//! the record completed, runs the handler (after a reclaim) if the record failed or its
//! lease ran out, or gives the usual 409 when `limit` has passed.
//!
//! # Resumable handlers
//! The layer stores the response of a handler that finished. A handler that dies half-way
//! (the process is killed after it allocated a node and before it booted the VM) leaves side
//! effects the record does not know about; the retry reclaims the record once the lease
//! ends and runs the handler again from the top. [`IdempotencyContext::resumable`] gives the
//! handler a [`Resumable`] handle on its record, so the retry finds what the dead attempt
//! did. Each tool fits one kind of downstream call:
//!
//! | the call | use | why it converges |
//! |---|---|---|
//! | takes a caller-supplied id or idempotency key (a payment API, a cloud `ClientToken`, a pool that remembers who asked) | [`IdempotencyContext::subkey`] as that key | every attempt sends the same [`SubKey`]; the downstream system deduplicates |
//! | local and transactional, or keyed by the sub-key, and its result is needed later (the node id) | [`Resumable::step`] | the result is journalled in the store, fenced by the attempt's token; a retry gets it back without running the future |
//! | takes no caller id but can be found afterwards (a VM booted with a tag) | [`Resumable::intent`] with the sub-key as the tag | `pending` is journalled before the call; a retry that finds it asks `reconcile` (list by tag) before issuing again, and fails as ambiguous if it cannot tell |
//!
//! A step alone is not enough for a call that is not idempotent: an attempt killed after
//! the call and before the journal write leaves no trace, and the retry calls again. Give
//! the call the step's sub-key too, as below, so that gap closes downstream.
//!
//! What stays unsafe: a downstream call that neither takes a caller id nor can be observed
//! afterwards. Nothing can tell whether a killed attempt made it; make such a call the last
//! thing the handler does, or put it behind something that can (a queue that deduplicates,
//! an outbox written in the same transaction as the step).
//!
//! Sub-keys are `idem-` + 48 lower-case hex digits (53 ASCII bytes, `[0-9a-f-]`), derived
//! from (principal, endpoint, key, the record's `created_at`, step name), never from the
//! attempt or randomness, so every attempt of one operation sends the same sub-key, and
//! the same key reused after retention (a new operation) sends new ones. Journal entries
//! live and die with the record. On a store
//! without a journal, `step` and `intent` fail with `StoreError::Unsupported`, which
//! [`Problem::from_step_error`] answers as a 500 `journal-unsupported`; every problem it
//! returns is one the layer does not store, so a retry resumes from the journal.
//!
//! ```
//! use std::sync::{Arc, Mutex};
//! use axum::{Extension, Router, body::Body, http::{Request, StatusCode}, response::{IntoResponse, Response}, routing::post};
//! use idem_core::MemoryStore;
//! use idem_http::{IdempotencyContext, IdempotencyLayer, Problem, Reconciled, StepError};
//! use tower::ServiceExt;
//!
//! /// Pretend infrastructure: a pool that remembers which node a sub-key got (idempotent by
//! /// caller id) and a hypervisor whose boots take no caller id but carry a tag.
//! #[derive(Default)]
//! struct Infra { nodes: Vec<String>, boots: Vec<(String, String)> }
//!
//! async fn create(Extension(ctx): Extension<IdempotencyContext>, Extension(infra): Extension<Arc<Mutex<Infra>>>) -> Response {
//!     let run = ctx.resumable();
//!     // A step whose downstream call is keyed by the sub-key.
//!     let node = run.step("allocate", |subkey| {
//!         let infra = Arc::clone(&infra);
//!         async move {
//!             let mut i = infra.lock().unwrap();
//!             if !i.nodes.contains(&subkey.to_string()) { i.nodes.push(subkey.to_string()); }
//!             Ok::<_, std::convert::Infallible>(format!("node-{}", &subkey.as_str()[5..13]))
//!         }
//!     });
//!     let node = match node.await {
//!         Ok(n) => n,
//!         Err(e) => return step_failed(&e),
//!     };
//!     // An intent for a call that cannot take a caller id: the sub-key is its tag.
//!     let (issue, find) = (Arc::clone(&infra), Arc::clone(&infra));
//!     let vm = run.intent(
//!         "boot",
//!         |tag| async move {
//!             let mut i = issue.lock().unwrap();
//!             let vm = format!("vm-{}", i.boots.len() + 1);
//!             i.boots.push((vm.clone(), tag.to_string()));
//!             Ok::<_, std::convert::Infallible>(vm)
//!         },
//!         |tag| async move {
//!             let i = find.lock().unwrap();
//!             Ok(match i.boots.iter().find(|(_, t)| *t == tag.as_str()) {
//!                 Some((vm, _)) => Reconciled::Found(vm.clone()),
//!                 None => Reconciled::NotFound,
//!             })
//!         },
//!     ).await;
//!     match vm {
//!         Ok(vm) => (StatusCode::CREATED, format!("{node} {vm}")).into_response(),
//!         Err(e) => step_failed(&e),
//!     }
//! }
//!
//! fn step_failed<E: std::fmt::Display>(e: &StepError<E>) -> Response {
//!     match Problem::from_step_error(e) {
//!         Some(p) => p.into_response(),
//!         None => (StatusCode::BAD_GATEWAY, e.to_string()).into_response(),
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let infra = Arc::new(Mutex::new(Infra::default()));
//! let app = Router::new()
//!     .route("/v1/workers", post(create))
//!     .layer(IdempotencyLayer::new(Arc::new(MemoryStore::new())))
//!     .layer(Extension(Arc::clone(&infra)));
//! let request = || Request::post("/v1/workers")
//!     .header("authorization", "Bearer t")
//!     .header("idempotency-key", "k-1")
//!     .body(Body::empty())
//!     .unwrap();
//! let first = app.clone().oneshot(request()).await.unwrap();
//! assert_eq!(first.status(), StatusCode::CREATED);
//! let retry = app.oneshot(request()).await.unwrap();
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//! let i = infra.lock().unwrap();
//! assert_eq!((i.nodes.len(), i.boots.len()), (1, 1));
//! # }
//! ```
//!
//! # Stability
//! Everything public here is covered by semver. Items that exist only for tests would go
//! behind a `test-util` cargo feature, documented as not semver-stable, never behind
//! `#[doc(hidden)]`; this crate has none today (tests use the public API, and
//! [`BearerToken::principal_for`] is public because applications that compute a
//! principal themselves need it too).
//!
//! # Layout
//! - [`layer`] holds [`IdempotencyLayer`], every setting's `with_*` method.
//! - [`config`] holds the setting types [`KeyRequirement`], [`MissingPrincipal`],
//!   [`MismatchStatus`], [`StoreFailureMode`], [`HandlerExecution`], [`LeaseRenewal`], and the shared
//!   settings bundle that [`layer`] builds and [`service`] reads (neither imports the
//!   other).
//! - [`service`] holds [`Idempotency`], the request flow.
//! - [`future`] holds [`ResponseFuture`] (a boxed `async fn`) and the drop guard that marks a
//!   record failed.
//! - [`body`] holds [`ResponseBody`] (passed through, buffered, or streamed after a read
//!   prefix).
//! - `streaming` (private) holds the rules for when a storable response streams instead.
//! - [`grpc`] holds the gRPC rules: which gRPC outcomes are stored, and the layer's
//!   answers as gRPC statuses ([`grpc_code_for`]).
//! - [`hints`] holds [`RetryHints`] and the last touch on the layer's own answers.
//! - [`principal`] holds [`PrincipalResolver`], [`BearerToken`].
//! - [`problem`] holds RFC 9457 bodies, [`ProblemKind`].
//! - [`context`] holds [`IdempotencyContext`], the request extension a claimed handler sees
//!   (with its lease state), and [`ResponseCaching`], the response extension it may set.
//! - [`deadline`] holds [`StoreDeadlines`] and [`CompletionRetry`], and the store wrapper
//!   the layer puts around its store: a deadline on every call (a missed claim is a 503),
//!   completions retried while the lease lasts.
//! - `lease` (private) holds the renewal loop and the lease state it shares with the
//!   context.
//! - [`Resumable`], [`SubKey`], [`Reconciled`], [`StepError`] and [`LeaseWatch`] are re-exported from
//!   [`idem_core::resume`]; [`Policy`] and [`FingerprintMode`] from [`idem_core`].
//! - [`headers`] holds the header names.

pub mod body;
pub mod config;
pub mod context;
pub mod deadline;
pub mod future;
#[doc(hidden)]
pub mod fuzzing;
pub mod grpc;
pub mod headers;
pub mod hints;
pub mod layer;
mod lease;
#[cfg(feature = "metrics")]
mod metrics_cache;
mod observe;
pub mod principal;
pub mod problem;
pub mod service;
mod streaming;

pub use body::ResponseBody;
pub use config::{HandlerExecution, KeyRequirement, LeaseRenewal, MismatchStatus, MissingPrincipal, StoreFailureMode};
pub use context::{IdempotencyContext, ResponseCaching};
pub use deadline::{CompletionRetry, StoreDeadlines};
pub use future::ResponseFuture;
pub use grpc::grpc_code_for;
pub use headers::{IDEMPOTENCY_KEY, IDEMPOTENCY_KEY_EXPIRES, IDEMPOTENT_REPLAYED, IDEMPOTENT_STORED};
pub use hints::{RetryHints, STRIPE_SHOULD_RETRY, X_SHOULD_RETRY};
pub use idem_core::resume::{LeaseWatch, Reconciled, Resumable, StepError, SubKey};
#[cfg(feature = "seal")]
pub use idem_core::seal::SealingKeys;
pub use idem_core::{FingerprintMode, Policy};
pub use layer::IdempotencyLayer;
pub use principal::{BearerToken, PrincipalResolver};
pub use problem::{PROBLEM_JSON, Problem, ProblemKind};
pub use service::Idempotency;

/// The README's example, compiled as a doctest so the registry page cannot drift from the
/// API.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
