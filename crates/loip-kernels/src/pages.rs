//! A growable f32 buffer in its own anonymous mapping: the KV cache's rows.
//!
//! A `Vec<f32>` of a few hundred KiB lives in the C allocator's heap. Growing one moves it (a
//! new chunk, the rows copied, the old chunk freed), and the freed chunk stays resident until
//! another allocation takes it: a cache of many such buffers growing together (every layer of
//! every sequence) left as much freed memory resident as it held rows, and a later buffer's
//! unwritten capacity landed on those resident pages. A [`PageVec`] maps its own pages:
//! it grows with `mremap` (no copy, no hole left behind), the kernel charges only the pages
//! written (capacity costs address space, not memory), and dropping it unmaps them. What it
//! costs beyond its elements is the unwritten rest of its last written page: less than one
//! page per buffer (no huge pages: `MADV_NOHUGEPAGE`).

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// Bytes of a memory page on this machine (4096 where it cannot be read).
pub fn page_bytes() -> usize {
    #[cfg(unix)]
    {
        // SAFETY: sysconf has no preconditions.
        let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if p > 0 {
            return p as usize;
        }
    }
    4096
}

/// An f32 buffer in its own anonymous mapping, grown by doubling its capacity; derefs to
/// `[f32]` (its `len` elements). Resident: the pages its elements have been written to.
pub struct PageVec {
    ptr: NonNull<f32>, // cap elements mapped (dangling when cap == 0)
    len: usize,        // f32 elements written
    cap: usize,        // f32 elements mapped: a whole number of pages
}

// SAFETY: a PageVec owns its mapping as a Vec owns its buffer; no shared state.
unsafe impl Send for PageVec {}
// SAFETY: `&PageVec` only reads.
unsafe impl Sync for PageVec {}

impl PageVec {
    /// An empty buffer (no mapping).
    pub const fn new() -> PageVec {
        PageVec {
            ptr: NonNull::dangling(),
            len: 0,
            cap: 0,
        }
    }

    /// A copy of `x` (capacity: `x`'s pages).
    pub fn from_slice(x: &[f32]) -> PageVec {
        let mut v = PageVec::new();
        v.extend_from_slice(x);
        v
    }

    /// Elements held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Elements it holds without growing (a whole number of pages).
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Appends `x`, growing the mapping to at least twice its size when it is full.
    pub fn extend_from_slice(&mut self, x: &[f32]) {
        let need = self
            .len
            .checked_add(x.len())
            .expect("PageVec length overflow");
        if need > self.cap {
            self.grow(need.max(2 * self.cap));
        }
        // SAFETY: `len + x.len() <= cap` elements are mapped; `x` cannot alias our mapping
        // while `&mut self` is held.
        unsafe {
            std::ptr::copy_nonoverlapping(x.as_ptr(), self.ptr.as_ptr().add(self.len), x.len());
        }
        self.len = need;
    }

    /// Keeps the first `n` elements (the pages stay mapped for the next appends).
    pub fn truncate(&mut self, n: usize) {
        self.len = self.len.min(n);
    }

    /// Keeps no element (the pages stay mapped for the next appends).
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Maps room for at least `elems` elements, the elements kept.
    fn grow(&mut self, elems: usize) {
        let page = page_bytes();
        let bytes = elems
            .checked_mul(4)
            .and_then(|b| b.checked_next_multiple_of(page))
            .expect("PageVec capacity overflow");
        let old = self.cap * 4;
        // SAFETY: `ptr` maps `old` bytes when `old > 0` (ours alone); `bytes > old`.
        let p = unsafe { map::grow(self.ptr.as_ptr().cast(), old, bytes) };
        let Some(p) = NonNull::new(p.cast::<f32>()) else {
            let layout = std::alloc::Layout::from_size_align(bytes, page)
                .unwrap_or(std::alloc::Layout::new::<f32>());
            std::alloc::handle_alloc_error(layout);
        };
        self.ptr = p;
        self.cap = bytes / 4;
    }
}

impl Default for PageVec {
    fn default() -> PageVec {
        PageVec::new()
    }
}

impl Drop for PageVec {
    fn drop(&mut self) {
        if self.cap > 0 {
            // SAFETY: `ptr` maps `cap * 4` bytes, ours alone, not used after this.
            unsafe { map::unmap(self.ptr.as_ptr().cast(), self.cap * 4) };
        }
    }
}

impl Clone for PageVec {
    fn clone(&self) -> PageVec {
        PageVec::from_slice(self)
    }
}

impl Deref for PageVec {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        // SAFETY: the first `len <= cap` elements are mapped and written (dangling and 0 long
        // when nothing is mapped), borrowed for `&self`'s life.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for PageVec {
    fn deref_mut(&mut self) -> &mut [f32] {
        // SAFETY: as in `deref`, and `&mut self` gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl fmt::Debug for PageVec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

#[cfg(unix)]
mod map {
    /// A mapping of `new` bytes holding the first `old` bytes of `p` (unmapped), null when the
    /// system refuses.
    ///
    /// # Safety
    /// `p` maps `old` bytes (ours alone) when `old > 0`; `new > old`, a whole number of pages.
    pub(super) unsafe fn grow(p: *mut libc::c_void, old: usize, new: usize) -> *mut libc::c_void {
        #[cfg(any(target_os = "linux", target_os = "android"))]
        if old > 0 {
            let q = libc::mremap(p, old, new, libc::MREMAP_MAYMOVE);
            return if q == libc::MAP_FAILED {
                std::ptr::null_mut()
            } else {
                q
            };
        }
        let q = libc::mmap(
            std::ptr::null_mut(),
            new,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        if q == libc::MAP_FAILED {
            return std::ptr::null_mut();
        }
        // no huge pages: one row written would make 2 MiB of capacity (or of a neighbouring
        // buffer's, once the kernel merges adjacent mappings) resident; a hint, so its
        // failure changes nothing else
        #[cfg(any(target_os = "linux", target_os = "android"))]
        libc::madvise(q, new, libc::MADV_NOHUGEPAGE);
        if old > 0 {
            std::ptr::copy_nonoverlapping(p.cast::<u8>(), q.cast::<u8>(), old);
            unmap(p, old);
        }
        q
    }

    /// Unmaps `bytes` at `p`.
    ///
    /// # Safety
    /// `p` maps `bytes` bytes, ours alone, not used after this.
    pub(super) unsafe fn unmap(p: *mut libc::c_void, bytes: usize) {
        libc::munmap(p, bytes);
    }
}

#[cfg(not(unix))]
mod map {
    use std::alloc::Layout;

    fn layout(bytes: usize) -> Layout {
        Layout::from_size_align(bytes, 64).unwrap_or(Layout::new::<f32>())
    }

    /// The allocator's memory where there are no mappings.
    ///
    /// # Safety
    /// As the unix version.
    pub(super) unsafe fn grow(p: *mut u8, old: usize, new: usize) -> *mut u8 {
        if old > 0 {
            std::alloc::realloc(p, layout(old), new)
        } else {
            std::alloc::alloc(layout(new))
        }
    }

    /// # Safety
    /// As the unix version.
    pub(super) unsafe fn unmap(p: *mut u8, bytes: usize) {
        std::alloc::dealloc(p, layout(bytes));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pages of `v`'s mapping the kernel holds in memory (`mincore`).
    #[cfg(any(target_os = "linux", target_os = "android"))]
    fn resident_pages(v: &PageVec) -> usize {
        let page = page_bytes();
        let pages = v.capacity() * 4 / page;
        let mut vec = vec![0u8; pages];
        // SAFETY: `v` maps `pages` whole pages at its pointer (page-aligned: a mapping's
        // start); `vec` has one byte a page.
        let r = unsafe { libc::mincore(v.ptr.as_ptr().cast(), pages * page, vec.as_mut_ptr()) };
        assert_eq!(r, 0);
        vec.iter().filter(|&&b| b & 1 == 1).count()
    }

    #[test]
    fn appends_grow_truncate_clone_and_drop() {
        let mut v = PageVec::new();
        assert!(v.is_empty() && v.capacity() == 0);
        let page = page_bytes() / 4;
        for i in 0..3 * page + 5 {
            v.extend_from_slice(&[i as f32, -(i as f32)]);
        }
        assert_eq!(v.len(), 2 * (3 * page + 5));
        assert_eq!(v.capacity() % page, 0);
        assert!(v.capacity() >= v.len() && v.capacity() < 4 * v.len());
        assert!(v
            .chunks(2)
            .enumerate()
            .all(|(i, p)| p == [i as f32, -(i as f32)]));
        let c = v.clone();
        v.truncate(4);
        assert_eq!(&v[..], &[0.0, -0.0, 1.0, -1.0]);
        v.copy_within(2.., 0);
        assert_eq!(&v[..2], &[1.0, -1.0]);
        assert_eq!(c.len(), 2 * (3 * page + 5));
        assert_eq!(c[2 * page], page as f32);
        v.clear();
        v.extend_from_slice(&[7.0]);
        assert_eq!(&v[..], &[7.0]);
        assert_eq!(
            format!("{:?}", PageVec::from_slice(&[1.0, 2.0])),
            "[1.0, 2.0]"
        );
    }

    #[test]
    #[cfg(any(target_os = "linux", target_os = "android"))]
    fn only_written_pages_are_resident() {
        // 64 buffers grown one row at a time to 100 rows of 768 bytes (KV rows of 3 heads of
        // 64): each doubled past its 100 rows, yet only the pages of its rows are resident
        let page = page_bytes();
        let row = [1.0f32; 192];
        let mut bufs: Vec<PageVec> = (0..64).map(|_| PageVec::new()).collect();
        for _ in 0..100 {
            for b in &mut bufs {
                b.extend_from_slice(&row);
            }
        }
        let written = (100 * 768usize).div_ceil(page);
        for b in &bufs {
            assert!(b.capacity() * 4 / page > written);
            assert_eq!(resident_pages(b), written);
        }
        // truncated rows stay resident (the next appends reuse them); a clone is its rows
        bufs[0].truncate(10 * 192);
        assert_eq!(resident_pages(&bufs[0]), written);
        let c = bufs[0].clone();
        assert_eq!(resident_pages(&c), (10 * 768usize).div_ceil(page));
    }
}
