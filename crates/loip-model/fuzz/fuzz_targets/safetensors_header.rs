//! A safetensors file's header on arbitrary bytes.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = loip_model::safetensors_file::read_header(data, std::path::Path::new("m.safetensors"));
});
