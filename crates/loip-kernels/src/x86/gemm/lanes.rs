//! Token-lane tiles of the AVX2 matmul for long batches (prefill): a register holds 8
//! *tokens* of one canonical accumulator lane instead of 8 lanes of one token, so the
//! canonical reduction becomes vertical adds shared by 8 tokens.
//!
//! The canonical dot of one output (row `r`, token `t`, see [`crate::canon`]) is 64
//! independent chains of fmas: chain `p = 16 a + l` (accumulator `a`, lane `l`) runs over the
//! elements `64 j + p` of the full groups in increasing `j`, from `+0.0`; the 64 results are
//! combined by a fixed tree. Here one register holds chain `p` of one row for 8 consecutive
//! tokens: a broadcast weight times the 8 tokens' elements, fused into the accumulator. A
//! tile of [`ROWS`] = 6 rows × [`GROUP`] = 16 tokens keeps 12 accumulators, 2 activation
//! registers and one broadcast (15 of the 16 registers): 12 fmas per 8 loads, against 8 per 6
//! for the column-lane tiles of `gemm.rs`, and each of the tree's 63 adds serves 8 tokens.
//!
//! A chain's weights are read from the row-major panel (a tile's rows stay in L1; consecutive
//! chains share their lines); a group's tokens are transposed once per call, `xt[p][j][k]`
//! (`k` < 16 the token in the group), so that a chain's activations are contiguous.
//!
//! Invariant: every output is the canonical dot bit for bit (the same fmas, with the same
//! operand order, and the same adds in the same tree); rows need a whole number of 16-element
//! groups (no sequential tail), which every quantized type has.
//!
//! Safety: the `unsafe fn`s require AVX2 and FMA (checked by [`crate::simd`]) and the buffer
//! lengths stated in their docs.

#[cfg(target_arch = "x86")]
use std::arch::x86::*;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::tile::Out;

/// Tokens per group (two 8-lane registers).
pub(super) const GROUP: usize = 16;
/// Rows per tile.
pub(super) const ROWS: usize = 6;

/// Steps `j` per chain slot in the transposed layouts: `ceil(cols / 64)`.
#[inline]
fn slots(cols: usize) -> usize {
    cols.div_ceil(64)
}

/// Steps of the chains of accumulator `a`: the `j` with `64 j + 16 a < cols`.
#[inline]
fn steps(cols: usize, a: usize) -> usize {
    cols.saturating_sub(16 * a).div_ceil(64)
}

/// f32 elements of one transposed group of tokens.
pub(super) fn group_len(cols: usize) -> usize {
    64 * slots(cols) * GROUP
}

/// `xt[g * group_len + (p * slots + j) * 16 + k] = x[(16 g + k) * cols + 64 j + p]` for the
/// first `groups` groups of 16 tokens of `x` (`n × cols`).
pub(super) fn transpose_tokens(x: &[f32], groups: usize, cols: usize, xt: &mut [f32]) {
    let (js, gl) = (slots(cols), group_len(cols));
    for (g, out) in xt.chunks_exact_mut(gl).take(groups).enumerate() {
        for k in 0..GROUP {
            let row = &x[(GROUP * g + k) * cols..(GROUP * g + k + 1) * cols];
            for (e, &v) in row.iter().enumerate() {
                out[((e % 64) * js + e / 64) * GROUP + k] = v;
            }
        }
    }
}

/// Accumulators of one chain: `[row][half]`, half `h` = tokens `8 h .. 8 h + 8`.
type Acc = [[__m256; 2]; ROWS];

/// Chain `p` of the tile's rows `w` (row-major, in L1) for the group `xg` (transposed), `n`
/// steps, into `dst` (`dst + chain` if `add`: the tree's first operand first). Not inlined:
/// each call keeps its 12 accumulators in registers, with nothing else live.
#[inline(never)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn chain(
    w: &[*const f32; ROWS],
    xg: *const f32,
    p: usize,
    js: usize,
    n: usize,
    dst: &mut Acc,
    add: bool,
) {
    let mut acc = [[_mm256_setzero_ps(); 2]; ROWS];
    let xp = xg.add(p * js * GROUP);
    let wp: [*const f32; ROWS] = std::array::from_fn(|i| w[i].add(p));
    for j in 0..n {
        let x0 = _mm256_loadu_ps(xp.add(GROUP * j));
        let x1 = _mm256_loadu_ps(xp.add(GROUP * j + 8));
        for i in 0..ROWS {
            // fma(w, x, acc): the canonical operands in the canonical order
            let b = _mm256_broadcast_ss(&*wp[i].add(64 * j));
            acc[i][0] = _mm256_fmadd_ps(b, x0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(b, x1, acc[i][1]);
        }
    }
    if add {
        add_into(dst, &acc);
    } else {
        *dst = acc;
    }
}

/// `a = a + b` per register (`a` the first operand, as in the canonical tree).
#[inline(always)]
unsafe fn add_into(a: &mut Acc, b: &Acc) {
    for i in 0..ROWS {
        for h in 0..2 {
            a[i][h] = _mm256_add_ps(a[i][h], b[i][h]);
        }
    }
}

/// One tile: `vals[i][k]` = canonical dot of row `w[i]` with token `k` of the group `xg`.
#[inline(always)]
unsafe fn tile(w: &[*const f32; ROWS], xg: *const f32, cols: usize, vals: &mut [[f32; 16]; ROWS]) {
    let js = slots(cols);
    let st: [usize; 4] = std::array::from_fn(|a| steps(cols, a));
    // v[l] = (P0 + P2) + (P1 + P3) of lane l, P_a the chain 16 a + l
    let mut v = [[[_mm256_setzero_ps(); 2]; ROWS]; 16];
    let mut s13 = [[_mm256_setzero_ps(); 2]; ROWS];
    for (l, vl) in v.iter_mut().enumerate() {
        chain(w, xg, l, js, st[0], vl, false);
        chain(w, xg, 32 + l, js, st[2], vl, true);
        chain(w, xg, 16 + l, js, st[1], &mut s13, false);
        chain(w, xg, 48 + l, js, st[3], &mut s13, true);
        add_into(vl, &s13);
    }
    // lanes l + l+8, then +4, +2, +1
    for (i, vi) in vals.iter_mut().enumerate() {
        for (h, out) in vi.chunks_exact_mut(8).enumerate() {
            let w8: [__m256; 8] =
                std::array::from_fn(|l| _mm256_add_ps(v[l][i][h], v[l + 8][i][h]));
            let w4: [__m256; 4] = std::array::from_fn(|l| _mm256_add_ps(w8[l], w8[l + 4]));
            let w2 = [_mm256_add_ps(w4[0], w4[2]), _mm256_add_ps(w4[1], w4[3])];
            _mm256_storeu_ps(out.as_mut_ptr(), _mm256_add_ps(w2[0], w2[1]));
        }
    }
}

/// Tokens `0 .. 16 * groups` (transposed in `xt`) against the `pr` rows of the panel `w`
/// (`pr × cols`, rows `row0 ..` of `out`), 6 rows at a time (the last tile repeats its last
/// row and drops the copies).
///
/// # Safety
/// AVX2/FMA available; `cols > 0` a multiple of 16, `w.len() >= pr * cols`,
/// `xt.len() >= groups * group_len(cols)`, filled by [`transpose_tokens`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn panel(
    w: &[f32],
    pr: usize,
    cols: usize,
    xt: &[f32],
    groups: usize,
    out: Out,
    row0: usize,
) {
    let gl = group_len(cols);
    debug_assert!(cols % 16 == 0 && pr > 0);
    assert!(
        w.len() >= pr * cols && xt.len() >= groups * gl,
        "lane buffers"
    );
    let mut vals = [[0f32; 16]; ROWS];
    for g in 0..groups {
        let xg = xt.as_ptr().add(g * gl);
        let mut r0 = 0;
        while r0 < pr {
            let wr: [*const f32; ROWS] =
                std::array::from_fn(|i| w.as_ptr().add((r0 + i).min(pr - 1) * cols));
            tile(&wr, xg, cols, &mut vals);
            for (i, vi) in vals.iter().enumerate().take(pr - r0) {
                for (k, &val) in vi.iter().enumerate() {
                    out.put(row0 + r0 + i, GROUP * g + k, val);
                }
            }
            r0 += ROWS;
        }
    }
}
