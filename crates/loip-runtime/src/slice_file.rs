//! Slice files on disk, below both the resident blocks and the slot loader: opening one
//! checked against its manifest entry (never through a link), and dropping its pages from
//! the page cache.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;

use loip_model::slice::SliceEntry;

use crate::RuntimeError;

/// Opens a slice file (never through a symbolic link; with `O_DIRECT` when `direct`) and
/// checks its size against the manifest, so a truncated or grown slice is named before
/// anything is read.
pub(crate) fn open_slice(path: &Path, s: &SliceEntry, direct: bool) -> Result<File, RuntimeError> {
    use std::os::unix::fs::OpenOptionsExt;
    let io = |e| RuntimeError::Io {
        path: path.to_path_buf(),
        source: e,
    };
    let mut opts = std::fs::OpenOptions::new();
    opts.read(true);
    // a link in the store is never followed out of it
    let flags = libc::O_NOFOLLOW | if direct { libc::O_DIRECT } else { 0 };
    opts.custom_flags(flags);
    let file = opts.open(path).map_err(io)?;
    let len = file.metadata().map_err(io)?.len();
    if len != s.size {
        return Err(RuntimeError::Model(loip_model::ModelError::Truncated {
            path: path.to_path_buf(),
            what: format!("slice is {len} bytes, manifest says {}", s.size),
        }));
    }
    Ok(file)
}

/// Asks the kernel to drop an open file's pages from the page cache (advice: a file system
/// without it keeps them).
pub fn drop_cached(f: &File) {
    // SAFETY: plain syscall on an open descriptor.
    unsafe {
        libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
    }
}

/// Drops a file's pages from the page cache, so a benchmark reads from the device.
pub fn drop_cache(path: &Path) {
    if let Ok(f) = File::open(path) {
        drop_cached(&f);
    }
}
