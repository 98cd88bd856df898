//! The forward pass, block by block: embedding → (attention → MLP) × layers → norm → head.
//!
//! Hidden states are f32 rows, one per token of the step: `x: (n_tokens, hidden)`. A step
//! may mix tokens of several sequences at different positions (a micro-batch); each token
//! attends only to its own sequence's cache. The block functions are what a pipeline stage
//! calls, with weights from memory or from the loader's slot.

use loip_kernels::{self as k, DType, LineVec, Matrix};
use loip_model::{Arch, ModelConfig};

use crate::kv::{KvCache, SeqId};
use crate::rope::Rope;
use crate::weights::{
    bind_embedding, AttnWeights, HeadWeights, LayerWeights, MlpWeights, TensorSource,
};
use crate::EngineError;

/// One token of a step: its sequence and its position in that sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TokenPos {
    /// sequence id
    pub seq: SeqId,
    /// 0-based position
    pub pos: usize,
}

/// The tokens of one step, in hidden-row order.
pub type Batch = [TokenPos];

/// Config-derived state shared by every block: dims, RoPE frequencies, GGUF q/k layout.
#[derive(Debug, Clone)]
pub struct Transformer {
    /// model config
    pub cfg: ModelConfig,
    rope: Rope,
    /// RoPE of the sliding-window layers when their base differs (Gemma 3)
    rope_local: Option<Rope>,
    qk_permuted: bool,
}

impl Transformer {
    /// `qk_permuted`: the q/k projection rows are in GGUF's interleaved-RoPE order.
    /// `param_dtype`: the checkpoint's float dtype (see [`Rope::new`]); use
    /// [`param_dtype_of`] on the embedding's stored type.
    pub fn new(cfg: ModelConfig, qk_permuted: bool, param_dtype: DType) -> Transformer {
        Transformer {
            rope: Rope::new(&cfg, param_dtype),
            rope_local: cfg
                .rope_local_theta
                .map(|theta| Rope::with_theta(&cfg, theta, param_dtype)),
            cfg,
            qk_permuted,
        }
    }

    /// Floats per token of K (and of V) per layer.
    pub fn kv_dim(&self) -> usize {
        self.cfg.num_kv_heads * self.cfg.head_dim
    }

    fn check_hidden(&self, x: &[f32], n: usize) -> Result<(), EngineError> {
        let expected = n * self.cfg.hidden_size;
        if x.len() != expected {
            return Err(EngineError::BadHidden {
                expected,
                got: x.len(),
            });
        }
        Ok(())
    }

    /// Embedding lookup: `out: (ids.len(), hidden)`. Gemma 3 scales the rows by √hidden
    /// (HF `Gemma3TextScaledWordEmbedding`: `hidden_size ** 0.5` rounded to f32).
    pub fn embed(&self, embed: &Matrix, ids: &[u32], out: &mut [f32]) -> Result<(), EngineError> {
        let h = self.cfg.hidden_size;
        self.check_hidden(out, ids.len())?;
        let scale = (self.cfg.arch == Arch::Gemma3).then(|| (h as f64).sqrt() as f32);
        for (&id, row) in ids.iter().zip(out.chunks_exact_mut(h)) {
            if id as usize >= embed.rows {
                return Err(EngineError::BadTokenId {
                    id,
                    vocab: embed.rows,
                });
            }
            k::dequant_row(embed, id as usize, row)?;
            if let Some(s) = scale {
                row.iter_mut().for_each(|v| *v *= s);
            }
        }
        Ok(())
    }

    /// Attention block of global layer `layer`, in place on `x: (batch.len(), hidden)`.
    /// Appends each token's K/V to `kv` before attending, so a sequence's tokens within one
    /// step see each other causally.
    pub fn attention(
        &self,
        layer: usize,
        w: &AttnWeights,
        x: &mut [f32],
        batch: &Batch,
        kv: &mut KvCache,
    ) -> Result<(), EngineError> {
        let c = &self.cfg;
        let (h, d) = (c.hidden_size, c.head_dim);
        let n = batch.len();
        self.check_hidden(x, n)?;
        let (qd, kvd) = (c.num_heads * d, c.num_kv_heads * d);

        let xn = self.rmsnorm_rows(x, &w.input_norm, n)?; // (n, hidden)
        let mut q = vec![0f32; n * qd]; // (n, n_heads * head_dim)
        let mut kk = vec![0f32; n * kvd]; // (n, n_kv_heads * head_dim)
        let mut v = vec![0f32; n * kvd]; // (n, n_kv_heads * head_dim)
        k::matmul_many(&[&w.q, &w.k, &w.v], &xn, &mut [&mut q, &mut kk, &mut v])?;
        // Qwen2: `q_proj(x)` etc. carry a bias, added before the norms and RoPE as in HF.
        for (bias, out) in [
            (&w.q_bias, &mut q),
            (&w.k_bias, &mut kk),
            (&w.v_bias, &mut v),
        ] {
            if let Some(b) = bias {
                let b = dequant_vec(b)?; // (width,)
                for row in out.chunks_exact_mut(b.len()) {
                    add_into(row, &b);
                }
            }
        }

        let q_norm = w.q_norm.map(|m| self.norm_weight(&m)).transpose()?;
        let k_norm = w.k_norm.map(|m| self.norm_weight(&m)).transpose()?;
        let window = c.layer_window(layer);
        let rope = match &self.rope_local {
            Some(local) if window.is_some() => local,
            _ => &self.rope,
        };
        // The kernel scales scores by head_dim^-1/2; Gemma asks query_pre_attn_scalar^-1/2.
        let q_scale = c
            .query_pre_attn_scalar
            .filter(|&s| s != d as f32)
            .map(|s| ((d as f64).sqrt() / f64::from(s).sqrt()) as f32);
        let half = rope.half_dim();
        let (mut cos, mut sin) = (vec![0f32; half], vec![0f32; half]);
        let mut tmp = vec![0f32; d];
        for (t, tp) in batch.iter().enumerate() {
            rope.cos_sin(tp.pos, &mut cos, &mut sin);
            let qt = &mut q[t * qd..(t + 1) * qd];
            let kt = &mut kk[t * kvd..(t + 1) * kvd];
            for (heads, norm) in [(qt, &q_norm), (kt, &k_norm)] {
                for head in heads.chunks_exact_mut(d) {
                    if self.qk_permuted {
                        unpermute_head(head, &mut tmp);
                    }
                    if let Some(nw) = norm {
                        tmp.copy_from_slice(head);
                        k::rmsnorm(&tmp, nw, c.rms_norm_eps, head);
                    }
                    k::rope_half(head, &cos, &sin);
                }
            }
            if let Some(s) = q_scale {
                q[t * qd..(t + 1) * qd].iter_mut().for_each(|v| *v *= s);
            }
        }
        for (t, tp) in batch.iter().enumerate() {
            kv.append(
                tp.seq,
                layer,
                tp.pos,
                &kk[t * kvd..(t + 1) * kvd],
                &v[t * kvd..(t + 1) * kvd],
            )?;
        }

        let mut att = LineVec::zeroed(n * qd); // (n, n_heads * head_dim): o's input
        let kv_ref = &*kv;
        // Runs of one sequence's consecutive positions (a prompt or a prompt chunk) attend
        // tiled over queries, each over its causal prefix or its sliding window, bit-identical
        // to each query alone; the other tokens (decode tokens of several sequences) attend
        // one by one.
        let runs = prompt_runs(batch);
        let mut in_run = vec![false; n];
        for &(a, b) in &runs {
            in_run[a..b].fill(true);
        }
        let attend = |(t, out): (usize, &mut [f32])| -> Result<(), EngineError> {
            if in_run[t] {
                return Ok(());
            }
            let tp = batch[t];
            let ctx = tp.pos + 1;
            // A sliding window of W keeps the last W positions, this one included (HF
            // `sliding_window_causal_mask`: kv_idx > q_idx - W). The cache still holds them:
            // it drops positions only after the whole step attended (`settle` below).
            let first = window.map_or(0, |w| ctx.saturating_sub(w));
            let (kc, vc) = kv_ref.rows(tp.seq, layer, first, ctx)?;
            k::attention(
                &q[t * qd..(t + 1) * qd],
                kc,
                vc,
                ctx - first,
                c.num_heads,
                c.num_kv_heads,
                d,
                out,
            );
            Ok(())
        };
        if n > 1 {
            // on the step's team (a rayon iterator here would run alone: the other threads
            // are the team's, waiting for its regions)
            k::try_par_chunks_mut(&mut att, qd, |t, out| attend((t, out)))?;
        } else {
            att.chunks_mut(qd).enumerate().try_for_each(attend)?;
        }
        for &(a, b) in &runs {
            let tp = batch[a];
            // from the run's first query's first position (the whole cache without a window)
            let w = window.unwrap_or(usize::MAX);
            let first = (tp.pos + 1).saturating_sub(w);
            let (kc, vc) = kv_ref.rows(tp.seq, layer, first, tp.pos + (b - a))?;
            k::attention_sliding(
                &q[a * qd..b * qd],
                kc,
                vc,
                tp.pos,
                w,
                c.num_heads,
                c.num_kv_heads,
                d,
                &mut att[a * qd..b * qd],
            );
        }

        if window.is_some() {
            // the ring keeps the last W positions of each sequence for the next step
            for tp in batch {
                kv.settle(tp.seq, layer);
            }
        }

        let mut o = vec![0f32; n * h]; // (n, hidden)
        k::matmul(&w.o, &att, &mut o)?;
        match &w.post_norm {
            Some(post) => add_into(x, &self.rmsnorm_rows(&o, post, n)?),
            None => add_into(x, &o),
        }
        Ok(())
    }

    /// MLP block (SwiGLU; Gemma 3: GeGLU with tanh GELU and a norm of its output), in place
    /// on `x: (n, hidden)`.
    pub fn mlp(&self, w: &MlpWeights, x: &mut [f32]) -> Result<(), EngineError> {
        let (h, i) = (self.cfg.hidden_size, self.cfg.intermediate_size);
        let n = x.len() / h.max(1);
        self.check_hidden(x, n)?;
        let xn = self.rmsnorm_rows(x, &w.post_norm, n)?; // (n, hidden)
        let mut gate = LineVec::zeroed(n * i); // (n, intermediate): down's input
        let mut up = vec![0f32; n * i]; // (n, intermediate)
        k::matmul_many(&[&w.gate, &w.up], &xn, &mut [&mut gate, &mut up])?;
        if self.cfg.arch == Arch::Gemma3 {
            k::gelu_tanh_mul(&mut gate, &up);
        } else {
            k::silu_mul(&mut gate, &up);
        }
        let mut down = vec![0f32; n * h]; // (n, hidden)
        k::matmul(&w.down, &gate, &mut down)?;
        match &w.out_norm {
            Some(post) => add_into(x, &self.rmsnorm_rows(&down, post, n)?),
            None => add_into(x, &down),
        }
        Ok(())
    }

    /// Final norm and LM head: `logits: (n, vocab)` from `x: (n, hidden)`.
    pub fn head(&self, w: &HeadWeights, x: &[f32], logits: &mut [f32]) -> Result<(), EngineError> {
        let h = self.cfg.hidden_size;
        let n = x.len() / h.max(1);
        self.check_hidden(x, n)?;
        let xn = self.rmsnorm_rows(x, &w.norm, n)?;
        k::matmul(&w.lm_head, &xn, logits)?;
        Ok(())
    }

    /// A norm weight as applied: `w`, or `1 + w` (in f32, as HF's Gemma3RMSNorm).
    fn norm_weight(&self, m: &Matrix) -> Result<Vec<f32>, EngineError> {
        let mut w = dequant_vec(m)?;
        if self.cfg.norm_plus_one {
            w.iter_mut().for_each(|v| *v += 1.0);
        }
        Ok(w)
    }

    /// `out: (n, hidden)`, each row of `x` normed, on 64-byte lines (a batched matmul's input).
    fn rmsnorm_rows(&self, x: &[f32], weight: &Matrix, n: usize) -> Result<LineVec, EngineError> {
        let h = self.cfg.hidden_size;
        let wv = self.norm_weight(weight)?; // (hidden,)
        let mut out = LineVec::zeroed(n * h);
        for (xr, or) in x.chunks_exact(h).zip(out.chunks_exact_mut(h)) {
            k::rmsnorm(xr, &wv, self.cfg.rms_norm_eps, or);
        }
        Ok(out)
    }
}

/// The float dtype HF would run a checkpoint in, from its embedding's stored type: 16-bit
/// float checkpoints run in their dtype; F32 and quantized ones (dequantized) in f32.
pub fn param_dtype_of(embedding: DType) -> DType {
    match embedding {
        DType::BF16 | DType::F16 => embedding,
        _ => DType::F32,
    }
}

/// A norm weight (1, len) as f32.
fn dequant_vec(m: &Matrix) -> Result<Vec<f32>, EngineError> {
    let mut v = vec![0f32; m.cols];
    k::dequant_row(m, 0, &mut v)?;
    Ok(v)
}

fn add_into(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += *b;
    }
}

/// GGUF stores each q/k head's rows interleaved for GPT-J-style RoPE: GGUF row `j` of a head
/// of size `d` is HF row `(j % 2) * d/2 + j / 2`. Restores HF order in place.
fn unpermute_head(head: &mut [f32], tmp: &mut [f32]) {
    let half = head.len() / 2;
    tmp.copy_from_slice(head);
    for (j, &val) in tmp.iter().enumerate() {
        head[(j % 2) * half + j / 2] = val;
    }
}

/// A whole model bound to one tensor source: the single-device engine.
pub struct Model<'a> {
    /// dims, RoPE, q/k layout
    pub tf: Transformer,
    embed: Matrix<'a>,
    layers: Vec<LayerWeights<'a>>,
    head: HeadWeights<'a>,
}

impl<'a> Model<'a> {
    /// Binds every tensor of the model from `src`, checking shapes.
    pub fn bind<S: TensorSource + ?Sized>(
        src: &'a S,
        cfg: &ModelConfig,
        qk_permuted: bool,
    ) -> Result<Self, EngineError> {
        let layers = (0..cfg.num_layers)
            .map(|l| LayerWeights::bind(src, cfg, l))
            .collect::<Result<_, _>>()?;
        let embed = bind_embedding(src, cfg)?;
        Ok(Model {
            tf: Transformer::new(cfg.clone(), qk_permuted, param_dtype_of(embed.dtype)),
            embed,
            layers,
            head: HeadWeights::bind(src, cfg)?,
        })
    }

    /// Binds a model from an opened checkpoint.
    pub fn from_checkpoint(ckpt: &'a loip_model::Checkpoint) -> Result<Self, EngineError> {
        Model::bind(ckpt, &ckpt.config, ckpt.qk_permuted)
    }

    /// A fresh KV cache for all layers, with an optional byte budget; sliding-window layers
    /// keep their last `window` positions.
    pub fn new_cache(&self, budget: Option<u64>) -> KvCache {
        KvCache::new(0..self.tf.cfg.num_layers, self.tf.kv_dim(), budget)
            .with_windows(|l| self.tf.cfg.layer_window(l))
    }

    /// Runs one step: `ids[t]` at `batch[t]`; returns hidden states `(n, hidden)` after the
    /// last layer (before the final norm).
    pub fn forward_hidden(
        &self,
        ids: &[u32],
        batch: &Batch,
        kv: &mut KvCache,
    ) -> Result<Vec<f32>, EngineError> {
        if ids.len() != batch.len() {
            return Err(EngineError::Invalid(format!(
                "{} ids for {} positions",
                ids.len(),
                batch.len()
            )));
        }
        let max_pos = batch.iter().map(|t| t.pos + 1).max().unwrap_or(0);
        let limit = self.tf.cfg.max_position_embeddings;
        if max_pos > limit {
            return Err(EngineError::ContextTooLong {
                needed: max_pos,
                limit,
            });
        }
        kv.reserve(ids.len())?;
        k::on_pool(|| {
            let mut x = vec![0f32; ids.len() * self.tf.cfg.hidden_size];
            self.tf.embed(&self.embed, ids, &mut x)?;
            for (l, w) in self.layers.iter().enumerate() {
                self.tf.attention(l, &w.attn, &mut x, batch, kv)?;
                self.tf.mlp(&w.mlp, &mut x)?;
            }
            Ok(x)
        })
    }

    /// Logits `(rows.len(), vocab)` of the selected rows of `x`.
    pub fn logits(&self, x: &[f32], rows: &[usize]) -> Result<Vec<f32>, EngineError> {
        let h = self.tf.cfg.hidden_size;
        let mut sel = Vec::with_capacity(rows.len() * h);
        for &r in rows {
            let row = x.get(r * h..(r + 1) * h).ok_or(EngineError::BadHidden {
                expected: (r + 1) * h,
                got: x.len(),
            })?;
            sel.extend_from_slice(row);
        }
        let mut out = vec![0f32; rows.len() * self.tf.cfg.vocab_size];
        k::on_pool(|| self.tf.head(&self.head, &sel, &mut out))?;
        Ok(out)
    }

    /// Logits at every position of one sequence's prompt `(ids.len(), vocab)`, from an empty cache.
    pub fn prompt_logits(&self, ids: &[u32]) -> Result<Vec<f32>, EngineError> {
        let mut kv = self.new_cache(None);
        let batch: Vec<TokenPos> = (0..ids.len()).map(|pos| TokenPos { seq: 0, pos }).collect();
        let x = self.forward_hidden(ids, &batch, &mut kv)?;
        let rows: Vec<usize> = (0..ids.len()).collect();
        self.logits(&x, &rows)
    }
}

/// Maximal runs `[a, b)` (at least two tokens) of `batch` that are one sequence's consecutive
/// positions, in batch order.
fn prompt_runs(batch: &Batch) -> Vec<(usize, usize)> {
    let mut runs = Vec::new();
    let mut a = 0;
    for t in 1..=batch.len() {
        let continues = t < batch.len()
            && batch[t].seq == batch[t - 1].seq
            && batch[t].pos == batch[t - 1].pos + 1;
        if !continues {
            if t - a >= 2 {
                runs.push((a, t));
            }
            a = t;
        }
    }
    runs
}
