//! Model shapes: the byte sizes and dimensions the cost model needs.
//!
//! A [`ModelShape`] is built from a checkpoint's published dimensions with
//! [`ModelShape::from_dims`]; every derived size is computed there, so a shape is consistent
//! by construction. Blocks are what the planner moves between memory and SSD: one layer's
//! attention block (input norm, q/k/v/o projections) and MLP block (post-attention norm,
//! gate/up/down projections).

use serde::{Deserialize, Serialize};

/// Sizes and dimensions of a decoder-only transformer, as the planner sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelShape {
    /// Shape name, e.g. `llama3.3-70b`; plans record it.
    pub name: String,
    /// Model width (`hidden_size`).
    pub hidden: u64,
    /// MLP width (`intermediate_size`).
    pub intermediate: u64,
    /// Decoder layers `L`.
    pub layers: u32,
    /// Query heads.
    pub heads: u64,
    /// Key/value heads.
    pub kv_heads: u64,
    /// Dimension of one head.
    pub head_dim: u64,
    /// Vocabulary size.
    pub vocab: u64,
    /// Whether the LM head shares the embedding matrix.
    pub tied: bool,
    /// Bytes per weight parameter (2.0 for bf16/f16).
    pub weight_bytes_per_param: f64,
    /// Bytes per KV cache element.
    pub kv_dtype_bytes: u64,
    /// Bytes of one layer's attention block `A` (input norm + q, k, v, o).  // bytes
    pub attn_bytes: u64,
    /// Bytes of one layer's MLP block `P` (post-attention norm + gate, up, down).  // bytes
    pub mlp_bytes: u64,
    /// KV cache bytes per token per layer `κ = 2·kv_heads·head_dim·kv_dtype_bytes`.  // bytes
    pub kv_bytes_per_token: u64,
    /// Activation bytes per token crossing a stage boundary `h = hidden·4` (f32).  // bytes
    pub act_bytes_per_token: u64,
    /// Embedding matrix bytes `E = vocab·hidden·w`.  // bytes
    pub embed_bytes: u64,
    /// Final norm + LM head bytes `H = hidden·w + vocab·hidden·w` (a tied head still needs its
    /// own copy when the last device is not the first; see [`ModelShape::head_bytes_on`]).  // bytes
    pub head_bytes: u64,
    /// Bytes the last device sends back to the first device per generated token after the
    /// last stage (the token's return trip), or `None` for the default; see
    /// [`ModelShape::return_bytes_per_token`].
    /// `Some(4)` models a sampled token id (design), `None` what the runtime sends today.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub return_bytes: Option<u64>,
    /// Most tokens in one step (the longest prompt the runtime accepts), which sizes the
    /// working buffers; `None`: one token per sequence in flight (decode only). See
    /// [`ModelShape::working_bytes`].  // tokens
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_tokens: Option<u64>,
    /// Attention window of the sliding-window layers (Gemma 3, Mistral, Qwen with
    /// `use_sliding_window`), or `None` when every layer attends to the whole context. See
    /// [`ModelShape::kv_bytes`] for what it does to the KV cache.  // tokens
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<u64>,
    /// Per layer, whether it attends within [`ModelShape::sliding_window`]; empty with a window:
    /// every layer does (Mistral).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sliding_layers: Vec<bool>,
}

/// Input width (columns) above which the batched matmul packs its input tokens into a buffer
/// of their own (`loip_kernels`' AVX-512 tiles of rows longer than one 1,024-column block);
/// [`ModelShape::step_working_bytes`] counts that buffer wherever a model has such inputs, on
/// every platform (an upper bound).
pub const PACKED_INPUT_MIN_COLS: u64 = 1024;

/// Fixed scratch every device reserves on top of its step's buffers: the attention scores of
/// long contexts (`2·heads·context` floats: 16 MiB covers 64 heads at 32k positions) and
/// allocator slack.  // bytes
pub const WORKING_SCRATCH_BYTES: u64 = 16 << 20;

impl ModelShape {
    /// Builds a shape from a checkpoint's dimensions.
    ///
    /// `weight_bytes_per_param` is 2.0 for 16-bit weights; `kv_dtype_bytes` is the KV cache
    /// element size (2 for f16/bf16 caches, 4 for f32).
    #[allow(clippy::too_many_arguments)]
    pub fn from_dims(
        name: impl Into<String>,
        hidden: u64,
        intermediate: u64,
        layers: u32,
        heads: u64,
        kv_heads: u64,
        head_dim: u64,
        vocab: u64,
        tied: bool,
        weight_bytes_per_param: f64,
        kv_dtype_bytes: u64,
    ) -> ModelShape {
        let w = weight_bytes_per_param;
        let q_dim = heads * head_dim;
        let kv_dim = kv_heads * head_dim;
        let attn_params = hidden * q_dim + 2 * hidden * kv_dim + q_dim * hidden + hidden;
        let mlp_params = 3 * hidden * intermediate + hidden;
        let bytes = |params: u64| (params as f64 * w).ceil() as u64;
        ModelShape {
            name: name.into(),
            hidden,
            intermediate,
            layers,
            heads,
            kv_heads,
            head_dim,
            vocab,
            tied,
            weight_bytes_per_param: w,
            kv_dtype_bytes,
            attn_bytes: bytes(attn_params),
            mlp_bytes: bytes(mlp_params),
            kv_bytes_per_token: 2 * kv_dim * kv_dtype_bytes,
            act_bytes_per_token: hidden * 4,
            embed_bytes: bytes(vocab * hidden),
            head_bytes: bytes(hidden + vocab * hidden),
            return_bytes: None,
            step_tokens: None,
            sliding_window: None,
            sliding_layers: Vec::new(),
        }
    }

    /// The same shape with sliding-window layers: `window` tokens, on the layers flagged in
    /// `layers` (empty: on every layer).
    pub fn with_sliding_window(mut self, window: Option<u64>, layers: Vec<bool>) -> ModelShape {
        self.sliding_layers = if window.is_some() { layers } else { Vec::new() };
        self.sliding_window = window;
        self
    }

    /// The attention window of layer `layer`, tokens (`None`: the whole context).
    pub fn layer_window(&self, layer: u32) -> Option<u64> {
        match self.sliding_layers.get(layer as usize) {
            Some(false) => None,
            _ => self.sliding_window,
        }
    }

    /// KV cache bytes of `layers` layers holding `context` positions of one sequence: the one
    /// place every planner, cost and simulator KV size comes from.  // bytes
    ///
    /// A sliding-window layer holds at most its window, `min(context, window)` positions
    /// (the engine's cache keeps only its last [`ModelShape::sliding_window`] positions), so
    /// its KV stops growing at the window. Which layers slide matters: without their indices
    /// this counts the most any `layers` layers of the model hold (its full-attention layers
    /// first), exact for the whole model and for models with one window on every layer or
    /// none; [`ModelShape::kv_bytes_of`] counts given layers exactly.
    pub fn kv_bytes(&self, layers: u64, context: u64) -> u64 {
        let full = self.full_layers().min(layers);
        self.kv_rows(full, layers - full, context) * self.kv_bytes_per_token
    }

    /// KV cache bytes of the given global layers holding `context` positions of one
    /// sequence, each sliding layer at `min(context, window)`.  // bytes
    pub fn kv_bytes_of(&self, layers: impl IntoIterator<Item = u32>, context: u64) -> u64 {
        let (mut full, mut sliding) = (0, 0);
        for l in layers {
            match self.layer_window(l) {
                Some(_) => sliding += 1,
                None => full += 1,
            }
        }
        self.kv_rows(full, sliding, context) * self.kv_bytes_per_token
    }

    /// Most positions of one sequence whose KV on `layers` layers (counted as
    /// [`ModelShape::kv_bytes`]) fits in `bytes` (`u64::MAX`: it never fills them, as when
    /// every layer slides).  // tokens
    pub fn kv_tokens_within(&self, layers: u64, bytes: u64) -> u64 {
        let full = self.full_layers().min(layers);
        let sliding = layers - full;
        let window = self.sliding_window.unwrap_or(u64::MAX);
        let per = self.kv_bytes_per_token.max(1);
        // below the window every layer grows; beyond it only the full ones
        let all = bytes / per / layers.max(1);
        if all <= window || sliding == 0 {
            return if layers == 0 { u64::MAX } else { all };
        }
        let left = bytes / per - sliding * window;
        left.checked_div(full).unwrap_or(u64::MAX)
    }

    /// Full-attention layers of the model.
    fn full_layers(&self) -> u64 {
        (0..self.layers)
            .filter(|&l| self.layer_window(l).is_none())
            .count() as u64
    }

    /// Cached rows: `full` layers at `context`, `sliding` ones at most at the window.
    fn kv_rows(&self, full: u64, sliding: u64, context: u64) -> u64 {
        let w = self.sliding_window.map_or(context, |w| w.min(context));
        (full * context).saturating_add(sliding * w)
    }

    /// Bytes of the token's return trip `r` (last device → first device, once per generated
    /// token): [`ModelShape::return_bytes`] if set, else `h` ([`ModelShape::act_bytes_per_token`]).
    ///
    /// Candidates: the last position's full f32 logits, `vocab·4`
    /// ([`ModelShape::logits_return_bytes`], what the distributed runtime sends its
    /// coordinator when it samples), an argmax of 8 bytes (token id and logit: the runtime's
    /// greedy decoding), or a sampled token id, 4 bytes (the design). The default is `h`;
    /// `loip-sim` sends the same bytes on its return hop, so simulator and cost model agree for
    /// any value (changing the default changes the simulated experiments: rerun them).  // bytes
    pub fn return_bytes_per_token(&self) -> u64 {
        self.return_bytes.unwrap_or(self.act_bytes_per_token)
    }

    /// Full f32 logits of one position, `vocab·4`: what the runtime returns when it samples.  // bytes
    pub fn logits_return_bytes(&self) -> u64 {
        self.vocab * 4
    }

    /// The same shape with the return trip carrying `bytes` per generated token.
    pub fn with_return_bytes(mut self, bytes: u64) -> ModelShape {
        self.return_bytes = Some(bytes);
        self
    }

    /// Bytes of one layer, attention + MLP.  // bytes
    pub fn layer_bytes(&self) -> u64 {
        self.attn_bytes + self.mlp_bytes
    }

    /// Total weight bytes: all layers, embedding, head (counted once if tied).  // bytes
    pub fn total_bytes(&self) -> u64 {
        self.layers as u64 * self.layer_bytes() + self.embed_bytes + self.head_bytes_on(true)
    }

    /// Head bytes a device must hold when it holds the head; `also_embedding` says whether
    /// it also holds the embedding (then a tied head costs only its final norm).  // bytes
    pub fn head_bytes_on(&self, also_embedding: bool) -> u64 {
        if self.tied && also_embedding {
            (self.hidden as f64 * self.weight_bytes_per_param).ceil() as u64
        } else {
            self.head_bytes
        }
    }

    /// f32 working buffers of one step of `tokens` tokens from `seqs` sequences over at most
    /// `context` cached positions: what the runtime allocates and accounts against a device's
    /// budget (`loip_runtime::executor::working_bytes` calls this).  // bytes
    ///
    /// Per token: the residual stream, the normed input, the attention output and two scratch
    /// rows (`5·hidden`), q and the attention result (`2·heads·head_dim`), k and v
    /// (`2·kv_heads·head_dim`), the MLP's gate and up (`2·intermediate`); per sequence, one
    /// row of logits (`vocab`); the attention scores (`2·heads·context`). Plus the batched
    /// matmul's packed copy of its input tokens, which the kernels keep for inputs wider than
    /// [`PACKED_INPUT_MIN_COLS`] (one buffer a process, as wide as the widest such input).
    pub fn step_working_bytes(&self, tokens: u64, seqs: u64, context: u64) -> u64 {
        let packed = [self.hidden, self.heads * self.head_dim, self.intermediate]
            .into_iter()
            .filter(|&c| c > PACKED_INPUT_MIN_COLS)
            .max()
            .unwrap_or(0);
        let per_token = 5 * self.hidden
            + 2 * self.heads * self.head_dim
            + 2 * self.kv_heads * self.head_dim
            + 2 * self.intermediate
            + packed;
        4 * (tokens * per_token + seqs * self.vocab + 2 * self.heads * context)
    }

    /// Working buffers `W` the planner reserves on a device for `b` sequences in flight:
    /// one step of the longest it will run ([`ModelShape::step_tokens`], at least `b`
    /// tokens) without the scores, plus [`WORKING_SCRATCH_BYTES`] (which holds the scores).
    /// At least what the runtime accounts for the same step, so a plan that fits is never
    /// refused at load time. Every device reserves the same amount.  // bytes
    pub fn working_bytes(&self, b: u32) -> u64 {
        let b = b.max(1) as u64;
        let tokens = self.step_tokens.unwrap_or(0).max(b);
        self.step_working_bytes(tokens, b, 0) + WORKING_SCRATCH_BYTES
    }

    /// FLOPs of one attention block's projections for one token (2 per multiply-add).
    pub fn attn_proj_flops(&self) -> f64 {
        let q_dim = self.heads * self.head_dim;
        let kv_dim = self.kv_heads * self.head_dim;
        2.0 * (2 * self.hidden * q_dim + 2 * self.hidden * kv_dim) as f64
    }

    /// FLOPs of attention over `n` cached tokens for one token (QKᵀ and AV).
    pub fn attn_ctx_flops(&self, n: u64) -> f64 {
        4.0 * (self.heads * self.head_dim) as f64 * n as f64
    }

    /// FLOPs of one MLP block for one token.
    pub fn mlp_flops(&self) -> f64 {
        6.0 * (self.hidden * self.intermediate) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama70b_sizes() {
        let s = ModelShape::from_dims(
            "llama3.3-70b",
            8192,
            28672,
            80,
            64,
            8,
            128,
            128256,
            false,
            2.0,
            2,
        );
        // q, o: 8192·8192; k, v: 8192·1024; norm 8192 → 151 011 328 params.
        assert_eq!(s.attn_bytes, 2 * (2 * 8192 * 8192 + 2 * 8192 * 1024 + 8192));
        assert_eq!(s.mlp_bytes, 2 * (3 * 8192 * 28672 + 8192));
        assert_eq!(s.kv_bytes_per_token, 2 * 1024 * 2);
        assert_eq!(s.act_bytes_per_token, 8192 * 4);
        // 70.6 B parameters → ~141 GB.
        let gb = s.total_bytes() as f64 / 1e9;
        assert!((140.0..142.0).contains(&gb), "{gb}");
    }

    #[test]
    fn working_reservation_covers_the_longest_step() {
        let mut s = ModelShape::from_dims("m", 8192, 28672, 80, 64, 8, 128, 128256, false, 2.0, 2);
        // per token 5·8192 + 2·8192 + 2·1024 + 2·28672 floats, and the packed copy of the
        // widest matmul input (the down projection's 28672)
        let per_token = 4 * (5 * 8192 + 2 * 8192 + 2 * 1024 + 2 * 28672 + 28672);
        assert_eq!(s.step_working_bytes(1, 1, 0), per_token + 4 * 128256);
        // no input wider than a block: no packed copy
        let small = ModelShape::from_dims("s", 576, 1024, 30, 9, 3, 64, 49152, true, 0.6, 2);
        let per_token = 4 * (5 * 576 + 2 * 576 + 2 * 192 + 2 * 1024);
        assert_eq!(small.step_working_bytes(1, 1, 0), per_token + 4 * 49152);
        assert_eq!(
            s.step_working_bytes(3, 2, 100) - s.step_working_bytes(3, 2, 0),
            4 * 2 * 64 * 100
        );
        // decode only: one token per sequence
        assert_eq!(
            s.working_bytes(2),
            s.step_working_bytes(2, 2, 0) + WORKING_SCRATCH_BYTES
        );
        // a 512-token prompt step is what the runtime will account: the plan reserves it,
        // scores of a 16k context included
        s.step_tokens = Some(512);
        let runtime = s.step_working_bytes(512, 1, 16 << 10);
        assert!(s.working_bytes(1) >= runtime);
        assert!(s.working_bytes(1) > s.step_working_bytes(2, 2, 0) + WORKING_SCRATCH_BYTES);
    }
}
