//! libFuzzer entry of `bodies/api_request.rs` (a `loip api` request body).
#![no_main]
use libfuzzer_sys::fuzz_target;

#[path = "../bodies/api_request.rs"]
mod body;

fuzz_target!(|data: &[u8]| body::run(data));
