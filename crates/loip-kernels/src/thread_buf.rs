//! Per-thread buffers the kernels reuse across calls: no allocation and no zero-fill per
//! call. Each is a `thread_local!` [`ThreadBuf`], taken for the call and put back after it;
//! a call nested on the same thread finds it taken and uses a fresh one.

use std::cell::Cell;
use std::sync::{Mutex, PoisonError};
use std::thread::LocalKey;

/// A thread's reusable buffer of f32. Declare one with
/// `thread_local! { static B: ThreadBuf = const { ThreadBuf::new(Vec::new()) }; }`.
pub(crate) type ThreadBuf = Cell<Vec<f32>>;

/// Keep every buffer, whatever its size (one a call needs again and again at the same size,
/// e.g. a panel of dequantized rows).
#[cfg_attr(
    not(any(target_arch = "x86_64", target_arch = "x86")),
    allow(dead_code)
)]
pub(crate) const KEEP_ALL: usize = usize::MAX;

/// `f(buf)`, `buf` this thread's buffer `key` cut to `len` elements starting on a 64-byte
/// line (no 64-byte load of it spans two lines). Its values are whatever an earlier call
/// left, zeros where it grew: `f` writes before it reads. The buffer is kept for the next
/// call unless its capacity exceeds `keep` elements.
pub(crate) fn with_thread_buf<R>(
    key: &'static LocalKey<ThreadBuf>,
    len: usize,
    keep: usize,
    f: impl FnOnce(&mut [f32]) -> R,
) -> R {
    let mut buf = key.with(Cell::take);
    let r = f(on_a_line(&mut buf, len));
    if buf.capacity() <= keep {
        key.with(|c| c.set(buf));
    }
    r
}

/// `len` elements of `buf` starting on a 64-byte line, `buf` replaced by a zeroed one where
/// it is too short (15 more elements than `len` for the start on a line).
fn on_a_line(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    let need = len.saturating_add(15);
    if buf.len() < need {
        *buf = vec![0f32; need];
    }
    let off = buf.as_ptr().align_offset(64).min(15);
    &mut buf[off..off + len]
}

/// A buffer of f32 the threads of a call share, kept for the next call (one per process,
/// whichever thread calls): `static B: SharedBuf = SharedBuf::new(Vec::new());`.
pub(crate) type SharedBuf = Mutex<Vec<f32>>;

/// [`with_thread_buf`] on a [`SharedBuf`] (kept whatever its size): `f(buf)`, `buf` `len`
/// elements on a 64-byte line, whatever an earlier call left in them. Calls at the same time
/// (other threads) get fresh buffers; the largest one is kept.
#[cfg_attr(
    not(any(target_arch = "x86_64", target_arch = "x86")),
    allow(dead_code)
)]
pub(crate) fn with_shared_buf<R>(
    key: &'static SharedBuf,
    len: usize,
    f: impl FnOnce(&mut [f32]) -> R,
) -> R {
    let lock = || key.lock().unwrap_or_else(PoisonError::into_inner);
    let mut buf = std::mem::take(&mut *lock());
    let r = f(on_a_line(&mut buf, len));
    let mut kept = lock();
    if kept.len() < buf.len() {
        *kept = buf;
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    thread_local! {
        static T: ThreadBuf = const { ThreadBuf::new(Vec::new()) };
    }

    #[test]
    fn buffers_start_on_a_line_are_reused_and_nest() {
        let first = with_thread_buf(&T, 100, KEEP_ALL, |b| {
            assert_eq!(b.len(), 100);
            assert_eq!(b.as_ptr() as usize % 64, 0);
            b.fill(1.0);
            // a nested call gets its own buffer
            with_thread_buf(&T, 10, KEEP_ALL, |c| {
                assert_eq!(c.len(), 10);
                assert_ne!(c.as_ptr(), b.as_ptr());
            });
            b.as_ptr() as usize
        });
        // the outer buffer is the one kept
        let again = with_thread_buf(&T, 50, KEEP_ALL, |b| {
            assert!(b.iter().all(|&v| v == 1.0));
            b.as_ptr() as usize
        });
        assert_eq!(first, again);
        // one past the cap is dropped after the call
        with_thread_buf(&T, 200, 100, |b| assert_eq!(b.len(), 200));
        with_thread_buf(&T, 0, KEEP_ALL, |b| assert!(b.is_empty()));
        assert_eq!(T.with(Cell::take).capacity(), 15);
    }

    #[test]
    fn shared_buffers_start_on_a_line_and_are_reused() {
        static S: SharedBuf = SharedBuf::new(Vec::new());
        let first = with_shared_buf(&S, 100, |b| {
            assert_eq!((b.len(), b.as_ptr() as usize % 64), (100, 0));
            b.fill(2.0);
            // a call meanwhile gets its own buffer
            with_shared_buf(&S, 10, |c| assert_ne!(c.as_ptr(), b.as_ptr()));
            b.as_ptr() as usize
        });
        let again = with_shared_buf(&S, 60, |b| {
            assert!(b.iter().all(|&v| v == 2.0));
            b.as_ptr() as usize
        });
        assert_eq!(first, again);
    }
}
