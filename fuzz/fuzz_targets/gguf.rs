//! A GGUF file is what a user (or a download) hands the loader: its header, its tensor
//! table, its chat template and the model configuration read from it must give a clear
//! error, never a panic, an out-of-bounds read or an allocation beyond what the file can
//! hold.
#![no_main]
use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let path = Path::new("fuzz.gguf");
    let Ok(f) = loip_model::gguf::GgufFile::parse(data, path) else {
        return;
    };
    let _ = f.model_config();
    // The file's chat template: compiled, then rendered within its budget of work.
    if let Ok(Some(t)) = loip_model::chat::ChatTemplate::from_gguf_metadata(&f.metadata) {
        let _ = t.render(&[loip_model::chat::ChatMessage::new("user", "hi")], true);
    }
    // The whole loader, from a file: tensor bounds, config checks, then binding the model.
    static FILE: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    let file = FILE.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("loip-fuzz-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        dir.join("m.gguf")
    });
    if std::fs::write(file, data).is_err() {
        return;
    }
    if let Ok(ckpt) = loip_model::Checkpoint::open(file) {
        let _ = loip_engine::Model::from_checkpoint(&ckpt);
    }
});
