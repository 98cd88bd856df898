//! Matrix × activations: `y = W · x` for a borrowed weight matrix in its stored dtype.
//!
//! Work is split over tasks of rows (rayon's, or inside a step the team's: `crate::team`);
//! each output element is one call of the canonical per-row dot ([`crate::canon`]), so the
//! result does not depend on the batch size, the thread count, the chunking, or the address
//! and alignment of the weight bytes.

use crate::dequant::dequant_into;
use crate::dispatch;
use crate::dtype::{KernelError, Matrix};
use crate::intdot;
use crate::simd::{self, Level};
use crate::team;
use crate::thread_buf::{with_shared_buf, with_thread_buf, SharedBuf, ThreadBuf};

/// Below this many multiply-adds (weight elements × tokens) a matmul runs on the calling
/// thread (task overhead would dominate).
const PAR_MIN_ELEMS: usize = 1 << 16;
/// Below this many multiply-adds a batched matmul on the per-row kernels is split into one
/// task per thread; above, into four per thread (for balance when a thread is also busy
/// elsewhere). One token takes guided tasks instead ([`one_token_tasks`]).
const FEW_TASKS_ELEMS: usize = 1 << 21;
/// Largest scratch (f32 elements, 4 MiB) a thread keeps between calls.
const SCRATCH_KEEP: usize = 1 << 20;
thread_local! {
    /// Batched calls' `rows × n` outputs in the kernels' layout (f32), reused.
    static SCRATCH: ThreadBuf = const { ThreadBuf::new(Vec::new()) };
}

/// Task boundaries are multiples of this many rows (the kernels' row tile).
const TASK_ROW_ALIGN: usize = 4;
/// One-token tasks' boundaries: multiples of this many rows (the AVX2 one-token kernels
/// reduce rows 8 at a time, the rest one by one).
const ONE_TOKEN_ROW_ALIGN: usize = 8;
/// Least weights of a one-token task but the last of a matrix (about 2 µs of a Q5_0 row
/// kernel on one Zen 5 core): each task pays a claim and a kernel call's setup.
const ONE_TOKEN_MIN_ELEMS: usize = 1 << 15;

/// Checks the shapes of a matmul and returns the number of tokens `n`.
fn check(w: &Matrix, x: &[f32], y: &[f32]) -> Result<usize, KernelError> {
    w.validate()?;
    if w.cols == 0 {
        if !x.is_empty() {
            return Err(KernelError::NotMultiple {
                what: "x",
                len: x.len(),
                cols: 0,
            });
        }
        return Ok(0);
    }
    if x.len() % w.cols != 0 {
        return Err(KernelError::NotMultiple {
            what: "x",
            len: x.len(),
            cols: w.cols,
        });
    }
    let n = x.len() / w.cols;
    let expected = n.saturating_mul(w.rows);
    if y.len() != expected {
        return Err(KernelError::Length {
            what: "y",
            expected,
            got: y.len(),
        });
    }
    Ok(n)
}

/// `y[t * w.rows + r] = dot(row r of w, x[t * w.cols .. (t + 1) * w.cols])` for each token
/// `t < n`, `n = x.len() / w.cols`.
///
/// `x`: `n × w.cols` f32 (row-major); `y`: `n × w.rows` f32. The tiled kernels of a batch read
/// `x` fastest from a 64-byte line (a [`crate::LineVec`]): at another address every 512-bit
/// token load spans two lines.
/// Weights are dequantized in registers (exactly) and accumulated in f32 in the canonical
/// order, bit-identical for any `n`, thread count, SIMD path and weight address.
///
/// # Errors
/// [`KernelError`] if `w` is inconsistent, `x.len()` is not a multiple of `w.cols`, or
/// `y.len() != n * w.rows`. (With `w.cols == 0`, `x` must be empty and `y` is left as is.)
pub fn matmul(w: &Matrix, x: &[f32], y: &mut [f32]) -> Result<(), KernelError> {
    matmul_at(simd::current(), w, x, y)
}

/// [`matmul`] on an explicit SIMD level (tests compare levels).
pub(crate) fn matmul_at(
    level: Level,
    w: &Matrix,
    x: &[f32],
    y: &mut [f32],
) -> Result<(), KernelError> {
    let n = check(w, x, y)?;
    if n == 0 || w.rows == 0 {
        return Ok(());
    }
    let (rows, cols, dtype) = (w.rows, w.cols, w.dtype);
    let rb = dtype.row_bytes(cols)?;
    // the integer-dot types quantize the activations once per call
    let qx = intdot::handles(dtype).then(|| intdot::quantize(x, cols));
    let kernel = |data: &[u8], out: &mut [f32]| match &qx {
        Some(qx) => intdot::rows(level, dtype, data, qx, out),
        None => dispatch::rows(level, dtype, data, cols, x, n, out),
    };
    let threads = rayon::current_num_threads();
    // multiply-adds of the call: a batch splits as a matrix n times larger
    let elems = rows.saturating_mul(cols).saturating_mul(n);
    let tasks = match elems {
        _ if threads <= 1 || rows < 2 * TASK_ROW_ALIGN => 1,
        e if e < PAR_MIN_ELEMS => 1,
        e if e < FEW_TASKS_ELEMS => threads,
        _ => 4 * threads,
    };
    let task_rows = rows.div_ceil(tasks).next_multiple_of(TASK_ROW_ALIGN);

    if dispatch::has_token_major(level, dtype, n) {
        // the tiled kernel writes y's layout itself; each task its own rows
        let yt = dispatch::TokenMajor::new(y, rows);
        with_shared_pack(level, cols, x, n, |pre| {
            let run = |(r0, r1): (usize, usize)| {
                let data = &w.data[r0 * rb..r1 * rb];
                dispatch::rows_token_major(level, dtype, data, cols, x, n, yt, r0, pre)
            };
            if tasks == 1 {
                run((0, rows));
            } else {
                let align = batch_row_align(n);
                let ranges = if tasks < 4 * threads {
                    batch_ranges(rows, tasks, align)
                } else {
                    guided_ranges(rows, 2 * threads, align, align)
                };
                team::par_for(ranges.len(), |i| run(ranges[i]));
            }
        });
        return Ok(());
    }

    let run = |out: &mut [f32]| {
        if tasks == 1 {
            kernel(w.data, out);
        } else {
            team::par_chunks_mut(out, task_rows * n, |i, o| {
                let r0 = i * task_rows;
                let r1 = r0 + o.len() / n;
                kernel(&w.data[r0 * rb..r1 * rb], o);
            });
        }
    };
    if n == 1 {
        // the kernels' layout out[r * n + t] is y's
        if tasks == 1 {
            kernel(w.data, y);
        } else {
            let tasks = one_token_tasks(w, y, rb, threads);
            team::par_drain(tasks, || (), |_, (w, rb, r0, o)| {
                kernel(&w.data[r0 * rb..(r0 + o.len()) * rb], o)
            });
        }
    } else {
        with_thread_buf(&SCRATCH, rows * n, SCRATCH_KEEP, |out| {
            run(out);
            for (r, o) in out.chunks_exact(n).enumerate() {
                for (t, &v) in o.iter().enumerate() {
                    y[t * rows + r] = v;
                }
            }
        });
    }
    Ok(())
}

/// [`matmul`] of several matrices with the same activations `x` (the q, k and v projections;
/// the MLP's gate and up): `ys[i] = ws[i] · x`. For one token the rows of all matrices are
/// split over the pool in one go, so the threads meet once instead of once per matrix. Every
/// output element is the same canonical dot as in [`matmul`]: the results are those of
/// separate calls, bit for bit.
///
/// # Errors
/// [`KernelError`] as [`matmul`], for any of the pairs; or a length mismatch of `ws` and `ys`.
pub fn matmul_many(ws: &[&Matrix], x: &[f32], ys: &mut [&mut [f32]]) -> Result<(), KernelError> {
    matmul_many_at(simd::current(), ws, x, ys)
}

/// [`matmul_many`] on an explicit SIMD level.
pub(crate) fn matmul_many_at(
    level: Level,
    ws: &[&Matrix],
    x: &[f32],
    ys: &mut [&mut [f32]],
) -> Result<(), KernelError> {
    if ws.len() != ys.len() {
        return Err(KernelError::Length {
            what: "ys",
            expected: ws.len(),
            got: ys.len(),
        });
    }
    let mut ns = Vec::with_capacity(ws.len());
    for (w, y) in ws.iter().zip(ys.iter()) {
        ns.push(check(w, x, y)?);
    }
    let single = ns.iter().all(|&n| n == 1);
    let threads = rayon::current_num_threads();
    let total: usize = ws
        .iter()
        .zip(&ns)
        .map(|(w, &n)| w.rows.saturating_mul(w.cols).saturating_mul(n))
        .sum();
    if !single && threads > 1 && total >= PAR_MIN_ELEMS && tiled_batch(level, ws, &ns) {
        return matmul_many_tiled(level, ws, x, ys, ns[0], threads);
    }
    if !single || threads <= 1 || total < PAR_MIN_ELEMS {
        for (w, y) in ws.iter().zip(ys.iter_mut()) {
            matmul_at(level, w, x, y)?;
        }
        return Ok(());
    }
    // one token: each matrix in guided tasks, all of them biggest first
    let mut tasks = Vec::new();
    for (w, y) in ws.iter().zip(ys.iter_mut()) {
        if w.rows == 0 || w.cols == 0 {
            continue;
        }
        let rb = w.dtype.row_bytes(w.cols)?;
        tasks.extend(one_token_tasks(w, y, rb, threads));
    }
    tasks.sort_by_key(|t| std::cmp::Reverse(t.3.len().saturating_mul(t.0.cols)));
    // the integer-dot types' activations, quantized once (every matrix has the same cols)
    let qx = ws
        .iter()
        .find(|w| intdot::handles(w.dtype) && w.rows > 0 && w.cols > 0)
        .map(|w| intdot::quantize(&x[..w.cols], w.cols));
    team::par_drain(
        tasks,
        || (),
        |_, (w, rb, r0, o)| {
            let data = &w.data[r0 * rb..(r0 + o.len()) * rb];
            match &qx {
                Some(qx) if intdot::handles(w.dtype) => intdot::rows(level, w.dtype, data, qx, o),
                _ => dispatch::rows(level, w.dtype, data, w.cols, &x[..w.cols], 1, o),
            }
        },
    );
    Ok(())
}

/// A one-token matmul's tasks `(w, row bytes, first row, its outputs)`: [`guided_ranges`] of
/// `w`'s rows (big tasks first, shrinking to [`ONE_TOKEN_MIN_ELEMS`] weights), so that the
/// threads finish a matrix together: with equal tasks (four a thread), the thread that
/// claimed the last one left the other waiting for about half a task at each matmul's end
/// (0.3–0.5 ms of a Qwen2.5 decode step at 2 threads, session 26).
fn one_token_tasks<'a, 'm>(
    w: &'m Matrix<'a>,
    y: &'m mut [f32],
    rb: usize,
    threads: usize,
) -> Vec<(&'m Matrix<'a>, usize, usize, &'m mut [f32])> {
    let min = ONE_TOKEN_MIN_ELEMS
        .div_ceil(w.cols.max(1))
        .next_multiple_of(ONE_TOKEN_ROW_ALIGN);
    let ranges = guided_ranges(y.len(), 2 * threads, ONE_TOKEN_ROW_ALIGN, min);
    let mut tasks = Vec::with_capacity(ranges.len());
    let mut rest = y;
    for (r0, r1) in ranges {
        let (o, tail) = std::mem::take(&mut rest).split_at_mut(r1 - r0);
        tasks.push((w, rb, r0, o));
        rest = tail;
    }
    tasks
}

/// Whether every matrix of a batched [`matmul_many`] (the same `n > 1` tokens each) takes the
/// token-major tiled kernel, so that one parallel region can run them all.
fn tiled_batch(level: Level, ws: &[&Matrix], ns: &[usize]) -> bool {
    let n = ns.first().copied().unwrap_or(0);
    n > 1
        && ns.iter().all(|&m| m == n)
        && ws
            .iter()
            .all(|w| w.rows > 0 && w.cols > 0 && dispatch::has_token_major(level, w.dtype, n))
}

/// Task boundaries of batched tiled calls of at most [`SHORT_ROW_ALIGN_TOKENS`] tokens: a
/// multiple of every row tile of the short-batch and panel kernels (2, 3, 4, 6 and 8 rows), so
/// that no task ends in a partial tile.
const BATCH_ROW_ALIGN: usize = 24;
/// Longer batches run only the panel kernels, whose row tiles (2 or 3 rows; AVX2's token-lane
/// tiles 6, or 12 where they mix with 4-row tiles) divide this: finer task boundaries, so that
/// a split into a multiple of the thread count has tasks of about equal size.
const LONG_BATCH_ROW_ALIGN: usize = 12;
/// Most tokens of a batch that [`BATCH_ROW_ALIGN`] applies to (the short-batch tiles' most).
const SHORT_ROW_ALIGN_TOKENS: usize = 8;

/// Task boundaries (a multiple of this many rows) of a batched tiled matmul of `n` tokens.
fn batch_row_align(n: usize) -> usize {
    if n > SHORT_ROW_ALIGN_TOKENS {
        LONG_BATCH_ROW_ALIGN
    } else {
        BATCH_ROW_ALIGN
    }
}

/// Row ranges `(r0, r1)` of `rows` rows split into `parts` tasks as equal as boundaries at
/// multiples of `align` allow (empty ranges dropped). With `parts` a multiple of the thread
/// count, the threads claim about the same work: tasks of a fixed size (the last shorter)
/// left one thread a task more than the other (a layer's prefill matmuls ran at 1.79-1.87x
/// on two threads, `prefill_bench --scaling`).
fn batch_ranges(rows: usize, parts: usize, align: usize) -> Vec<(usize, usize)> {
    let (parts, align) = (parts.max(1), align.max(1));
    let bound = |i: usize| {
        if i >= parts {
            return rows;
        }
        // the multiple of `align` nearest to i · rows / parts
        let b = (i * rows / parts + align / 2) / align * align;
        b.min(rows)
    };
    (0..parts)
        .map(|i| (bound(i), bound(i + 1)))
        .filter(|(a, b)| a < b)
        .collect()
}

/// Guided split of `rows` rows: each task `1 / div` of the rows left, rounded up to a multiple
/// of `align`, at least `min` rows (the last: what is left), so the tasks shrink toward the end
/// and a thread slowed by anything (the other process, a page fault, the leader's own work)
/// leaves the other idle for a short task, not a full share. Claimed in order by
/// `team::par_for`: the big tasks first.
fn guided_ranges(rows: usize, div: usize, align: usize, min: usize) -> Vec<(usize, usize)> {
    let (div, align) = (div.max(1), align.max(1));
    let min = min.max(align);
    let mut out = Vec::new();
    let mut r0 = 0;
    while r0 < rows {
        let left = rows - r0;
        let len = left
            .div_ceil(div)
            .next_multiple_of(align)
            .max(min)
            .min(left);
        out.push((r0, r0 + len));
        r0 += len;
    }
    out
}

/// [`matmul_many`] of `n > 1` tokens where every matrix takes the tiled kernel: the rows of
/// all matrices are split over the pool in one go (one fork and join instead of one per
/// matrix), each matrix in [`guided_ranges`], all tasks biggest first. Each output element is
/// the same canonical dot as in [`matmul`].
fn matmul_many_tiled(
    level: Level,
    ws: &[&Matrix],
    x: &[f32],
    ys: &mut [&mut [f32]],
    n: usize,
    threads: usize,
) -> Result<(), KernelError> {
    let mut tasks = Vec::new();
    for (w, y) in ws.iter().zip(ys.iter_mut()) {
        let rb = w.dtype.row_bytes(w.cols)?;
        let yt = dispatch::TokenMajor::new(y, w.rows);
        let align = batch_row_align(n);
        for (r0, r1) in guided_ranges(w.rows, 2 * threads, align, align) {
            tasks.push((*w, rb, yt, r0, r1));
        }
    }
    // biggest first (the order `team::par_for` claims them): the last tasks are the short ones
    tasks.sort_by_key(|t| std::cmp::Reverse((t.4 - t.3).saturating_mul(t.0.cols)));
    // every matrix has the same cols (`check`)
    let cols = ws.first().map_or(0, |w| w.cols);
    with_shared_pack(level, cols, &x[..n * cols], n, |pre| {
        team::par_for(tasks.len(), |i| {
            let (w, rb, yt, r0, r1) = tasks[i];
            let data = &w.data[r0 * rb..r1 * rb];
            let x = &x[..n * w.cols];
            dispatch::rows_token_major(level, w.dtype, data, w.cols, x, n, yt, r0, pre)
        })
    });
    Ok(())
}

/// The tokens of the tiled matmuls that pack all their tokens (AVX-512, rows longer than a
/// block, see `x86::gemm::shared_pack_len`), packed once per call for all its tasks, reused
/// across calls (one buffer in the process: `n × cols` f32 of the longest rows so packed).
static SHARED_PACK: SharedBuf = SharedBuf::new(Vec::new());

/// `f(pre)`: `pre` the tokens `x` (`n × cols`) packed for the tiled kernel at `level` (in
/// [`SHARED_PACK`], blocks of tokens split over the threads), where it packs all of them;
/// else `None`.
fn with_shared_pack<R>(
    level: Level,
    cols: usize,
    x: &[f32],
    n: usize,
    f: impl FnOnce(Option<&[f32]>) -> R,
) -> R {
    #[cfg(any(target_arch = "x86_64", target_arch = "x86"))]
    {
        use crate::x86::gemm;
        let len = gemm::shared_pack_len(simd::usable(level) == Level::Avx512, cols, n);
        if len > 0 {
            return with_shared_buf(&SHARED_PACK, len, |buf| {
                // whole blocks per task, two tasks a thread
                let block = gemm::packed_block_len(n, cols);
                let threads = rayon::current_num_threads().max(1);
                let chunk = len.div_ceil(block).div_ceil(2 * threads) * block;
                team::par_chunks_mut(buf, chunk, |i, o| {
                    gemm::pack_tokens(x, n, cols, i * chunk / block, o)
                });
                f(Some(buf))
            });
        }
    }
    let _ = (level, cols, x, n);
    f(None)
}

/// Plain scalar reference of [`matmul`]: dequantize each element, multiply, and accumulate
/// sequentially in f32 (`acc += w * x`, no fma). Same contract and errors as [`matmul`];
/// results differ from [`matmul`] only by summation order.
pub fn matmul_ref(w: &Matrix, x: &[f32], y: &mut [f32]) -> Result<(), KernelError> {
    let n = check(w, x, y)?;
    if n == 0 {
        return Ok(());
    }
    let (rows, cols) = (w.rows, w.cols);
    let rb = w.dtype.row_bytes(cols)?;
    let mut row = vec![0f32; cols]; // one dequantized row
    for r in 0..rows {
        dequant_into(w.dtype, &w.data[r * rb..(r + 1) * rb], &mut row);
        for t in 0..n {
            let xt = &x[t * cols..(t + 1) * cols];
            let mut acc = 0f32;
            for (a, b) in row.iter().zip(xt) {
                acc += a * b;
            }
            y[t * rows + r] = acc;
        }
    }
    Ok(())
}

/// Dequantizes row `r` of `w` into `out` (`out.len() == w.cols`), exactly as ggml / Hugging
/// Face do: `Q8_0` `q·d`; `Q4_0` `(q − 8)·d`; `Q4_1` `q·d + m` (low nibbles are elements
/// 0..16 of a block, high nibbles 16..32); `Q4_K` `(d·sc)·q − dmin·m` with ggml's 6-bit
/// scales; `Q6_K` `(d·sc)·(q − 32)`; `Q5_0`, `Q5_1`, `Q2_K`, `Q3_K`, `Q5_K`, `IQ4_NL`, `IQ4_XS`
/// as ggml's `dequantize_row_*`; f16/bf16 widened exactly.
///
/// # Errors
/// [`KernelError`] if `w` is inconsistent, `r >= w.rows` or `out.len() != w.cols`.
pub fn dequant_row(w: &Matrix, r: usize, out: &mut [f32]) -> Result<(), KernelError> {
    w.validate()?;
    if r >= w.rows {
        return Err(KernelError::RowOutOfRange {
            row: r,
            rows: w.rows,
        });
    }
    if out.len() != w.cols {
        return Err(KernelError::Length {
            what: "out",
            expected: w.cols,
            got: out.len(),
        });
    }
    let rb = w.dtype.row_bytes(w.cols)?;
    dequant_into(w.dtype, &w.data[r * rb..(r + 1) * rb], out);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_ranges_cover_rows_in_aligned_even_parts() {
        for rows in [1, 5, 12, 13, 24, 128, 256, 640, 1024, 2048, 4864] {
            for parts in [1, 2, 3, 4, 6, 8, 12, 16] {
                for align in [1, 12, 24] {
                    let r = batch_ranges(rows, parts, align);
                    // consecutive, non-empty, from 0 to rows
                    assert_eq!(r.first().map(|p| p.0), Some(0), "{rows} {parts} {align}");
                    assert_eq!(r.last().map(|p| p.1), Some(rows), "{rows} {parts} {align}");
                    assert!(r.windows(2).all(|w| w[0].1 == w[1].0));
                    assert!(r.iter().all(|&(a, b)| a < b && a % align == 0));
                    assert!(r.len() <= parts);
                    // as even as the alignment allows: within one align of rows / parts
                    let ideal = rows as f64 / parts as f64;
                    for &(a, b) in &r {
                        assert!(
                            ((b - a) as f64 - ideal).abs() <= align as f64 + 1.0 || b - a < align,
                            "{rows} {parts} {align}: {r:?}"
                        );
                    }
                }
            }
        }
        // Gemma 3's 640-row projections at 8 tasks (4 per thread of 2): tasks of 72 to 84 rows
        let r = batch_ranges(640, 8, LONG_BATCH_ROW_ALIGN);
        assert_eq!(r.len(), 8);
        assert!(
            r.iter().all(|&(a, b)| (72..=84).contains(&(b - a))),
            "{r:?}"
        );
        assert_eq!(batch_row_align(8), BATCH_ROW_ALIGN);
        assert_eq!(batch_row_align(9), LONG_BATCH_ROW_ALIGN);
    }

    #[test]
    fn one_token_tasks_cover_the_outputs_biggest_first() {
        use crate::dtype::DType;
        // Qwen2.5's shapes at 2 threads: q / o (896 x 896), k (128), gate (4864), down (896 x
        // 4864), and a head of 151936 rows (fewer columns: the data is not read)
        for (rows, cols) in [(896, 896), (128, 896), (4864, 896), (896, 4864), (13, 64)] {
            let rb = DType::Q8_0.row_bytes(cols).expect("blocks");
            let data = vec![0u8; rows * rb];
            let w = Matrix::new(DType::Q8_0, rows, cols, &data).expect("shape");
            let mut y = vec![0f32; rows];
            let tasks = one_token_tasks(&w, &mut y, rb, 2);
            let mut next = 0;
            for (i, (tw, trb, r0, o)) in tasks.iter().enumerate() {
                assert!(std::ptr::eq(*tw, &w) && *trb == rb && *r0 == next, "{rows}x{cols}");
                assert_eq!(r0 % ONE_TOKEN_ROW_ALIGN, 0);
                if i + 1 < tasks.len() {
                    assert!(o.len() * cols >= ONE_TOKEN_MIN_ELEMS, "{rows}x{cols} task {i}");
                }
                next += o.len();
            }
            assert_eq!(next, rows);
        }
    }

    #[test]
    fn guided_ranges_cover_rows_in_aligned_shrinking_parts() {
        for rows in [1, 5, 12, 13, 24, 128, 256, 640, 1024, 2048, 4864] {
            for div in [1, 2, 4, 8] {
                for align in [1, 12, 24] {
                    for min in [0, align, 2 * align] {
                        let r = guided_ranges(rows, div, align, min);
                        let at = format!("{rows} {div} {align} {min}: {r:?}");
                        assert_eq!(r.first().map(|p| p.0), Some(0), "{at}");
                        assert_eq!(r.last().map(|p| p.1), Some(rows), "{at}");
                        assert!(r.windows(2).all(|w| w[0].1 == w[1].0), "{at}");
                        assert!(r.iter().all(|&(a, b)| a < b && a % align == 0), "{at}");
                        // never longer than the one before; all but the last at least `min`
                        assert!(
                            r.windows(2).all(|w| w[1].1 - w[1].0 <= w[0].1 - w[0].0),
                            "{at}"
                        );
                        let body = &r[..r.len() - 1];
                        assert!(body.iter().all(|&(a, b)| b - a >= min.max(align)), "{at}");
                    }
                }
            }
        }
        // Gemma 3's 640-row projections on 2 threads: 168 rows first, 12-row tasks at the end
        let r = guided_ranges(640, 4, LONG_BATCH_ROW_ALIGN, LONG_BATCH_ROW_ALIGN);
        assert_eq!(r.first(), Some(&(0, 168)));
        assert_eq!(r.last().map(|p| p.1 - p.0), Some(4));
    }
}
