//! Packed panels: the long batches' tiles over rows of whole 64-element chunks read their
//! rows and tokens from copies laid out in the order a pass reads them.
//!
//! A tile's pass `s` reads, per 64-element chunk `c`, elements `64 c + W s .. 64 c + W (s +
//! 1)` (`W` = the slot's lanes) of each of its `R` rows and `T` tokens: in the rows' natural
//! order those are `R + T` streams of one `W`-lane piece every 256 bytes. Packed, a tile's
//! rows are one stream, `[slot][chunk][row][lane]`, and a block of `T` tokens another,
//! `[slot][chunk][token][lane]` ([`pack`]): each pass reads two contiguous runs, with two
//! pointers (the row-major tiles kept nine, and reloaded bounds from the stack).
//!
//! Invariant: the packing moves values only; each slot register sees the same fmas, on the
//! same values, in the same order as in the row-major tiles of [`super`], so every output is
//! bit-identical to theirs.

use super::tile::{Out, Slot};
use super::{finish, Slots, KB};
use std::mem::MaybeUninit;

/// Whether the packed tiles take rows of `cols` columns: whole 64-element chunks (no partial
/// slot, no tail), as every row of Gemma 3's and Qwen2.5's matrices.
pub(super) fn handles(cols: usize) -> bool {
    cols > 0 && cols % 64 == 0
}

/// `out[((s * C + c) * k + i) * w + l]` = `src[i][64 c + w s + l]` for the `k` rows `src`
/// of `cols` f32 (`C = cols / 64` chunks, `64 / w` slots of `w` lanes, `w` 8 or 16): `k *
/// cols` f32. Each row is read in order (a stream the prefetchers follow).
///
/// # Safety
/// Each `src[i]` is valid for `cols` reads, `out` for `src.len() * cols` writes, `cols` a
/// multiple of 64.
#[inline(always)]
pub(super) unsafe fn pack(src: &[*const f32], cols: usize, w: usize, out: *mut f32) {
    let (k, chunks) = (src.len(), cols / 64);
    for (i, r) in src.iter().enumerate() {
        for c in 0..chunks {
            for s in 0..64 / w {
                let (from, to) = (
                    r.add(64 * c + w * s),
                    out.add(((s * chunks + c) * k + i) * w),
                );
                // constant lengths: vector moves, not calls
                if w == 16 {
                    std::ptr::copy_nonoverlapping(from, to, 16);
                } else {
                    std::ptr::copy_nonoverlapping(from, to, 8);
                }
            }
        }
    }
}

/// The block of tokens `t0 .. t0 + k` (`k` at most 8) of the rows of `cols` f32 at `x`,
/// packed into `out` ([`pack`] with `w` lanes; `k * cols` f32).
///
/// # Safety
/// `x` valid for reads of the `t0 + k` rows, `out` for `k * cols` writes, `cols` a multiple of
/// 64, `0 < k <= 8`.
#[inline(always)]
pub(super) unsafe fn pack_block(
    x: *const f32,
    cols: usize,
    (t0, k): (usize, usize),
    w: usize,
    out: *mut f32,
) {
    let src: [*const f32; 8] = std::array::from_fn(|t| x.add((t0 + t.min(k - 1)) * cols));
    pack(&src[..k], cols, w, out);
}

/// One packed tile over the chunks `c0 .. c1` of `chunks`: `st[i][t][s]` = slot `s` of rows
/// `i` of the tile `w` × tokens `t` of the block `x` (both as [`pack`] lays them out), from
/// the state of the chunks `0 .. c0` that `st` holds (nothing if `c0 == 0`).
#[inline(always)]
#[allow(clippy::needless_range_loop)] // one index runs over three arrays
unsafe fn tile<V: Slot, const S: usize, const R: usize, const T: usize>(
    w: *const f32,
    x: *const f32,
    chunks: usize,
    (c0, c1): (usize, usize),
    st: &mut Slots<V, S, R, T>,
) {
    let wd = V::WIDTH;
    for s in 0..V::SLOTS {
        let mut acc = [[V::zero(); T]; R];
        if c0 > 0 {
            for i in 0..R {
                for t in 0..T {
                    // written by the block before (c0 > 0)
                    acc[i][t] = st[i][t][s].assume_init();
                }
            }
        }
        let mut wp = w.add((s * chunks + c0) * R * wd);
        let mut xp = x.add((s * chunks + c0) * T * wd);
        for _ in c0..c1 {
            let wv: [V; R] = std::array::from_fn(|i| V::load(wp.add(i * wd)));
            let xv: [V; T] = std::array::from_fn(|t| V::load(xp.add(t * wd)));
            for i in 0..R {
                for t in 0..T {
                    acc[i][t] = V::fma(wv[i], xv[t], acc[i][t]);
                }
            }
            wp = wp.add(R * wd);
            xp = xp.add(T * wd);
        }
        for i in 0..R {
            for t in 0..T {
                st[i][t][s].write(acc[i][t]);
            }
        }
    }
}

/// The packed block `x` of tokens `t0 .. t0 + T` against every tile of the packed panel `w`
/// (`pr` rows of `cols` columns, in tiles of `R` rows, the last one padded; rows `row0 ..`
/// of `out`). Rows longer than [`KB`] run block by block over all the tiles, as in
/// [`super`].
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
    let chunks = cols / 64;
    let tiles = pr.div_ceil(R);
    let tile_at = |j: usize| w.add(j * R * cols);
    // no tail (whole chunks): `finish` reads neither rows nor tokens
    let (wn, xn) = ([std::ptr::null(); R], [std::ptr::null(); T]);
    let fin = |st: &Slots<V, S, R, T>, j: usize| {
        finish(
            st,
            (cols, cols),
            &wn,
            &xn,
            out,
            (row0 + R * j, t0),
            pr - R * j,
        )
    };
    if cols <= KB {
        let mut st: Slots<V, S, R, T> = [[[MaybeUninit::uninit(); S]; T]; R];
        for j in 0..tiles {
            tile::<V, S, R, T>(tile_at(j), x, chunks, (0, chunks), &mut st);
            fin(&st, j);
        }
        return;
    }
    states.clear();
    states.resize(tiles, [[[MaybeUninit::uninit(); S]; T]; R]);
    let mut c0 = 0;
    while c0 < chunks {
        let c1 = (c0 + KB / 64).min(chunks);
        for (j, st) in states.iter_mut().enumerate() {
            tile::<V, S, R, T>(tile_at(j), x, chunks, (c0, c1), st);
        }
        c0 = c1;
    }
    for (j, st) in states.iter().enumerate() {
        fin(st, j);
    }
}

/// The job's tokens against its packed panel (`job.w`, see [`tokens`]): blocks of `T`
/// tokens, the last block narrower. `xb` holds one packed block (at least `T * cols` f32),
/// packed here before each, or with `all`, every block of the job's tokens in order (`(n -
/// t_start) * cols` f32), packed here if `fill` (else only read: `xb` may point to memory
/// other threads read meanwhile).
///
/// # Safety
/// `xb` valid for those reads, and for those writes where it is written.
#[inline(always)]
pub(super) unsafe fn panel<V: Slot, const S: usize, const R: usize, const T: usize>(
    job: super::Job<'_>,
    xb: *mut f32,
    (all, fill): (bool, bool),
) {
    let super::Job {
        w,
        pr,
        cols,
        x,
        n,
        t_start,
        out,
        row0,
    } = job;
    debug_assert!(handles(cols));
    let w = w.as_ptr();
    // the packed block of tokens t0 .. t0 + k, packed first where asked
    let block = |t0: usize, k: usize| {
        let at = if all {
            xb.add((t0 - t_start) * cols)
        } else {
            xb
        };
        if !all || fill {
            pack_block(x.as_ptr(), cols, (t0, k), V::WIDTH, at);
        }
        at as *const f32
    };
    let mut t0 = t_start;
    let mut states = Vec::new();
    while t0 + T <= n {
        let xt = block(t0, T);
        tokens::<V, S, R, T>(w, pr, cols, xt, t0, out, row0, &mut states);
        t0 += T;
    }
    // the remaining 0 .. T - 1 tokens (T is at most 8)
    macro_rules! rest {
        ($t:literal) => {{
            let xt = block(t0, $t);
            tokens::<V, S, R, $t>(w, pr, cols, xt, t0, out, row0, &mut Vec::new())
        }};
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
