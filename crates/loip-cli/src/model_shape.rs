//! Model shapes for the planner, from a checkpoint or a preset name.

use anyhow::{bail, Context, Result};
use loip_plan::ModelShape;

/// The shape of `--model PATH|smollm2` or `--shape PRESET` (exactly one of them).
pub fn resolve_shape(model: Option<&str>, shape: Option<&str>) -> Result<ModelShape> {
    match (model, shape) {
        (Some(m), None) => {
            let dir = std::path::Path::new(m);
            if dir.join(loip_model::slice::MANIFEST).is_file() {
                let manifest = loip_model::slice::Manifest::load(dir)?;
                return Ok(loip_runtime::shape::shape_from_manifest(m, &manifest));
            }
            let ckpt = loip::model::open(m)?;
            Ok(loip_runtime::shape::shape_from_checkpoint(m, &ckpt))
        }
        (None, Some(s)) => {
            let cfg = loip_model::preset_config(s).with_context(|| format!("--shape {s}"))?;
            Ok(loip_runtime::shape::shape_from_config(s, &cfg, 2.0))
        }
        (Some(_), Some(_)) => bail!("give either --model or --shape, not both"),
        (None, None) => bail!("give --model PATH or --shape NAME"),
    }
}
