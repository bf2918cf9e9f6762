//! `GET /openapi.json`: the API's OpenAPI 3.1 document. The application describes its own
//! operations (here as JSON, as a team would with utoipa's derives); `idem_openapi::Keyed`
//! then adds what the idempotency layer does to each keyed one, configured as the layers
//! in [`crate::app::router`] are.

use idem_http::KeyRequirement;
use idem_openapi::Keyed;
use serde_json::json;
use utoipa::openapi::OpenApi;
use utoipa::openapi::path::HttpMethod;

/// The document: the application's operations, then the layer's additions.
///
/// # Panics
/// Never: the application's part is a fixed, valid document (a test parses it).
#[must_use]
pub fn document() -> OpenApi {
    let mut api: OpenApi = serde_json::from_value(own()).expect("the application's part is a valid OpenAPI document");
    let required = Keyed::new();
    required.document(&mut api, "/v1/workers", HttpMethod::Post);
    required.document(&mut api, "/v1/workers/{id}/reboot", HttpMethod::Post);
    Keyed::new().with_key_requirement(KeyRequirement::Optional).document(
        &mut api,
        "/v1/workers/{id}",
        HttpMethod::Delete,
    );
    api
}

/// What the handlers answer themselves.
fn own() -> serde_json::Value {
    let problem = |what: &str| json!({ "description": what, "content": { "application/problem+json": { "schema": { "$ref": "#/components/schemas/Problem" } } } });
    let unauthorized = problem("No `Authorization: Bearer` token.");
    let missing = problem("No such worker of this principal.");
    let broken = problem("The infrastructure's state could not be read or written.");
    let id = json!([{ "name": "id", "in": "path", "required": true, "schema": { "type": "string" } }]);
    json!({
        "openapi": "3.1.0",
        "info": { "title": "leasebroker", "version": env!("CARGO_PKG_VERSION"),
                  "description": "A provisioning API protected by idem: retried creates converge on one worker." },
        "security": [{ "bearer": [] }],
        "paths": {
            "/v1/workers": { "post": {
                "operationId": "createWorker",
                "requestBody": { "required": true, "content": { "application/json": {
                    "schema": { "$ref": "#/components/schemas/WorkerSpec" } } } },
                "responses": {
                    "201": { "description": "The worker: allocated, leased, booted.",
                             "headers": { "Location": { "schema": { "type": "string" } } },
                             "content": { "application/json": { "schema": { "$ref": "#/components/schemas/Worker" } } } },
                    "401": unauthorized,
                    "422": problem("The body is not a worker spec."),
                    "500": broken,
                    "503": problem("The hypervisor failed to boot; retry with the same key.")
                }
            } },
            "/v1/workers/{id}/reboot": { "post": {
                "operationId": "rebootWorker",
                "parameters": id,
                "responses": {
                    "202": { "description": "Reboot accepted.", "content": { "application/json": { "schema": {
                        "type": "object", "required": ["id", "reboots"],
                        "properties": { "id": { "type": "string" }, "reboots": { "type": "integer", "minimum": 0 } } } } } },
                    "401": unauthorized, "404": missing, "500": broken
                }
            } },
            "/v1/workers/{id}": {
                "get": {
                    "operationId": "showWorker",
                    "parameters": id,
                    "responses": {
                        "200": { "description": "The worker.",
                                 "content": { "application/json": { "schema": { "$ref": "#/components/schemas/Worker" } } } },
                        "401": unauthorized, "404": missing, "500": broken
                    }
                },
                "delete": {
                    "operationId": "deleteWorker",
                    "parameters": id,
                    "responses": { "204": { "description": "Deleted." }, "401": unauthorized, "404": missing, "500": broken }
                }
            },
            "/admin/stats": { "get": {
                "operationId": "stats",
                "security": [],
                "responses": { "200": { "description": "Counts of what the infrastructure did.",
                                        "content": { "application/json": { "schema": { "type": "object" } } } },
                               "500": broken }
            } }
        },
        "components": {
            "securitySchemes": { "bearer": { "type": "http", "scheme": "bearer" } },
            "schemas": {
                "Problem": { "type": "object", "description": "RFC 9457 problem details.",
                             "properties": { "type": { "type": "string" }, "title": { "type": "string" },
                                             "status": { "type": "integer" }, "detail": { "type": "string" } } },
                "WorkerSpec": { "type": "object", "required": ["image", "cpu", "memory_gb"], "properties": {
                    "image": { "type": "string" },
                    "cpu": { "type": "integer", "minimum": 0, "maximum": 4_294_967_295_u64 },
                    "memory_gb": { "type": "integer", "minimum": 0, "maximum": 4_294_967_295_u64 },
                    "labels": { "type": "object", "additionalProperties": { "type": "string" } } } },
                "Worker": { "type": "object",
                    "required": ["id", "owner", "node", "lease", "vm", "spec", "state", "reboots"],
                    "properties": {
                        "id": { "type": "string" }, "owner": { "type": "string" }, "node": { "type": "string" },
                        "lease": { "type": "string" }, "vm": { "type": "string" },
                        "spec": { "$ref": "#/components/schemas/WorkerSpec" },
                        "state": { "type": "string" }, "reboots": { "type": "integer", "minimum": 0 } } }
            }
        }
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_keyed_operations_carry_the_key_and_the_layers_answers() {
        let api = super::document();
        let v = serde_json::to_value(&api).unwrap();
        let post = &v["paths"]["/v1/workers"]["post"];
        let key = post["parameters"].as_array().unwrap().iter().find(|p| p["name"] == "Idempotency-Key").unwrap();
        assert_eq!((key["in"].as_str(), key["required"].as_bool()), (Some("header"), Some(true)));
        let conflict = &post["responses"]["409"]["content"]["application/problem+json"]["schema"];
        assert!(conflict["properties"]["type"]["enum"].as_array().unwrap().len() >= 3, "{conflict}");
        let delete = &v["paths"]["/v1/workers/{id}"]["delete"];
        let key = delete["parameters"].as_array().unwrap().iter().find(|p| p["name"] == "Idempotency-Key").unwrap();
        assert_eq!(key["required"].as_bool(), Some(false));
        let get = &v["paths"]["/v1/workers/{id}"]["get"];
        assert!(get["parameters"].as_array().unwrap().iter().all(|p| p["name"] != "Idempotency-Key"));
    }
}
