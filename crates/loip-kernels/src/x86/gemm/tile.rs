//! What the tiles of `gemm.rs`, `short.rs` and `lanes.rs` share: the register [`Slot`] of
//! the canonical dot state, a tile's slot [`State`], the output view [`Out`], and the longest
//! batch that the short tiles take ([`SHORT_BATCH`]). Below all three, so that none imports
//! another back.

#[cfg(target_arch = "x86")]
use std::arch::x86::*;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use std::mem::MaybeUninit;

/// Longest batch whose panels are one tile of rows.
pub(super) const SHORT_BATCH: usize = 8;

/// A vector register holding one slot of the canonical dot state.
pub(super) trait Slot: Copy {
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

/// `impl Slot` for a register type: lanes, the three intrinsics, and its reduction.
macro_rules! slot {
    ($v:ty, $width:expr, $zero:ident, $load:ident, $fma:ident, |$s:ident| $reduce:expr) => {
        impl Slot for $v {
            const WIDTH: usize = $width;
            const SLOTS: usize = 64 / $width;
            #[inline(always)]
            unsafe fn zero() -> Self {
                $zero()
            }
            #[inline(always)]
            unsafe fn load(p: *const f32) -> Self {
                $load(p)
            }
            #[inline(always)]
            unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
                $fma(a, b, c)
            }
            #[inline(always)]
            unsafe fn reduce($s: &[Self; 8]) -> f32 {
                $reduce
            }
        }
    };
}
// slot 2a + h is half h of accumulator a: the layout of the AVX2 reduction
slot!(
    __m256,
    8,
    _mm256_setzero_ps,
    _mm256_loadu_ps,
    _mm256_fmadd_ps,
    |s| crate::x86::avx2::reduce(s)
);
// slot a is accumulator a: the layout of the AVX-512 reduction
slot!(
    __m512,
    16,
    _mm512_setzero_ps,
    _mm512_loadu_ps,
    _mm512_fmadd_ps,
    |s| crate::x86::avx512::reduce(&[s[0], s[1], s[2], s[3]])
);

/// Slot states of a tile, `[row][token][slot]`; slots `SLOTS ..` are never written or read
/// (left uninitialized: zeroing the whole array was a `memset` per tile, 9 % of a prefill).
pub(super) type State<V, const R: usize, const T: usize> = [[[MaybeUninit<V>; 8]; T]; R];

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
    pub(super) fn put(&self, r: usize, t: usize, v: f32) {
        let i = r * self.rs + t * self.ts;
        assert!(i < self.len, "gemm output index");
        // SAFETY: in bounds (checked); the constructors give exclusive access to these rows
        unsafe { *self.ptr.add(i) = v };
    }
}
