//! Prints the lifecycle's transition table as JSON: `openapi/lifecycle.json`, which checkers
//! outside Rust (the soak) read. `cargo run -p api-types --example lifecycle > openapi/lifecycle.json`
fn main() {
    print!("{}", api_types::lifecycle::table_json());
}
