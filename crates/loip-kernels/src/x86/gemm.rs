//! Register-tiled matmul for n > 1 tokens (prefill, prefill chunks, batched decode, draft
//! verification): `out[r * n + t]` = canonical dot of row `r` with token `t`.
//!
//! A panel of rows is dequantized once into an f32 buffer (exactly: the values of
//! `dequant`, as every path computes them), then tiles of `R` rows × `T` tokens run over it
//! with one accumulator register per (row, token). The canonical dot's state per output is
//! 64 lanes (4 accumulators × 16 lanes, see [`crate::canon`]); a register holds one *slot* of
//! it: one half (8 lanes) of one accumulator, 8 slots (the `Slot` trait leaves room for
//! wider registers). Slot `s` of width `V` collects the elements `64 j + V s .. 64 j + V (s + 1)` of the
//! full groups, in increasing `j`, with one fma each: exactly the fmas of those lanes in the
//! canonical order. The slots are independent, so the tile computes them one after another
//! (over blocks of [`KB`] columns, keeping them in a small stack buffer in between), then
//! reduces them with the canonical tree and adds the sequential tail last.
//!
//! Invariant: every output element is bit-identical to the per-row kernels and the portable
//! path, whatever `n`, the tile shapes, the panel size and the thread split; only the
//! interleaving of independent accumulator lanes differs.
//!
//! AVX2 machines use it for every batch. AVX-512 machines keep their per-row kernels
//! (`avx512`: 1 row × 4 tokens with the whole state in 16 of the 32 registers), which measured
//! as fast as 512-bit tiles of this kind here.
//!
//! Safety: every `unsafe fn` here requires AVX2, FMA and F16C, checked by [`crate::simd`], and
//! the buffer lengths stated in its docs.

#[cfg(target_arch = "x86")]
use std::arch::x86::*;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use crate::dequant::{dequant_into, prefix_bytes};
use crate::dtype::DType;
use std::cell::RefCell;

/// f32 bytes of one dequantized panel of rows (about a quarter of a small L2).
const PANEL_BYTES: usize = 128 << 10;
/// Columns per block of the slot passes: the `R + T` rows of a tile stay in L1 meanwhile
/// (a multiple of 64, the canonical chunk).
const KB: usize = 1024;

thread_local! {
    /// The dequantized panel of this thread, reused across calls (f32, `rows × cols`).
    static PANEL: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// A vector register holding one slot of the canonical dot state.
trait Slot: Copy {
    /// lanes per register (8 or 16)
    const WIDTH: usize;
    /// slots of the 64-lane state (`64 / WIDTH`)
    const SLOTS: usize;
    unsafe fn zero() -> Self;
    unsafe fn load(p: *const f32) -> Self;
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self;
    /// the canonical reduction of the `SLOTS` first slots
    unsafe fn reduce(s: &[Self; 8]) -> f32;
}

impl Slot for __m256 {
    const WIDTH: usize = 8;
    const SLOTS: usize = 8;
    #[inline(always)]
    unsafe fn zero() -> Self {
        _mm256_setzero_ps()
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        _mm256_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
        _mm256_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn reduce(s: &[Self; 8]) -> f32 {
        // slot 2a + h is half h of accumulator a: the layout of the AVX2 reduction
        super::avx2::reduce(s)
    }
}

/// One tile: `st[i][t][s]` += slot `s` of rows `w[i]` · tokens `x[t]` over the full-group
/// elements `0 .. full` (`full` a multiple of 16).
#[inline(always)]
#[allow(clippy::needless_range_loop)] // one index runs over three arrays
unsafe fn tile<V: Slot, const R: usize, const T: usize>(
    w: &[*const f32; R],
    x: &[*const f32; T],
    full: usize,
    st: &mut [[[V; 8]; T]; R],
) {
    let mut k0 = 0;
    while k0 < full {
        let k1 = (k0 + KB).min(full);
        for s in 0..V::SLOTS {
            let mut acc = [[V::zero(); T]; R];
            for i in 0..R {
                for t in 0..T {
                    acc[i][t] = st[i][t][s];
                }
            }
            let mut e = k0 + V::WIDTH * s;
            while e + V::WIDTH <= k1 {
                let wv: [V; R] = std::array::from_fn(|i| V::load(w[i].add(e)));
                let xv: [V; T] = std::array::from_fn(|t| V::load(x[t].add(e)));
                for i in 0..R {
                    for t in 0..T {
                        acc[i][t] = V::fma(wv[i], xv[t], acc[i][t]);
                    }
                }
                e += 64;
            }
            for i in 0..R {
                for t in 0..T {
                    st[i][t][s] = acc[i][t];
                }
            }
        }
        k0 = k1;
    }
}

/// Tokens `t0 .. t0 + T` against every row of the panel `w` (`pr` rows of `cols` f32, rows
/// `row0 ..` of `out`), `R` rows at a time (the last tile repeats its last row and drops the
/// copies).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn tokens<V: Slot, const R: usize, const T: usize>(
    w: *const f32,
    pr: usize,
    cols: usize,
    x: *const f32,
    t0: usize,
    out: Out,
    row0: usize,
) {
    let full = cols / 16 * 16;
    let xs: [*const f32; T] = std::array::from_fn(|t| x.add((t0 + t) * cols));
    let mut r0 = 0;
    while r0 < pr {
        let ws: [*const f32; R] = std::array::from_fn(|i| w.add((r0 + i).min(pr - 1) * cols));
        let mut st = [[[V::zero(); 8]; T]; R];
        tile::<V, R, T>(&ws, &xs, full, &mut st);
        for (i, sti) in st.iter().enumerate().take(pr - r0) {
            for (t, s) in sti.iter().enumerate() {
                let mut v = V::reduce(s);
                if full < cols {
                    let mut tail = 0f32;
                    for j in full..cols {
                        tail = (*ws[i].add(j)).mul_add(*xs[t].add(j), tail);
                    }
                    v += tail;
                }
                out.put(row0 + r0 + i, t0 + t, v);
            }
        }
        r0 += R;
    }
}

/// All tokens against the panel: blocks of `T` tokens, the last block narrower.
#[inline(always)]
unsafe fn panel<V: Slot, const R: usize, const T: usize>(
    w: &[f32],
    pr: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    out: Out,
    row0: usize,
) {
    let (w, x) = (w.as_ptr(), x.as_ptr());
    let mut t0 = 0;
    while t0 + T <= n {
        tokens::<V, R, T>(w, pr, cols, x, t0, out, row0);
        t0 += T;
    }
    // the remaining 0 .. T - 1 tokens (T is at most 4)
    match n - t0 {
        0 => {}
        1 => tokens::<V, R, 1>(w, pr, cols, x, t0, out, row0),
        2 => tokens::<V, R, 2>(w, pr, cols, x, t0, out, row0),
        _ => tokens::<V, R, 3>(w, pr, cols, x, t0, out, row0),
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn panel_avx2(
    w: &[f32],
    pr: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    out: Out,
    row0: usize,
) {
    // 3 × 4 accumulators + 3 rows + 4 tokens: 19 registers, one reloaded (best measured
    // against 3 × 3, 2 × 4, 4 × 2 and 2 × 3)
    panel::<__m256, 3, 4>(w, pr, cols, x, n, out, row0)
}

/// Where the outputs go: element (row `r`, token `t`) at `ptr[r * rs + t * ts]`, inside
/// `len` elements (every write is bounds-checked).
#[derive(Clone, Copy)]
pub(crate) struct Out {
    ptr: *mut f32,
    len: usize,
    rs: usize,
    ts: usize,
}

impl Out {
    /// `out[r * n + t]` (the per-row kernels' layout; tests compare the kernels in it).
    #[cfg(test)]
    pub(crate) fn row_major(out: &mut [f32], n: usize) -> Out {
        Out {
            ptr: out.as_mut_ptr(),
            len: out.len(),
            rs: n,
            ts: 1,
        }
    }

    /// `ptr[r + t * stride]`, `len` elements: rows of a token-major output.
    ///
    /// # Safety
    /// `ptr` is valid for writes of `len` f32 while the `Out` is used, and nothing else
    /// reads or writes the elements this `Out`'s rows address meanwhile.
    pub(crate) unsafe fn token_major(ptr: *mut f32, len: usize, stride: usize) -> Out {
        Out {
            ptr,
            len,
            rs: 1,
            ts: stride,
        }
    }

    #[inline(always)]
    fn put(&self, r: usize, t: usize, v: f32) {
        let i = r * self.rs + t * self.ts;
        assert!(i < self.len, "gemm output index");
        // SAFETY: in bounds (checked); the constructors give exclusive access to these rows
        unsafe { *self.ptr.add(i) = v };
    }
}

/// Output (row `r`, token `t`) of `out` = canonical dot of row `r` of `data` (`rows` rows)
/// with row `t` of `x` (`n × cols`).
///
/// # Safety
/// AVX2/FMA/F16C available; `data.len() == rows * row_bytes(cols)`, `x.len() == n * cols`,
/// `cols` a multiple of the block size, `n > 0`.
pub(crate) unsafe fn rows(
    dtype: DType,
    data: &[u8],
    cols: usize,
    x: &[f32],
    n: usize,
    rows: usize,
    out: Out,
) {
    let rb = prefix_bytes(dtype, cols);
    debug_assert!(n > 0 && x.len() == n * cols && data.len() == rows * rb);
    if cols == 0 {
        for r in 0..rows {
            for t in 0..n {
                out.put(r, t, 0.0);
            }
        }
        return;
    }
    if rows == 0 {
        return;
    }
    let per_panel = (PANEL_BYTES / (4 * cols)).clamp(1, rows);
    PANEL.with(|buf| {
        let mut buf = buf.borrow_mut();
        if buf.len() < per_panel * cols {
            buf.resize(per_panel * cols, 0.0);
        }
        let mut p0 = 0;
        while p0 < rows {
            let pr = per_panel.min(rows - p0);
            let wb = &mut buf[..pr * cols];
            let bytes = &data[p0 * rb..(p0 + pr) * rb];
            if !super::avx2::dequant_rows(dtype, bytes, cols, wb) {
                for (o, b) in wb.chunks_exact_mut(cols).zip(bytes.chunks_exact(rb)) {
                    dequant_into(dtype, b, o);
                }
            }
            panel_avx2(wb, pr, cols, x, n, out, p0);
            p0 += pr;
        }
    });
}
