//! The other files a model directory or a device's store holds: a safetensors header, a
//! sharded checkpoint's index, a slice file's header, a slice manifest. The first byte picks
//! the parser.
#![no_main]
use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    let path = Path::new("fuzz");
    match which % 4 {
        0 => {
            let _ = loip_model::safetensors_file::read_header(rest, path);
        }
        1 => {
            if let Ok(s) = std::str::from_utf8(rest) {
                let _ = loip_model::safetensors_file::read_index(s, path);
            }
        }
        2 => {
            let _ = loip_model::slice::parse_slice_header(path, rest);
        }
        _ => {
            if let Ok(m) = serde_json::from_slice::<loip_model::slice::Manifest>(rest) {
                let _ = loip_runtime::net::validate::check_manifest(&m);
                let _ = loip_runtime::net::validate::check_config(&m.config);
            }
        }
    }
});
