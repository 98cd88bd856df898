//! Chat templates: turn a list of messages into the prompt text a chat model was trained on.
//!
//! Templates are the Jinja sources shipped with models (`tokenizer.chat_template` in GGUF,
//! `chat_template.jinja` or `tokenizer_config.json` in a Hugging Face directory). They are
//! rendered with `minijinja` set up the way Hugging Face transformers sets up Jinja2:
//! `trim_blocks` and `lstrip_blocks` on, Python string/dict/list methods (`.strip()`,
//! `.items()`, ...) through `minijinja-contrib`'s pycompat, a `raise_exception(msg)` function
//! that fails the render with `msg`, and the variables `messages`, `add_generation_prompt`,
//! `bos_token` and `eos_token`.
//!
//! The template is compiled once in [`ChatTemplate::new`]; a syntax error is reported there,
//! not at the first render.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use minijinja::{Environment, ErrorKind, Value};
use serde::{Deserialize, Serialize};

use crate::gguf::GgufMetadata;

const TEMPLATE_NAME: &str = "chat_template";

/// Errors from loading or rendering a chat template.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChatError {
    /// A file of the model directory could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// `tokenizer_config.json` is not valid JSON or has an unexpected shape.
    #[error("invalid {path}: {message}")]
    Config {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// The template does not compile.
    #[error("chat template does not compile: {0:#}")]
    Syntax(#[source] minijinja::Error),
    /// The template raised an error (`raise_exception`) or failed while rendering.
    #[error("chat template failed to render: {0:#}")]
    Render(#[source] minijinja::Error),
}

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// The message text.
    pub content: String,
}

impl ChatMessage {
    /// A message with the given role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template plus the bos/eos strings it may refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `template_source`. `bos_token`/`eos_token` are the strings the template sees
    /// as `bos_token`/`eos_token` (undefined when `None`).
    pub fn new(
        template_source: String,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, ChatError> {
        let mut env = Environment::new();
        // Hugging Face renders with trim_blocks=True, lstrip_blocks=True.
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(ChatError::Syntax)?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        minijinja_contrib::add_to_environment(&mut env);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned(TEMPLATE_NAME, template_source)
            .map_err(ChatError::Syntax)?;
        Ok(Self {
            env,
            bos_token,
            eos_token,
        })
    }

    /// Loads the chat template of a Hugging Face model directory: `chat_template.jinja`, else
    /// `chat_template.json` (`{"chat_template": ...}`), else the `chat_template` entry of
    /// `tokenizer_config.json` (a string, or a list of `{name, template}` of which `default` is
    /// used). bos/eos strings come from `tokenizer_config.json`. `Ok(None)` if the directory has
    /// no template.
    pub fn from_hf_dir(dir: &Path) -> Result<Option<Self>, ChatError> {
        let config_path = dir.join("tokenizer_config.json");
        let config =
            match read_optional(&config_path)? {
                Some(text) => Some(serde_json::from_str::<serde_json::Value>(&text).map_err(
                    |e| ChatError::Config {
                        path: config_path.clone(),
                        message: e.to_string(),
                    },
                )?),
                None => None,
            };
        let token = |key: &str| config.as_ref().and_then(|c| token_string(c.get(key)?));
        let (bos, eos) = (token("bos_token"), token("eos_token"));

        if let Some(src) = read_optional(&dir.join("chat_template.jinja"))? {
            return Self::new(src, bos, eos).map(Some);
        }
        let json_path = dir.join("chat_template.json");
        if let Some(text) = read_optional(&json_path)? {
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| ChatError::Config {
                    path: json_path.clone(),
                    message: e.to_string(),
                })?;
            if let Some(src) = template_entry(&json_path, v.get("chat_template"))? {
                return Self::new(src, bos, eos).map(Some);
            }
        }
        let Some(config) = config.as_ref() else {
            return Ok(None);
        };
        match template_entry(&config_path, config.get("chat_template"))? {
            Some(src) => Self::new(src, bos, eos).map(Some),
            None => Ok(None),
        }
    }

    /// The template of a GGUF file (`tokenizer.chat_template`), with bos/eos strings looked up
    /// in `tokenizer.ggml.tokens`. `Ok(None)` if the file has no template.
    pub fn from_gguf_metadata(meta: &GgufMetadata) -> Result<Option<Self>, ChatError> {
        let Some(src) = meta.get_str("tokenizer.chat_template") else {
            return Ok(None);
        };
        let tokens = meta.get("tokenizer.ggml.tokens").and_then(|v| v.as_array());
        let token = |key: &str| {
            let id = usize::try_from(meta.get_u32(key)?).ok()?;
            tokens?.get(id)?.as_str().map(str::to_string)
        };
        let (bos, eos) = (
            token("tokenizer.ggml.bos_token_id"),
            token("tokenizer.ggml.eos_token_id"),
        );
        Self::new(src.to_string(), bos, eos).map(Some)
    }

    /// Renders the conversation; with `add_generation_prompt` the text ends with the opening
    /// of an assistant turn, ready for generation.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| {
                let mut map = BTreeMap::new();
                map.insert("role".to_string(), Value::from(m.role.as_str()));
                map.insert("content".to_string(), Value::from(m.content.as_str()));
                Value::from(map)
            })
            .collect();
        let mut ctx: BTreeMap<String, Value> = BTreeMap::new();
        ctx.insert("messages".into(), Value::from(messages));
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        );
        if let Some(b) = &self.bos_token {
            ctx.insert("bos_token".into(), Value::from(b.as_str()));
        }
        if let Some(e) = &self.eos_token {
            ctx.insert("eos_token".into(), Value::from(e.as_str()));
        }
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(ChatError::Render)?;
        tmpl.render(Value::from(ctx)).map_err(ChatError::Render)
    }

    /// The bos string given at construction.
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// The eos string given at construction.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }
}

/// `raise_exception(msg)`: what HF templates call to reject a conversation.
fn raise_exception(msg: String) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
}

/// Reads a file, `None` if it does not exist.
fn read_optional(path: &Path) -> Result<Option<String>, ChatError> {
    match std::fs::read_to_string(path) {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(ChatError::Io {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// A special-token entry of `tokenizer_config.json`: a string, or `{"content": ...}`.
fn token_string(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// The `chat_template` entry: a string, or a list of `{name, template}` (use `default`).
fn template_entry(path: &Path, v: Option<&serde_json::Value>) -> Result<Option<String>, ChatError> {
    let bad = |message: String| ChatError::Config {
        path: path.to_path_buf(),
        message,
    };
    match v {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
        Some(serde_json::Value::Array(list)) => {
            let mut names = Vec::new();
            for item in list {
                let name = item.get("name").and_then(|n| n.as_str());
                let template = item.get("template").and_then(|t| t.as_str());
                match (name, template) {
                    (Some("default"), Some(t)) => return Ok(Some(t.to_string())),
                    (Some(n), Some(_)) => names.push(n.to_string()),
                    _ => {
                        return Err(bad(
                            "chat_template list entries must be {name, template}".into()
                        ))
                    }
                }
            }
            Err(bad(format!(
                "chat_template list has no \"default\" entry (has: {})",
                names.join(", ")
            )))
        }
        Some(_) => Err(bad(
            "chat_template must be a string or a list of {name, template}".into(),
        )),
    }
}
