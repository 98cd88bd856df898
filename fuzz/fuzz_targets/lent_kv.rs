//! libFuzzer entry of `bodies/lent_kv.rs` (see there what it feeds).
#![no_main]
use libfuzzer_sys::fuzz_target;

#[path = "../bodies/lent_kv.rs"]
mod body;

fuzz_target!(|data: &[u8]| body::run(data));
