//! Rotary position embedding frequencies (default and Llama-3 scaled), as HF computes them.

use loip_kernels::DType;
use loip_model::{ModelConfig, RopeScaling};

/// Inverse frequencies of one head: `head_dim / 2` values.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f32>, // (head_dim / 2,)
}

impl Rope {
    /// HF `rope_init_fn`: `1 / theta^(2i/d)` in f32, then the Llama-3 smoothing if configured,
    /// then rounding to `param_dtype`, the checkpoint's float dtype (F32 for quantized files,
    /// which the reference dequantizes to f32).
    pub fn new(cfg: &ModelConfig, param_dtype: DType) -> Rope {
        Rope::build(cfg, cfg.rope_theta, cfg.rope_scaling.is_some(), param_dtype)
    }

    /// The plain (unscaled) schedule with base `theta`: Gemma 3's sliding-window layers
    /// (`rope_local_base_freq`).
    pub fn with_theta(cfg: &ModelConfig, theta: f32, param_dtype: DType) -> Rope {
        Rope::build(cfg, theta, false, param_dtype)
    }

    fn build(cfg: &ModelConfig, theta: f32, scaled: bool, param_dtype: DType) -> Rope {
        let d = cfg.head_dim;
        let mut inv_freq: Vec<f32> = (0..d / 2)
            .map(|i| {
                let exponent = (2 * i) as f32 / d as f32;
                1.0f32 / theta.powf(exponent)
            })
            .collect();
        if let Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        }) = cfg.rope_scaling.filter(|_| scaled)
        {
            let old = original_max_position_embeddings as f32;
            let low_wavelen = old / low_freq_factor;
            let high_wavelen = old / high_freq_factor;
            for f in inv_freq.iter_mut() {
                let wavelen = 2.0 * std::f32::consts::PI / *f;
                let scaled = if wavelen > low_wavelen {
                    *f / factor
                } else {
                    *f
                };
                // negated as HF writes it: a NaN wavelength counts as medium
                #[allow(clippy::neg_cmp_op_on_partial_ord)]
                let medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
                *f = if medium {
                    let smooth =
                        (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                    (1.0 - smooth) * scaled / factor + smooth * scaled
                } else {
                    scaled
                };
            }
        }
        // HF keeps `inv_freq` as a buffer of the model's dtype: a 16-bit checkpoint rotates
        // with frequencies rounded to 16 bits, and so must we to give the same logits.
        match param_dtype {
            DType::BF16 => inv_freq
                .iter_mut()
                .for_each(|f| *f = half::bf16::from_f32(*f).to_f32()),
            DType::F16 => inv_freq
                .iter_mut()
                .for_each(|f| *f = half::f16::from_f32(*f).to_f32()),
            _ => {}
        }
        Rope { inv_freq }
    }

    /// Fills `cos` and `sin` (each `head_dim / 2`) for position `pos`.
    pub fn cos_sin(&self, pos: usize, cos: &mut [f32], sin: &mut [f32]) {
        let p = pos as f32;
        for ((c, s), f) in cos.iter_mut().zip(sin.iter_mut()).zip(&self.inv_freq) {
            let angle = f * p;
            *c = angle.cos();
            *s = angle.sin();
        }
    }

    /// Half the head dimension.
    pub fn half_dim(&self) -> usize {
        self.inv_freq.len()
    }
}
