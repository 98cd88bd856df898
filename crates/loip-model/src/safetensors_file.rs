//! Safetensors headers: reading and checking one file's header, and writing a header for a
//! streamed file.
//!
//! Layout: `u64` little-endian header length `n`, `n` bytes of JSON
//! (`{"name": {"dtype", "shape", "data_offsets": [start, end]}, "__metadata__": {...}}`), then
//! the data; a tensor's bytes are `8 + n + start .. 8 + n + end`. The `safetensors` crate
//! parses the JSON into [`safetensors::tensor::Metadata`], which checks that the offsets are
//! contiguous, sorted and of `numel × dtype size` bytes; this module adds the checks against
//! the file length. Nothing is allocated from an unchecked length.

use std::collections::BTreeMap;
use std::path::Path;

use loip_kernels::DType;
use safetensors::tensor::Metadata;
use safetensors::Dtype;
use serde_json::{json, Map, Value};

use crate::error::ModelError;

/// The largest JSON header accepted, bytes (the `safetensors` crate's own limit).
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// One tensor of a safetensors file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SafetensorsEntry {
    /// name as stored
    pub name: String,
    /// stored type; `Err(name)` for dtypes without a kernel (e.g. `I64`, `F8_E4M3`)
    pub dtype: Result<DType, String>,
    /// shape as stored (HF order)
    pub shape: Vec<usize>,
    /// absolute byte offset in the file
    pub offset: u64,
    /// data length, bytes
    pub nbytes: u64,
}

/// The safetensors dtype name of a float [`DType`]; `None` for quantized types.
pub fn safetensors_dtype_name(dtype: DType) -> Option<&'static str> {
    match dtype {
        DType::F32 => Some("F32"),
        DType::F16 => Some("F16"),
        DType::BF16 => Some("BF16"),
        _ => None,
    }
}

fn dtype_of(d: Dtype) -> Result<DType, String> {
    match d {
        Dtype::F32 => Ok(DType::F32),
        Dtype::F16 => Ok(DType::F16),
        Dtype::BF16 => Ok(DType::BF16),
        other => Err(format!("{other:?}")),
    }
}

/// Reads and checks the header of the safetensors file whose whole contents are `bytes`;
/// `path` is only used in errors. Entries are sorted by offset.
pub fn read_header(bytes: &[u8], path: &Path) -> Result<Vec<SafetensorsEntry>, ModelError> {
    let file_len = bytes.len() as u64;
    let len_bytes: [u8; 8] = bytes
        .get(..8)
        .and_then(|s| s.try_into().ok())
        .ok_or_else(|| ModelError::truncated(path, "the 8-byte header length"))?;
    let n = u64::from_le_bytes(len_bytes);
    if n > MAX_HEADER_BYTES {
        return Err(ModelError::header(
            path,
            format!("header length {n} exceeds {MAX_HEADER_BYTES} bytes"),
        ));
    }
    if 8 + n > file_len {
        return Err(ModelError::truncated(
            path,
            format!("the JSON header ({n} bytes declared, {file_len} in the file)"),
        ));
    }
    let header = &bytes[8..(8 + n) as usize];
    let metadata: Metadata = serde_json::from_slice(header)
        .map_err(|e| ModelError::header(path, format!("JSON header: {e}")))?;
    let data_start = 8 + n;
    let mut entries = Vec::new();
    for (name, info) in metadata.tensors() {
        let (s, e) = info.data_offsets;
        let (start, end) = (
            data_start.saturating_add(s as u64),
            data_start.saturating_add(e as u64),
        );
        if end > file_len {
            return Err(ModelError::DataPastEof {
                path: path.into(),
                tensor: name,
                start,
                end,
                file_len,
            });
        }
        entries.push(SafetensorsEntry {
            name,
            dtype: dtype_of(info.dtype),
            shape: info.shape.clone(),
            offset: start,
            nbytes: end - start,
        });
    }
    entries.sort_by(|a, b| (a.offset, &a.name).cmp(&(b.offset, &b.name)));
    Ok(entries)
}

/// The header of a safetensors file holding `tensors` (name, float dtype, shape) back to back
/// in the given order: 8-byte length + JSON padded with spaces to a multiple of 8 bytes, so
/// that the data starts 8-byte aligned. Returns the header bytes and each tensor's data length.
pub fn write_header(
    tensors: &[(String, DType, Vec<usize>)],
) -> Result<(Vec<u8>, Vec<u64>), ModelError> {
    let mut map = Map::new();
    map.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut offset = 0u64;
    let mut sizes = Vec::with_capacity(tensors.len());
    for (name, dtype, shape) in tensors {
        let dname = safetensors_dtype_name(*dtype).ok_or_else(|| ModelError::UnsupportedDtype {
            tensor: name.clone(),
            dtype: dtype.name().into(),
        })?;
        let numel = shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64));
        let nbytes = numel
            .and_then(|n| n.checked_mul(dtype.block_bytes() as u64))
            .ok_or_else(|| {
                ModelError::config(name.clone(), format!("shape {shape:?} overflows"))
            })?;
        map.insert(
            name.clone(),
            json!({"dtype": dname, "shape": shape, "data_offsets": [offset, offset + nbytes]}),
        );
        offset += nbytes;
        sizes.push(nbytes);
    }
    let mut text = serde_json::to_string(&Value::Object(map))
        .map_err(|e| ModelError::config("safetensors header", e.to_string()))?
        .into_bytes();
    while text.len() % 8 != 0 {
        text.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + text.len());
    out.extend_from_slice(&(text.len() as u64).to_le_bytes());
    out.extend_from_slice(&text);
    Ok((out, sizes))
}

/// A whole safetensors file in memory (for tests and small fixtures): `tensors` are
/// (name, float dtype, shape, data bytes).
pub fn to_bytes(tensors: &[(String, DType, Vec<usize>, Vec<u8>)]) -> Result<Vec<u8>, ModelError> {
    let specs: Vec<_> = tensors
        .iter()
        .map(|(n, d, s, _)| (n.clone(), *d, s.clone()))
        .collect();
    let (mut out, sizes) = write_header(&specs)?;
    for ((name, _, _, data), size) in tensors.iter().zip(sizes) {
        if data.len() as u64 != size {
            return Err(ModelError::config(
                name.clone(),
                format!("{} data bytes for a tensor of {size}", data.len()),
            ));
        }
        out.extend_from_slice(data);
    }
    Ok(out)
}

/// The `weight_map` of a sharded checkpoint's `model.safetensors.index.json`: tensor name →
/// shard file name (a bare file name in the same directory).
pub fn read_index(text: &str, path: &Path) -> Result<BTreeMap<String, String>, ModelError> {
    let v: Value = serde_json::from_str(text)
        .map_err(|e| ModelError::header(path, format!("not valid JSON: {e}")))?;
    let map = v
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| ModelError::header(path, "no \"weight_map\" object"))?;
    let mut out = BTreeMap::new();
    for (name, file) in map {
        let file = file.as_str().ok_or_else(|| {
            ModelError::header(path, format!("weight_map[{name:?}] is not a string"))
        })?;
        let bare = !file.is_empty()
            && file != "."
            && file != ".."
            && !file.contains(['/', '\\'])
            && !file.starts_with('.');
        if !bare {
            return Err(ModelError::header(
                path,
                format!("weight_map[{name:?}] = {file:?} is not a file name in this directory"),
            ));
        }
        out.insert(name.clone(), file.to_string());
    }
    Ok(out)
}
