//! An HF `config.json` (config, bounds, fit) and a sharded index on arbitrary text.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|text: &str| {
    if let Ok(cfg) = loip_model::ModelConfig::from_hf_json(text) {
        if cfg.validate().is_ok() && cfg.check_fits(1 << 20).is_ok() {
            let _ = loip_model::model_tensors(&cfg);
        }
    }
    let _ = loip_model::safetensors_file::read_index(text, std::path::Path::new("index.json"));
});
