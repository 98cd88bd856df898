//! Page-aligned heap buffers for `O_DIRECT` reads and resident blocks.

use std::alloc::{alloc_zeroed, dealloc, Layout};

use crate::RuntimeError;

/// An owned, zero-initialised, aligned byte buffer.
pub struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
    layout: Layout,
}

// SAFETY: the buffer is plain owned memory, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Allocates `len` bytes (at least one page) aligned to `align` (a power of two).
    pub fn new(len: usize, align: usize) -> Result<AlignedBuf, RuntimeError> {
        let size = len.max(1).div_ceil(align) * align;
        let layout = Layout::from_size_align(size, align)
            .map_err(|e| RuntimeError::Invalid(format!("buffer of {len} bytes: {e}")))?;
        // SAFETY: layout has non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(RuntimeError::OutOfMemory {
                what: "aligned buffer".into(),
                bytes: size as u64,
            });
        }
        Ok(AlignedBuf { ptr, len, layout })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for len initialised bytes for the life of self.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// Raw pointer for a loader thread (see the loader's protocol).
    pub(crate) fn as_ptr_mut(&self) -> *mut u8 {
        self.ptr
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr, self.layout) }
    }
}
