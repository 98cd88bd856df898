//! A worker's slice store: the slice files it was given, checked by checksum, kept across
//! restarts so a restarted worker is not sent its weights again.
//!
//! Layout: `DIR/*.slice` (files named as in the model's manifest), `DIR/manifest.json` (the
//! last model loaded, for people), `DIR/.verified.json` (file → size, mtime, CRC-32 of the
//! files verified so far). At start-up every slice is verified, reusing the cached CRC of a
//! file whose size and mtime did not change, so restarts are fast; a file that fails to read
//! is left out of the inventory. A slice being received is written to `NAME.part`, its CRC
//! checked against the manifest entry, synced, then renamed into place, so a crash never
//! leaves a half-written slice under its real name.
//!
//! File names come from the peer: only `[A-Za-z0-9._-]` names ending in `.slice`, not
//! starting with a dot, are accepted, so nothing is written outside `DIR`.
//!
//! A quota bounds what a coordinator may make the store hold: by default what the store
//! holds plus the free space of its file system less 5 % of that file system (the disk is
//! never filled), or a fixed figure (`loip worker --store-quota`); a slice beyond it is
//! refused before any byte is written.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use loip_model::slice::{DropBehind, Manifest, SliceEntry, MANIFEST};
use loip_plan::units::format_bytes;
use serde::{Deserialize, Serialize};

use crate::wire::StoredSlice;
use crate::RuntimeError;

const CACHE: &str = ".verified.json";
/// Largest slice a worker accepts, bytes.
pub const MAX_SLICE_BYTES: u64 = 64 << 30;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Held {
    size: u64,
    mtime_ns: u64,
    crc32: String,
}

/// The slice files of one worker.
#[derive(Debug)]
pub struct Store {
    dir: PathBuf,
    held: BTreeMap<String, Held>,
    /// most bytes of slices it may hold
    quota: u64,
}

/// The default quota of a store holding `held` bytes on a file system of `size` bytes with
/// `avail` free: what it holds plus the free space, less 5 % of the file system.  // bytes
pub fn default_quota(held: u64, size: u64, avail: u64) -> u64 {
    held + avail.saturating_sub(size / 20)
}

/// (size, free space) of the file system holding `dir`, bytes.
fn fs_space(dir: &Path) -> Option<(u64, u64)> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs writes into the zeroed struct we own; the path is NUL-terminated.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    let frag = st.f_frsize as u64;
    Some((st.f_blocks as u64 * frag, st.f_bavail as u64 * frag))
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> RuntimeError + '_ {
    move |source| RuntimeError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn mtime_ns(m: &fs::Metadata) -> u64 {
    m.modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos() as u64)
}

/// `msg` without what it says of the store's files beyond their names: a checksum error's
/// two CRCs and a size error's two sizes (a reply to a peer says what is wrong, not what the
/// file holds).
pub fn without_file_details(msg: &str) -> String {
    let mut out = msg.to_string();
    if let Some(i) = out.find(" (manifest ") {
        if let Some(j) = out[i..].find(')') {
            out.replace_range(i..i + j + 1, "");
        }
    }
    if let Some(i) = out.find("slice is ") {
        let rest = &out[i..];
        let end = rest
            .find(", manifest says ")
            .map(|k| k + ", manifest says ".len())
            .map(|k| {
                k + rest[k..]
                    .find(|c: char| !c.is_ascii_digit())
                    .unwrap_or(rest.len() - k)
            });
        if let Some(e) = end {
            out.replace_range(i..i + e, "slice's size differs from the manifest");
        }
    }
    out
}

/// Whether a peer-given file name is acceptable in the store.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && !name.starts_with('.')
        && name.ends_with(".slice")
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
}

/// Received bytes written back and dropped from the page cache at a time: at most two of
/// these are charged to the worker while a slice arrives (within `memory::IO_ALLOWANCE`).
const RECEIVE_WINDOW: u64 = 2 << 20;

fn file_crc(path: &Path) -> Result<u32, RuntimeError> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(io(path))?;
    let mut h = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(io(path))?;
        if n == 0 {
            // checking the store leaves nothing in the page cache charged to this process
            crate::slice_file::drop_cached(&f);
            return Ok(h.finalize());
        }
        h.update(&buf[..n]);
    }
}

impl Store {
    /// Opens (creating) the store in `dir` and verifies what it holds, with the default
    /// quota (see the module docs).
    pub fn open(dir: &Path) -> Result<Store, RuntimeError> {
        Store::open_with_quota(dir, None)
    }

    /// [`Store::open`] with a quota of `quota` bytes of slices (`None`: the default).
    pub fn open_with_quota(dir: &Path, quota: Option<u64>) -> Result<Store, RuntimeError> {
        fs::create_dir_all(dir).map_err(io(dir))?;
        let cached: BTreeMap<String, Held> = fs::read(dir.join(CACHE))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        let mut held = BTreeMap::new();
        for e in fs::read_dir(dir).map_err(io(dir))? {
            let e = e.map_err(io(dir))?;
            let name = e.file_name().to_string_lossy().into_owned();
            let path = e.path();
            if name.ends_with(".part") {
                let _ = fs::remove_file(&path);
                continue;
            }
            if !valid_name(&name) {
                continue;
            }
            // regular files only: a link planted in the store is never followed
            if !e.file_type().is_ok_and(|t| t.is_file()) {
                tracing::warn!("store: leaving out {name}: not a regular file");
                continue;
            }
            let Ok(meta) = e.metadata() else { continue };
            let (size, mtime) = (meta.len(), mtime_ns(&meta));
            let h = match cached.get(&name) {
                Some(c) if c.size == size && c.mtime_ns == mtime => c.clone(),
                _ => match file_crc(&path) {
                    Ok(crc) => Held {
                        size,
                        mtime_ns: mtime,
                        crc32: format!("{crc:08x}"),
                    },
                    Err(err) => {
                        tracing::warn!("store: leaving out {name}: {err}");
                        continue;
                    }
                },
            };
            held.insert(name, h);
        }
        let total: u64 = held.values().map(|h| h.size).sum();
        let quota = quota.unwrap_or_else(|| match fs_space(dir) {
            Some((size, avail)) => default_quota(total, size, avail),
            None => u64::MAX,
        });
        let s = Store {
            dir: dir.to_path_buf(),
            held,
            quota,
        };
        s.save_cache()?;
        Ok(s)
    }

    fn save_cache(&self) -> Result<(), RuntimeError> {
        let tmp = self.dir.join(format!("{CACHE}.tmp"));
        let text = serde_json::to_vec_pretty(&self.held)
            .map_err(|e| RuntimeError::Invalid(e.to_string()))?;
        fs::write(&tmp, text).map_err(io(&tmp))?;
        fs::rename(&tmp, self.dir.join(CACHE)).map_err(io(&tmp))
    }

    /// The store directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Verified slices held.
    pub fn inventory(&self) -> Vec<StoredSlice> {
        self.held
            .iter()
            .map(|(f, h)| StoredSlice {
                file: f.clone(),
                size: h.size,
                crc32: h.crc32.clone(),
            })
            .collect()
    }

    /// The most bytes of slices the store may hold.
    pub fn quota(&self) -> u64 {
        self.quota
    }

    /// Bytes of slices held.
    pub fn held_bytes(&self) -> u64 {
        self.held.values().map(|h| h.size).sum()
    }

    /// Whether the store holds exactly this slice.
    pub fn has(&self, e: &SliceEntry) -> bool {
        self.held
            .get(&e.file)
            .is_some_and(|h| h.size == e.size && h.crc32 == e.crc32)
    }

    /// Starts receiving `entry`'s file.
    pub fn begin(&self, entry: &SliceEntry) -> Result<SliceWriter, RuntimeError> {
        if !valid_name(&entry.file) {
            return Err(RuntimeError::Invalid(format!(
                "refusing slice file name {:?}",
                entry.file
            )));
        }
        if entry.size > MAX_SLICE_BYTES {
            return Err(RuntimeError::Invalid(format!(
                "slice {} of {} bytes is over the limit",
                entry.file, entry.size
            )));
        }
        // a slice replacing one of the same name frees that one's bytes
        let replaced = self.held.get(&entry.file).map_or(0, |h| h.size);
        let after = (self.held_bytes() - replaced).saturating_add(entry.size);
        if after > self.quota {
            return Err(RuntimeError::Invalid(format!(
                "the store's quota of {} would be exceeded ({} held, the slice needs {}): \
                 raise `loip worker --store-quota` or free space on its disk",
                format_bytes(self.quota),
                format_bytes(self.held_bytes()),
                format_bytes(entry.size)
            )));
        }
        let tmp = self.dir.join(format!("{}.part", entry.file));
        let file = File::create(&tmp).map_err(io(&tmp))?;
        Ok(SliceWriter {
            entry: entry.clone(),
            tmp,
            file: Some(DropBehind::with_window(file, RECEIVE_WINDOW)),
            crc: crc32fast::Hasher::new(),
            written: 0,
            done: false,
        })
    }

    /// Records a finished slice (from [`SliceWriter::finish`]).
    fn record(&mut self, file: &str, h: Held) -> Result<(), RuntimeError> {
        self.held.insert(file.to_string(), h);
        self.save_cache()
    }

    /// Writes the model's manifest beside the slices (informational), without where the
    /// coordinator keeps the model (its path is the coordinator's business, not the
    /// device's: only the file name is kept).
    pub fn save_manifest(&self, m: &Manifest) -> Result<(), RuntimeError> {
        let path = self.dir.join(MANIFEST);
        let mut m = m.clone();
        m.source.path = Path::new(&m.source.path)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let text =
            serde_json::to_vec_pretty(&m).map_err(|e| RuntimeError::Invalid(e.to_string()))?;
        let tmp = self.dir.join("manifest.json.tmp");
        fs::write(&tmp, text).map_err(io(&tmp))?;
        fs::rename(&tmp, &path).map_err(io(&path))
    }
}

/// A slice being received.
#[derive(Debug)]
pub struct SliceWriter {
    entry: SliceEntry,
    tmp: PathBuf,
    /// written back and dropped from the page cache as it goes, so receiving a model does
    /// not grow what the kernel charges this process
    file: Option<DropBehind>,
    crc: crc32fast::Hasher,
    written: u64,
    done: bool,
}

impl SliceWriter {
    /// Bytes still expected.
    pub fn remaining(&self) -> u64 {
        self.entry.size - self.written
    }

    /// Appends a chunk; more bytes than announced is an error.
    pub fn write(&mut self, bytes: &[u8]) -> Result<(), RuntimeError> {
        if bytes.len() as u64 > self.remaining() {
            return Err(RuntimeError::Invalid(format!(
                "more bytes than the {} announced for {}",
                self.entry.size, self.entry.file
            )));
        }
        let Some(f) = self.file.as_mut() else {
            return Err(RuntimeError::Invalid(
                "the slice is already finished".into(),
            ));
        };
        f.write_all(bytes).map_err(io(&self.tmp))?;
        self.crc.update(bytes);
        self.written += bytes.len() as u64;
        Ok(())
    }

    /// Checks the CRC, syncs, renames into place and records the slice in `store`.
    pub fn finish(mut self, store: &mut Store) -> Result<(), RuntimeError> {
        let (entry, tmp) = (self.entry.clone(), self.tmp.clone());
        if self.written != entry.size {
            return Err(RuntimeError::Invalid(format!(
                "{}: {} of {} bytes received",
                entry.file, self.written, entry.size
            )));
        }
        let got = format!("{:08x}", self.crc.clone().finalize());
        if got != entry.crc32 {
            return Err(RuntimeError::Model(loip_model::ModelError::Checksum {
                path: tmp,
                expected: entry.crc32,
                actual: got,
            }));
        }
        if let Some(f) = self.file.take() {
            f.finish().map_err(io(&tmp))?;
        }
        let path = store.dir.join(&entry.file);
        fs::rename(&tmp, &path).map_err(io(&path))?;
        self.done = true;
        let meta = fs::metadata(&path).map_err(io(&path))?;
        store.record(
            &entry.file,
            Held {
                size: meta.len(),
                mtime_ns: mtime_ns(&meta),
                crc32: got,
            },
        )
    }
}

impl Drop for SliceWriter {
    fn drop(&mut self) {
        // An abandoned or refused transfer leaves no partial file.
        if !self.done {
            let _ = fs::remove_file(&self.tmp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_saved_manifest_keeps_the_models_file_name_not_its_path() {
        let dir = std::env::temp_dir().join(format!("loip-store-manifest-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let s = Store::open(&dir).unwrap();
        let fixture = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/tiny-llama"
        );
        let ckpt = loip_model::Checkpoint::open(Path::new(fixture)).unwrap();
        let slices = dir.join("split");
        let progress = loip_model::slice::SplitProgress {
            on_bytes: &|_, _| {},
        };
        loip_model::slice::split(&ckpt, &slices, progress).unwrap();
        let mut m = Manifest::load(&slices).unwrap();
        m.source.path = "/home/someone/models/secret/tiny.gguf".into();
        s.save_manifest(&m).unwrap();
        let text = fs::read_to_string(dir.join(MANIFEST)).unwrap();
        assert!(!text.contains("/home/someone"), "{text}");
        assert!(text.contains("\"tiny.gguf\""), "the file name stays");
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn replies_say_what_is_wrong_without_sizes_or_checksums() {
        let crc = "layer-001-attn.slice: checksum mismatch (manifest 0badc0de, file 12345678): \
                   the slice is corrupt; re-run `loip split`";
        assert_eq!(
            without_file_details(crc),
            "layer-001-attn.slice: checksum mismatch: the slice is corrupt; re-run `loip split`"
        );
        let size = "x.slice: truncated: slice is 4053 bytes, manifest says 8192";
        assert_eq!(
            without_file_details(size),
            "x.slice: truncated: slice's size differs from the manifest"
        );
        assert_eq!(without_file_details("no device"), "no device");
    }

    #[test]
    fn names_are_confined_to_the_store() {
        assert!(valid_name("layer-003-attn.slice"));
        for bad in [
            "../x.slice",
            "a/b.slice",
            ".hidden.slice",
            "x.txt",
            "",
            "a b.slice",
        ] {
            assert!(!valid_name(bad), "{bad}");
        }
    }

    fn entry(file: &str, bytes: &[u8]) -> SliceEntry {
        SliceEntry {
            kind: loip_model::slice::SliceKind::Embed,
            file: file.into(),
            size: bytes.len() as u64,
            crc32: format!("{:08x}", crc32fast::hash(bytes)),
            tensors: Vec::new(),
        }
    }

    fn receive(s: &mut Store, file: &str, bytes: &[u8]) -> Result<(), RuntimeError> {
        let mut w = s.begin(&entry(file, bytes))?;
        w.write(bytes)?;
        w.finish(s)
    }

    #[test]
    fn slices_beyond_the_quota_are_refused_before_a_byte_is_written() {
        let dir = std::env::temp_dir().join(format!("loip-store-quota-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let mut s = Store::open_with_quota(&dir, Some(1000)).unwrap();
        receive(&mut s, "a.slice", &[1u8; 600]).unwrap();
        let e = receive(&mut s, "b.slice", &[2u8; 600])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("quota of") && e.contains("would be exceeded"),
            "{e}"
        );
        assert!(!dir.join("b.slice.part").exists() && !dir.join("b.slice").exists());
        // replacing a slice counts only the difference
        receive(&mut s, "a.slice", &[3u8; 900]).unwrap();
        assert_eq!(s.held_bytes(), 900);
        // reopened, the default quota is what it holds plus the disk's free space
        drop(s);
        let s = Store::open(&dir).unwrap();
        assert!(s.quota() >= 900, "{}", s.quota());
        assert_eq!(default_quota(100, 1000, 500), 550);
        assert_eq!(default_quota(100, 1000, 20), 100);
        let _ = fs::remove_dir_all(&dir);
    }
}
