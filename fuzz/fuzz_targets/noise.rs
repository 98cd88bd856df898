//! libFuzzer entry of `bodies/noise.rs` (see there what it feeds).
#![no_main]
use libfuzzer_sys::fuzz_target;

#[path = "../bodies/noise.rs"]
mod body;

fuzz_target!(|data: &[u8]| body::run(data));
