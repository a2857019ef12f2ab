//! Prints the regional API's OpenAPI document.
fn main() {
    println!("{}", regional::openapi_json());
}
