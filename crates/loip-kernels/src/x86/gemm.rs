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
//! Panels: batches of up to [`SHORT_BATCH`] tokens (batched decode) dequantize one tile of
//! `R` rows at a time into a 64-byte-aligned buffer that stays in L1, then run every token
//! over it; longer batches (prefill) dequantize panels of [`PANEL_BYTES`] (AVX2) or
//! [`PANEL_BYTES_WIDE`] (AVX-512) that stay in L2
//! (at least [`LONG_PANEL_ROWS`] rows when rows are longer than a block of [`KB`] columns:
//! such panels run block by block over all their tiles, so that a block of the tokens stays
//! in L1 across the tiles).
//!
//! AVX-512 panels of long batches' rows of whole 64-element chunks are packed (see
//! [`packed`]): each tile's rows, and each block of tokens, laid out in the order a pass
//! reads them (`prefill_bench`, one thread: Qwen2.5's 4864 × 896 Q5_0 gate and up 1.05×, its
//! 896 × 4864 Q6_K down projection 1.03–1.28×; see the CHANGELOG). Where rows are longer than
//! a block, `matmul` packs all the tokens once for every task of the call ([`pack_tokens`],
//! split over the threads) and hands them in (`pre`).
//!
//! AVX2 machines use it for every batch, with 256-bit slots. AVX-512 machines keep their
//! per-row kernels (`avx512`: 1 row × 4 tokens, weights dequantized in registers by table
//! lookups, no panel) for short batches of the types they have them for; prefill and the
//! other types take 512-bit slots here (see `dispatch::AVX512_ROWS_MAX_TOKENS`).
//!
//! Safety: every `unsafe fn` here requires AVX2, FMA and F16C, checked by [`crate::simd`], and
//! the buffer lengths stated in its docs.

#[cfg(target_arch = "x86")]
use std::arch::x86::*;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use crate::dequant::{dequant_into, prefix_bytes};
use crate::dtype::DType;
use crate::thread_buf::{with_thread_buf, ThreadBuf, KEEP_ALL};
use std::mem::MaybeUninit;

mod lanes;
mod packed;
pub(crate) mod short;
mod tile;

pub(crate) use tile::Out;
use tile::{Slot, SHORT_BATCH};

/// Slot states of a tile, `[row][token][slot]`, `S` = the level's `Slot::SLOTS` (4 for
/// 512-bit slots): no unused slots between outputs, so that the states of a long-row panel's
/// tiles (8 tiles of 3 × 6 outputs, 37 KB with 512-bit slots) spread over every L1 set. (With
/// 8 slots per output the used half of 512-bit states fell in the same half of the sets.)
/// Never zeroed: each pass writes its slots before anything reads them.
type Slots<V, const S: usize, const R: usize, const T: usize> = [[[MaybeUninit<V>; S]; T]; R];

/// f32 bytes of one dequantized panel of rows for long batches with 256-bit slots (about a
/// quarter of a small L2). Batches of at most [`SHORT_BATCH`] tokens dequantize one tile of
/// rows at a time instead, into L1 (the panel's stores to L2 were their bottleneck).
const PANEL_BYTES: usize = 128 << 10;
/// [`PANEL_BYTES`] with 512-bit slots: half of the 1 MiB L2 of the AVX-512 cores (Zen 4 and
/// 5, Intel's server cores); every block of tokens streams through L1 once per panel, so
/// a panel 4 times larger reads the tokens from L3 a quarter as often (Qwen2.5's 4864 × 896
/// gate and up projections 1.1–1.2× on Zen 5).
const PANEL_BYTES_WIDE: usize = 512 << 10;
/// Fewest rows of a long batch's panel of rows longer than [`KB`] columns (a multiple of
/// every tile's rows): each block of columns of a tile of tokens stays in L1 across this many
/// rows (with 128 KiB panels, rows of 4864 columns had 6).
const LONG_PANEL_ROWS: usize = 24;
/// Fewest rows of a call whose rows are longer than a block of [`KB`] columns for the
/// packed tiles when the caller did not pack the tokens (`pre`): such a call packs all its
/// tokens itself (`n × cols`), which fewer rows do not repay (the row-major tiles were
/// faster for a panel's worth of rows). `matmul` packs them once for all its tasks.
const PACK_ALL_MIN_ROWS: usize = 4 * LONG_PANEL_ROWS;
/// Columns per block of the slot passes: the `R + T` rows of a tile stay in L1 meanwhile
/// (a multiple of 64, the canonical chunk).
const KB: usize = 1024;

thread_local! {
    /// The dequantized panel of this thread, reused across calls (f32, `rows × cols`).
    static PANEL: ThreadBuf = const { ThreadBuf::new(Vec::new()) };
    /// The token-lane tiles' transposed tokens, or the packed tiles' packed tokens, of this
    /// thread (f32), reused.
    static LANES: ThreadBuf = const { ThreadBuf::new(Vec::new()) };
}

/// The canonical reduction of one output's slot state (slots `SLOTS ..` are not read).
///
/// # Safety
/// Slots `0 .. V::SLOTS` of `s` are written.
#[inline(always)]
unsafe fn reduce_state<V: Slot, const S: usize>(s: &[MaybeUninit<V>; S]) -> f32 {
    let s: [V; 8] = std::array::from_fn(|k| {
        if k < V::SLOTS {
            s[k].assume_init() // k < SLOTS <= S
        } else {
            V::zero()
        }
    });
    V::reduce(&s)
}

/// One tile over one block of columns: `st[i][t][s]` = slot `s` of rows `w[i]` · tokens
/// `x[t]` over the full-group elements `0 .. k1`, from the state of the elements `0 .. k0`
/// that `st` holds (nothing if `k0 == 0`); `k0` a multiple of 64, `k1` of 16. Writes every
/// slot `s < SLOTS`.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // one index runs over three arrays
unsafe fn tile<V: Slot, const S: usize, const R: usize, const T: usize>(
    w: &[*const f32; R],
    x: &[*const f32; T],
    (k0, k1): (usize, usize),
    st: &mut Slots<V, S, R, T>,
) {
    for s in 0..V::SLOTS {
        let mut acc = [[V::zero(); T]; R];
        if k0 > 0 {
            for i in 0..R {
                for t in 0..T {
                    // written by the block before (k0 > 0)
                    acc[i][t] = st[i][t][s].assume_init();
                }
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
                st[i][t][s].write(acc[i][t]);
            }
        }
    }
}

/// Tokens `t0 .. t0 + T` against every row of the panel `w` (`pr` rows of `cols` f32, rows
/// `row0 ..` of `out`), `R` rows at a time (the last tile repeats its last row and drops the
/// copies).
///
/// Rows longer than one block of [`KB`] columns run block by block over all the tiles of the
/// panel, each tile's slot state resting in `states` in between: the block's tokens stay in
/// L1 across the tiles, instead of all of each token's row passing through L1 once per tile
/// (rows of 2048 and 4864 columns, the down projections of Gemma 3 and Qwen2.5, ran at half
/// the rate of rows of 640).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn tokens<V: Slot, const S: usize, const R: usize, const T: usize>(
    w: *const f32,
    pr: usize,
    cols: usize,
    x: *const f32,
    t0: usize,
    out: Out,
    row0: usize,
    states: &mut Vec<Slots<V, S, R, T>>,
) {
    let full = cols / 16 * 16;
    let xs: [*const f32; T] = std::array::from_fn(|t| x.add((t0 + t) * cols));
    let ws = |r0: usize| -> [*const f32; R] {
        std::array::from_fn(|i| w.add((r0 + i).min(pr - 1) * cols))
    };
    let fin = |j: usize| (row0 + R * j, pr - R * j, ws(R * j));
    let tiles = pr.div_ceil(R);
    if full <= KB {
        // one block: each tile's state stays on the stack
        let mut st: Slots<V, S, R, T> = [[[MaybeUninit::uninit(); S]; T]; R];
        for j in 0..tiles {
            if full == 0 {
                st.iter_mut().flatten().for_each(|s| {
                    s[..V::SLOTS].iter_mut().for_each(|v| {
                        v.write(V::zero());
                    });
                });
            } else {
                tile::<V, S, R, T>(&ws(R * j), &xs, (0, full), &mut st);
            }
            let (r0, valid, wj) = fin(j);
            finish(&st, (cols, full), &wj, &xs, out, (r0, t0), valid);
        }
        return;
    }
    states.clear();
    states.resize(tiles, [[[MaybeUninit::uninit(); S]; T]; R]);
    let mut k0 = 0;
    while k0 < full {
        let k1 = (k0 + KB).min(full);
        for (j, st) in states.iter_mut().enumerate() {
            tile::<V, S, R, T>(&ws(R * j), &xs, (k0, k1), st);
        }
        k0 = k1;
    }
    for (j, st) in states.iter().enumerate() {
        let (r0, valid, wj) = fin(j);
        finish(st, (cols, full), &wj, &xs, out, (r0, t0), valid);
    }
}

/// The outputs of one tile from its state (`valid` rows of it; rows `r0 ..`, tokens `t0 ..`
/// of `out`): the canonical reduction, plus the sequential tail of the columns `full ..
/// cols` of rows `w` and tokens `x`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn finish<V: Slot, const S: usize, const R: usize, const T: usize>(
    st: &Slots<V, S, R, T>,
    (cols, full): (usize, usize),
    w: &[*const f32; R],
    x: &[*const f32; T],
    out: Out,
    (r0, t0): (usize, usize),
    valid: usize,
) {
    for (i, sti) in st.iter().enumerate().take(valid) {
        for (t, s) in sti.iter().enumerate() {
            // slots < SLOTS are written by `tile` (or zeroed)
            let mut v = reduce_state(s);
            if full < cols {
                let mut tail = 0f32;
                for j in full..cols {
                    tail = (*w[i].add(j)).mul_add(*x[t].add(j), tail);
                }
                v += tail;
            }
            out.put(r0 + i, t0 + t, v);
        }
    }
}

/// One panel's job: `pr` dequantized rows `w` (`pr × cols` f32, rows `row0 ..` of `out`)
/// against the tokens `t_start .. n` of `x` (`n × cols`).
#[derive(Clone, Copy)]
struct Job<'a> {
    w: &'a [f32],
    pr: usize,
    cols: usize,
    x: &'a [f32],
    n: usize,
    t_start: usize,
    out: Out,
    row0: usize,
}

/// The job's tokens against the panel: blocks of `T` tokens, the last block narrower (`R`
/// rows per tile throughout).
#[inline(always)]
unsafe fn panel<V: Slot, const S: usize, const R: usize, const T: usize>(job: Job<'_>) {
    let Job {
        w,
        pr,
        cols,
        x,
        n,
        t_start,
        out,
        row0,
    } = job;
    let (w, x) = (w.as_ptr(), x.as_ptr());
    let mut t0 = t_start;
    let mut states = Vec::new();
    while t0 + T <= n {
        tokens::<V, S, R, T>(w, pr, cols, x, t0, out, row0, &mut states);
        t0 += T;
    }
    // the remaining 0 .. T - 1 tokens (T is at most 8)
    macro_rules! rest {
        ($t:literal) => {
            tokens::<V, S, R, $t>(w, pr, cols, x, t0, out, row0, &mut Vec::new())
        };
    }
    match n - t0 {
        0 => {}
        1 => rest!(1),
        2 => rest!(2),
        3 => rest!(3),
        4 => rest!(4),
        5 => rest!(5),
        6 => rest!(6),
        _ => rest!(7),
    }
}

/// A panel kernel for one level (`$name`, with `$feat` enabled) and its tile shapes: for `n`
/// tokens matching `$n` (the job's, from `t_start`), tiles of `$r` rows × `$t` tokens; `$shape`
/// returns that `($r, $t)`.
macro_rules! panel_level {
    ($name:ident, $shape:ident, $feat:literal, $v:ty, $s:literal,
     $($n:pat => ($r:literal, $t:literal)),+) => {
        /// Rows and tokens per tile of [`
        #[doc = stringify!($name)]
        /// `] for `n` tokens.
        fn $shape(n: usize) -> (usize, usize) {
            match n {
                $($n => ($r, $t)),+
            }
        }

        /// The job's panel: packed (`xp` = `Some`, see [`packed::panel`]) or row-major.
        #[target_feature(enable = $feat)]
        unsafe fn $name(job: Job<'_>, xp: Option<(*mut f32, bool, bool)>) {
            match (job.n - job.t_start, xp) {
                $(($n, Some((xp, all, fill))) => packed::panel::<$v, $s, $r, $t>(job, xp, (all, fill)),)+
                $(($n, None) => panel::<$v, $s, $r, $t>(job)),+
            }
        }
    };
}

// 16 registers: R × T accumulators + R rows + T tokens (2 × 4 measured best for n >= 4 with
// panels in L1: no spills; 3 × 4 needs 19)
panel_level!(panel_avx2, shape_avx2, "avx2,fma,f16c", __m256, 8,
    2 => (4, 2),
    3 => (3, 3),
    _ => (2, 4)
);
// 32 registers
panel_level!(panel_avx512, shape_avx512, "avx512f,avx2,fma,f16c", __m512, 4,
    2 => (8, 2),
    3 => (6, 3),
    4 => (4, 4),
    5 => (4, 5),
    8 => (2, 8),
    _ => (3, 6)
);

/// Rows per tile of the panel kernels for `n` tokens.
fn tile_rows(wide: bool, n: usize) -> usize {
    if wide {
        shape_avx512(n).0
    } else {
        shape_avx2(n).0
    }
}

/// f32 of the tokens that [`rows`] packs all at once for `n` tokens of `cols` columns with
/// 512-bit slots if `wide` (rows longer than a block of [`KB`] columns, see
/// [`packed`]), laid out as [`pack_tokens`] writes them; 0 where it packs none, or per block.
/// A matmul packs them once for all its tasks and hands them to each (`pre`).
pub(crate) fn shared_pack_len(wide: bool, cols: usize, n: usize) -> usize {
    // n > SHORT_BATCH: never the short tiles (`short::handles`), whatever the toggles
    if wide && n > SHORT_BATCH && cols > KB && packed::handles(cols) && !ab_pack_off() {
        n * cols
    } else {
        0
    }
}

/// f32 of one block of packed tokens (the last block may be shorter): chunks of the
/// [`shared_pack_len`] buffer of a multiple of this length start on a block.
pub(crate) fn packed_block_len(n: usize, cols: usize) -> usize {
    shape_avx512(n).1 * cols
}

/// Packs the tokens `x` (`n × cols`) of the blocks from `b0` on into `out` (whole blocks
/// from the block `b0` of the [`shared_pack_len`] buffer, as [`rows`] reads it).
///
/// Panics if `x` is not `n × cols` or `out` runs past the end of the tokens or ends inside a
/// block.
pub(crate) fn pack_tokens(x: &[f32], n: usize, cols: usize, b0: usize, out: &mut [f32]) {
    let t = shape_avx512(n).1;
    assert!(x.len() == n * cols && packed::handles(cols), "pack shape");
    let mut t0 = b0 * t;
    assert!(t0 * cols + out.len() <= n * cols, "pack range");
    let mut at = 0;
    while at < out.len() {
        let k = t.min(n - t0);
        assert!(at + k * cols <= out.len(), "pack ends inside a block");
        // SAFETY: tokens t0 .. t0 + k < n of x, and k * cols f32 of out from `at` (checked)
        unsafe { packed::pack_block(x.as_ptr(), cols, (t0, k), 16, out.as_mut_ptr().add(at)) };
        at += k * cols;
        t0 += k;
    }
}

/// Output (row `r`, token `t`) of `out` = canonical dot of row `r` of `data` (`rows` rows)
/// with row `t` of `x` (`n × cols`), with 512-bit slots if `wide`, else 256-bit.
///
/// # Safety
/// AVX2/FMA/F16C available, and AVX-512F if `wide`; `data.len() == rows * row_bytes(cols)`, `x.len() == n * cols`,
/// `cols` a multiple of the block size, `n > 0`; `pre`, if given, holds
/// [`shared_pack_len`] (non-zero) f32: every block of `x` packed by [`pack_tokens`].
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn rows(
    wide: bool,
    dtype: DType,
    data: &[u8],
    cols: usize,
    x: &[f32],
    n: usize,
    rows: usize,
    out: Out,
    pre: Option<&[f32]>,
) {
    let rb = prefix_bytes(dtype, cols);
    debug_assert!(pre.is_none_or(|p| p.len() == shared_pack_len(wide, cols, n)));
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
    if wide && short::handles(dtype, n) && !crate::simd::short_tiles_off() {
        short::rows(dtype, data, cols, x, n, rows, out);
        return;
    }
    // groups of 16 tokens take the token-lane tiles (AVX2, rows of whole 16-element groups),
    // the remaining tokens the column-lane tiles
    let groups = if !wide && cols % 16 == 0 && crate::simd::lane_tiles() {
        n / lanes::GROUP
    } else {
        0
    };
    let rest = n - groups * lanes::GROUP;
    let tr = match (groups, rest) {
        (0, _) => tile_rows(wide, n),
        (_, 0) => lanes::ROWS,
        // a multiple of both row tiles (2, 3 or 4 rows for the rest)
        (_, r) => lanes::ROWS * tile_rows(wide, r) / gcd(lanes::ROWS, tile_rows(wide, r)),
    };
    let per_panel = if n <= SHORT_BATCH {
        tr
    } else {
        let long = if cols > KB { LONG_PANEL_ROWS } else { 0 };
        let bytes = if wide { PANEL_BYTES_WIDE } else { PANEL_BYTES };
        (bytes / (4 * cols)).max(long).max(tr) / tr * tr
    }
    .min(rows);
    // packed panels (AVX-512 long batches, rows of whole chunks): the tiles of a panel, the
    // last one padded, then one tile's dequantized rows; a block of tokens (at most 8), or
    // all of them, packed here or by the caller (`pre`) (short batches' panels are one tile:
    // packing their tokens would not repay)
    let pack = wide
        && !ab_pack_off()
        && groups == 0
        && n > SHORT_BATCH
        && packed::handles(cols)
        && (cols <= KB || rows >= PACK_ALL_MIN_ROWS || pre.is_some());
    if pack {
        let len = (per_panel.div_ceil(tr) + 1) * tr * cols;
        with_thread_buf(&PANEL, len, KEEP_ALL, |buf| {
            // rows longer than a block: every block of tokens packed once, for every panel
            let all = cols > KB;
            let xlen = match (all, pre) {
                (true, Some(_)) => 0,
                (true, None) => n * cols,
                (false, _) => 8 * cols,
            };
            with_thread_buf(&LANES, xlen, KEEP_ALL, |xp| {
                // `pre` is only read (`fill` false): its pointer is never written through
                let (xp, packs) = match pre {
                    Some(p) if all => (p.as_ptr().cast_mut(), false),
                    _ => (xp.as_mut_ptr(), true),
                };
                let (tiles, rowbuf) = buf.split_at_mut(len - tr * cols);
                let mut p0 = 0;
                while p0 < rows {
                    let pr = per_panel.min(rows - p0);
                    super::prefetch(data.as_ptr().wrapping_add((p0 + pr) * rb), pr * rb);
                    let mut r0 = 0;
                    while r0 < pr {
                        let k = tr.min(pr - r0);
                        let wb = &mut rowbuf[..k * cols];
                        let bytes = &data[(p0 + r0) * rb..(p0 + r0 + k) * rb];
                        if !super::route::avx2_dequant_rows(dtype, bytes, cols, wb) {
                            for (o, b) in wb.chunks_exact_mut(cols).zip(bytes.chunks_exact(rb)) {
                                dequant_into(dtype, b, o);
                            }
                        }
                        // the last tile repeats its last row
                        let src: [*const f32; 8] =
                            std::array::from_fn(|i| wb.as_ptr().add(i.min(k - 1) * cols));
                        packed::pack(&src[..tr], cols, 16, tiles.as_mut_ptr().add(r0 * cols));
                        r0 += tr;
                    }
                    let job = Job {
                        w: &tiles[..pr.div_ceil(tr) * tr * cols],
                        pr,
                        cols,
                        x,
                        n,
                        t_start: 0,
                        out,
                        row0: p0,
                    };
                    panel_avx512(job, Some((xp, all, packs && p0 == 0)));
                    p0 += pr;
                }
            });
        });
        return;
    }
    // the panel on a 64-byte line: no store splits a line
    with_thread_buf(&PANEL, per_panel * cols, KEEP_ALL, |buf| {
        let lanes_len = if groups > 0 {
            groups * lanes::group_len(cols)
        } else {
            0
        };
        with_thread_buf(&LANES, lanes_len, KEEP_ALL, |xt| {
            if groups > 0 {
                lanes::transpose_tokens(x, groups, cols, xt);
            }
            let mut p0 = 0;
            while p0 < rows {
                let pr = per_panel.min(rows - p0);
                let wb = &mut buf[..pr * cols];
                let bytes = &data[p0 * rb..(p0 + pr) * rb];
                // the next panel's weights, while this one computes (a hint; may point past
                // the end, never faults): small panels stream from L3 or memory like decode's
                super::prefetch(data.as_ptr().wrapping_add((p0 + pr) * rb), pr * rb);
                if !super::route::avx2_dequant_rows(dtype, bytes, cols, wb) {
                    for (o, b) in wb.chunks_exact_mut(cols).zip(bytes.chunks_exact(rb)) {
                        dequant_into(dtype, b, o);
                    }
                }
                if groups > 0 {
                    lanes::panel(wb, pr, cols, xt, groups, out, p0);
                }
                if rest > 0 {
                    let job = Job {
                        w: wb,
                        pr,
                        cols,
                        x,
                        n,
                        t_start: n - rest,
                        out,
                        row0: p0,
                    };
                    if wide {
                        panel_avx512(job, None);
                    } else {
                        panel_avx2(job, None);
                    }
                }
                p0 += pr;
            }
        });
    });
}

/// `LOIP_PACK=off` (read once): the row-major tiles where the packed ones would run, for
/// A/B runs of the packed panels (bit-identical either way).
fn ab_pack_off() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OFF.get_or_init(|| std::env::var("LOIP_PACK").as_deref() == Ok("off"))
}

/// Greatest common divisor.
fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values in [-2, 2) from a fixed linear congruential sequence.
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
            })
            .collect()
    }

    /// Tokens at every f32 offset from a 64-byte line: the same bits as the scalar dots, for
    /// long batches of rows with a tail, of one block of columns and of more, row-major and
    /// packed.
    #[test]
    fn tokens_at_every_alignment_give_the_scalar_bits() {
        for wide in [false, true] {
            if !crate::simd::supported(if wide {
                crate::simd::Level::Avx512
            } else {
                crate::simd::Level::Avx2
            }) {
                continue;
            }
            // rows with a tail (row-major panels), of whole chunks (packed with 512-bit
            // slots) in one block, and in three, the last one short (packed from
            // `PACK_ALL_MIN_ROWS` rows on, row-major below)
            for (cols, n, nr) in [
                (100, 11, 7),
                (640, 20, 7),
                (1041, 13, 7),
                (2176, 15, 7),
                (2176, 15, PACK_ALL_MIN_ROWS + 1),
            ] {
                let w = values(nr * cols, 1);
                let data: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
                let xs = values(n * cols + 16, 2);
                for off in 0..16 {
                    let x = &xs[off..off + n * cols];
                    let mut want = vec![0f32; nr * n];
                    for (r, o) in want.chunks_exact_mut(n).enumerate() {
                        let row = &data[r * cols * 4..(r + 1) * cols * 4];
                        crate::dequant::row_dots_scalar(DType::F32, row, cols, x, o);
                    }
                    let mut got = vec![f32::NAN; nr * n];
                    // SAFETY: the level is supported; lengths as documented
                    unsafe {
                        let out = Out::row_major(&mut got, n);
                        rows(wide, DType::F32, &data, cols, x, n, nr, out, None);
                    }
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "{nr}x{cols} n={n} off={off} wide={wide}"
                    );
                    // the tokens packed beforehand, two blocks per call, for any row count
                    let len = shared_pack_len(wide, cols, n);
                    if len > 0 {
                        let mut pre = vec![f32::NAN; len];
                        let chunk = 2 * packed_block_len(n, cols);
                        for (i, o) in pre.chunks_mut(chunk).enumerate() {
                            pack_tokens(x, n, cols, 2 * i, o);
                        }
                        got.fill(f32::NAN);
                        // SAFETY: as above; `pre` as `shared_pack_len` says
                        unsafe {
                            let out = Out::row_major(&mut got, n);
                            rows(wide, DType::F32, &data, cols, x, n, nr, out, Some(&pre));
                        }
                        assert_eq!(bits(&got), bits(&want), "{nr}x{cols} n={n} off={off} pre");
                    }
                }
            }
        }
    }
}
