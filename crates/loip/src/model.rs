//! Opening a model by name or path (a known name is fetched, verified and cached on first
//! use), with its tokenizer and chat template.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use loip_model::chat::ChatTemplate;
use loip_model::slice::{Slices, MANIFEST};
use loip_model::tokenizer::Tokenizer;
use loip_model::{Checkpoint, ModelConfig};

/// A checkpoint opened from `smollm2` or a local path.
pub fn open(model: &str) -> Result<Checkpoint> {
    let path = loip_model::fetch::resolve_model(model)?;
    Checkpoint::open(&path).with_context(|| format!("opening model {}", path.display()))
}

/// What a request needs besides weights: config, tokenizer, chat template.
pub struct ModelInfo {
    /// hyper-parameters
    pub config: ModelConfig,
    /// tokenizer, when the model has one
    pub tokenizer: Result<Tokenizer>,
    /// chat template, when the model has one
    pub chat: Result<Option<ChatTemplate>>,
}

/// Config, tokenizer and chat template of a checkpoint or a slice directory.
pub fn info(model: &str) -> Result<ModelInfo> {
    let p = Path::new(model);
    if p.join(MANIFEST).is_file() {
        return Ok(slice_info(&Slices::open(p)?));
    }
    let ckpt = open(model)?;
    Ok(ModelInfo {
        tokenizer: tokenizer(&ckpt),
        chat: chat_template(&ckpt),
        config: ckpt.config.clone(),
    })
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

/// Config, tokenizer and chat template of an opened slice directory (its manifest read
/// once, by whoever opened it).
pub fn slice_info(slices: &Slices) -> ModelInfo {
    let tok = slices.dir.join("tokenizer.json");
    ModelInfo {
        config: slices.manifest.config.clone(),
        tokenizer: Tokenizer::from_file(&tok)
            .with_context(|| format!("loading tokenizer {}", tok.display())),
        chat: ChatTemplate::from_hf_dir(&slices.dir).map_err(Into::into),
    }
}

fn dir_of(p: &Path) -> PathBuf {
    if p.is_dir() {
        p.to_path_buf()
    } else {
        p.parent().map(Path::to_path_buf).unwrap_or_default()
    }
}
