//! The regional (internal) API's committed OpenAPI document is generated from the code.
//! Regenerate with `cargo run -p regional --example openapi > openapi/regional.json`.

#[test]
fn committed_document_matches_the_code() {
    let committed: serde_json::Value =
        serde_json::from_str(include_str!("../../../openapi/regional.json")).unwrap();
    let generated: serde_json::Value = serde_json::from_str(&regional::openapi_json()).unwrap();
    assert!(committed == generated, "openapi/regional.json is out of date: run `cargo run -p regional --example openapi > openapi/regional.json`");
}
