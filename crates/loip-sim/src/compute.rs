//! Block compute times of one device, extended beyond what the cost model needs.
//!
//! The cost model prices one decoded token per sequence with the whole block on one device:
//! `t^A(1, n)`, `t^P(1)` and the LM head `t^H(1)` from [`DeviceProfile`]. For those arguments
//! this module returns exactly the profile's numbers, so simulator and cost model agree by
//! construction on the compute of a block. It adds what the simulator needs besides:
//!
//! - **several tokens of one sequence** (recomputation of evicted KV: the current token plus
//!   `e` recomputed ones): the weights and the sequence's KV are read once, FLOPs scale with
//!   the tokens;
//! - **several sequences at once** (tensor parallelism under bursty traffic): each sequence
//!   reads its own KV;
//! - **a fraction `f` of a block** (a tensor-parallel shard): weight and KV bytes and FLOPs
//!   scale with `f`, the per-block overhead does not.
//!
//! For roofline profiles these follow the roofline formula of `loip_plan::profile`, except
//! that FLOPs of several tokens at once run at the profile's prefill rate
//! (`Roofline::prefill_flops`) when it states one; for
//! measured profiles (grids in `b`) the extension is an approximation: the grid's time at
//! `b = tokens` scaled by `f`.

use loip_plan::profile::Roofline;
use loip_plan::{ComputeModel, DeviceProfile, ModelShape};

/// A roofline block that reads `bytes` and computes `flops` for `tokens` tokens at once: the
/// profile's own formula for one token; for several (recomputation, a TP batch) the FLOPs
/// run at [`Roofline::many_token_flops`] — the measured or cited prefill rate when the
/// profile states one, else the roofline's `peak_flops · efficiency`.  // seconds
fn roofline_many(r: &Roofline, bytes: f64, flops: f64, tokens: u32) -> f64 {
    let compute = if tokens > 1 {
        flops / r.many_token_flops()
    } else {
        flops / (r.peak_flops * r.efficiency)
    };
    (bytes / (r.mem_bw * r.efficiency)).max(compute) + r.block_overhead
}

/// Compute times of one device for one model shape.
#[derive(Debug, Clone, Copy)]
pub struct DeviceModel<'a> {
    /// The device's profile.
    pub profile: &'a DeviceProfile,
    /// The model shape.
    pub shape: &'a ModelShape,
}

impl<'a> DeviceModel<'a> {
    /// A model of `profile` running `shape`.
    pub fn new(profile: &'a DeviceProfile, shape: &'a ModelShape) -> Self {
        DeviceModel { profile, shape }
    }

    /// Attention block time: `seqs` sequences, `tokens` new tokens each (1 + recomputed), `n`
    /// cached tokens each, fraction `frac` of the heads.  // seconds
    pub fn attn(&self, seqs: u32, tokens: u32, n: u64, frac: f64) -> f64 {
        let (seqs, tokens) = (seqs.max(1), tokens.max(1));
        if tokens == 1 && frac == 1.0 {
            return self.profile.attn_time(self.shape, seqs, n);
        }
        let s = self.shape;
        match &self.profile.compute {
            ComputeModel::Roofline(r) => {
                let bytes =
                    frac * (s.attn_bytes as f64 + seqs as f64 * (n * s.kv_bytes_per_token) as f64);
                let flops =
                    frac * (seqs * tokens) as f64 * (s.attn_proj_flops() + s.attn_ctx_flops(n));
                roofline_many(r, bytes, flops, seqs * tokens)
            }
            ComputeModel::Measured(_) => self.profile.attn_time(s, seqs * tokens, n) * frac,
        }
    }

    /// MLP block time for `tokens` tokens in all, fraction `frac` of the columns.  // seconds
    pub fn mlp(&self, tokens: u32, frac: f64) -> f64 {
        let tokens = tokens.max(1);
        let measured = matches!(self.profile.compute, ComputeModel::Measured(_));
        if frac == 1.0 && (tokens == 1 || measured) {
            return self.profile.mlp_time(self.shape, tokens);
        }
        match &self.profile.compute {
            ComputeModel::Roofline(r) => {
                let bytes = frac * self.shape.mlp_bytes as f64;
                let flops = frac * tokens as f64 * self.shape.mlp_flops();
                roofline_many(r, bytes, flops, tokens)
            }
            ComputeModel::Measured(_) => self.profile.mlp_time(self.shape, tokens) * frac,
        }
    }

    /// Final norm + LM head for `tokens` tokens: the profile's `t^H(tokens)`, as in the cost
    /// model.  // seconds
    pub fn head(&self, tokens: u32) -> f64 {
        self.profile.head_time(self.shape, tokens.max(1))
    }

    /// Relative speed for tensor-parallel sharding: layers per second at one token.  // 1/s
    pub fn speed(&self, n: u64) -> f64 {
        1.0 / (self.attn(1, 1, n, 1.0) + self.mlp(1, 1.0)).max(1e-12)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use loip_plan::profile::preset;

    #[test]
    fn matches_profile_at_one_token_and_scales() {
        let shape = crate::shapes::shape("llama3.3-70b").unwrap();
        let p = preset("orin64").unwrap();
        let m = DeviceModel::new(&p, &shape);
        assert_eq!(m.attn(1, 1, 1000, 1.0), p.attn_time(&shape, 1, 1000));
        assert_eq!(m.mlp(1, 1.0), p.mlp_time(&shape, 1));
        // Memory-bound: a few recomputed tokens cost almost nothing more...
        assert!(m.mlp(8, 1.0) < 1.01 * m.mlp(1, 1.0));
        // ...but thousands do.
        assert!(m.mlp(4000, 1.0) > 5.0 * m.mlp(1, 1.0));
        // A half shard takes about half the time.
        let half = m.attn(1, 2, 1000, 0.5);
        assert!(half > 0.45 * m.attn(1, 1, 1000, 1.0) && half < 0.55 * m.attn(1, 1, 1000, 1.0));
        assert!(m.head(1) > 0.0);
        assert_eq!(m.head(1), p.head_time(&shape, 1));
    }
}
