//! Opening a model by name or path, with its tokenizer and chat template.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use loip_model::chat::ChatTemplate;
use loip_model::tokenizer::Tokenizer;
use loip_model::Checkpoint;

/// A checkpoint opened from `smollm2` or a local path.
pub fn open(model: &str) -> Result<Checkpoint> {
    let path = loip_model::fetch::resolve_model(model)?;
    Checkpoint::open(&path).with_context(|| format!("opening model {}", path.display()))
}

/// The model's tokenizer: `tokenizer.json` beside an HF checkpoint, or the GGUF vocabulary.
pub fn tokenizer(ckpt: &Checkpoint) -> Result<Tokenizer> {
    if let Some(meta) = &ckpt.gguf_metadata {
        return Ok(Tokenizer::from_gguf_metadata(meta)?);
    }
    let path = dir_of(&ckpt.dir_or_file).join("tokenizer.json");
    Tokenizer::from_file(&path).with_context(|| format!("loading tokenizer {}", path.display()))
}

/// The model's chat template, if it has one.
pub fn chat_template(ckpt: &Checkpoint) -> Result<Option<ChatTemplate>> {
    if let Some(meta) = &ckpt.gguf_metadata {
        return Ok(ChatTemplate::from_gguf_metadata(meta)?);
    }
    Ok(ChatTemplate::from_hf_dir(&dir_of(&ckpt.dir_or_file))?)
}

fn dir_of(p: &Path) -> PathBuf {
    if p.is_dir() {
        p.to_path_buf()
    } else {
        p.parent().map(Path::to_path_buf).unwrap_or_default()
    }
}
