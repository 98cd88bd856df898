//! GGUF header, metadata, config, bounds and tokenizer on arbitrary bytes.
#![no_main]
use libfuzzer_sys::fuzz_target;
use loip_model::gguf::GgufFile;
use loip_model::tokenizer::Tokenizer;

fuzz_target!(|data: &[u8]| {
    if let Ok(f) = GgufFile::parse(data, std::path::Path::new("m.gguf")) {
        let _ = Tokenizer::from_gguf_metadata(&f.metadata);
        if let Ok(cfg) = f.model_config() {
            if cfg.validate().is_ok() && cfg.check_fits(data.len() as u64).is_ok() {
                let _ = loip_model::model_tensors(&cfg);
            }
        }
    }
});
