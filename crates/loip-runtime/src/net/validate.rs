//! The one check of every manifest a worker receives (`probe`, `load`), run before anything
//! is opened, allocated or written: slice names pass the store's name check (nothing outside
//! the store can be named), every config field is bounded (by `ModelConfig::validate`, as in
//! a model file), and every tensor lies inside its slice with a size that matches its dtype
//! and shape. Error messages name the slice or the
//! field; they never carry a path, a size or a checksum of a file the peer did not send.

use loip_model::slice::{Manifest, SliceKind};
use loip_model::ModelConfig;

use crate::net::store::{valid_name, MAX_SLICE_BYTES};

/// Limits of a slice's tensor list (the config's own bounds are
/// [`ModelConfig::validate`]'s, the same as for a model file).
pub struct Bounds;

impl Bounds {
    /// tensors in one slice
    pub const TENSORS_PER_SLICE: usize = 64;
    /// tensor dimensions
    pub const RANK: usize = 4;
}

/// Checks a peer's model config with the bounds every model file is held to.
pub fn check_config(c: &ModelConfig) -> Result<(), String> {
    c.validate().map_err(|e| format!("bad model config: {e}"))
}

/// Checks a whole manifest received from a peer.
pub fn check_manifest(m: &Manifest) -> Result<(), String> {
    check_config(&m.config)?;
    let layers = m.config.num_layers;
    if m.slices.len() > 2 * layers + 3 {
        return Err(format!(
            "the manifest lists {} slices for {layers} layers",
            m.slices.len()
        ));
    }
    let mut files = std::collections::HashSet::new();
    let mut kinds = std::collections::HashSet::new();
    for s in &m.slices {
        let id = s.kind.id();
        if !valid_name(&s.file) {
            return Err(format!(
                "slice {id}: the file name is not a plain store name (letters, digits, '.', '_', '-', ending in .slice)"
            ));
        }
        if !files.insert(s.file.as_str()) || !kinds.insert(id.clone()) {
            return Err(format!("slice {id} ({}) is listed twice", s.file));
        }
        if let SliceKind::Attn(l) | SliceKind::Mlp(l) = s.kind {
            if l >= layers {
                return Err(format!("slice {id}: layer {l} of a model with {layers} layers"));
            }
        }
        if s.size > MAX_SLICE_BYTES {
            return Err(format!(
                "slice {id}: {} bytes is over the limit of {MAX_SLICE_BYTES}",
                s.size
            ));
        }
        if s.tensors.len() > Bounds::TENSORS_PER_SLICE {
            return Err(format!("slice {id}: {} tensors", s.tensors.len()));
        }
        for t in &s.tensors {
            let bad = |why: String| format!("slice {id}, tensor {:.80}: {why}", t.name);
            if t.name.len() > 256 {
                return Err(bad("name over 256 bytes".into()));
            }
            let dtype = t.dtype().map_err(|e| bad(e.to_string()))?;
            if t.shape.is_empty() || t.shape.len() > Bounds::RANK {
                return Err(bad(format!("rank {}", t.shape.len())));
            }
            let cols = t.shape[t.shape.len() - 1];
            let rows = t.shape[..t.shape.len() - 1]
                .iter()
                .try_fold(1usize, |a, &d| a.checked_mul(d))
                .ok_or_else(|| bad("shape overflows".into()))?;
            let row = dtype.row_bytes(cols).map_err(|e| bad(e.to_string()))?;
            let need = rows
                .checked_mul(row)
                .ok_or_else(|| bad("shape overflows".into()))? as u64;
            if need != t.nbytes {
                return Err(bad(format!(
                    "{} bytes for a {:?} {} tensor (needs {need})",
                    t.nbytes,
                    t.shape,
                    dtype.name()
                )));
            }
            let end = t.offset.checked_add(t.nbytes);
            if end.is_none_or(|e| e > s.size) {
                return Err(bad(format!(
                    "bytes {}..+{} lie outside the slice's {} bytes",
                    t.offset, t.nbytes, s.size
                )));
            }
        }
    }
    Ok(())
}
