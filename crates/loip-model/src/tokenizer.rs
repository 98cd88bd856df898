//! Text ↔ token ids: a thin wrapper around the pure-Rust `tokenizers` crate.
//!
//! Two ways in:
//! * [`Tokenizer::from_file`] reads a Hugging Face `tokenizer.json` as is;
//! * [`Tokenizer::from_gguf_vocab`] rebuilds a byte-level (GPT-2 style) BPE tokenizer from the
//!   `tokenizer.ggml.*` metadata of a GGUF file, choosing the pre-tokenizer that matches
//!   `tokenizer.ggml.pre` so that ids equal what Hugging Face produces for the same model;
//!   or, for `tokenizer.ggml.model = "llama"` (SentencePiece: Gemma), a BPE whose merges come
//!   from the piece scores as Hugging Face's `SentencePieceExtractor` derives them, with byte
//!   fallback (`<0xNN>` pieces) and `▁` for spaces.
//!
//! Invariants kept here:
//! * control (token type 3) and user-defined (type 4) GGUF tokens are *added tokens*: text such
//!   as `<|im_start|>` inside a prompt encodes to its single id, never to its spelling;
//! * control tokens are *special*: `decode(.., skip_special = true)` drops them, user-defined
//!   tokens are always printed (as Hugging Face and llama.cpp do);
//! * a tokenizer is immutable once built, so `&Tokenizer` can be shared across threads.
//!
//! [`StreamDecoder`] turns a stream of generated ids into text pieces without ever cutting a
//! multi-byte UTF-8 character in half.

use std::path::{Path, PathBuf};

use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::replace::Replace;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

use crate::gguf::GgufMetadata;

/// GGUF `tokenizer.ggml.token_type` value of a normal token.
pub const TOKEN_TYPE_NORMAL: i32 = 1;
/// GGUF `tokenizer.ggml.token_type` value of the unknown token.
pub const TOKEN_TYPE_UNKNOWN: i32 = 2;
/// GGUF `tokenizer.ggml.token_type` value of a control (special) token.
pub const TOKEN_TYPE_CONTROL: i32 = 3;
/// GGUF `tokenizer.ggml.token_type` value of a user-defined (added, not special) token.
pub const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// Split regex of Llama-3 (`tokenizer.ggml.pre` = `llama-bpe` / `llama3`), as in its
/// `tokenizer.json` (and llama.cpp's `llama-vocab.cpp`): up to 3 digits per piece.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Split regex of Qwen2 (`tokenizer.ggml.pre` = `qwen2`): like Llama-3 but one digit per piece.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Errors from loading a tokenizer, encoding or decoding.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizerError {
    /// `tokenizer.json` could not be read or parsed.
    #[error("cannot load tokenizer {path}: {source}")]
    Load {
        /// The file that failed.
        path: PathBuf,
        /// What the `tokenizers` crate reported.
        #[source]
        source: tokenizers::Error,
    },
    /// The GGUF `tokenizer.ggml.model` is not one this crate can rebuild.
    #[error(
        "unsupported GGUF tokenizer model {model:?}: only \"gpt2\" (byte-level BPE) and \"llama\" (SentencePiece) are supported"
    )]
    UnsupportedModel {
        /// The `tokenizer.ggml.model` value.
        model: String,
    },
    /// The GGUF vocabulary metadata is inconsistent (bad merge, id out of range, ...).
    #[error("invalid GGUF vocabulary: {0}")]
    InvalidVocab(String),
    /// Encoding failed inside the `tokenizers` crate.
    #[error("encode failed: {0}")]
    Encode(#[source] tokenizers::Error),
    /// Decoding failed inside the `tokenizers` crate.
    #[error("decode failed: {0}")]
    Decode(#[source] tokenizers::Error),
    /// An id given to `decode` is not in the vocabulary.
    #[error("token id {id} is outside the vocabulary (size {vocab_size})")]
    IdOutOfRange {
        /// The offending id.
        id: u32,
        /// Number of ids in the vocabulary.
        vocab_size: usize,
    },
}

/// The `tokenizer.ggml.*` metadata of a GGUF file, already pulled out of its key/value table.
#[derive(Debug, Clone, Default)]
pub struct GgufVocab {
    /// `tokenizer.ggml.model`, e.g. `"gpt2"` (byte-level BPE) or `"llama"` (SentencePiece).
    pub model: String,
    /// `tokenizer.ggml.pre`, the pre-tokenizer name (`"smollm"`, `"llama-bpe"`, ...).
    pub pre: Option<String>,
    /// `tokenizer.ggml.tokens`; the index is the token id. Byte-level spelling (`Ġthe`).
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.token_type`, parallel to `tokens` (1 normal, 3 control, 4 user-defined);
    /// may be empty (then every token is normal).
    pub token_types: Vec<i32>,
    /// `tokenizer.ggml.merges`, each `"left right"`, highest priority first.
    pub merges: Vec<String>,
    /// `tokenizer.ggml.scores`, parallel to `tokens` (SentencePiece piece scores; may be empty)
    pub scores: Vec<f32>,
    /// `tokenizer.ggml.bos_token_id`.
    pub bos: Option<u32>,
    /// `tokenizer.ggml.eos_token_id`.
    pub eos: Option<u32>,
    /// `tokenizer.ggml.add_bos_token`: prepend `bos` when encoding with special tokens.
    pub add_bos: bool,
}

impl GgufVocab {
    /// Pulls the `tokenizer.ggml.*` keys out of GGUF metadata. `model` and `tokens` are
    /// required; the rest default to empty / absent / `false`.
    pub fn from_metadata(meta: &GgufMetadata) -> Result<Self, TokenizerError> {
        let bad = |key: &str, what: &str| TokenizerError::InvalidVocab(format!("{key}: {what}"));
        let strings = |key: &str| -> Result<Option<Vec<String>>, TokenizerError> {
            match meta.get(key) {
                None => Ok(None),
                Some(_) => meta
                    .get_str_array(key)
                    .map(|v| Some(v.into_iter().map(str::to_string).collect()))
                    .ok_or_else(|| bad(key, "expected an array of strings")),
            }
        };
        let id = |key: &str| -> Result<Option<u32>, TokenizerError> {
            match meta.get(key) {
                None => Ok(None),
                Some(_) => meta
                    .get_u32(key)
                    .map(Some)
                    .ok_or_else(|| bad(key, "expected a token id")),
            }
        };
        let model = meta
            .get_str("tokenizer.ggml.model")
            .ok_or_else(|| bad("tokenizer.ggml.model", "missing or not a string"))?
            .to_string();
        let tokens = strings("tokenizer.ggml.tokens")?
            .ok_or_else(|| bad("tokenizer.ggml.tokens", "missing"))?;
        let token_types = match meta.get("tokenizer.ggml.token_type") {
            None => Vec::new(),
            Some(_) => meta
                .get_i32_array("tokenizer.ggml.token_type")
                .ok_or_else(|| bad("tokenizer.ggml.token_type", "expected an array of integers"))?,
        };
        Ok(Self {
            model,
            pre: meta.get_str("tokenizer.ggml.pre").map(str::to_string),
            tokens,
            token_types,
            merges: strings("tokenizer.ggml.merges")?.unwrap_or_default(),
            scores: match meta.get("tokenizer.ggml.scores") {
                None => Vec::new(),
                Some(_) => meta
                    .get_f32_array("tokenizer.ggml.scores")
                    .ok_or_else(|| bad("tokenizer.ggml.scores", "expected an array of floats"))?,
            },
            bos: id("tokenizer.ggml.bos_token_id")?,
            eos: id("tokenizer.ggml.eos_token_id")?,
            add_bos: meta
                .get_bool("tokenizer.ggml.add_bos_token")
                .unwrap_or(false),
        })
    }
}

/// A loaded tokenizer. Cheap to share by reference; immutable after construction.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// `inner` with special-token matching off, made on first use by [`Tokenizer::encode_plain`]
    plain: std::sync::OnceLock<tokenizers::Tokenizer>,
    vocab_size: usize, // ids 0..vocab_size, added tokens included
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size)
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// Loads a Hugging Face `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<Self, TokenizerError> {
        let inner =
            tokenizers::Tokenizer::from_file(path).map_err(|source| TokenizerError::Load {
                path: path.to_path_buf(),
                source,
            })?;
        Ok(Self::wrap(inner))
    }

    /// Builds a byte-level BPE tokenizer from GGUF metadata (`tokenizer.ggml.model == "gpt2"`).
    ///
    /// The pre-tokenizer follows `tokenizer.ggml.pre`: `smollm` (digits split one by one, then
    /// GPT-2 byte-level split), `llama-bpe`/`llama3`, `qwen2`, `default`/`gpt2`; an unknown
    /// name falls back to GPT-2 with a warning.
    pub fn from_gguf_vocab(v: GgufVocab) -> Result<Self, TokenizerError> {
        if v.model != "gpt2" && v.model != "llama" {
            return Err(TokenizerError::UnsupportedModel { model: v.model });
        }
        let n = v.tokens.len();
        if !v.token_types.is_empty() && v.token_types.len() != n {
            return Err(TokenizerError::InvalidVocab(format!(
                "{} token types for {} tokens",
                v.token_types.len(),
                n
            )));
        }
        for (what, id) in [("bos", v.bos), ("eos", v.eos)] {
            if let Some(id) = id.filter(|&id| id as usize >= n) {
                return Err(TokenizerError::InvalidVocab(format!(
                    "{what} token id {id} is outside the vocabulary ({n} tokens)"
                )));
            }
        }
        let spm = v.model == "llama";
        if spm && v.scores.len() != n {
            return Err(TokenizerError::InvalidVocab(format!(
                "{} scores for {} tokens",
                v.scores.len(),
                n
            )));
        }
        let pre = v.pre.as_deref().unwrap_or("default");
        let scheme = PreScheme::from_name(pre);

        let mut vocab = Vocab::default();
        for (id, tok) in v.tokens.iter().enumerate() {
            let id = u32::try_from(id)
                .map_err(|_| TokenizerError::InvalidVocab(format!("{n} tokens is too many")))?;
            // The first spelling wins if the vocabulary repeats a token.
            vocab.entry(tok.clone()).or_insert(id);
        }
        let mut merges = Vec::with_capacity(v.merges.len());
        if spm {
            merges = spm_merges(&v, &vocab);
        }
        for (i, m) in v.merges.iter().enumerate() {
            let (a, b) = m.split_once(' ').ok_or_else(|| {
                TokenizerError::InvalidVocab(format!("merge {i} {m:?} is not \"left right\""))
            })?;
            merges.push((a.to_string(), b.to_string()));
        }
        let mut builder = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .ignore_merges(!spm && scheme.ignore_merges());
        if spm {
            builder = builder.byte_fallback(true);
            if let Some(unk) = v.token_types.iter().position(|&t| t == TOKEN_TYPE_UNKNOWN) {
                builder = builder.unk_token(v.tokens[unk].clone());
            }
        }
        let bpe = builder
            .build()
            .map_err(|e| TokenizerError::InvalidVocab(e.to_string()))?;

        let mut inner = tokenizers::Tokenizer::new(bpe);
        if spm {
            let bad = |e: tokenizers::Error| TokenizerError::InvalidVocab(e.to_string());
            inner
                .with_normalizer(Some(Replace::new(" ", "\u{2581}").map_err(bad)?))
                .map_err(bad)?;
            inner.with_decoder(Some(DecoderSequence::new(vec![
                Replace::new("\u{2581}", " ").map_err(bad)?.into(),
                ByteFallback::new().into(),
                Fuse::new().into(),
            ])));
        } else {
            inner.with_pre_tokenizer(Some(scheme.pre_tokenizer()?));
            inner.with_decoder(Some(ByteLevelDecoder::default()));
        }
        if v.add_bos {
            let bos = v.bos.ok_or_else(|| {
                TokenizerError::InvalidVocab(
                    "add_bos_token is set but bos_token_id is missing".into(),
                )
            })?;
            let bos_tok = v.tokens[bos as usize].clone();
            let template = TemplateProcessing::builder()
                .try_single(format!("{bos_tok} $A"))
                .and_then(|b| b.try_pair(format!("{bos_tok} $A {bos_tok}:1 $B:1")))
                .map_err(|e| TokenizerError::InvalidVocab(format!("bos template: {e}")))?
                .special_tokens(vec![(bos_tok.clone(), bos)])
                .build()
                .map_err(|e| TokenizerError::InvalidVocab(format!("bos template: {e}")))?;
            inner.with_post_processor(Some(template));
        } else if !spm {
            // Only trims offsets; ids are unaffected. Mirrors HF's byte-level post-processor.
            inner.with_post_processor(Some(ByteLevel::new(false, false, true)));
        }

        let mut special = Vec::new();
        let mut user = Vec::new();
        for (tok, &ty) in v.tokens.iter().zip(&v.token_types) {
            match ty {
                TOKEN_TYPE_CONTROL => {
                    special.push(AddedToken::from(tok.clone(), true).normalized(false))
                }
                TOKEN_TYPE_USER_DEFINED => {
                    user.push(AddedToken::from(tok.clone(), false).normalized(false))
                }
                _ => {}
            }
        }
        inner
            .add_special_tokens(special)
            .map_err(|e| TokenizerError::InvalidVocab(e.to_string()))?;
        inner
            .add_tokens(user)
            .map_err(|e| TokenizerError::InvalidVocab(e.to_string()))?;
        Ok(Self::wrap(inner))
    }

    /// [`GgufVocab::from_metadata`] then [`Tokenizer::from_gguf_vocab`].
    pub fn from_gguf_metadata(meta: &GgufMetadata) -> Result<Self, TokenizerError> {
        Self::from_gguf_vocab(GgufVocab::from_metadata(meta)?)
    }

    fn wrap(inner: tokenizers::Tokenizer) -> Self {
        let vocab_size = inner.get_vocab_size(true);
        Self {
            inner,
            plain: std::sync::OnceLock::new(),
            vocab_size,
        }
    }

    /// Encodes `text`. Special tokens written in the text (e.g. `<|im_start|>`) are matched as
    /// single ids; `add_special_tokens` adds what the tokenizer's post-processor adds (bos).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(TokenizerError::Encode)?;
        Ok(enc.get_ids().to_vec())
    }

    /// Encodes `text` as plain text: special (control) tokens spelled in it, e.g.
    /// `<|im_start|>`, are tokenized like any other text, never matched as their ids
    /// (what user-supplied text must get). Nothing is added (no bos).
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let plain = self.plain.get_or_init(|| {
            let mut t = self.inner.clone();
            t.set_encode_special_tokens(true);
            t
        });
        let enc = plain.encode(text, false).map_err(TokenizerError::Encode)?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decodes `ids` to text; `skip_special` drops special (control) tokens.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            return Err(TokenizerError::IdOutOfRange {
                id,
                vocab_size: self.vocab_size,
            });
        }
        self.inner
            .decode(ids, skip_special)
            .map_err(TokenizerError::Decode)
    }

    /// The id of a token spelled exactly `tok` (byte-level spelling, e.g. `Ġthe`), if any.
    pub fn token_to_id(&self, tok: &str) -> Option<u32> {
        self.inner.token_to_id(tok)
    }

    /// The spelling of token `id`, if any.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Number of ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The tokenizer as `tokenizer.json` text (what [`Tokenizer::from_file`] reads back).
    pub fn to_json(&self) -> Result<String, TokenizerError> {
        self.inner.to_string(false).map_err(TokenizerError::Encode)
    }
}

/// SentencePiece merges as Hugging Face's `SentencePieceExtractor` derives them: for every
/// normal piece, each split into two normal pieces is a merge ranked by the whole piece's
/// score (highest first; ties in vocabulary order, then by the ids of left and right).
fn spm_merges(v: &GgufVocab, vocab: &Vocab) -> Vec<(String, String)> {
    let normal = |id: usize| {
        v.token_types
            .get(id)
            .is_none_or(|&t| t == TOKEN_TYPE_NORMAL)
    };
    let normal_id = |s: &str| vocab.get(s).copied().filter(|&id| normal(id as usize));
    let mut ranked: Vec<(f32, usize, u32, u32)> = Vec::new(); // (score, piece, left, right)
    for (id, piece) in v.tokens.iter().enumerate() {
        if !normal(id) {
            continue;
        }
        let mut local = Vec::new();
        for (k, _) in piece.char_indices().skip(1) {
            if let (Some(l), Some(r)) = (normal_id(&piece[..k]), normal_id(&piece[k..])) {
                local.push((l, r));
            }
        }
        local.sort_unstable();
        ranked.extend(local.into_iter().map(|(l, r)| (v.scores[id], id, l, r)));
    }
    // stable: equal scores keep vocabulary order
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0));
    ranked
        .into_iter()
        .map(|(_, _, l, r)| (v.tokens[l as usize].clone(), v.tokens[r as usize].clone()))
        .collect()
}

/// Which pre-tokenizer a `tokenizer.ggml.pre` name stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PreScheme {
    /// HF SmolLM2: `Digits(individual) + ByteLevel(regex)`.
    Smollm,
    /// Llama-3 split regex + `ByteLevel(use_regex = false)`, `ignore_merges`.
    Llama3,
    /// Qwen2 split regex + `ByteLevel(use_regex = false)`.
    Qwen2,
    /// Plain GPT-2 `ByteLevel(regex)`.
    Gpt2,
}

impl PreScheme {
    fn from_name(pre: &str) -> Self {
        match pre {
            "smollm" => Self::Smollm,
            "llama-bpe" | "llama3" => Self::Llama3,
            "qwen2" => Self::Qwen2,
            "default" | "gpt2" | "gpt-2" => Self::Gpt2,
            other => {
                tracing::warn!(
                    pre = other,
                    "unknown tokenizer.ggml.pre; using the GPT-2 pre-tokenizer"
                );
                Self::Gpt2
            }
        }
    }

    fn ignore_merges(self) -> bool {
        matches!(self, Self::Llama3)
    }

    fn pre_tokenizer(self) -> Result<PreTokenizerWrapper, TokenizerError> {
        let split = |re: &str| {
            Split::new(
                SplitPattern::Regex(re.to_string()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| TokenizerError::InvalidVocab(format!("split regex: {e}")))
        };
        Ok(match self {
            Self::Smollm => PreTokenizerWrapper::Sequence(Sequence::new(vec![
                Digits::new(true).into(),
                ByteLevel::new(false, true, true).into(),
            ])),
            Self::Llama3 => PreTokenizerWrapper::Sequence(Sequence::new(vec![
                split(LLAMA3_SPLIT)?.into(),
                ByteLevel::new(false, true, false).into(),
            ])),
            Self::Qwen2 => PreTokenizerWrapper::Sequence(Sequence::new(vec![
                split(QWEN2_SPLIT)?.into(),
                ByteLevel::new(false, false, false).into(),
            ])),
            Self::Gpt2 => ByteLevel::new(false, true, true).into(),
        })
    }
}

/// Incremental detokenizer for streaming output.
///
/// Push generated ids one at a time; each push returns the text that became complete. Text is
/// held back while it ends in an incomplete UTF-8 sequence (decoded as U+FFFD), so a character
/// split across two byte tokens comes out whole. Only a short window of ids is re-decoded
/// per push, so the cost per token stays constant.
#[derive(Debug)]
pub struct StreamDecoder<'a> {
    tok: &'a Tokenizer,
    skip_special: bool,
    ids: Vec<u32>,       // window: ids[..prefix_index] are context already emitted
    prefix: String,      // decode(ids[..]) as of the last emission
    prefix_index: usize, // ids before this index are context, not pending
}

impl<'a> StreamDecoder<'a> {
    /// A decoder that skips special tokens (what a user should see).
    pub fn new(tok: &'a Tokenizer) -> Self {
        Self::with_skip_special(tok, true)
    }

    /// A decoder that keeps (`false`) or drops (`true`) special tokens.
    pub fn with_skip_special(tok: &'a Tokenizer, skip_special: bool) -> Self {
        Self {
            tok,
            skip_special,
            ids: Vec::new(),
            prefix: String::new(),
            prefix_index: 0,
        }
    }

    /// Feeds one id; returns newly completed text, or `None` if nothing is complete yet.
    pub fn push(&mut self, id: u32) -> Result<Option<String>, TokenizerError> {
        if self.prefix.is_empty() && !self.ids.is_empty() {
            let p = self.tok.decode(&self.ids, self.skip_special)?;
            if !p.ends_with('\u{FFFD}') {
                self.prefix = p;
                self.prefix_index = self.ids.len();
            }
        }
        self.ids.push(id);
        let text = self.tok.decode(&self.ids, self.skip_special)?;
        if text.len() <= self.prefix.len() || text.ends_with('\u{FFFD}') {
            return Ok(None);
        }
        let new_text = match text.strip_prefix(self.prefix.as_str()) {
            Some(t) => t.to_string(),
            // The decoder rewrote earlier text (should not happen for byte-level BPE): emit the
            // part after the common prefix rather than fail the whole generation.
            None => text[common_prefix_len(&text, &self.prefix)..].to_string(),
        };
        let new_prefix_index = self.ids.len() - self.prefix_index;
        self.ids.drain(..self.prefix_index);
        self.prefix = self.tok.decode(&self.ids, self.skip_special)?;
        self.prefix_index = new_prefix_index;
        Ok(Some(new_text))
    }

    /// Ends the stream: returns whatever text is still held back (an incomplete trailing
    /// UTF-8 sequence comes out as U+FFFD), or an empty string.
    pub fn finish(self) -> Result<String, TokenizerError> {
        let text = self.tok.decode(&self.ids, self.skip_special)?;
        if text.len() <= self.prefix.len() {
            return Ok(String::new());
        }
        Ok(match text.strip_prefix(self.prefix.as_str()) {
            Some(t) => t.to_string(),
            None => text[common_prefix_len(&text, &self.prefix)..].to_string(),
        })
    }
}

/// Length in bytes of the longest common prefix of `a` and `b` that ends on a char boundary.
fn common_prefix_len(a: &str, b: &str) -> usize {
    a.char_indices()
        .zip(b.chars())
        .find(|((_, ca), cb)| ca != cb)
        .map(|((i, _), _)| i)
        .unwrap_or_else(|| a.len().min(b.len()))
}
