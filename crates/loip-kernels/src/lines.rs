//! f32 buffers that start on a 64-byte cache line: the activations a caller hands to the
//! batched [`crate::matmul`] / [`crate::matmul_many`] (a prompt's normed hidden rows, the
//! attention output, the gated MLP activations), so that no 512-bit token load of the tiles
//! spans two lines. Every row of 640, 896, 1024, 2048 or 4864 f32 is a whole number of lines,
//! so every token's row of such a buffer starts on one too. (A `Vec<f32>` of a prompt's size
//! comes from `mmap` and starts 16 bytes into a line.)

use std::fmt;
use std::ops::{Deref, DerefMut};

/// f32 per 64-byte line.
const LINE_F32: usize = 16;

/// One cache line of f32: the unit of [`LineVec`]'s storage, whose alignment it gives.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([f32; LINE_F32]);

/// A `Vec<f32>` whose first element starts on a 64-byte line; derefs to `[f32]`.
#[derive(Clone, Default)]
pub struct LineVec {
    lines: Vec<Line>, // (len.div_ceil(16),) lines; the tail of the last one unused
    len: usize,       // f32 elements
}

impl LineVec {
    /// `len` zeros.
    pub fn zeroed(len: usize) -> LineVec {
        LineVec {
            lines: vec![Line([0.0; LINE_F32]); len.div_ceil(LINE_F32)],
            len,
        }
    }

    /// A copy of `x`.
    pub fn from_slice(x: &[f32]) -> LineVec {
        let mut v = LineVec::zeroed(x.len());
        v.copy_from_slice(x);
        v
    }

    /// The values as a plain `Vec<f32>` (a copy).
    pub fn to_vec(&self) -> Vec<f32> {
        self.deref().to_vec()
    }
}

impl Deref for LineVec {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        // SAFETY: `lines` holds `lines.len() * 16 >= len` contiguous initialised f32 (`Line`
        // is `repr(C)` over `[f32; 16]`, 64 bytes, no padding), borrowed for `&self`'s life.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<f32>(), self.len) }
    }
}

impl DerefMut for LineVec {
    fn deref_mut(&mut self) -> &mut [f32] {
        // SAFETY: as in `deref`, and `&mut self` gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<f32>(), self.len) }
    }
}

impl fmt::Debug for LineVec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl PartialEq for LineVec {
    fn eq(&self, other: &LineVec) -> bool {
        **self == **other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_vecs_start_on_a_line_and_hold_their_values() {
        for len in [0, 1, 15, 16, 17, 896, 896 * 3 + 5] {
            let src: Vec<f32> = (0..len).map(|i| i as f32 * 0.5 - 3.0).collect();
            let mut v = LineVec::zeroed(len);
            assert_eq!(v.len(), len);
            assert!(v.iter().all(|&x| x == 0.0));
            assert_eq!(v.as_ptr() as usize % 64, 0, "{len}");
            v.copy_from_slice(&src);
            assert_eq!(v.to_vec(), src);
            let c = LineVec::from_slice(&src);
            assert_eq!(c, v);
            assert_eq!(c.clone().as_ptr() as usize % 64, 0);
            assert_eq!(format!("{c:?}"), format!("{src:?}"));
        }
        assert!(LineVec::default().is_empty());
    }
}
