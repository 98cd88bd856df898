//! GGUF (v2, v3) reader: header, metadata key/values, tensor infos, and the mapping of a
//! `llama` GGUF onto canonical HF tensor names and (in `model_config`) a
//! [`ModelConfig`](crate::config::ModelConfig).
//!
//! Layout (all little-endian): `"GGUF"`, `u32 version`, `u64 tensor_count`, `u64 kv_count`,
//! then `kv_count` × (string key, `u32` value type, value), then `tensor_count` ×
//! (string name, `u32 n_dims`, `n_dims` × `u64 ne`, `u32 ggml_type`, `u64 offset`), then
//! padding to `general.alignment` (default 32), then the tensor data. A string is a `u64`
//! byte length and UTF-8 bytes. Tensor offsets are relative to the data section and aligned.
//!
//! Invariants kept by [`GgufFile::parse`]: every length is checked against the bytes left
//! before anything is allocated for it, arrays and nesting are bounded, every tensor has a
//! supported type, whole quantization blocks per row, an aligned offset, and data that lies
//! inside the file. Nothing here panics on any input.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use loip_kernels::DType;

use crate::config::Arch;
use crate::error::ModelError;
use crate::names::{self, suffix};

/// The first four bytes of every GGUF file.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of tensor data when `general.alignment` is absent, bytes.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's `GGML_MAX_DIMS`.
const MAX_DIMS: u32 = 4;
/// Longest metadata array accepted (the largest vocabularies are ~256k entries).
const MAX_ARRAY_LEN: u64 = 1 << 24;
/// Most metadata values (array elements included) accepted in one file.
const MAX_VALUES: u64 = 1 << 25;
/// Deepest nesting of arrays accepted.
const MAX_DEPTH: u32 = 4;

/// A metadata value. Arrays keep their elements as values (all of one type in a valid file).
#[derive(Debug, Clone, PartialEq)]
#[allow(missing_docs)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    Array(Vec<GgufValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// GGUF value type ids (`gguf_type`).
pub mod value_type {
    #![allow(missing_docs)]
    pub const U8: u32 = 0;
    pub const I8: u32 = 1;
    pub const U16: u32 = 2;
    pub const I16: u32 = 3;
    pub const U32: u32 = 4;
    pub const I32: u32 = 5;
    pub const F32: u32 = 6;
    pub const BOOL: u32 = 7;
    pub const STRING: u32 = 8;
    pub const ARRAY: u32 = 9;
    pub const U64: u32 = 10;
    pub const I64: u32 = 11;
    pub const F64: u32 = 12;
}

impl GgufValue {
    /// The GGUF value type id of this value.
    pub fn type_id(&self) -> u32 {
        use value_type as t;
        match self {
            GgufValue::U8(_) => t::U8,
            GgufValue::I8(_) => t::I8,
            GgufValue::U16(_) => t::U16,
            GgufValue::I16(_) => t::I16,
            GgufValue::U32(_) => t::U32,
            GgufValue::I32(_) => t::I32,
            GgufValue::F32(_) => t::F32,
            GgufValue::Bool(_) => t::BOOL,
            GgufValue::Str(_) => t::STRING,
            GgufValue::Array(_) => t::ARRAY,
            GgufValue::U64(_) => t::U64,
            GgufValue::I64(_) => t::I64,
            GgufValue::F64(_) => t::F64,
        }
    }

    /// Any integer type with a value ≥ 0, widened.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(v.into()),
            GgufValue::U16(v) => Some(v.into()),
            GgufValue::U32(v) => Some(v.into()),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) => u64::try_from(v).ok(),
            GgufValue::I16(v) => u64::try_from(v).ok(),
            GgufValue::I32(v) => u64::try_from(v).ok(),
            GgufValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any integer type, widened.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            GgufValue::I8(v) => Some(v.into()),
            GgufValue::I16(v) => Some(v.into()),
            GgufValue::I32(v) => Some(v.into()),
            GgufValue::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// A float (F32, or F64 narrowed).
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            GgufValue::F32(v) => Some(v),
            GgufValue::F64(v) => Some(v as f32),
            _ => None,
        }
    }

    /// A string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::Str(s) => Some(s),
            _ => None,
        }
    }

    /// A bool.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// An array's elements.
    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// The metadata of a GGUF file.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufMetadata {
    /// GGUF version (2 or 3)
    pub version: u32,
    /// tensor data alignment, bytes (`general.alignment`, default 32)
    pub alignment: u64,
    /// every key/value pair, in key order
    pub kv: BTreeMap<String, GgufValue>,
}

impl GgufMetadata {
    /// The raw value of `key`.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.kv.get(key)
    }

    /// A string value.
    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key)?.as_str()
    }

    /// An integer value of any type that fits `u32`.
    pub fn get_u32(&self, key: &str) -> Option<u32> {
        self.get(key)?.as_u64().and_then(|v| u32::try_from(v).ok())
    }

    /// An integer value of any type that is ≥ 0.
    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key)?.as_u64()
    }

    /// A float value (F32 or F64).
    pub fn get_f32(&self, key: &str) -> Option<f32> {
        self.get(key)?.as_f32()
    }

    /// A bool value.
    pub fn get_bool(&self, key: &str) -> Option<bool> {
        self.get(key)?.as_bool()
    }

    /// An array of strings (e.g. `tokenizer.ggml.tokens`, `tokenizer.ggml.merges`).
    pub fn get_str_array(&self, key: &str) -> Option<Vec<&str>> {
        self.get(key)?
            .as_array()?
            .iter()
            .map(GgufValue::as_str)
            .collect()
    }

    /// An array of integers that fit `i32` (e.g. `tokenizer.ggml.token_type`).
    pub fn get_i32_array(&self, key: &str) -> Option<Vec<i32>> {
        self.get(key)?
            .as_array()?
            .iter()
            .map(|v| v.as_i64().and_then(|x| i32::try_from(x).ok()))
            .collect()
    }

    /// An array of floats (e.g. `tokenizer.ggml.scores`).
    pub fn get_f32_array(&self, key: &str) -> Option<Vec<f32>> {
        self.get(key)?
            .as_array()?
            .iter()
            .map(GgufValue::as_f32)
            .collect()
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> Option<&str> {
        self.get_str("general.architecture")
    }
}

/// One tensor as described by the GGUF header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufTensor {
    /// GGUF name, e.g. `blk.0.attn_q.weight`
    pub name: String,
    /// stored type
    pub dtype: DType,
    /// ggml dims, `ne[0]` = elements per row (cols), `ne[1]` = rows, ...
    pub ne: Vec<u64>,
    /// absolute byte offset of the data in the file
    pub offset: u64,
    /// data length, bytes
    pub nbytes: u64,
}

impl GgufTensor {
    /// Shape in HF order (`ne` reversed): `[rows, cols]` for a matrix.
    pub fn hf_shape(&self) -> Vec<usize> {
        // Each dim was checked to fit usize in parse.
        self.ne.iter().rev().map(|&d| d as usize).collect()
    }
}

/// A parsed GGUF header.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufFile {
    /// version, alignment and key/values
    pub metadata: GgufMetadata,
    /// tensors in header order
    pub tensors: Vec<GgufTensor>,
    /// absolute offset of the data section, bytes (a multiple of the alignment)
    pub data_offset: u64,
}

/// ggml tensor type id → name, for the types llama.cpp defines (ids 4 and 5 are retired).
pub fn ggml_type_name(id: u32) -> Option<&'static str> {
    Some(match id {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        6 => "Q5_0",
        7 => "Q5_1",
        8 => "Q8_0",
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        12 => "Q4_K",
        13 => "Q5_K",
        14 => "Q6_K",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        30 => "BF16",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => return None,
    })
}

/// ggml tensor type id → [`DType`], for the types the kernels implement.
pub fn dtype_from_ggml(id: u32) -> Option<DType> {
    Some(match id {
        0 => DType::F32,
        1 => DType::F16,
        2 => DType::Q4_0,
        3 => DType::Q4_1,
        6 => DType::Q5_0,
        7 => DType::Q5_1,
        8 => DType::Q8_0,
        10 => DType::Q2K,
        11 => DType::Q3K,
        12 => DType::Q4K,
        13 => DType::Q5K,
        14 => DType::Q6K,
        20 => DType::IQ4NL,
        23 => DType::IQ4XS,
        30 => DType::BF16,
        _ => return None,
    })
}

/// [`DType`] → ggml tensor type id.
pub fn ggml_type_of(dtype: DType) -> u32 {
    match dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::Q4_0 => 2,
        DType::Q4_1 => 3,
        DType::Q8_0 => 8,
        DType::Q4K => 12,
        DType::Q6K => 14,
        DType::Q5_0 => 6,
        DType::Q5_1 => 7,
        DType::Q2K => 10,
        DType::Q3K => 11,
        DType::Q5K => 13,
        DType::IQ4NL => 20,
        DType::IQ4XS => 23,
        DType::BF16 => 30,
    }
}

/// `"NAME (id)"` for errors, `"unknown (id)"` for ids llama.cpp does not define.
fn type_label(id: u32) -> String {
    format!("{} ({id})", ggml_type_name(id).unwrap_or("unknown"))
}

/// Per-layer GGUF names (`blk.N.<gguf>.weight`) and their HF suffixes.
const LAYER_NAME_MAP: [(&str, &str); 11] = [
    ("attn_norm", suffix::INPUT_LAYERNORM),
    ("attn_q", suffix::Q_PROJ),
    ("attn_k", suffix::K_PROJ),
    ("attn_v", suffix::V_PROJ),
    ("attn_output", suffix::O_PROJ),
    ("attn_q_norm", suffix::Q_NORM),
    ("attn_k_norm", suffix::K_NORM),
    ("ffn_norm", suffix::POST_ATTENTION_LAYERNORM),
    ("ffn_gate", suffix::GATE_PROJ),
    ("ffn_up", suffix::UP_PROJ),
    ("ffn_down", suffix::DOWN_PROJ),
];

/// Per-layer GGUF bias names (`blk.N.<gguf>.bias`) and their HF suffixes (Qwen2).
const LAYER_BIAS_MAP: [(&str, &str); 3] = [
    ("attn_q", suffix::Q_BIAS),
    ("attn_k", suffix::K_BIAS),
    ("attn_v", suffix::V_BIAS),
];

/// Gemma 3's per-layer norms as llama.cpp names them; they take precedence over
/// [`LAYER_NAME_MAP`] for `gemma3` files (where `ffn_norm` is the pre-feedforward norm).
const GEMMA3_NORM_MAP: [(&str, &str); 3] = [
    ("post_attention_norm", suffix::POST_ATTENTION_LAYERNORM),
    ("ffn_norm", suffix::PRE_FEEDFORWARD_LAYERNORM),
    ("post_ffw_norm", suffix::POST_FEEDFORWARD_LAYERNORM),
];

/// [`gguf_to_hf_name`] for a file of family `arch` (Gemma 3 names its norms differently).
pub fn gguf_to_hf_name_for(arch: Arch, name: &str) -> Option<String> {
    if arch == Arch::Gemma3 {
        let mapped = name.strip_prefix("blk.").and_then(|rest| {
            let (idx, tail) = rest.split_once('.')?;
            let stem = tail.strip_suffix(".weight")?;
            let (_, hf) = GEMMA3_NORM_MAP.iter().find(|(g, _)| *g == stem)?;
            let layer = names::parse_layer_tensor_name(&format!("model.layers.{idx}.x"))?.0;
            Some(names::layer_tensor_name(layer, hf))
        });
        if mapped.is_some() {
            return mapped;
        }
    }
    gguf_to_hf_name(name)
}

/// [`hf_to_gguf_name`] for a checkpoint of family `arch`.
pub fn hf_to_gguf_name_for(arch: Arch, name: &str) -> Option<String> {
    if arch == Arch::Gemma3 {
        if let Some((layer, hf)) = names::parse_layer_tensor_name(name) {
            if let Some((stem, _)) = GEMMA3_NORM_MAP.iter().find(|(_, h)| *h == hf) {
                return Some(format!("blk.{layer}.{stem}.weight"));
            }
        }
    }
    hf_to_gguf_name(name)
}

/// GGUF tensor name → canonical HF name (`None` for names outside the llama graph).
pub fn gguf_to_hf_name(name: &str) -> Option<String> {
    match name {
        "token_embd.weight" => return Some(names::EMBED_TOKENS.into()),
        "output_norm.weight" => return Some(names::FINAL_NORM.into()),
        "output.weight" => return Some(names::LM_HEAD.into()),
        _ => {}
    }
    let rest = name.strip_prefix("blk.")?;
    let (idx, tail) = rest.split_once('.')?;
    let (stem, table) = match tail.strip_suffix(".weight") {
        Some(stem) => (stem, &LAYER_NAME_MAP[..]),
        None => (tail.strip_suffix(".bias")?, &LAYER_BIAS_MAP[..]),
    };
    let hf_layer = names::parse_layer_tensor_name(&format!("model.layers.{idx}.x"))?.0;
    let (_, hf_suffix) = table.iter().find(|(g, _)| *g == stem)?;
    Some(names::layer_tensor_name(hf_layer, hf_suffix))
}

/// Canonical HF name → GGUF tensor name (`None` for names outside the llama graph).
pub fn hf_to_gguf_name(name: &str) -> Option<String> {
    match name {
        names::EMBED_TOKENS => return Some("token_embd.weight".into()),
        names::FINAL_NORM => return Some("output_norm.weight".into()),
        names::LM_HEAD => return Some("output.weight".into()),
        _ => {}
    }
    let (layer, hf_suffix) = names::parse_layer_tensor_name(name)?;
    if let Some((stem, _)) = LAYER_BIAS_MAP.iter().find(|(_, h)| *h == hf_suffix) {
        return Some(format!("blk.{layer}.{stem}.bias"));
    }
    let (stem, _) = LAYER_NAME_MAP.iter().find(|(_, h)| *h == hf_suffix)?;
    Some(format!("blk.{layer}.{stem}.weight"))
}

/// Where row `j` of one head (of `head_dim` rows) of a GGUF `llama` q or k projection came
/// from in the HF checkpoint: HF row `(j % 2) * (head_dim / 2) + j / 2`.
///
/// llama.cpp's `convert_hf_to_gguf.py` (`LlamaModel.permute(w, n_head, n_head_kv)`, applied
/// to `q_proj` with `n_head` and to `k_proj` with `n_head_kv`) stores
/// `w.reshape(n_head, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(rows, cols)`: within each
/// head, the output index `j = 2 i + s` (shape `(head_dim/2, 2)`) takes input row
/// `s * head_dim/2 + i` (shape `(2, head_dim/2)`). This turns HF's rotate-half RoPE pairs
/// `(i, i + d/2)` into adjacent pairs `(2i, 2i+1)`, which ggml's "normal" RoPE rotates.
pub fn gguf_qk_row_to_hf(j: usize, head_dim: usize) -> usize {
    (j % 2) * (head_dim / 2) + j / 2
}

/// Bounds-checked little-endian cursor over the header bytes.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a Path,
    values: u64,
}

impl<'a> Cursor<'a> {
    fn left(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &dyn Fn() -> String) -> Result<&'a [u8], ModelError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len());
        match end {
            Some(end) => {
                let s = &self.bytes[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(ModelError::truncated(self.path, what())),
        }
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N], ModelError> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, ModelError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, ModelError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String, ModelError> {
        let len = self.u64(what)?;
        if len > self.left() as u64 {
            return Err(ModelError::truncated(
                self.path,
                format!("{} (a string of {len} bytes)", what()),
            ));
        }
        let bytes = self.take(len as usize, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| ModelError::header(self.path, format!("{} is not valid UTF-8", what())))
    }

    fn value(&mut self, ty: u32, depth: u32, key: &str) -> Result<GgufValue, ModelError> {
        use value_type as t;
        self.values += 1;
        if self.values > MAX_VALUES {
            return Err(ModelError::header(
                self.path,
                format!("more than {MAX_VALUES} metadata values"),
            ));
        }
        let what = || format!("the value of metadata key {key:?}");
        Ok(match ty {
            t::U8 => GgufValue::U8(self.array::<1>(&what)?[0]),
            t::I8 => GgufValue::I8(i8::from_le_bytes(self.array(&what)?)),
            t::U16 => GgufValue::U16(u16::from_le_bytes(self.array(&what)?)),
            t::I16 => GgufValue::I16(i16::from_le_bytes(self.array(&what)?)),
            t::U32 => GgufValue::U32(u32::from_le_bytes(self.array(&what)?)),
            t::I32 => GgufValue::I32(i32::from_le_bytes(self.array(&what)?)),
            t::F32 => GgufValue::F32(f32::from_le_bytes(self.array(&what)?)),
            t::U64 => GgufValue::U64(u64::from_le_bytes(self.array(&what)?)),
            t::I64 => GgufValue::I64(i64::from_le_bytes(self.array(&what)?)),
            t::F64 => GgufValue::F64(f64::from_le_bytes(self.array(&what)?)),
            t::BOOL => match self.array::<1>(&what)?[0] {
                0 => GgufValue::Bool(false),
                1 => GgufValue::Bool(true),
                b => {
                    return Err(ModelError::header(
                        self.path,
                        format!("metadata key {key:?}: bool byte {b}"),
                    ))
                }
            },
            t::STRING => GgufValue::Str(self.string(&what)?),
            t::ARRAY => {
                if depth >= MAX_DEPTH {
                    return Err(ModelError::header(
                        self.path,
                        format!("metadata key {key:?}: arrays nested too deep"),
                    ));
                }
                let elem_ty = self.u32(&what)?;
                let len = self.u64(&what)?;
                let min_elem = match elem_ty {
                    t::U8 | t::I8 | t::BOOL => 1,
                    t::U16 | t::I16 => 2,
                    t::U32 | t::I32 | t::F32 => 4,
                    t::U64 | t::I64 | t::F64 | t::STRING => 8,
                    t::ARRAY => 12,
                    other => {
                        return Err(ModelError::header(
                            self.path,
                            format!("metadata key {key:?}: unknown array element type {other}"),
                        ))
                    }
                };
                if len > MAX_ARRAY_LEN {
                    return Err(ModelError::header(
                        self.path,
                        format!("metadata key {key:?}: array of {len} elements"),
                    ));
                }
                if len.saturating_mul(min_elem) > self.left() as u64 {
                    return Err(ModelError::truncated(
                        self.path,
                        format!("{} (an array of {len} elements)", what()),
                    ));
                }
                // `len` is now bounded by the bytes left in the file.
                let mut items = Vec::with_capacity(len as usize);
                for _ in 0..len {
                    items.push(self.value(elem_ty, depth + 1, key)?);
                }
                GgufValue::Array(items)
            }
            other => {
                return Err(ModelError::header(
                    self.path,
                    format!("metadata key {key:?}: unknown value type {other}"),
                ))
            }
        })
    }
}

impl GgufFile {
    /// Parses and checks the header of the GGUF file whose whole contents are `bytes`;
    /// `path` is only used in errors.
    pub fn parse(bytes: &[u8], path: &Path) -> Result<Self, ModelError> {
        let mut c = Cursor {
            bytes,
            pos: 0,
            path,
            values: 0,
        };
        let file_len = bytes.len() as u64;
        let magic: [u8; 4] = c
            .array(&|| "the magic bytes".into())
            .map_err(|_| ModelError::BadMagic { path: path.into() })?;
        if magic != GGUF_MAGIC {
            return Err(ModelError::BadMagic { path: path.into() });
        }
        let version = c.u32(&|| "the version".into())?;
        if !(version == 2 || version == 3) {
            return Err(ModelError::UnsupportedVersion {
                path: path.into(),
                version,
            });
        }
        let tensor_count = c.u64(&|| "the tensor count".into())?;
        let kv_count = c.u64(&|| "the metadata count".into())?;
        // A key/value takes at least 8 (key length) + 4 (type) + 1 bytes; a tensor info at
        // least 8 (name length) + 4 (n_dims) + 8 (ne0) + 4 (type) + 8 (offset).
        if kv_count.saturating_mul(13) > c.left() as u64 {
            return Err(ModelError::truncated(
                path,
                format!("the metadata ({kv_count} key/values declared)"),
            ));
        }
        let mut kv = BTreeMap::new();
        for i in 0..kv_count {
            let key = c.string(&|| format!("metadata key #{i}"))?;
            let ty = c.u32(&|| format!("the type of metadata key {key:?}"))?;
            let value = c.value(ty, 0, &key)?;
            if kv.insert(key.clone(), value).is_some() {
                return Err(ModelError::header(
                    path,
                    format!("duplicate metadata key {key:?}"),
                ));
            }
        }
        let alignment = match kv.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a.is_power_of_two() && a <= 1 << 30 => a,
                _ => {
                    return Err(ModelError::header(
                        path,
                        format!("general.alignment {v:?} is not a power of two"),
                    ));
                }
            },
        };
        if tensor_count.saturating_mul(32) > c.left() as u64 {
            return Err(ModelError::truncated(
                path,
                format!("the tensor infos ({tensor_count} tensors declared)"),
            ));
        }
        let mut raw = Vec::with_capacity(tensor_count as usize);
        let mut seen = BTreeSet::new();
        for i in 0..tensor_count {
            let name = c.string(&|| format!("the name of tensor #{i}"))?;
            let what = || format!("the info of tensor {name}");
            let n_dims = c.u32(&what)?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(ModelError::header(
                    path,
                    format!("tensor {name}: {n_dims} dimensions (1..={MAX_DIMS} allowed)"),
                ));
            }
            let mut ne = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                ne.push(c.u64(&what)?);
            }
            let ty = c.u32(&what)?;
            let rel = c.u64(&what)?;
            if !seen.insert(name.clone()) {
                return Err(ModelError::header(
                    path,
                    format!("duplicate tensor name {name}"),
                ));
            }
            raw.push((name, ne, ty, rel));
        }
        let data_offset = (c.pos as u64).div_ceil(alignment) * alignment;
        if !raw.is_empty() && data_offset > file_len {
            return Err(ModelError::truncated(
                path,
                "the padding before the tensor data",
            ));
        }
        let mut tensors = Vec::with_capacity(raw.len());
        for (name, ne, ty, rel) in raw {
            let dtype = dtype_from_ggml(ty).ok_or_else(|| ModelError::UnsupportedTensorType {
                tensor: name.clone(),
                type_name: type_label(ty),
            })?;
            let nbytes = tensor_nbytes(&name, dtype, &ne, path)?;
            if rel % alignment != 0 {
                return Err(ModelError::header(
                    path,
                    format!("tensor {name}: data offset {rel} is not a multiple of the alignment {alignment}"),
                ));
            }
            let start = data_offset.checked_add(rel);
            let end = start.and_then(|s| s.checked_add(nbytes));
            match (start, end) {
                (Some(start), Some(end)) if end <= file_len => tensors.push(GgufTensor {
                    name,
                    dtype,
                    ne,
                    offset: start,
                    nbytes,
                }),
                _ => {
                    let start = start.unwrap_or(u64::MAX);
                    return Err(ModelError::DataPastEof {
                        path: path.into(),
                        tensor: name,
                        start,
                        end: start.saturating_add(nbytes),
                        file_len,
                    });
                }
            }
        }
        Ok(GgufFile {
            metadata: GgufMetadata {
                version,
                alignment,
                kv,
            },
            tensors,
            data_offset,
        })
    }
}

/// Bytes of a tensor with ggml dims `ne`: whole blocks along `ne[0]`, no overflow.
fn tensor_nbytes(name: &str, dtype: DType, ne: &[u64], path: &Path) -> Result<u64, ModelError> {
    let bad = |reason: String| ModelError::header(path, format!("tensor {name}: {reason}"));
    let mut elems: u64 = 1;
    for &d in ne {
        if d == 0 || usize::try_from(d).is_err() {
            return Err(bad(format!("dimension {d} in {ne:?}")));
        }
        elems = elems
            .checked_mul(d)
            .ok_or_else(|| bad(format!("dimensions {ne:?} overflow")))?;
    }
    let block = dtype.block_elems() as u64;
    let cols = ne.first().copied().unwrap_or(1);
    if cols % block != 0 {
        return Err(bad(format!(
            "a row of {cols} elements is not whole {dtype} blocks of {block}"
        )));
    }
    (elems / block)
        .checked_mul(dtype.block_bytes() as u64)
        .ok_or_else(|| bad(format!("dimensions {ne:?} overflow")))
}

mod model_config;

#[cfg(test)]
#[path = "gguf_tests.rs"]
mod tests;
