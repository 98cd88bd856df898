//! An opened checkpoint: config + a map of every tensor (canonical HF name → file, offset,
//! dtype, shape) over memory-mapped files.
//!
//! [`Checkpoint::open`] reads an HF directory (`config.json` + `model.safetensors`, or shards
//! listed by `model.safetensors.index.json`) or a `llama` `.gguf` file. Before it returns, the
//! config is validated (bounded, and its counts fit the files' size before any name or buffer
//! is sized from them) and every tensor the config implies is present with the right shape
//! and a supported dtype, so the engine's later [`Checkpoint::matrix`] calls fail only on a
//! programming error. Tensor bytes are borrowed from the mappings; nothing is copied.
//! [`TensorReader`] reads them instead with positioned reads into one bounded buffer, for a
//! pass over the whole checkpoint (a split) that must stay within a memory budget.
//!
//! The files must not be truncated by someone else while mapped (that would fault on access).

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use loip_kernels::{DType, Matrix};
use memmap2::Mmap;

use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::gguf::{gguf_to_hf_name_for, GgufFile, GgufMetadata, GGUF_MAGIC};
use crate::names;
use crate::safetensors_file::{read_header, read_index};

/// Largest `config.json` / index file read, bytes.
const MAX_JSON_BYTES: u64 = 64 << 20;

/// Where one tensor's bytes are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// HF canonical name (GGUF names are mapped; unmapped safetensors names are kept)
    pub name: String,
    /// stored type
    pub dtype: DType,
    /// HF order: `[rows, cols]` for 2-D, `[len]` for 1-D
    pub shape: Vec<usize>,
    /// index into [`Checkpoint::files`]
    pub file: usize,
    /// absolute byte offset in that file
    pub offset: u64,
    /// data length, bytes (`rows × dtype.row_bytes(cols)`)
    pub nbytes: u64,
}

/// The on-disk format of a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// HF directory: `config.json` + one or more `.safetensors` files
    HfSafetensors,
    /// a single GGUF file
    Gguf,
}

/// An opened, checked checkpoint.
#[derive(Debug)]
pub struct Checkpoint {
    /// resolved hyper-parameters (validated)
    pub config: ModelConfig,
    /// file format
    pub format: Format,
    /// every tensor, by HF canonical name
    pub tensors: BTreeMap<String, TensorInfo>,
    /// `true` for GGUF `llama` checkpoints: within each head of `head_dim` rows of
    /// `q_proj`/`k_proj`, stored row `j` is HF row `(j % 2) * (head_dim / 2) + j / 2`
    /// ([`crate::gguf::gguf_qk_row_to_hf`], from llama.cpp `convert_hf_to_gguf.py`
    /// `LlamaModel.permute`, checked against it in the tests). So element `j` of each projected
    /// q/k head is HF element `(j % 2) * (d/2) + j/2`: the engine either un-permutes the
    /// projected vectors before rotate-half RoPE, or applies interleaved RoPE (pairs
    /// `(2i, 2i+1)`) directly, which gives the same attention scores since q and k are
    /// permuted alike. `false` for HF checkpoints.
    pub qk_permuted: bool,
    /// the directory (HF) or file (GGUF) that was opened
    pub dir_or_file: PathBuf,
    /// the mapped files; [`TensorInfo::file`] indexes this
    pub files: Vec<PathBuf>,
    /// GGUF metadata (tokenizer, chat template, ...); `None` for HF checkpoints
    pub gguf_metadata: Option<GgufMetadata>,
    maps: Vec<Mmap>,
}

/// Maps a whole file read-only. Empty files are refused (they cannot be mapped and hold no
/// header).
fn map_file(path: &Path) -> Result<Mmap, ModelError> {
    let file = File::open(path).map_err(|e| ModelError::io(path, e))?;
    let len = file.metadata().map_err(|e| ModelError::io(path, e))?.len();
    if len == 0 {
        return Err(ModelError::truncated(
            path,
            "the header (the file is empty)",
        ));
    }
    // SAFETY: the map is read-only and lives inside the Checkpoint that owns it; the module
    // documents that the files must not be modified while open (the usual mmap contract).
    unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))
}

fn read_small(path: &Path) -> Result<String, ModelError> {
    let len = std::fs::metadata(path)
        .map_err(|e| ModelError::io(path, e))?
        .len();
    if len > MAX_JSON_BYTES {
        return Err(ModelError::header(
            path,
            format!("{len} bytes is too large for a JSON file"),
        ));
    }
    std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))
}

impl Drop for Checkpoint {
    /// Unmaps the files, then asks the kernel to drop their pages from the page cache: what
    /// was read through the maps (a header and tokenizer read once at start, weights split
    /// into slices) is not read again by this process, and left cached it stays charged to
    /// the process's memory cgroup (`--mem` counts it). The advice drops only clean pages no
    /// process maps, so another holder of the same file keeps what it uses.
    fn drop(&mut self) {
        self.maps.clear();
        for path in &self.files {
            drop_from_page_cache(path);
        }
    }
}

/// Asks the kernel to drop the file at `path` from the page cache (`posix_fadvise(DONTNEED)`),
/// but for the pages some process maps, which it keeps. Advice only: nothing happens where the
/// file cannot be opened or the platform has no such call.
pub fn drop_from_page_cache(path: &Path) {
    #[cfg(unix)]
    if let Ok(f) = File::open(path) {
        use std::os::fd::AsRawFd;
        // SAFETY: plain syscall on an open descriptor; advice only.
        unsafe {
            libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
        }
    }
    #[cfg(not(unix))]
    let _ = path;
}

impl Checkpoint {
    /// Opens an HF checkpoint directory or a `.gguf` file. A path to a `.safetensors` file or
    /// `config.json` opens its directory.
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        let meta = std::fs::metadata(path).map_err(|e| ModelError::io(path, e))?;
        if meta.is_dir() {
            return Self::open_hf(path);
        }
        let is_hf_file = path.extension().is_some_and(|e| e == "safetensors")
            || path
                .file_name()
                .is_some_and(|n| n == "config.json" || n == "model.safetensors.index.json");
        if is_hf_file {
            let dir = match path.parent() {
                Some(p) if !p.as_os_str().is_empty() => p,
                _ => Path::new("."),
            };
            return Self::open_hf(dir);
        }
        Self::open_gguf(path)
    }

    fn open_hf(dir: &Path) -> Result<Self, ModelError> {
        let config = ModelConfig::from_hf_json(&read_small(&dir.join("config.json"))?)?;
        config.validate()?;

        let index_path = dir.join("model.safetensors.index.json");
        let (files, weight_map) = if index_path.exists() {
            let weight_map = read_index(&read_small(&index_path)?, &index_path)?;
            let mut files: Vec<String> = weight_map.values().cloned().collect();
            files.sort();
            files.dedup();
            (
                files.into_iter().map(|f| dir.join(f)).collect::<Vec<_>>(),
                Some(weight_map),
            )
        } else {
            (vec![dir.join("model.safetensors")], None)
        };

        let mut maps = Vec::with_capacity(files.len());
        let mut tensors = BTreeMap::new();
        // (name, dtype) of tensors whose dtype has no kernel: an error only if the model needs them
        let mut unsupported = Vec::new();
        let mut vision = 0usize; // tensors of a vision tower, not read
        for (file, path) in files.iter().enumerate() {
            let map = map_file(path)?;
            for mut e in read_header(&map, path)? {
                if names::is_vision_tensor(&e.name) {
                    vision += 1;
                    continue;
                }
                e.name = names::text_model_name(&e.name);
                let dtype = match e.dtype {
                    Ok(d) => d,
                    Err(dtype) => {
                        unsupported.push((e.name, dtype));
                        continue;
                    }
                };
                let info = TensorInfo {
                    name: e.name.clone(),
                    dtype,
                    shape: e.shape,
                    file,
                    offset: e.offset,
                    nbytes: e.nbytes,
                };
                if let Some(prev) = tensors.insert(e.name.clone(), info) {
                    return Err(ModelError::header(
                        path,
                        format!(
                            "tensor {} is also in {}",
                            e.name,
                            files[prev.file].display()
                        ),
                    ));
                }
            }
            maps.push(map);
        }
        if vision > 0 {
            tracing::info!(
                tensors = vision,
                "ignoring the vision tower (only the text model runs)"
            );
        }
        // The counts must fit the files before any name or buffer is sized from them.
        let file_bytes = maps.iter().map(|m| m.len() as u64).sum();
        config.check_fits(file_bytes)?;
        let required: std::collections::BTreeSet<String> = names::model_tensors(&config)
            .into_iter()
            .map(|s| s.name)
            .collect();
        for (name, dtype) in unsupported {
            if required.contains(&name) {
                return Err(ModelError::UnsupportedDtype {
                    tensor: name,
                    dtype,
                });
            }
            tracing::debug!(tensor = %name, %dtype, "skipping tensor of unsupported dtype");
        }
        if let Some(weight_map) = &weight_map {
            for (name, file) in weight_map {
                if names::is_vision_tensor(name) {
                    continue;
                }
                let name = &names::text_model_name(name);
                match tensors.get(name) {
                    Some(info) if files[info.file] == dir.join(file) => {}
                    Some(info) => {
                        return Err(ModelError::header(
                            &index_path,
                            format!(
                                "weight_map puts {name} in {file}, but it is in {}",
                                files[info.file].display()
                            ),
                        ))
                    }
                    None if required.contains(name) => {
                        return Err(ModelError::MissingTensor {
                            tensor: name.clone(),
                            path: dir.join(file),
                        })
                    }
                    None => {}
                }
            }
        }
        let ck = Checkpoint {
            config,
            format: Format::HfSafetensors,
            tensors,
            qk_permuted: false,
            dir_or_file: dir.to_path_buf(),
            files,
            gguf_metadata: None,
            maps,
        };
        ck.check_model_tensors()?;
        Ok(ck)
    }

    fn open_gguf(path: &Path) -> Result<Self, ModelError> {
        let map = map_file(path)?;
        if map.get(..4) != Some(&GGUF_MAGIC[..]) {
            return Err(ModelError::BadMagic { path: path.into() });
        }
        let gguf = GgufFile::parse(&map, path)?;
        let config = gguf.model_config()?;
        config.validate()?;
        config.check_fits(map.len() as u64)?;
        // llama.cpp permutes q/k rows only for `llama` (LlamaModel.permute); Qwen conversions
        // keep HF order and run NEOX (rotate-half) RoPE.
        let qk_permuted = config.arch == crate::config::Arch::Llama;
        let required: std::collections::BTreeSet<String> = names::model_tensors(&config)
            .into_iter()
            .map(|s| s.name)
            .collect();
        let mut tensors = BTreeMap::new();
        let vision = gguf
            .tensors
            .iter()
            .filter(|t| names::is_vision_tensor(&t.name))
            .count();
        if vision > 0 {
            tracing::info!(
                tensors = vision,
                "ignoring the vision tower (only the text model runs)"
            );
        }
        for t in gguf
            .tensors
            .iter()
            .filter(|t| !names::is_vision_tensor(&t.name))
        {
            // A tensor the graph does not read (a bias on a `llama` file, ...) would change
            // the computation if llama.cpp uses it: refused rather than ignored.
            let name = gguf_to_hf_name_for(config.arch, &t.name)
                .filter(|n| required.contains(n))
                .ok_or_else(|| {
                    ModelError::header(
                        path,
                        format!(
                            "tensor {} is not part of the {} graph this reader supports",
                            t.name, config.arch
                        ),
                    )
                })?;
            let info = TensorInfo {
                name: name.clone(),
                dtype: t.dtype,
                shape: t.hf_shape(),
                file: 0,
                offset: t.offset,
                nbytes: t.nbytes,
            };
            tensors.insert(name, info);
        }
        let ck = Checkpoint {
            config,
            format: Format::Gguf,
            tensors,
            qk_permuted,
            dir_or_file: path.to_path_buf(),
            files: vec![path.to_path_buf()],
            gguf_metadata: Some(gguf.metadata),
            maps: vec![map],
        };
        ck.check_model_tensors()?;
        Ok(ck)
    }

    /// Every tensor the config implies exists, with the implied shape, as a valid matrix.
    fn check_model_tensors(&self) -> Result<(), ModelError> {
        for spec in names::model_tensors(&self.config) {
            match spec.shape[..] {
                [len] => self.vector(&spec.name, len).map(drop)?,
                [rows, cols] => self.matrix(&spec.name, rows, cols).map(drop)?,
                _ => {}
            }
        }
        Ok(())
    }

    /// Where a tensor is; [`ModelError::MissingTensor`] if it is not in the checkpoint.
    pub fn tensor_info(&self, name: &str) -> Result<&TensorInfo, ModelError> {
        self.tensors
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor {
                tensor: name.into(),
                path: self.dir_or_file.clone(),
            })
    }

    /// Whether the checkpoint holds a tensor of this name.
    pub fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Maps every page of the checkpoint's files into this process now (`MADV_POPULATE_READ`,
    /// reading from disk what the page cache lacks), so that the first forward pass does not
    /// take one page fault per 4 KiB of weights (tens of milliseconds for a few hundred MB).
    /// For a model held whole in memory, where the first step reads every weight anyway.
    /// A hint: where the kernel lacks it (before Linux 5.14) or refuses, nothing changes and
    /// the pages fault in as they are first read.
    pub fn populate(&self) {
        #[cfg(target_os = "linux")]
        for m in &self.maps {
            if m.advise(memmap2::Advice::PopulateRead).is_err() {
                // older kernels: ask for read-ahead instead
                let _ = m.advise(memmap2::Advice::WillNeed);
            }
        }
    }

    /// A tensor's stored bytes, borrowed from the mapping.
    pub fn tensor_bytes(&self, name: &str) -> Result<&[u8], ModelError> {
        let info = self.tensor_info(name)?;
        let bytes = self.maps.get(info.file).and_then(|m| {
            let start = usize::try_from(info.offset).ok()?;
            let end = start.checked_add(usize::try_from(info.nbytes).ok()?)?;
            m.get(start..end)
        });
        bytes.ok_or_else(|| {
            let path = self
                .files
                .get(info.file)
                .cloned()
                .unwrap_or_else(|| self.dir_or_file.clone());
            ModelError::truncated(path, format!("the data of tensor {name}"))
        })
    }

    /// A `rows × cols` weight matrix. The stored shape must be `[rows, cols]`, or `[cols]`
    /// when `rows == 1`; otherwise [`ModelError::WrongShape`] names the tensor and both shapes.
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix<'_>, ModelError> {
        let info = self.tensor_info(name)?;
        let ok = info.shape == [rows, cols] || (rows == 1 && info.shape == [cols]);
        if !ok {
            return Err(ModelError::WrongShape {
                tensor: name.into(),
                expected: vec![rows, cols],
                actual: info.shape.clone(),
            });
        }
        Matrix::new(info.dtype, rows, cols, self.tensor_bytes(name)?).map_err(|source| {
            ModelError::Kernel {
                tensor: name.into(),
                source,
            }
        })
    }

    /// A 1-D tensor of `len` elements (norm weights) as a `1 × len` matrix.
    pub fn vector(&self, name: &str, len: usize) -> Result<Matrix<'_>, ModelError> {
        let info = self.tensor_info(name)?;
        if info.shape != [len] {
            return Err(ModelError::WrongShape {
                tensor: name.into(),
                expected: vec![len],
                actual: info.shape.clone(),
            });
        }
        Matrix::new(info.dtype, 1, len, self.tensor_bytes(name)?).map_err(|source| {
            ModelError::Kernel {
                tensor: name.into(),
                source,
            }
        })
    }

    /// Sum of all tensors' data lengths, bytes.
    pub fn total_tensor_bytes(&self) -> u64 {
        self.tensors.values().map(|t| t.nbytes).sum()
    }
}

/// Reads a [`Checkpoint`]'s tensors chunk by chunk with positioned reads into one reused
/// buffer, never through the mappings, and drops the source file's cached pages behind each
/// chunk. A pass over the whole checkpoint (a split) thus keeps one chunk resident: pages of
/// a file mapping count in the process's resident set, and a split of a model larger than a
/// device's budget must not read it through one.
#[derive(Debug)]
pub struct TensorReader<'a> {
    ckpt: &'a Checkpoint,
    files: Vec<File>, // parallel to `ckpt.files`
    buf: Vec<u8>,     // (chunk,) bytes, reused for every read
}

impl<'a> TensorReader<'a> {
    /// A reader over `ckpt`'s files with a buffer of `chunk` bytes (at least 4 KiB).
    pub fn new(ckpt: &'a Checkpoint, chunk: usize) -> Result<Self, ModelError> {
        let files = ckpt
            .files
            .iter()
            .map(|p| File::open(p).map_err(|e| ModelError::io(p, e)))
            .collect::<Result<_, _>>()?;
        Ok(TensorReader {
            ckpt,
            files,
            buf: vec![0; chunk.max(4096)],
        })
    }

    /// Calls `f` with a tensor's stored bytes in order, at most one chunk at a time.
    pub fn for_each_chunk(
        &mut self,
        name: &str,
        f: &mut dyn FnMut(&[u8]) -> Result<(), ModelError>,
    ) -> Result<(), ModelError> {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::FileExt;
        let info = self.ckpt.tensor_info(name)?;
        let path = self
            .ckpt
            .files
            .get(info.file)
            .unwrap_or(&self.ckpt.dir_or_file);
        let file = self
            .files
            .get(info.file)
            .ok_or_else(|| ModelError::truncated(path, format!("the data of tensor {name}")))?;
        let (mut pos, end) = (info.offset, info.offset.saturating_add(info.nbytes));
        while pos < end {
            let n = (end - pos).min(self.buf.len() as u64) as usize;
            let chunk = &mut self.buf[..n];
            file.read_exact_at(chunk, pos).map_err(|e| match e.kind() {
                std::io::ErrorKind::UnexpectedEof => {
                    ModelError::truncated(path, format!("the data of tensor {name}"))
                }
                _ => ModelError::io(path, e),
            })?;
            // SAFETY: plain syscall on an open descriptor; the advice only drops clean pages.
            unsafe {
                libc::posix_fadvise(
                    file.as_raw_fd(),
                    pos as libc::off_t,
                    n as libc::off_t,
                    libc::POSIX_FADV_DONTNEED,
                );
            }
            f(chunk)?;
            pos += n as u64;
        }
        Ok(())
    }
}
