//! Slice files: each layer's attention block and MLP block (norms go with their block), the
//! embedding and the head, each in its own file with tensor data aligned to [`SLICE_ALIGN`]
//! bytes so it can be read with `O_DIRECT`, plus `manifest.json` describing every slice.
//!
//! A slice file is self-describing: page 0 (and more pages if needed) holds
//! `b"LOIPSLC1"`, a little-endian u32 JSON length and the JSON of its [`SliceEntry`] without
//! checksum; tensors follow, each at a multiple of 4096; the file is padded to a multiple of
//! 4096. The manifest repeats the entries with a CRC-32 of the whole file, so a device
//! parses the manifest once and never parses a slice again (the direct loader), while the
//! conventional loader parses the header on every load.
//!
//! Invariants: a slice is written to a temporary name and renamed into place, so a crash never
//! leaves a half-written slice under its real name; the manifest is written last. A split
//! stays within a small, fixed memory: the checkpoint is read with positioned reads into one
//! [`SPLIT_CHUNK`] buffer ([`TensorReader`], never through its mapping), and the written
//! slices' pages are written back and dropped from the page cache behind the writer.

use std::fs::{self, File};
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::checkpoint::{Checkpoint, TensorReader};
use crate::config::ModelConfig;
use crate::error::ModelError;
use loip_kernels::DType;

/// Alignment of slice data and file sizes, bytes.
pub const SLICE_ALIGN: u64 = 4096;
/// Magic at the start of every slice file.
pub const SLICE_MAGIC: &[u8; 8] = b"LOIPSLC1";
/// Manifest file name inside a slice directory.
pub const MANIFEST: &str = "manifest.json";
const MANIFEST_VERSION: u32 = 2;
/// Read buffer of a split, bytes: the most checkpoint data a split holds at once.
pub const SPLIT_CHUNK: usize = 4 << 20;
/// Written bytes a split lets accumulate before it writes them back and drops them from the
/// page cache, bytes.
pub const WRITE_WINDOW: u64 = 8 << 20;

/// What a slice holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(tag = "kind", content = "layer", rename_all = "lowercase")]
pub enum SliceKind {
    /// token embedding
    Embed,
    /// attention block of a layer (input norm, q/k/v/o, q/k norms)
    Attn(usize),
    /// MLP block of a layer (post-attention norm, gate/up/down)
    Mlp(usize),
    /// final norm and LM head (just the norm when tied: the device holding the head then
    /// also holds the embedding slice)
    Head,
}

impl SliceKind {
    /// File stem, e.g. `layer-003-attn`.
    pub fn id(self) -> String {
        match self {
            SliceKind::Embed => "embed".into(),
            SliceKind::Attn(l) => format!("layer-{l:03}-attn"),
            SliceKind::Mlp(l) => format!("layer-{l:03}-mlp"),
            SliceKind::Head => "head".into(),
        }
    }
}

/// One tensor inside a slice file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SliceTensor {
    /// canonical (HF) name
    pub name: String,
    /// stored type name (`BF16`, `Q4_1`, ...)
    pub dtype: String,
    /// HF order, `[rows, cols]` for matrices
    pub shape: Vec<usize>,
    /// byte offset in the slice file, a multiple of 4096
    pub offset: u64,
    /// bytes of data
    pub nbytes: u64,
}

impl SliceTensor {
    /// The stored type.
    pub fn dtype(&self) -> Result<DType, ModelError> {
        DType::from_name(&self.dtype).ok_or_else(|| ModelError::UnsupportedDtype {
            tensor: self.name.clone(),
            dtype: self.dtype.clone(),
        })
    }
}

/// One slice file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SliceEntry {
    /// what it holds
    #[serde(flatten)]
    pub kind: SliceKind,
    /// file name in the slice directory
    pub file: String,
    /// file size, bytes (a multiple of 4096)
    pub size: u64,
    /// CRC-32 (IEEE) of the whole file, hex; empty inside the file's own header
    #[serde(default)]
    pub crc32: String,
    /// tensors in file order
    pub tensors: Vec<SliceTensor>,
}

impl SliceEntry {
    /// Bytes of tensor data (without header and padding).
    pub fn data_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.nbytes).sum()
    }
}

/// The manifest of a slice directory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// format version
    pub version: u32,
    /// model hyper-parameters
    pub config: ModelConfig,
    /// q/k projection rows in GGUF's interleaved order
    pub qk_permuted: bool,
    /// where the slices came from, and its size and mtime, to detect a stale split
    pub source: SourceStamp,
    /// every slice
    pub slices: Vec<SliceEntry>,
}

/// Identity of the split's source checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceStamp {
    /// the checkpoint path
    pub path: String,
    /// total bytes of its files
    pub bytes: u64,
    /// newest mtime of its files, seconds since the epoch
    pub mtime: u64,
}

impl Manifest {
    /// Reads and validates `DIR/manifest.json`.
    pub fn load(dir: &Path) -> Result<Manifest, ModelError> {
        let path = dir.join(MANIFEST);
        let text = fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
        let m: Manifest = serde_json::from_str(&text).map_err(|e| ModelError::BadHeader {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        if m.version != MANIFEST_VERSION {
            return Err(ModelError::BadHeader {
                path,
                reason: format!("manifest version {} (this build reads {MANIFEST_VERSION}); re-run `loip split`", m.version),
            });
        }
        m.config.validate()?;
        for s in &m.slices {
            if s.file.contains('/') || s.file.contains("..") || s.size % SLICE_ALIGN != 0 {
                return Err(ModelError::BadHeader {
                    path: path.clone(),
                    reason: format!("bad slice entry {}", s.file),
                });
            }
            for t in &s.tensors {
                t.dtype()?;
                if t.offset % SLICE_ALIGN != 0
                    || t.offset
                        .checked_add(t.nbytes)
                        .is_none_or(|end| end > s.size)
                {
                    return Err(ModelError::BadHeader {
                        path: path.clone(),
                        reason: format!("tensor {} lies outside {}", t.name, s.file),
                    });
                }
            }
        }
        Ok(m)
    }

    /// The entry of a slice kind.
    pub fn slice(&self, kind: SliceKind) -> Option<&SliceEntry> {
        self.slices.iter().find(|s| s.kind == kind)
    }
}

/// A slice directory opened once: its path and its validated manifest, passed down to
/// whatever plans, ships or loads from it instead of each reading the manifest again.
#[derive(Debug, Clone)]
pub struct Slices {
    /// the directory of the slice files
    pub dir: PathBuf,
    /// its manifest
    pub manifest: Manifest,
}

impl Slices {
    /// Opens `dir` (reads and validates its manifest).
    pub fn open(dir: &Path) -> Result<Slices, ModelError> {
        Ok(Slices {
            dir: dir.to_path_buf(),
            manifest: Manifest::load(dir)?,
        })
    }
}

/// The slice a tensor of a model with config `cfg` belongs to: its block in
/// [`crate::names::layer_tensors`] (where Gemma 3's `post_attention_layernorm` is part of the
/// attention block), else [`slice_of`].
pub fn slice_of_in(cfg: &ModelConfig, name: &str) -> Option<SliceKind> {
    use crate::names::{layer_tensors, parse_layer_tensor_name, TensorGroup};
    if let Some((layer, _)) = parse_layer_tensor_name(name).filter(|&(l, _)| l < cfg.num_layers) {
        let spec = layer_tensors(cfg, layer)
            .into_iter()
            .find(|t| t.name == name);
        match spec.map(|t| t.group) {
            Some(TensorGroup::Attention(l)) => return Some(SliceKind::Attn(l)),
            Some(TensorGroup::Mlp(l)) => return Some(SliceKind::Mlp(l)),
            _ => {}
        }
    }
    slice_of(name)
}

/// The slice a canonical tensor name belongs to, by name alone (Llama's layout; see
/// [`slice_of_in`] for the config-aware answer).
pub fn slice_of(name: &str) -> Option<SliceKind> {
    use crate::names::{parse_layer_tensor_name, EMBED_TOKENS, FINAL_NORM, LM_HEAD};
    if name == EMBED_TOKENS {
        return Some(SliceKind::Embed);
    }
    if name == FINAL_NORM || name == LM_HEAD {
        return Some(SliceKind::Head);
    }
    let (layer, suffix) = parse_layer_tensor_name(name)?;
    if suffix.starts_with("input_layernorm.") || suffix.starts_with("self_attn.") {
        Some(SliceKind::Attn(layer))
    } else if suffix.starts_with("post_attention_layernorm.")
        || suffix.starts_with("pre_feedforward_layernorm.")
        || suffix.starts_with("post_feedforward_layernorm.")
        || suffix.starts_with("mlp.")
    {
        Some(SliceKind::Mlp(layer))
    } else {
        None
    }
}

/// Whether `out` holds a complete split of the checkpoint stamped `stamp`: its manifest names
/// that source and every slice file it lists has its recorded size.
pub fn is_current(out: &Path, stamp: &SourceStamp) -> bool {
    Manifest::load(out).is_ok_and(|old| {
        old.source == *stamp
            && old.slices.iter().all(|s| {
                fs::metadata(out.join(&s.file))
                    .map(|m| m.len() == s.size)
                    .unwrap_or(false)
            })
    })
}

/// The identity of a checkpoint's files: path, total bytes, newest mtime.
pub fn source_stamp(ckpt: &Checkpoint) -> Result<SourceStamp, ModelError> {
    let (mut bytes, mut mtime) = (0u64, 0u64);
    for f in &ckpt.files {
        let m = fs::metadata(f).map_err(|e| ModelError::io(f, e))?;
        bytes += m.len();
        let t = m
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_secs());
        mtime = mtime.max(t);
    }
    let path = fs::canonicalize(&ckpt.dir_or_file).unwrap_or_else(|_| ckpt.dir_or_file.clone());
    Ok(SourceStamp {
        path: path.to_string_lossy().into_owned(),
        bytes,
        mtime,
    })
}

fn align_up(x: u64) -> u64 {
    x.div_ceil(SLICE_ALIGN) * SLICE_ALIGN
}

/// Progress of a split, for a progress bar.
pub struct SplitProgress<'a> {
    /// called with (bytes done, bytes total)
    pub on_bytes: &'a dyn Fn(u64, u64),
}

/// What [`split`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SplitOutcome {
    /// slices written
    Written,
    /// an identical split was already there
    UpToDate,
}

/// Splits `ckpt` into slice files under `out`. Returns [`SplitOutcome::UpToDate`] without
/// writing when `out` already holds a verified-size split of the same source.
pub fn split(
    ckpt: &Checkpoint,
    out: &Path,
    progress: SplitProgress,
) -> Result<SplitOutcome, ModelError> {
    let stamp = source_stamp(ckpt)?;
    if is_current(out, &stamp) {
        return Ok(SplitOutcome::UpToDate);
    }
    fs::create_dir_all(out).map_err(|e| ModelError::io(out, e))?;
    let mut groups: std::collections::BTreeMap<SliceKind, Vec<&str>> = Default::default();
    for name in ckpt.tensors.keys() {
        let kind = slice_of_in(&ckpt.config, name).ok_or_else(|| ModelError::BadHeader {
            path: ckpt.dir_or_file.clone(),
            reason: format!("tensor {name} belongs to no block"),
        })?;
        groups.entry(kind).or_default().push(name);
    }
    let total: u64 = groups
        .values()
        .flatten()
        .filter_map(|n| ckpt.tensors.get(*n))
        .map(|t| t.nbytes)
        .sum();
    let mut done = 0u64;
    let mut slices = Vec::new();
    let mut reader = TensorReader::new(ckpt, SPLIT_CHUNK)?;
    for (kind, names) in groups {
        let entry = write_slice(ckpt, &mut reader, out, kind, &names, &mut |n| {
            done += n;
            (progress.on_bytes)(done, total);
        })?;
        slices.push(entry);
    }
    let manifest = Manifest {
        version: MANIFEST_VERSION,
        config: ckpt.config.clone(),
        qk_permuted: ckpt.qk_permuted,
        source: stamp,
        slices,
    };
    let text = serde_json::to_string_pretty(&manifest).map_err(|e| ModelError::BadHeader {
        path: out.join(MANIFEST),
        reason: e.to_string(),
    })?;
    write_tokenizer_files(ckpt, out)?;
    write_atomic(&out.join(MANIFEST), text.as_bytes())?;
    Ok(SplitOutcome::Written)
}

/// Puts the tokenizer and chat template beside the slices, so a slice directory is a
/// complete model for `loip generate`: HF files are copied; a GGUF's vocabulary becomes a
/// `tokenizer.json` and its template a `tokenizer_config.json`. A model without a tokenizer
/// is fine (ids only).
fn write_tokenizer_files(ckpt: &Checkpoint, out: &Path) -> Result<(), ModelError> {
    const HF_FILES: [&str; 4] = [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "chat_template.json",
    ];
    match &ckpt.gguf_metadata {
        None => {
            for f in HF_FILES {
                let src = ckpt.dir_or_file.join(f);
                if src.is_file() {
                    let dst = out.join(f);
                    fs::copy(&src, &dst).map_err(|e| ModelError::io(&dst, e))?;
                }
            }
        }
        Some(meta) => {
            let Ok(tok) = crate::tokenizer::Tokenizer::from_gguf_metadata(meta) else {
                return Ok(());
            };
            if let Ok(json) = tok.to_json() {
                write_atomic(&out.join("tokenizer.json"), json.as_bytes())?;
            }
            let name = |key: &str| meta.get_u32(key).and_then(|id| tok.id_to_token(id));
            let mut cfg = serde_json::Map::new();
            let fields = [
                (
                    "chat_template",
                    meta.get_str("tokenizer.chat_template").map(str::to_string),
                ),
                ("bos_token", name("tokenizer.ggml.bos_token_id")),
                ("eos_token", name("tokenizer.ggml.eos_token_id")),
            ];
            for (k, v) in fields {
                if let Some(v) = v {
                    cfg.insert(k.into(), v.into());
                }
            }
            let cfg = serde_json::Value::Object(cfg);
            write_atomic(
                &out.join("tokenizer_config.json"),
                cfg.to_string().as_bytes(),
            )?;
        }
    }
    Ok(())
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), ModelError> {
    let tmp = path.with_extension("tmp");
    fs::write(&tmp, bytes).map_err(|e| ModelError::io(&tmp, e))?;
    fs::rename(&tmp, path).map_err(|e| ModelError::io(path, e))
}

fn write_slice(
    ckpt: &Checkpoint,
    reader: &mut TensorReader<'_>,
    out: &Path,
    kind: SliceKind,
    names: &[&str],
    on_bytes: &mut dyn FnMut(u64),
) -> Result<SliceEntry, ModelError> {
    let file = format!("{}.slice", kind.id());
    // Lay out: header pages, then each tensor at a 4096 boundary.
    let mut tensors = Vec::new();
    for name in names {
        let info = ckpt
            .tensors
            .get(*name)
            .ok_or_else(|| ModelError::MissingTensor {
                tensor: name.to_string(),
                path: ckpt.dir_or_file.clone(),
            })?;
        tensors.push(SliceTensor {
            name: name.to_string(),
            dtype: info.dtype.name().to_string(),
            shape: info.shape.clone(),
            offset: 0,
            nbytes: info.nbytes,
        });
    }
    let header_len = |entry: &SliceEntry| {
        serde_json::to_vec(entry)
            .map(|v| v.len() as u64)
            .unwrap_or(0)
    };
    let mut entry = SliceEntry {
        kind,
        file: file.clone(),
        size: 0,
        crc32: String::new(),
        tensors,
    };
    // Offsets change the header length only by digits; iterate until stable.
    for _ in 0..4 {
        let mut pos = align_up(12 + header_len(&entry) + 64);
        for t in entry.tensors.iter_mut() {
            t.offset = pos;
            pos = align_up(pos + t.nbytes);
        }
        entry.size = pos.max(SLICE_ALIGN);
    }
    let header = serde_json::to_vec(&entry).map_err(|e| ModelError::BadHeader {
        path: out.join(&file),
        reason: e.to_string(),
    })?;
    if 12 + header.len() as u64 > entry.tensors.first().map_or(entry.size, |t| t.offset) {
        return Err(ModelError::BadHeader {
            path: out.join(&file),
            reason: "slice header does not fit".into(),
        });
    }
    let path = out.join(&file);
    let tmp = out.join(format!("{file}.tmp"));
    let f = File::create(&tmp).map_err(|e| ModelError::io(&tmp, e))?;
    let mut w = CrcWriter {
        inner: BufWriter::with_capacity(1 << 20, DropBehind::new(f)),
        crc: crc32fast::Hasher::new(),
        pos: 0,
    };
    let io = |e| ModelError::io(&tmp, e);
    w.write_all(SLICE_MAGIC).map_err(io)?;
    w.write_all(&(header.len() as u32).to_le_bytes())
        .map_err(io)?;
    w.write_all(&header).map_err(io)?;
    for t in &entry.tensors {
        w.pad_to(t.offset).map_err(io)?;
        reader.for_each_chunk(&t.name, &mut |chunk| {
            w.write_all(chunk).map_err(io)?;
            on_bytes(chunk.len() as u64);
            Ok(())
        })?;
    }
    w.pad_to(entry.size).map_err(io)?;
    let crc = w.crc.clone().finalize();
    w.inner
        .into_inner()
        .map_err(|e| ModelError::io(&tmp, e.into_error()))?
        .finish()
        .map_err(io)?;
    fs::rename(&tmp, &path).map_err(|e| ModelError::io(&path, e))?;
    entry.crc32 = format!("{crc:08x}");
    Ok(entry)
}

/// A file writer that hands every [`WRITE_WINDOW`] of written bytes to writeback at once
/// and, one window later, waits for it and drops it from the page cache, so a split leaves
/// no dirty or cached pages of its output behind (Linux `sync_file_range` + `fadvise`; both
/// only advice: a file system without them keeps its pages, as a plain write would). At
/// most two windows of the file are in the page cache at once.
#[derive(Debug)]
pub struct DropBehind {
    file: File,
    window: u64,  // bytes
    pos: u64,     // bytes written
    started: u64, // bytes handed to writeback
    dropped: u64, // bytes written back and dropped from the cache
}

impl DropBehind {
    /// Writes `file` with a [`WRITE_WINDOW`].
    pub fn new(file: File) -> Self {
        Self::with_window(file, WRITE_WINDOW)
    }

    /// Writes `file`, writing back and dropping every `window` bytes (at least 64 KiB).
    pub fn with_window(file: File, window: u64) -> Self {
        DropBehind {
            file,
            window: window.max(64 << 10),
            pos: 0,
            started: 0,
            dropped: 0,
        }
    }

    fn write_back(&mut self) {
        use std::os::fd::AsRawFd;
        let fd = self.file.as_raw_fd();
        // SAFETY: plain syscalls on an open descriptor, over ranges already written.
        unsafe {
            if self.started > self.dropped {
                let (off, len) = (
                    self.dropped as libc::off64_t,
                    (self.started - self.dropped) as libc::off64_t,
                );
                libc::sync_file_range(
                    fd,
                    off,
                    len,
                    libc::SYNC_FILE_RANGE_WAIT_BEFORE
                        | libc::SYNC_FILE_RANGE_WRITE
                        | libc::SYNC_FILE_RANGE_WAIT_AFTER,
                );
                libc::posix_fadvise(fd, off, len, libc::POSIX_FADV_DONTNEED);
                self.dropped = self.started;
            }
            let (off, len) = (
                self.started as libc::off64_t,
                (self.pos - self.started) as libc::off64_t,
            );
            libc::sync_file_range(fd, off, len, libc::SYNC_FILE_RANGE_WRITE);
        }
        self.started = self.pos;
    }

    /// Syncs the file and drops all its pages from the cache.
    pub fn finish(self) -> std::io::Result<File> {
        use std::os::fd::AsRawFd;
        self.file.sync_all()?;
        // SAFETY: plain syscall on an open descriptor.
        unsafe {
            libc::posix_fadvise(self.file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
        }
        Ok(self.file)
    }
}

impl Write for DropBehind {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.file.write(buf)?;
        self.pos += n as u64;
        if self.pos - self.started >= self.window {
            self.write_back();
        }
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

struct CrcWriter<W: Write> {
    inner: W,
    crc: crc32fast::Hasher,
    pos: u64,
}

impl<W: Write> CrcWriter<W> {
    fn pad_to(&mut self, target: u64) -> std::io::Result<()> {
        const ZEROS: [u8; 4096] = [0; 4096];
        while self.pos < target {
            let n = ((target - self.pos) as usize).min(ZEROS.len());
            self.write_all(&ZEROS[..n])?;
        }
        Ok(())
    }
}

impl<W: Write> Write for CrcWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.crc.update(&buf[..n]);
        self.pos += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// CRC-32 of a byte buffer, hex, as stored in the manifest.
pub fn crc32_hex(bytes: &[u8]) -> String {
    format!("{:08x}", crc32fast::hash(bytes))
}

/// Parses a slice file's own header from its first bytes (the conventional path).
pub fn parse_slice_header(path: &Path, bytes: &[u8]) -> Result<SliceEntry, ModelError> {
    let bad = |reason: &str| ModelError::BadHeader {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    };
    if bytes.len() < 12 || &bytes[..8] != SLICE_MAGIC {
        return Err(ModelError::BadMagic {
            path: path.to_path_buf(),
        });
    }
    let len = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize;
    let json = bytes
        .get(12..12 + len)
        .ok_or_else(|| bad("header longer than the file"))?;
    let entry: SliceEntry = serde_json::from_slice(json).map_err(|e| bad(&e.to_string()))?;
    for t in &entry.tensors {
        t.dtype()?;
        if t.offset
            .checked_add(t.nbytes)
            .is_none_or(|end| end > bytes.len() as u64)
        {
            return Err(ModelError::Truncated {
                path: path.to_path_buf(),
                what: format!("tensor {}", t.name),
            });
        }
    }
    Ok(entry)
}

/// Re-checks every slice's size and CRC against the manifest. Returns the number of slices
/// checked, or the first bad one as an error naming its file.
pub fn verify(dir: &Path, on_slice: &dyn Fn(usize, usize)) -> Result<usize, ModelError> {
    let m = Manifest::load(dir)?;
    for (i, s) in m.slices.iter().enumerate() {
        verify_slice(dir, s)?;
        on_slice(i + 1, m.slices.len());
    }
    Ok(m.slices.len())
}

/// Checks one slice file's size and CRC.
pub fn verify_slice(dir: &Path, s: &SliceEntry) -> Result<(), ModelError> {
    let path: PathBuf = dir.join(&s.file);
    let mut f = File::open(&path).map_err(|e| ModelError::io(&path, e))?;
    let len = f.metadata().map_err(|e| ModelError::io(&path, e))?.len();
    if len != s.size {
        return Err(ModelError::Truncated {
            path,
            what: format!("slice is {len} bytes, manifest says {}", s.size),
        });
    }
    let mut h = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| ModelError::io(&path, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    check_crc(&path, s, h.finalize())
}

/// Compares a computed CRC with the manifest's.
pub fn check_crc(path: &Path, s: &SliceEntry, crc: u32) -> Result<(), ModelError> {
    let got = format!("{crc:08x}");
    if got != s.crc32 {
        return Err(ModelError::Checksum {
            path: path.to_path_buf(),
            expected: s.crc32.clone(),
            actual: got,
        });
    }
    Ok(())
}
