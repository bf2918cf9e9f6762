//! Request builders and response readers for the HTTP scenarios. No sockets: every
//! request goes through `tower::ServiceExt::oneshot`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::body::Body;
use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;

/// A request builder with the usual headers.
#[derive(Clone, Debug)]
pub(crate) struct Req {
    method: http::Method,
    uri: String,
    token: Option<String>,
    keys: Vec<Vec<u8>>,
    body: Bytes,
    content_type: Option<String>,
}

/// A `POST` to `uri` by bearer `tok-p`, JSON, no key yet.
pub(crate) fn post(uri: &str) -> Req {
    Req {
        method: http::Method::POST,
        uri: uri.to_owned(),
        token: Some("tok-p".into()),
        keys: Vec::new(),
        body: Bytes::new(),
        content_type: Some("application/json".into()),
    }
}

impl Req {
    pub(crate) fn token(mut self, token: &str) -> Self {
        self.token = Some(token.to_owned());
        self
    }

    pub(crate) fn key(mut self, key: &str) -> Self {
        self.keys.push(key.as_bytes().to_vec());
        self
    }

    pub(crate) fn body(mut self, body: impl Into<Bytes>) -> Self {
        self.body = body.into();
        self
    }

    pub(crate) fn build(&self) -> Request<Body> {
        let mut b = Request::builder().method(self.method.clone()).uri(&self.uri);
        if let Some(t) = &self.token {
            b = b.header("authorization", format!("Bearer {t}"));
        }
        for k in &self.keys {
            b = b.header("idempotency-key", http::HeaderValue::from_bytes(k).unwrap());
        }
        if let Some(ct) = &self.content_type {
            b = b.header("content-type", ct);
        }
        b.body(Body::from(self.body.clone())).unwrap()
    }
}

/// A response read whole.
#[derive(Debug)]
pub(crate) struct Got {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
}

impl Got {
    pub(crate) async fn read<B>(res: Response<B>) -> Self
    where
        B: http_body::Body<Data = Bytes>,
        B::Error: std::fmt::Debug,
    {
        let (parts, body) = res.into_parts();
        Self { status: parts.status, headers: parts.headers, body: body.collect().await.unwrap().to_bytes() }
    }

    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }

    pub(crate) fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    pub(crate) fn text(&self) -> &str {
        std::str::from_utf8(&self.body).unwrap()
    }

    /// Asserts an RFC 9457 body of `slug` with `status`, and returns it.
    #[track_caller]
    pub(crate) fn problem(&self, status: u16, slug: &str) -> serde_json::Value {
        assert_eq!(self.status.as_u16(), status, "status; body: {}", self.text());
        assert_eq!(self.header("content-type"), Some("application/problem+json"), "content-type");
        let v: serde_json::Value = serde_json::from_slice(&self.body).expect("problem body is JSON");
        assert_eq!(v["type"], format!("{}{slug}", idem_http::DEFAULT_TYPE_BASE), "type; body {v}");
        assert_eq!(v["status"], status, "status member");
        assert!(v["title"].as_str().is_some_and(|t| !t.is_empty()), "title");
        assert!(v["detail"].as_str().is_some_and(|t| !t.is_empty()), "detail");
        v
    }

    pub(crate) fn retry_after(&self) -> u64 {
        self.header("retry-after").expect("Retry-After").parse().unwrap()
    }
}

/// Sends one request through `app`.
pub(crate) async fn send(app: &Router, req: &Req) -> Got {
    Got::read(app.clone().oneshot(req.build()).await.unwrap()).await
}

/// Counts handler runs.
#[derive(Clone, Debug, Default)]
pub(crate) struct Counter(Arc<AtomicUsize>);

impl Counter {
    pub(crate) fn bump(&self) -> usize {
        self.0.fetch_add(1, Ordering::SeqCst) + 1
    }
    pub(crate) fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

/// `Policy::default()` with `change` applied: the record rules of one scenario.
pub(crate) fn policy(change: impl FnOnce(&mut idem_http::Policy)) -> idem_http::Policy {
    let mut policy = idem_http::Policy::default();
    change(&mut policy);
    policy
}
