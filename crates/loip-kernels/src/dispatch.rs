//! Safe dispatch from a [`Level`] to the kernel of that instruction set.
//!
//! A level the CPU does not support falls back to the scalar path, so these functions are
//! safe to call with any level. Slice lengths are checked here, before any `unsafe` code.

use crate::canon::Act;
use crate::dequant::{prefix_bytes, row_dots_scalar};
use crate::dtype::DType;
use crate::simd::{per_row_batches, usable, Level};

/// From this many tokens on, AVX2 matmuls use the register-tiled kernel
/// ([`crate::x86::gemm`], through [`rows_token_major`]); below, the per-row dot kernels of
/// [`rows`]. AVX-512 keeps its per-row kernels (1 row × 4 tokens, weights dequantized in
/// registers) for batches of up to [`AVX512_ROWS_MAX_TOKENS`] of the types it has them for,
/// [`avx512_native`], except where the in-register short-batch tiles take them (Q4_0, Q4_1,
/// Q8_0, Q4_K, Q6_K, and Q5_0 / Q5_1, which have no per-row kernel there, at 4 to 8 tokens:
/// `x86::gemm::short::handles`, 0.88x the per-row time of a SmolLM2
/// step's matmuls at n = 4); longer batches and other types take 512-bit tiles.
const GEMM_MIN_TOKENS: usize = 2;

/// Longest batch that AVX-512 runs on its per-row kernels for [`avx512_native`] types.
/// Prefill (256 tokens, SmolLM2 Q4_1, interleaved runs) took 0.76× the time on 1 thread and
/// 0.86× on 2 with 512-bit tiles than with the per-row kernels.
#[cfg_attr(
    not(any(target_arch = "x86_64", target_arch = "x86")),
    allow(dead_code)
)]
const AVX512_ROWS_MAX_TOKENS: usize = 8;

/// Types with AVX-512 per-row kernels of their own (others go through f32 rows there).
#[cfg_attr(
    not(any(target_arch = "x86_64", target_arch = "x86")),
    allow(dead_code)
)]
fn avx512_native(dtype: DType) -> bool {
    matches!(
        dtype,
        DType::F32
            | DType::F16
            | DType::BF16
            | DType::Q8_0
            | DType::Q4_0
            | DType::Q4_1
            | DType::Q4K
            | DType::Q6K
    )
}

/// Whether a matmul of `n` tokens takes the register-tiled kernel.
#[inline]
#[cfg_attr(
    not(any(target_arch = "x86_64", target_arch = "x86")),
    allow(dead_code)
)]
fn tiled(n: usize) -> bool {
    n >= GEMM_MIN_TOKENS && !per_row_batches()
}

/// `out[r * n + t]` = canonical dot of row `r` of `data` with token `t` of `x`.
///
/// `data`: `out.len() / n` rows of `cols` elements of `dtype`; `x`: `n × cols`.
/// Panics if the lengths disagree (callers validate shapes first).
pub(crate) fn rows(
    level: Level,
    dtype: DType,
    data: &[u8],
    cols: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
) {
    assert!(n > 0 && cols % dtype.block_elems() == 0, "bad matmul shape");
    assert_eq!(x.len(), n * cols, "x length");
    assert_eq!(out.len() % n, 0, "out length");
    let rb = prefix_bytes(dtype, cols);
    assert_eq!(data.len(), out.len() / n * rb, "weight bytes");
    if crate::intdot::handles(dtype) {
        // callers that reuse the activations quantize once (`matmul`); same result
        let qx = crate::intdot::quantize(x, cols);
        return crate::intdot::rows(level, dtype, data, &qx, out);
    }
    match usable(level) {
        #[cfg(any(target_arch = "x86_64", target_arch = "x86"))]
        // SAFETY: AVX-512F/AVX2/FMA/F16C detected; lengths checked above.
        Level::Avx512 => unsafe { crate::x86::route::avx512_rows(dtype, data, cols, x, n, out) },
        #[cfg(any(target_arch = "x86_64", target_arch = "x86"))]
        // SAFETY: AVX2/FMA/F16C detected; lengths checked above.
        Level::Avx2 => unsafe { crate::x86::route::avx2_rows(dtype, data, cols, x, n, out) },
        #[cfg(all(target_arch = "aarch64", target_endian = "little"))]
        // SAFETY: NEON is baseline on aarch64; lengths checked above.
        Level::Neon => unsafe { crate::arm::neon::rows(dtype, data, cols, x, n, out) },
        _ => {
            for (r, o) in out.chunks_exact_mut(n).enumerate() {
                row_dots_scalar(dtype, &data[r * rb..(r + 1) * rb], cols, x, o);
            }
        }
    }
}

/// A token-major output `y[t * rows + r]` (`n × rows` f32) that tasks on several threads
/// fill, each through [`rows_token_major`] for its own run of rows.
#[derive(Clone, Copy)]
pub(crate) struct TokenMajor<'a> {
    #[cfg_attr(
        not(any(target_arch = "x86_64", target_arch = "x86")),
        allow(dead_code)
    )]
    ptr: *mut f32,
    len: usize,
    rows: usize,
    _y: std::marker::PhantomData<&'a mut [f32]>,
}

// SAFETY: a `TokenMajor` is only written through `rows_token_major`, which writes the rows
// it is given and nothing else; callers give each task its own rows (see `matmul`).
unsafe impl Send for TokenMajor<'_> {}
// SAFETY: as above.
unsafe impl Sync for TokenMajor<'_> {}

impl<'a> TokenMajor<'a> {
    /// `y` of `y.len() / rows` tokens of `rows` outputs each.
    pub(crate) fn new(y: &'a mut [f32], rows: usize) -> TokenMajor<'a> {
        TokenMajor {
            ptr: y.as_mut_ptr(),
            len: y.len(),
            rows,
            _y: std::marker::PhantomData,
        }
    }
}

/// Whether [`rows_token_major`] takes `n` tokens of `dtype` on `level` (else callers use
/// [`rows`] and transpose).
pub(crate) fn has_token_major(level: Level, dtype: DType, n: usize) -> bool {
    if crate::intdot::handles(dtype) {
        return false;
    }
    #[cfg(any(target_arch = "x86_64", target_arch = "x86"))]
    match usable(level) {
        Level::Avx2 => return tiled(n),
        Level::Avx512 => {
            return tiled(n)
                && (n > AVX512_ROWS_MAX_TOKENS
                    || !avx512_native(dtype)
                    || (crate::x86::gemm::short::handles(dtype, n)
                        && !crate::simd::short_tiles_off()))
        }
        Level::Scalar | Level::Neon => {}
    }
    let _ = (level, dtype, n);
    false
}

/// `y[t * rows + r0 + r]` = canonical dot of row `r` of `data` with token `t` of `x`, for the
/// `data.len() / row_bytes` rows of `data` (rows `r0 ..` of `y`). Call only where
/// [`has_token_major`] says so. Panics if the lengths disagree or the rows fall outside `y`.
///
/// Tasks that call this at the same time with copies of one `y` must pass disjoint rows.
/// `pre`: `x` packed once for all of a matmul's tasks, where `crate::x86::gemm` packs all the
/// tokens (see `gemm::shared_pack_len`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn rows_token_major(
    level: Level,
    dtype: DType,
    data: &[u8],
    cols: usize,
    x: &[f32],
    n: usize,
    y: TokenMajor<'_>,
    r0: usize,
    pre: Option<&[f32]>,
) {
    // The caller decided with `has_token_major`; only what the unsafe code relies on (the
    // CPU's features) is checked again here, not the run-time toggles, which another thread
    // (a test) may flip in between without changing any result.
    assert!(
        n >= GEMM_MIN_TOKENS && matches!(usable(level), Level::Avx2 | Level::Avx512),
        "no token-major kernel"
    );
    assert!(n > 0 && cols % dtype.block_elems() == 0, "bad matmul shape");
    assert_eq!(x.len(), n * cols, "x length");
    assert_eq!(y.len, n * y.rows, "y length");
    let rb = prefix_bytes(dtype, cols);
    assert!(rb > 0 && data.len() % rb == 0, "weight bytes");
    let rows = data.len() / rb;
    assert!(r0 + rows <= y.rows, "rows outside y");
    #[cfg(any(target_arch = "x86_64", target_arch = "x86"))]
    // SAFETY: AVX2/FMA/F16C (and AVX-512F where `wide`) detected (has_token_major); lengths
    // checked above; the output rows r0 .. r0 + rows are this caller's alone (the contract
    // above), and every index r0 + r + t * rows (r < rows, t < n) is below len.
    unsafe {
        let out = crate::x86::gemm::Out::token_major(y.ptr.add(r0), y.len - r0, y.rows);
        let wide = usable(level) == Level::Avx512;
        let len = crate::x86::gemm::shared_pack_len(wide, cols, n);
        assert!(pre.is_none_or(|p| len > 0 && p.len() == len), "packed tokens");
        crate::x86::gemm::rows(wide, dtype, data, cols, x, n, rows, out, pre)
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "x86")))]
    let _ = pre;
}

/// Canonical dot product of two f32 slices. Panics if the lengths differ.
pub(crate) fn dot_f32(level: Level, a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot lengths");
    match usable(level) {
        #[cfg(any(target_arch = "x86_64", target_arch = "x86"))]
        // SAFETY: features detected; equal lengths.
        Level::Avx512 => unsafe { crate::x86::avx512_act::dot_f32(a, b) },
        #[cfg(any(target_arch = "x86_64", target_arch = "x86"))]
        // SAFETY: features detected; equal lengths.
        Level::Avx2 => unsafe { crate::x86::avx2::dot_f32(a, b) },
        #[cfg(all(target_arch = "aarch64", target_endian = "little"))]
        // SAFETY: NEON is baseline on aarch64; equal lengths.
        Level::Neon => unsafe { crate::arm::neon::dot_f32(a, b) },
        _ => crate::canon::dot_f32(a, b),
    }
}

/// `out[t]` = canonical dot of `q` with row `t` of `k` (rows `stride` apart, `q.len()` long).
/// Panics if `k` is too short.
pub(crate) fn dot_rows(level: Level, q: &[f32], k: &[f32], stride: usize, out: &mut [f32]) {
    if let Some(last) = out.len().checked_sub(1) {
        assert!(last * stride + q.len() <= k.len(), "dot_rows: k too short");
    }
    match usable(level) {
        #[cfg(any(target_arch = "x86_64", target_arch = "x86"))]
        // SAFETY: features detected; every row read is inside `k` (checked above).
        Level::Avx512 => unsafe { crate::x86::avx512_act::dot_rows(q, k, stride, out) },
        #[cfg(any(target_arch = "x86_64", target_arch = "x86"))]
        // SAFETY: features detected; every row read is inside `k` (checked above).
        Level::Avx2 => unsafe { crate::x86::avx2::dot_rows(q, k, stride, out) },
        #[cfg(all(target_arch = "aarch64", target_endian = "little"))]
        // SAFETY: NEON is baseline on aarch64; every row read is inside `k` (checked above).
        Level::Neon => unsafe { crate::arm::neon::dot_rows(q, k, stride, out) },
        level => {
            for (t, o) in out.iter_mut().enumerate() {
                *o = dot_f32(level, q, &k[t * stride..t * stride + q.len()]);
            }
        }
    }
}

/// `out[i] = fma(p[t], v[t * stride + i], out[i])` for `t = 0, 1, ..` in order (the weighted sum
/// of value rows; `out` is its own start value). Panics if `v` is too short.
pub(crate) fn weighted_rows(level: Level, p: &[f32], v: &[f32], stride: usize, out: &mut [f32]) {
    if let Some(last) = p.len().checked_sub(1) {
        assert!(
            last * stride + out.len() <= v.len(),
            "weighted_rows: v too short"
        );
    }
    match usable(level) {
        #[cfg(any(target_arch = "x86_64", target_arch = "x86"))]
        // SAFETY: features detected; every row read is inside `v` (checked above).
        Level::Avx512 => unsafe { crate::x86::avx512_act::weighted_rows(p, v, stride, out) },
        #[cfg(any(target_arch = "x86_64", target_arch = "x86"))]
        // SAFETY: features detected; every row read is inside `v` (checked above).
        Level::Avx2 => unsafe { crate::x86::avx2::weighted_rows(p, v, stride, out) },
        #[cfg(all(target_arch = "aarch64", target_endian = "little"))]
        // SAFETY: NEON is baseline on aarch64; every row read is inside `v` (checked above).
        Level::Neon => unsafe { crate::arm::neon::weighted_rows(p, v, stride, out) },
        _ => {
            for (t, &pt) in p.iter().enumerate() {
                let row = &v[t * stride..t * stride + out.len()];
                out.iter_mut()
                    .zip(row)
                    .for_each(|(o, &x)| *o = pt.mul_add(x, *o));
            }
        }
    }
}

/// `s[i] = exp(s[i])` with the canonical exp.
pub(crate) fn exp_inplace(level: Level, s: &mut [f32]) {
    match usable(level) {
        #[cfg(any(target_arch = "x86_64", target_arch = "x86"))]
        // SAFETY: features detected.
        Level::Avx512 => unsafe { crate::x86::avx512_act::exp_inplace(s) },
        #[cfg(any(target_arch = "x86_64", target_arch = "x86"))]
        // SAFETY: features detected.
        Level::Avx2 => unsafe { crate::x86::avx2::exp_inplace(s) },
        _ => s.iter_mut().for_each(|v| *v = crate::canon::exp(*v)),
    }
}

/// `gate[i] = act(gate[i]) * up[i]` (see [`Act`]). Panics if the lengths differ.
pub(crate) fn act_mul(level: Level, act: Act, gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "act_mul lengths");
    match (usable(level), act) {
        #[cfg(any(target_arch = "x86_64", target_arch = "x86"))]
        // SAFETY: features detected; equal lengths.
        (Level::Avx512, Act::Silu) => unsafe { crate::x86::avx512_act::act_mul::<false>(gate, up) },
        #[cfg(any(target_arch = "x86_64", target_arch = "x86"))]
        // SAFETY: features detected; equal lengths.
        (Level::Avx512, Act::GeluTanh) => unsafe {
            crate::x86::avx512_act::act_mul::<true>(gate, up)
        },
        #[cfg(any(target_arch = "x86_64", target_arch = "x86"))]
        // SAFETY: features detected; equal lengths.
        (Level::Avx2, Act::Silu) => unsafe { crate::x86::avx2::act_mul::<false>(gate, up) },
        #[cfg(any(target_arch = "x86_64", target_arch = "x86"))]
        // SAFETY: features detected; equal lengths.
        (Level::Avx2, Act::GeluTanh) => unsafe { crate::x86::avx2::act_mul::<true>(gate, up) },
        _ => crate::canon::act_mul_scalar(act, gate, up),
    }
}
