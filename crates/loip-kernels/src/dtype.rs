//! Stored tensor types and the borrowed weight matrix view.

use thiserror::Error;

/// Errors from kernel argument checks.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KernelError {
    /// A row length that is not a whole number of quantization blocks.
    #[error("{dtype}: a row of {cols} elements is not a multiple of the block size {block}")]
    PartialBlock {
        /// tensor type
        dtype: DType,
        /// row length in elements
        cols: usize,
        /// elements per block
        block: usize,
    },
    /// The byte buffer does not match `rows × row_bytes(cols)`.
    #[error("{dtype} matrix {rows}x{cols} needs {expected} bytes, got {got}")]
    WrongSize {
        /// tensor type
        dtype: DType,
        /// rows
        rows: usize,
        /// columns
        cols: usize,
        /// bytes needed
        expected: usize,
        /// bytes given
        got: usize,
    },
    /// A buffer whose length does not match the shape of the operation.
    #[error("{what}: expected {expected} elements, got {got}")]
    Length {
        /// which argument
        what: &'static str,
        /// elements needed
        expected: usize,
        /// elements given
        got: usize,
    },
    /// An activation buffer that is not a whole number of rows of `cols` elements.
    #[error("{what}: length {len} is not a multiple of the row length {cols}")]
    NotMultiple {
        /// which argument
        what: &'static str,
        /// elements given
        len: usize,
        /// required row length (matrix columns)
        cols: usize,
    },
    /// A row index past the end of the matrix.
    #[error("row {row} out of range for a matrix of {rows} rows")]
    RowOutOfRange {
        /// requested row
        row: usize,
        /// rows in the matrix
        rows: usize,
    },
}

/// A stored element type. Quantized types use the GGUF (ggml) block layouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit float
    F32,
    /// IEEE half
    F16,
    /// bfloat16
    BF16,
    /// ggml Q8_0: 32 elements = f16 scale + 32 × i8 (34 bytes)
    Q8_0,
    /// ggml Q4_0: 32 elements = f16 scale + 16 bytes of nibbles (18 bytes)
    Q4_0,
    /// ggml Q4_1: 32 elements = f16 scale + f16 min + 16 bytes of nibbles (20 bytes)
    Q4_1,
    /// ggml Q4_K: 256 elements, 144 bytes
    Q4K,
    /// ggml Q6_K: 256 elements, 210 bytes
    Q6K,
    /// ggml Q5_0: 32 elements = f16 scale + 4 bytes of high bits + 16 bytes of nibbles (22 bytes)
    Q5_0,
    /// ggml Q5_1: 32 elements = f16 scale + f16 min + 4 + 16 bytes (24 bytes)
    Q5_1,
    /// ggml Q2_K: 256 elements, 84 bytes (16 × 4-bit scale/min pairs, 2-bit values)
    Q2K,
    /// ggml Q3_K: 256 elements, 110 bytes (16 × 6-bit scales, 3-bit values)
    Q3K,
    /// ggml Q5_K: 256 elements, 176 bytes (8 × 6-bit scale/min pairs, 5-bit values)
    Q5K,
    /// ggml IQ4_NL: 32 elements = f16 scale + 16 bytes of nibbles into a fixed table (18 bytes)
    IQ4NL,
    /// ggml IQ4_XS: 256 elements, 136 bytes (8 × 6-bit scales, nibbles into the IQ4_NL table)
    IQ4XS,
}

impl DType {
    /// The name used in errors, manifests and GGUF (e.g. `Q4_1`, `BF16`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::Q8_0 => "Q8_0",
            DType::Q4_0 => "Q4_0",
            DType::Q4_1 => "Q4_1",
            DType::Q4K => "Q4_K",
            DType::Q6K => "Q6_K",
            DType::Q5_0 => "Q5_0",
            DType::Q5_1 => "Q5_1",
            DType::Q2K => "Q2_K",
            DType::Q3K => "Q3_K",
            DType::Q5K => "Q5_K",
            DType::IQ4NL => "IQ4_NL",
            DType::IQ4XS => "IQ4_XS",
        }
    }

    /// Parses a name produced by [`DType::name`].
    pub fn from_name(name: &str) -> Option<DType> {
        Some(match name {
            "F32" => DType::F32,
            "F16" => DType::F16,
            "BF16" => DType::BF16,
            "Q8_0" => DType::Q8_0,
            "Q4_0" => DType::Q4_0,
            "Q4_1" => DType::Q4_1,
            "Q4_K" => DType::Q4K,
            "Q6_K" => DType::Q6K,
            "Q5_0" => DType::Q5_0,
            "Q5_1" => DType::Q5_1,
            "Q2_K" => DType::Q2K,
            "Q3_K" => DType::Q3K,
            "Q5_K" => DType::Q5K,
            "IQ4_NL" => DType::IQ4NL,
            "IQ4_XS" => DType::IQ4XS,
            _ => return None,
        })
    }

    /// Elements per block (1 for float types).
    pub fn block_elems(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::BF16 => 1,
            DType::Q8_0 | DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::IQ4NL => {
                32
            }
            DType::Q4K | DType::Q6K | DType::Q2K | DType::Q3K | DType::Q5K | DType::IQ4XS => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Q8_0 => 34,
            DType::Q4_0 => 18,
            DType::Q4_1 => 20,
            DType::Q4K => 144,
            DType::Q6K => 210,
            DType::Q5_0 => 22,
            DType::Q5_1 => 24,
            DType::Q2K => 84,
            DType::Q3K => 110,
            DType::Q5K => 176,
            DType::IQ4NL => 18,
            DType::IQ4XS => 136,
        }
    }

    /// Bytes of one row of `cols` elements.
    pub fn row_bytes(self, cols: usize) -> Result<usize, KernelError> {
        let block = self.block_elems();
        if cols % block != 0 {
            return Err(KernelError::PartialBlock {
                dtype: self,
                cols,
                block,
            });
        }
        Ok(cols / block * self.block_bytes())
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A borrowed row-major weight matrix: `rows × cols` elements of `dtype`.
///
/// `data` may live anywhere (mmap, loader slot, heap) and need not be aligned.
#[derive(Debug, Clone, Copy)]
pub struct Matrix<'a> {
    /// stored type
    pub dtype: DType,
    /// number of rows (output features)
    pub rows: usize,
    /// number of columns (input features)
    pub cols: usize,
    /// `rows * dtype.row_bytes(cols)` bytes
    pub data: &'a [u8],
}

impl<'a> Matrix<'a> {
    /// Checks that `data` holds exactly `rows × cols` elements of `dtype`.
    pub fn new(
        dtype: DType,
        rows: usize,
        cols: usize,
        data: &'a [u8],
    ) -> Result<Self, KernelError> {
        // saturating: a shape too large to address can never match a real buffer
        let expected = dtype.row_bytes(cols)?.saturating_mul(rows);
        if data.len() != expected {
            return Err(KernelError::WrongSize {
                dtype,
                rows,
                cols,
                expected,
                got: data.len(),
            });
        }
        Ok(Matrix {
            dtype,
            rows,
            cols,
            data,
        })
    }

    /// Checks that `data` has exactly `rows × row_bytes(cols)` bytes (the fields are public, so a
    /// `Matrix` built without [`Matrix::new`] may be inconsistent; every kernel calls this first).
    pub fn validate(&self) -> Result<(), KernelError> {
        Matrix::new(self.dtype, self.rows, self.cols, self.data).map(|_| ())
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.data.len() / self.rows.max(1)
    }

    /// The bytes of row `r`.
    ///
    /// # Panics
    /// If `r >= rows` (use [`Matrix::get_row`] for a checked version).
    pub fn row(&self, r: usize) -> &'a [u8] {
        let rb = self.row_bytes();
        &self.data[r * rb..(r + 1) * rb]
    }

    /// The bytes of row `r`, or `None` if `r >= rows` or the matrix is inconsistent.
    pub fn get_row(&self, r: usize) -> Option<&'a [u8]> {
        let rb = self.dtype.row_bytes(self.cols).ok()?;
        if r >= self.rows || self.data.len() != rb.checked_mul(self.rows)? {
            return None;
        }
        self.data.get(r * rb..(r + 1) * rb)
    }
}
