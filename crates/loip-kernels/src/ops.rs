//! The public kernel entry points, gathered in one place.
//!
//! - [`matmul`] / [`matmul_many`] / [`matmul_ref`] / [`dequant_row`]: weights in their stored
//!   dtype.
//! - [`LineVec`]: f32 activations on 64-byte lines, what the batched matmuls read fastest.
//! - [`rmsnorm`], [`silu_mul`], [`gelu_tanh_mul`], [`rope_half`]: element-wise f32 kernels.
//! - [`attention`] / [`attention_ref`]: one query token over a KV cache;
//!   [`attention_causal`] / [`attention_sliding`]: the tokens of a prompt chunk, each over
//!   its causal prefix or its sliding window.
//! - [`simd_level`] / [`set_force_scalar`] / [`set_per_row_batches`] / [`set_lane_tiles`]:
//!   which SIMD path runs.
//! - [`try_par_chunks_mut`]: a parallel loop over chunks that uses the step's team.
//! - [`on_pool`] / [`set_team_off`] / [`set_pin_off`]: run a whole step on the thread pool
//!   with a team of its threads (one hand-off and one wake-up, not one per matmul), pinned one
//!   per core where the pool has a thread per core.
//!
//! Every optimized kernel follows the canonical order of operations of `canon` (see the crate
//! docs), so results are bit-identical across SIMD paths, batch sizes, thread counts and
//! weight addresses. The `_ref` functions are plain, independent scalar code for tests.

pub use crate::attention::{attention, attention_causal, attention_ref, attention_sliding};
pub use crate::elementwise::{gelu_tanh_mul, rmsnorm, rope_half, silu_mul};
pub use crate::lines::LineVec;
pub use crate::matmul::{dequant_row, matmul, matmul_many, matmul_ref};
pub use crate::simd::{
    set_force_scalar, set_lane_tiles, set_per_row_batches, set_short_tiles_off, simd_level,
};

/// Runs `f` on a thread of the current rayon pool: the caller's own thread when it already is
/// one, else one hand-off to the pool for all of `f`.
///
/// Every [`matmul`] splits its rows over the pool. Called from a thread outside the pool, each
/// call hands its work over and waits to be woken (tens of microseconds, hundreds of times per
/// token on a small model); inside `on_pool` the calling worker takes a share itself and the
/// hand-offs disappear. Results do not change: each output element is the same canonical dot.
///
/// With two threads or more, `f` also runs with a team of the pool's threads
/// (`crate::team`): they spin (then park) between the parallel regions of `f` instead of
/// sleeping after each, so the step pays one wake-up instead of one per matmul, and they
/// leave when `f` returns. `LOIP_TEAM=0` or [`set_team_off`] turns the team off.
pub fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    crate::team::lead(f)
}

/// `f(i, chunk i)` for the chunks of `chunk` elements of `data` (the last may be shorter), in
/// parallel: on the step's team inside [`on_pool`] (where a rayon parallel iterator would
/// find the other threads busy in the team and run alone), else on rayon. The first error
/// `f` returns (by chunk order) is returned once every chunk ran.
pub fn try_par_chunks_mut<T: Send, E: Send>(
    data: &mut [T],
    chunk: usize,
    f: impl Fn(usize, &mut [T]) -> Result<(), E> + Sync,
) -> Result<(), E> {
    let errs = std::sync::Mutex::new(Vec::new());
    crate::team::par_chunks_mut(data, chunk, |i, s| {
        if let Err(e) = f(i, s) {
            errs.lock().unwrap_or_else(|p| p.into_inner()).push((i, e));
        }
    });
    let mut errs = errs.into_inner().unwrap_or_else(|p| p.into_inner());
    errs.sort_by_key(|(i, _)| *i);
    match errs.into_iter().next() {
        Some((_, e)) => Err(e),
        None => Ok(()),
    }
}

/// Makes [`on_pool`] run steps with plain rayon fork-join instead of a team of spinning
/// threads (`false` restores the team, unless the environment variable `LOIP_TEAM=0` turns it
/// off for the whole process). Results are bit-identical either way; only speed changes.
/// Meant for benchmarks that compare the two side by side.
pub fn set_team_off(off: bool) {
    crate::team::set_off(off);
}

/// Makes the threads of later steps stay where the scheduler puts them instead of pinning
/// themselves one per core (`false` restores pinning, unless the environment variable
/// `LOIP_PIN=0` turns it off for the whole process; threads already pinned stay pinned).
/// Pinning applies only where the pool has exactly one thread per core the process may use;
/// results are bit-identical either way. Meant for benchmarks that compare the two.
pub fn set_pin_off(off: bool) {
    crate::affinity::set_off(off);
}
