//! Resident blocks: slice files read once into page-aligned memory (CRC-checked) and kept
//! for the whole run. A plan switch keeps the blocks that stay resident ([`Resident::reload`])
//! and reads only those that become resident.

use std::collections::HashMap;
use std::path::Path;

use loip_engine::{EngineError, TensorSource};
use loip_kernels::DType;
use loip_model::slice::{check_crc, SliceEntry};

use crate::aligned::AlignedBuf;
use crate::RuntimeError;

/// Tensors of the resident slices.
#[derive(Default)]
pub struct Resident {
    bufs: Vec<AlignedBuf>,
    files: Vec<String>, // per buffer, its slice file
    views: HashMap<String, (usize, DType, Vec<usize>, usize, usize)>, // name → (buf, dtype, shape, offset, bytes)
    bytes: u64,
}

impl Resident {
    /// Reads `slices` from `dir`, checking sizes and CRCs.
    pub fn load(dir: &Path, slices: &[SliceEntry]) -> Result<Resident, RuntimeError> {
        let mut r = Resident::default();
        for s in slices {
            r.add(dir, s)?;
        }
        Ok(r)
    }

    /// The resident set of a plan switch: the slices of `slices` already held are kept as
    /// they are (read and checked when they were loaded; nothing writes them since), the
    /// others held are freed first, then the missing ones are read. So the memory held never
    /// exceeds the new set's, and a switch that only offloads blocks reads nothing. On an
    /// error the blocks read so far are dropped with the rest.
    pub fn reload(mut self, dir: &Path, slices: &[SliceEntry]) -> Result<Resident, RuntimeError> {
        let mut held: HashMap<String, AlignedBuf> = self
            .files
            .drain(..)
            .zip(self.bufs.drain(..))
            .filter(|(f, _)| slices.iter().any(|s| &s.file == f))
            .collect();
        drop(self); // the blocks that leave are freed before anything is read
        let mut r = Resident::default();
        for s in slices {
            match held.remove(&s.file) {
                Some(buf) if buf.len() as u64 == s.size => r.keep(s, buf)?,
                _ => r.add(dir, s)?,
            }
        }
        Ok(r)
    }

    fn add(&mut self, dir: &Path, s: &SliceEntry) -> Result<(), RuntimeError> {
        use std::os::unix::fs::FileExt;
        let path = dir.join(&s.file);
        // O_DIRECT (slices are padded for it): reading a resident block leaves nothing in the
        // page cache to be charged to this process; a file system without it is read through
        // the cache, which is then dropped
        let (file, direct) = match crate::slice_file::open_slice(&path, s, true) {
            Ok(f) => (f, true),
            Err(RuntimeError::Io { source, .. }) if source.raw_os_error() == Some(libc::EINVAL) => {
                (crate::slice_file::open_slice(&path, s, false)?, false)
            }
            Err(e) => return Err(e),
        };
        let mut buf = AlignedBuf::new(s.size as usize, 4096)?;
        file.read_exact_at(buf.as_mut_slice(), 0)
            .map_err(|e| RuntimeError::Io {
                path: path.clone(),
                source: e,
            })?;
        if !direct {
            crate::slice_file::drop_cached(&file);
        }
        check_crc(&path, s, crc32fast::hash(buf.as_slice()))?;
        self.keep(s, buf)
    }

    /// Holds `buf`, the checked bytes of slice `s`.
    fn keep(&mut self, s: &SliceEntry, buf: AlignedBuf) -> Result<(), RuntimeError> {
        let idx = self.bufs.len();
        for t in &s.tensors {
            self.views.insert(
                t.name.clone(),
                (
                    idx,
                    t.dtype()?,
                    t.shape.clone(),
                    t.offset as usize,
                    t.nbytes as usize,
                ),
            );
        }
        self.bytes += s.size;
        self.bufs.push(buf);
        self.files.push(s.file.clone());
        Ok(())
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Its buffers (the probe evicts them from the caches before each timed run).
    pub(crate) fn buffers(&self) -> impl Iterator<Item = &[u8]> + '_ {
        self.bufs.iter().map(|b| b.as_slice())
    }
}

impl TensorSource for Resident {
    fn tensor(&self, name: &str) -> Result<(DType, Vec<usize>, &[u8]), EngineError> {
        let (b, d, shape, off, n) = self
            .views
            .get(name)
            .ok_or_else(|| EngineError::Invalid(format!("tensor {name} is not resident here")))?;
        let bytes = self
            .bufs
            .get(*b)
            .and_then(|buf| buf.as_slice().get(*off..off.checked_add(*n)?))
            .ok_or_else(|| EngineError::Invalid(format!("tensor {name} lies outside its slice")))?;
        Ok((*d, shape.clone(), bytes))
    }
}
