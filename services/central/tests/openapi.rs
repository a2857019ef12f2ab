//! The committed OpenAPI document is generated from the code (no drift), and stays compatible with
//! DigitalOcean's published contract for `/v2/dedicated-inferences*`.
//!
//! Regenerate with `cargo run -p central -- openapi > openapi/public.json`.

use serde_json::Value;

fn generated() -> Value {
    serde_json::from_str(&central::openapi_json()).unwrap()
}

#[test]
fn committed_document_matches_the_code() {
    let committed = include_str!("../../../openapi/public.json");
    let committed: Value = serde_json::from_str(committed).expect("openapi/public.json is JSON");
    assert!(
        committed == generated(),
        "openapi/public.json is out of date: run `cargo run -p central -- openapi > openapi/public.json`"
    );
}

/// DigitalOcean's operations: (path, method, operationId, success status, scope).
const CONTRACT: &[(&str, &str, &str, &str, &str)] = &[
    (
        "/v2/dedicated-inferences",
        "get",
        "dedicatedInferences_list",
        "200",
        "dedicated_inference:read",
    ),
    (
        "/v2/dedicated-inferences",
        "post",
        "dedicatedInferences_create",
        "202",
        "dedicated_inference:create",
    ),
    (
        "/v2/dedicated-inferences/{dedicated_inference_id}",
        "get",
        "dedicatedInferences_get",
        "200",
        "dedicated_inference:read",
    ),
    (
        "/v2/dedicated-inferences/{dedicated_inference_id}",
        "patch",
        "dedicatedInferences_patch",
        "202",
        "dedicated_inference:update",
    ),
    (
        "/v2/dedicated-inferences/{dedicated_inference_id}",
        "delete",
        "dedicatedInferences_delete",
        "202",
        "dedicated_inference:delete",
    ),
    (
        "/v2/dedicated-inferences/{dedicated_inference_id}/accelerators",
        "get",
        "dedicatedInferences_list_accelerators",
        "200",
        "dedicated_inference:read",
    ),
    (
        "/v2/dedicated-inferences/{dedicated_inference_id}/accelerators/{accelerator_id}",
        "get",
        "dedicatedInferences_get_accelerator",
        "200",
        "dedicated_inference:read",
    ),
    (
        "/v2/dedicated-inferences/{dedicated_inference_id}/ca",
        "get",
        "dedicatedInferences_get_ca",
        "200",
        "dedicated_inference:read",
    ),
    (
        "/v2/dedicated-inferences/{dedicated_inference_id}/tokens",
        "get",
        "dedicatedInferences_list_tokens",
        "200",
        "dedicated_inference_tokens:read",
    ),
    (
        "/v2/dedicated-inferences/{dedicated_inference_id}/tokens",
        "post",
        "dedicatedInferences_create_tokens",
        "202",
        "dedicated_inference_tokens:create",
    ),
    (
        "/v2/dedicated-inferences/{dedicated_inference_id}/tokens/{token_id}",
        "delete",
        "dedicatedInferences_delete_tokens",
        "204",
        "dedicated_inference_tokens:delete",
    ),
    (
        "/v2/dedicated-inferences/sizes",
        "get",
        "dedicatedInferences_list_sizes",
        "200",
        "dedicated_inference:read",
    ),
    (
        "/v2/dedicated-inferences/gpu-model-config",
        "get",
        "dedicatedInferences_get_gpu_model_config",
        "200",
        "dedicated_inference:read",
    ),
];

#[test]
fn every_operation_of_the_contract_is_served() {
    let doc = generated();
    for (path, method, operation_id, status, scope) in CONTRACT {
        let op = &doc["paths"][path][method];
        assert!(op.is_object(), "{method} {path} is missing");
        assert_eq!(op["operationId"], *operation_id, "{method} {path}");
        assert!(
            op["responses"][status].is_object(),
            "{method} {path} must answer {status}"
        );
        for error in ["401", "429"] {
            assert!(
                op["responses"][error].is_object(),
                "{method} {path} documents {error}"
            );
        }
        let scopes = &op["security"][0]["bearer_auth"];
        assert!(
            scopes.as_array().unwrap().iter().any(|s| s == scope),
            "{method} {path} needs {scope}"
        );
    }
}

fn schema<'a>(doc: &'a Value, name: &str) -> &'a Value {
    let s = &doc["components"]["schemas"][name];
    assert!(s.is_object(), "schema {name} missing");
    s
}

fn has_fields(doc: &Value, name: &str, fields: &[&str]) {
    let props = &schema(doc, name)["properties"];
    for f in fields {
        assert!(props[f].is_object(), "{name}.{f} missing");
    }
}

#[test]
fn response_and_request_fields_of_the_contract_are_present() {
    let doc = generated();
    has_fields(
        &doc,
        "DedicatedInference",
        &[
            "id",
            "status",
            "region",
            "vpc_uuid",
            "spec",
            "pending_deployment_spec",
            "endpoints",
            "created_at",
            "updated_at",
        ],
    );
    has_fields(
        &doc,
        "SpecOutput",
        &[
            "version",
            "name",
            "region",
            "vpc",
            "enable_public_endpoint",
            "model_deployments",
        ],
    );
    has_fields(
        &doc,
        "PendingSpecOutput",
        &[
            "id",
            "version",
            "name",
            "status",
            "vpc",
            "enable_public_endpoint",
            "model_deployments",
            "created_at",
            "updated_at",
        ],
    );
    has_fields(
        &doc,
        "ModelDeploymentOutput",
        &[
            "model_id",
            "model_slug",
            "model_provider",
            "workload_config",
            "accelerators",
        ],
    );
    has_fields(
        &doc,
        "AcceleratorOutput",
        &["scale", "type", "accelerator_slug", "status"],
    );
    has_fields(
        &doc,
        "AcceleratorInfo",
        &["id", "name", "slug", "role", "status", "created_at"],
    );
    has_fields(
        &doc,
        "AccessToken",
        &["id", "name", "value", "created_at", "is_managed"],
    );
    has_fields(
        &doc,
        "Endpoints",
        &["public_endpoint_fqdn", "private_endpoint_fqdn"],
    );
    has_fields(
        &doc,
        "Size",
        &["gpu_slug", "price_per_hour", "region", "currency"],
    );
    has_fields(&doc, "SizesResponse", &["enabled_regions", "sizes"]);
    has_fields(
        &doc,
        "GpuModelConfig",
        &["gpu_slugs", "model_slug", "model_name", "is_gated_model"],
    );
    has_fields(&doc, "CaResponse", &["cert"]);
    has_fields(&doc, "ErrorBody", &["id", "message", "request_id"]);
    has_fields(
        &doc,
        "DedicatedInferenceList",
        &["dedicated_inferences", "links", "meta"],
    );
    has_fields(&doc, "CreateRequest", &["spec", "access_tokens"]);
    has_fields(
        &doc,
        "SpecInput",
        &[
            "version",
            "name",
            "region",
            "vpc",
            "enable_public_endpoint",
            "model_deployments",
        ],
    );
    has_fields(&doc, "TokenCreateRequest", &["name"]);
    for required in [
        "version",
        "name",
        "region",
        "enable_public_endpoint",
        "model_deployments",
    ] {
        assert!(
            schema(&doc, "SpecInput")["required"]
                .as_array()
                .unwrap()
                .iter()
                .any(|r| r == required),
            "SpecInput requires {required}"
        );
    }
}
