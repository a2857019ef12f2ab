//! The committed transition table (`openapi/lifecycle.json`, read by the soak's checker) is the
//! one the code applies.

#[test]
fn committed_table_matches_the_code() {
    assert_eq!(
        include_str!("../../../openapi/lifecycle.json"),
        api_types::lifecycle::table_json(),
        "openapi/lifecycle.json is out of date: run \
         `cargo run -p api-types --example lifecycle > openapi/lifecycle.json`"
    );
}
