//! The one error type of this crate. Every variant names what was wrong: the file, the tensor,
//! the config field. Nothing read from a file can panic; it ends up here instead.

use std::path::PathBuf;

use loip_kernels::KernelError;
use thiserror::Error;

/// Errors from reading, checking and writing model files.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ModelError {
    /// An operating-system error on a file.
    #[error("{}: {source}", path.display())]
    Io {
        /// the file or directory
        path: PathBuf,
        /// the underlying error
        #[source]
        source: std::io::Error,
    },
    /// The file does not start with the expected magic bytes.
    #[error("{}: not a GGUF file (bad magic bytes)", path.display())]
    BadMagic {
        /// the file
        path: PathBuf,
    },
    /// A GGUF version this reader does not understand.
    #[error("{}: unsupported GGUF version {version} (supported: 2, 3)", path.display())]
    UnsupportedVersion {
        /// the file
        path: PathBuf,
        /// the version field as read (little-endian)
        version: u32,
    },
    /// The file ends before a structure it declares.
    #[error("{}: file is truncated: it ends inside {what}", path.display())]
    Truncated {
        /// the file
        path: PathBuf,
        /// what was being read
        what: String,
    },
    /// A tensor's byte range ends past the end of its file.
    #[error(
        "{}: tensor {tensor}: data bytes [{start}, {end}) lie past the end of the file ({file_len} bytes)",
        path.display()
    )]
    DataPastEof {
        /// the file
        path: PathBuf,
        /// the tensor (name as stored in the file)
        tensor: String,
        /// absolute start offset, bytes
        start: u64,
        /// absolute end offset (exclusive), bytes
        end: u64,
        /// file length, bytes
        file_len: u64,
    },
    /// A header that parses but makes no sense (bad JSON, overlapping or misaligned data,
    /// absurd counts, duplicate names, ...).
    #[error("{}: bad header: {reason}", path.display())]
    BadHeader {
        /// the file
        path: PathBuf,
        /// what is wrong
        reason: String,
    },
    /// A model architecture this crate does not know (`model_type`, `architectures` or
    /// `general.architecture`).
    #[error(
        "unknown model architecture {0:?} (supported: llama, mistral, qwen2, qwen3, gemma3 \
         text models; in GGUF: llama (Mistral files too), qwen2, qwen3, gemma3)"
    )]
    UnknownArch(String),
    /// A GGUF tensor type without a kernel.
    #[error("tensor {tensor}: unsupported GGUF tensor type {type_name}")]
    UnsupportedTensorType {
        /// the tensor (GGUF name)
        tensor: String,
        /// ggml type name and id, e.g. `Q5_K (13)`
        type_name: String,
    },
    /// A safetensors dtype (or a requested dtype) that is not F32, F16 or BF16.
    #[error("tensor {tensor}: unsupported dtype {dtype} (supported: F32, F16, BF16)")]
    UnsupportedDtype {
        /// the tensor
        tensor: String,
        /// the dtype as named by the file
        dtype: String,
    },
    /// A tensor the model needs is not in the checkpoint.
    #[error("tensor {tensor} not found in {}", path.display())]
    MissingTensor {
        /// HF canonical name
        tensor: String,
        /// the checkpoint directory or file
        path: PathBuf,
    },
    /// A tensor whose shape is not the one the config implies.
    #[error("tensor {tensor}: expected shape {expected:?}, found {actual:?}")]
    WrongShape {
        /// HF canonical name
        tensor: String,
        /// shape asked for, HF order
        expected: Vec<usize>,
        /// shape in the file, HF order
        actual: Vec<usize>,
    },
    /// A config value that is missing, of the wrong type or out of range.
    #[error("config field {field}: {reason}")]
    InvalidConfig {
        /// the field (HF `config.json` key, GGUF metadata key or [`crate::ModelConfig`] field)
        field: String,
        /// what is wrong
        reason: String,
    },
    /// A tensor's bytes do not form a matrix of its dtype (e.g. a partial quantization block).
    #[error("tensor {tensor}: {source}")]
    Kernel {
        /// HF canonical name
        tensor: String,
        /// the kernel-side check that failed
        #[source]
        source: KernelError,
    },
    /// A preset name that is not in [`crate::preset_names`].
    #[error("unknown preset {name:?} (known: {known})")]
    UnknownPreset {
        /// the name asked for
        name: String,
        /// the known names, comma-separated
        known: String,
    },
    /// A slice file whose contents do not match its manifest checksum (corrupt on disk).
    #[error("{}: checksum mismatch (manifest {expected}, file {actual}): the slice is corrupt; re-run `loip split`", path.display())]
    Checksum {
        /// the slice file
        path: PathBuf,
        /// CRC-32 in the manifest
        expected: String,
        /// CRC-32 of the file
        actual: String,
    },
}

impl ModelError {
    /// Wraps an I/O error with the path it happened on.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ModelError::Io {
            path: path.into(),
            source,
        }
    }

    /// A [`ModelError::InvalidConfig`] for `field`.
    pub fn config(field: impl Into<String>, reason: impl Into<String>) -> Self {
        ModelError::InvalidConfig {
            field: field.into(),
            reason: reason.into(),
        }
    }

    /// A [`ModelError::BadHeader`] for `path`.
    pub fn header(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        ModelError::BadHeader {
            path: path.into(),
            reason: reason.into(),
        }
    }

    /// A [`ModelError::Truncated`] for `path`.
    pub fn truncated(path: impl Into<PathBuf>, what: impl Into<String>) -> Self {
        ModelError::Truncated {
            path: path.into(),
            what: what.into(),
        }
    }
}
