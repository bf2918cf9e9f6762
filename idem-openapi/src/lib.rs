//! # idem-openapi
//!
//! Adds to a [utoipa](https://docs.rs/utoipa) OpenAPI document what
//! [`idem_http::IdempotencyLayer`] adds to an operation, so generated API docs and clients
//! know it:
//!
//! - the `Idempotency-Key` request header (draft-ietf-httpapi-idempotency-key-header §2):
//!   required or optional as the layer is configured, 1 to `max_key_len` characters of
//!   visible ASCII, not starting with `"` (that form is an RFC 8941 sf-string, also
//!   accepted: `"abc"` and `abc` are one key);
//! - each answer the layer makes itself, as an `application/problem+json` body (RFC 9457
//!   §3) whose `type` is one of the layer's problem types for that status: 400 (missing,
//!   invalid or repeated key; unreadable body), 401 (no principal), 409 (in flight, busy,
//!   and the fingerprint mismatch unless it is answered 422), 413, 422 (mismatch, when so
//!   configured), 431 and 503 (store unavailable, deadline passed), with `Retry-After` on
//!   the 409 and 503 answers that may be retried and the optional retry hints;
//! - on every response the operation already documents: `Idempotent-Replayed` (replays),
//!   `Idempotency-Key-Expires` (until when the key's record is kept) and
//!   `Idempotent-Stored` (a response that could not be stored).
//!
//! Answers the operation already documents (a handler's own 400, say) are kept: the layer's
//! problem types are then listed only in their description.
//!
//! ```
//! use idem_http::KeyRequirement;
//! use idem_openapi::Keyed;
//! use utoipa::openapi::path::{HttpMethod, OperationBuilder, PathItem};
//! use utoipa::openapi::{OpenApiBuilder, PathsBuilder, ResponseBuilder};
//!
//! let create = OperationBuilder::new().response("201", ResponseBuilder::new().description("Created"));
//! let paths = PathsBuilder::new().path("/v1/workers", PathItem::new(HttpMethod::Post, create));
//! let mut api = OpenApiBuilder::new().paths(paths).build();
//! // Every POST, PUT, PATCH and DELETE of the document, as the layer's defaults key them.
//! assert_eq!(Keyed::new().document_all(&mut api), 1);
//! let post = api.paths.paths["/v1/workers"].post.as_ref().unwrap();
//! assert!(post.responses.responses.contains_key("409"));
//! # let _ = KeyRequirement::Optional;
//! ```
//!
//! Costs nothing at run time: the document is built once, at start-up.

use idem_core::key::DEFAULT_MAX_KEY_LEN;
use idem_http::{KeyRequirement, MismatchStatus, ProblemKind};
use utoipa::openapi::path::{HttpMethod, Operation, ParameterBuilder, ParameterIn};
use utoipa::openapi::schema::{ObjectBuilder, Type};
use utoipa::openapi::{ContentBuilder, HeaderBuilder, OpenApi, RefOr, Required, Response, ResponseBuilder, Schema};

/// How the layer in front of an operation is configured: what [`Keyed::document`] writes
/// into it. The defaults are the layer's.
#[derive(Clone, Copy, Debug)]
pub struct Keyed {
    key: KeyRequirement,
    max_key_len: usize,
    mismatch: MismatchStatus,
}

impl Default for Keyed {
    fn default() -> Self {
        Self { key: KeyRequirement::Required, max_key_len: DEFAULT_MAX_KEY_LEN, mismatch: MismatchStatus::Conflict }
    }
}

impl Keyed {
    /// The layer's defaults: key required, at most 255 bytes, mismatch answered 409.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// As [`idem_http::IdempotencyLayer::with_key_requirement`].
    #[must_use]
    pub fn with_key_requirement(mut self, key: KeyRequirement) -> Self {
        self.key = key;
        self
    }

    /// As [`idem_http::IdempotencyLayer::with_max_key_len`], bytes.
    #[must_use]
    pub fn with_max_key_len(mut self, bytes: usize) -> Self {
        self.max_key_len = bytes;
        self
    }

    /// As [`idem_http::IdempotencyLayer::with_mismatch_status`].
    #[must_use]
    pub fn with_mismatch_status(mut self, status: MismatchStatus) -> Self {
        self.mismatch = status;
        self
    }

    /// Documents every operation the layer keys by default (POST, PUT, PATCH, DELETE;
    /// never the safe methods, RFC 9110 §9.2.1) in `api`; returns how many.
    pub fn document_all(&self, api: &mut OpenApi) -> usize {
        let mut n = 0;
        for item in api.paths.paths.values_mut() {
            for op in [&mut item.post, &mut item.put, &mut item.patch, &mut item.delete].into_iter().flatten() {
                self.add_to(op);
                n += 1;
            }
        }
        n
    }

    /// Documents the operation `method` of `path` in `api`; false when the document has no
    /// such operation.
    pub fn document(&self, api: &mut OpenApi, path: &str, method: HttpMethod) -> bool {
        let Some(item) = api.paths.paths.get_mut(path) else { return false };
        let op = match method {
            HttpMethod::Get => &mut item.get,
            HttpMethod::Post => &mut item.post,
            HttpMethod::Put => &mut item.put,
            HttpMethod::Delete => &mut item.delete,
            HttpMethod::Options => &mut item.options,
            HttpMethod::Head => &mut item.head,
            HttpMethod::Patch => &mut item.patch,
            HttpMethod::Trace => &mut item.trace,
        };
        op.as_mut().map(|op| self.add_to(op)).is_some()
    }

    fn add_to(&self, op: &mut Operation) {
        let required = self.key == KeyRequirement::Required;
        let key = ParameterBuilder::new()
            .name("Idempotency-Key")
            .parameter_in(ParameterIn::Header)
            .required(if required { Required::True } else { Required::False })
            .description(Some(format!(
                "One key per logical operation, the same on every retry of it \
                 (draft-ietf-httpapi-idempotency-key-header §2). {}",
                if required {
                    "Required: a request without one is answered 400."
                } else {
                    "Optional: a request without one runs without idempotency, every time."
                }
            )))
            .schema(Some(
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .min_length(Some(1))
                    .max_length(Some(self.max_key_len))
                    // Visible ASCII; a leading `"` makes it an sf-string instead.
                    .pattern(Some("^[!#-~][!-~]*$")),
            ))
            .build();
        let params = op.parameters.get_or_insert_with(Vec::new);
        params.retain(|p| !matches!(p, RefOr::T(p) if p.name.eq_ignore_ascii_case("idempotency-key")));
        params.push(RefOr::T(key));

        for answer in op.responses.responses.values_mut() {
            if let RefOr::T(answer) = answer {
                add_record_headers(answer);
            }
        }
        let mismatch = match self.mismatch {
            MismatchStatus::UnprocessableContent => "422",
            _ => "409",
        };
        let mut kinds: Vec<(&str, ProblemKind)> = vec![
            ("400", ProblemKind::InvalidKey),
            ("400", ProblemKind::DuplicateKey),
            ("400", ProblemKind::UnreadableBody),
            ("401", ProblemKind::MissingPrincipal),
            ("409", ProblemKind::InFlight),
            ("409", ProblemKind::Busy),
            (mismatch, ProblemKind::Mismatch),
            ("413", ProblemKind::BodyTooLarge),
            ("431", ProblemKind::HeadersTooLarge),
            ("503", ProblemKind::StoreUnavailable),
            ("503", ProblemKind::DeadlinePassed),
        ];
        if required {
            kinds.insert(0, ("400", ProblemKind::MissingKey));
        }
        for status in ["400", "401", "409", "413", "422", "431", "503"] {
            let types: Vec<String> = kinds.iter().filter(|(s, _)| *s == status).map(|(_, k)| k.type_uri()).collect();
            if types.is_empty() {
                continue;
            }
            let listed = format!("The idempotency layer's answer: an RFC 9457 problem of type {}.", types.join(", "));
            match op.responses.responses.get_mut(status) {
                // The operation's own answer with this status stays; the layer's types are named.
                Some(RefOr::T(own)) if !own.description.contains(&listed) => {
                    own.description = format!("{} {listed}", own.description);
                }
                Some(_) => {}
                None => {
                    let retried = matches!(status, "409" | "503");
                    let answer = problem_answer(&listed, &types, retried);
                    op.responses.responses.insert(status.to_owned(), RefOr::T(answer));
                }
            }
        }
    }
}

fn string_header(description: &str) -> utoipa::openapi::Header {
    HeaderBuilder::new()
        .schema(Some(ObjectBuilder::new().schema_type(Type::String)))
        .description(Some(description))
        .build()
}

fn add_record_headers(answer: &mut Response) {
    let headers = [
        ("Idempotent-Replayed", "`true` on a stored response replayed to a retry of the key."),
        (
            "Idempotency-Key-Expires",
            "HTTP-date (RFC 9110 §5.6.7) until which the key's record is kept; after it the key starts a new operation.",
        ),
        ("Idempotent-Stored", "`false` when the response could not be stored: a retry of the key will not replay it."),
    ];
    for (name, what) in headers {
        answer.headers.entry(name.to_owned()).or_insert_with(|| RefOr::T(string_header(what)));
    }
}

/// A problem answer: the RFC 9457 members, `type` one of `types`.
fn problem_answer(description: &str, types: &[String], retried: bool) -> Response {
    let text = || ObjectBuilder::new().schema_type(Type::String);
    let schema = ObjectBuilder::new()
        .schema_type(Type::Object)
        .property("type", text().enum_values(Some(types.iter().cloned())))
        .property("title", text())
        .property("status", ObjectBuilder::new().schema_type(Type::Integer))
        .property("detail", text())
        .required("type")
        .required("status");
    let mut answer = ResponseBuilder::new()
        .description(description)
        .content(idem_http::PROBLEM_JSON, ContentBuilder::new().schema(Some(Schema::Object(schema.build()))).build())
        .build();
    if retried {
        let after = "Seconds to wait before retrying with the same key (RFC 9110 §10.2.3).";
        answer.headers.insert("Retry-After".to_owned(), RefOr::T(string_header(after)));
    }
    for hint in [idem_http::X_SHOULD_RETRY, idem_http::STRIPE_SHOULD_RETRY] {
        let what = "`true` or `false`: whether a retry with the same key can succeed (when retry hints are on).";
        answer.headers.insert(hint.as_str().to_owned(), RefOr::T(string_header(what)));
    }
    add_record_headers(&mut answer);
    answer
}

#[cfg(test)]
mod tests {
    use utoipa::openapi::path::{OperationBuilder, PathItem};
    use utoipa::openapi::{OpenApiBuilder, PathsBuilder};

    use super::*;

    fn api() -> OpenApi {
        let op = |own: &str| OperationBuilder::new().response(own, ResponseBuilder::new().description("own"));
        let paths = PathsBuilder::new()
            .path("/a", PathItem::new(HttpMethod::Post, op("201")))
            .path("/a/{id}", PathItem::new(HttpMethod::Get, op("200")))
            .path("/b", PathItem::new(HttpMethod::Put, op("400")));
        OpenApiBuilder::new().paths(paths).build()
    }

    fn json(api: &OpenApi) -> serde_json::Value {
        serde_json::to_value(api).unwrap()
    }

    #[test]
    fn every_unsafe_operation_is_keyed_and_no_safe_one() {
        let mut api = api();
        assert_eq!(Keyed::new().document_all(&mut api), 2);
        let v = json(&api);
        assert!(v["paths"]["/a/{id}"]["get"].get("parameters").is_none(), "a GET is never keyed");
        let post = &v["paths"]["/a"]["post"];
        assert_eq!(post["parameters"][0]["name"], "Idempotency-Key");
        assert_eq!(post["parameters"][0]["required"], true);
        assert_eq!(post["parameters"][0]["schema"]["maxLength"], 255);
        let own = &post["responses"]["201"]["headers"];
        assert!(own.get("Idempotent-Replayed").is_some() && own.get("Idempotency-Key-Expires").is_some());
        let types = &post["responses"]["409"]["content"]["application/problem+json"]["schema"]["properties"]["type"];
        let types: Vec<&str> = types["enum"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
        assert_eq!(types, [ProblemKind::InFlight, ProblemKind::Busy, ProblemKind::Mismatch].map(ProblemKind::type_uri));
        assert!(post["responses"]["409"]["headers"].get("Retry-After").is_some());
        assert!(post["responses"]["503"]["headers"].get("Retry-After").is_some());
        assert!(post["responses"]["400"]["headers"].get("Retry-After").is_none(), "a 400 is never retried as is");
    }

    #[test]
    fn the_documented_configuration_is_the_layers() {
        let mut api = api();
        let keyed = Keyed::new()
            .with_key_requirement(KeyRequirement::Optional)
            .with_max_key_len(64)
            .with_mismatch_status(MismatchStatus::UnprocessableContent);
        assert!(keyed.document(&mut api, "/a", HttpMethod::Post));
        assert!(!keyed.document(&mut api, "/a", HttpMethod::Delete), "no such operation");
        assert!(!keyed.document(&mut api, "/nowhere", HttpMethod::Post));
        let post = &json(&api)["paths"]["/a"]["post"];
        assert_eq!(
            (&post["parameters"][0]["required"], &post["parameters"][0]["schema"]["maxLength"]),
            (&false.into(), &64.into())
        );
        let enum_of = |status: &str| {
            post["responses"][status]["content"]["application/problem+json"]["schema"]["properties"]["type"]["enum"]
                .clone()
        };
        assert_eq!(enum_of("422"), serde_json::json!([ProblemKind::Mismatch.type_uri()]));
        assert!(
            !enum_of("400").as_array().unwrap().contains(&ProblemKind::MissingKey.type_uri().into()),
            "an optional key is never missing"
        );
    }

    #[test]
    fn an_answer_the_operation_documents_is_kept_and_names_the_layers_types() {
        let mut api = api();
        Keyed::new().document_all(&mut api);
        // Twice: the key parameter is not repeated.
        Keyed::new().document_all(&mut api);
        let put = &json(&api)["paths"]["/b"]["put"];
        assert_eq!(put["parameters"].as_array().unwrap().len(), 1);
        let own = put["responses"]["400"]["description"].as_str().unwrap();
        assert!(own.starts_with("own ") && own.contains(&ProblemKind::InvalidKey.type_uri()), "{own}");
        assert!(put["responses"]["400"].get("content").is_none(), "the operation's own answer keeps its content");
    }
}
