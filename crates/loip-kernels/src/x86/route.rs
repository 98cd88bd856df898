//! The x86 entry points by stored type: which AVX2 or AVX-512 kernel runs a matrix's rows
//! (the base types in `avx2.rs` / `avx512.rs`, the extra GGUF types in `quant_ext_simd.rs`),
//! and which AVX2 decoder dequantizes them. They sit above the kernels, so that no kernel
//! file imports another back; each takes its level's names in its own body.
//!
//! Safety: as stated on each function (the level's CPU features and the buffer lengths).

use crate::dtype::DType;

/// `out[r * n + t]` = canonical dot of row `r` of `data` with row `t` of `x` (`n × cols`).
///
/// # Safety
/// AVX2/FMA/F16C available; `data.len() == out.len() / n * row_bytes(cols)`,
/// `x.len() == n * cols`, `cols` a multiple of the block size, `n > 0`.
pub(crate) unsafe fn avx2_rows(
    dtype: DType,
    data: &[u8],
    cols: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
) {
    use super::avx2::{rows_float, rows_quant, BF16, F16, F32, Q40, Q41, Q4K, Q6K, Q80};
    let rb = crate::dequant::prefix_bytes(dtype, cols);
    debug_assert!(n > 0 && x.len() == n * cols && data.len() == out.len() / n * rb);
    match dtype {
        DType::F32 => rows_float::<F32>(data, rb, cols, x, n, out),
        DType::F16 => rows_float::<F16>(data, rb, cols, x, n, out),
        DType::BF16 => rows_float::<BF16>(data, rb, cols, x, n, out),
        DType::Q8_0 => rows_quant::<Q80>(data, rb, cols, x, n, out),
        DType::Q4_0 => rows_quant::<Q40>(data, rb, cols, x, n, out),
        DType::Q4_1 => rows_quant::<Q41>(data, rb, cols, x, n, out),
        DType::Q4K => rows_quant::<Q4K>(data, rb, cols, x, n, out),
        DType::Q6K if n == 1 => {
            // one token: the rows in assembly, the activations permuted once
            super::quant_ext_simd::with_permuted(x, |xp| {
                super::quant_ext_decode::q6k_rows(data, rb, cols, xp, out)
            })
        }
        DType::Q6K => rows_quant::<Q6K>(data, rb, cols, x, n, out),
        DType::Q5_0
        | DType::Q5_1
        | DType::Q2K
        | DType::Q3K
        | DType::Q5K
        | DType::IQ4NL
        | DType::IQ4XS => super::quant_ext_simd::rows::<false>(dtype, data, rb, cols, x, n, out),
    }
}

/// Dequantizes the rows of `data` (`out.len() / cols` rows of `cols` elements of `dtype`)
/// into `out`, row-major. Returns `false`, writing nothing, for a type without an AVX2
/// decoder here (the caller then uses the scalar `dequant`, which gives the same values).
///
/// # Safety
/// AVX2/FMA/F16C available; `data.len() == out.len() / cols * row_bytes(cols)`, `cols > 0` a
/// multiple of the block size.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn avx2_dequant_rows(
    dtype: DType,
    data: &[u8],
    cols: usize,
    out: &mut [f32],
) -> bool {
    use super::avx2::{dequant_float, dequant_quant, BF16, F16, F32, Q40, Q41, Q4K, Q6K, Q80};
    let rb = crate::dequant::prefix_bytes(dtype, cols);
    debug_assert!(cols > 0 && data.len() == out.len() / cols * rb);
    let rows = out.len() / cols;
    let (d, o) = (data.as_ptr(), out.as_mut_ptr());
    macro_rules! each_row {
        ($f:ident, $t:ty) => {
            for r in 0..rows {
                $f::<$t>(d.add(r * rb), cols, o.add(r * cols))
            }
        };
    }
    match dtype {
        DType::F32 => each_row!(dequant_float, F32),
        DType::F16 => each_row!(dequant_float, F16),
        DType::BF16 => each_row!(dequant_float, BF16),
        DType::Q8_0 => each_row!(dequant_quant, Q80),
        DType::Q4_0 => each_row!(dequant_quant, Q40),
        DType::Q4_1 => each_row!(dequant_quant, Q41),
        DType::Q4K => each_row!(dequant_quant, Q4K),
        DType::Q6K => each_row!(dequant_quant, Q6K),
        d if super::quant_ext_simd::handles(d) => {
            super::quant_ext_simd::dequant_rows(dtype, data, cols, out)
        }
        #[allow(unreachable_patterns)]
        _ => return false,
    }
    true
}

/// `out[r * n + t]` = canonical dot of row `r` of `data` (rows of `cols` elements of `dtype`)
/// with row `t` of `x` (`n × cols`).
///
/// # Safety
/// AVX-512F/AVX2/FMA/F16C available; `data.len() == out.len() / n * row_bytes(cols)`,
/// `x.len() == n * cols`, `cols` a multiple of the block size, `n > 0`.
pub(crate) unsafe fn avx512_rows(
    dtype: DType,
    data: &[u8],
    cols: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
) {
    use super::avx512::{rows_float, rows_quant, BF16, F16, F32, Q40, Q41, Q4K, Q6K, Q80};
    let rb = crate::dequant::prefix_bytes(dtype, cols);
    debug_assert!(n > 0 && x.len() == n * cols && data.len() == out.len() / n * rb);
    match dtype {
        DType::F32 => rows_float::<F32>(data, rb, cols, x, n, out),
        DType::F16 => rows_float::<F16>(data, rb, cols, x, n, out),
        DType::BF16 => rows_float::<BF16>(data, rb, cols, x, n, out),
        DType::Q8_0 => rows_quant::<Q80>(data, rb, cols, x, n, out),
        DType::Q4_0 => rows_quant::<Q40>(data, rb, cols, x, n, out),
        DType::Q4_1 => rows_quant::<Q41>(data, rb, cols, x, n, out),
        DType::Q4K => rows_quant::<Q4K>(data, rb, cols, x, n, out),
        DType::Q6K => rows_quant::<Q6K>(data, rb, cols, x, n, out),
        DType::Q5_0
        | DType::Q5_1
        | DType::Q2K
        | DType::Q3K
        | DType::Q5K
        | DType::IQ4NL
        | DType::IQ4XS => super::quant_ext_simd::rows::<true>(dtype, data, rb, cols, x, n, out),
    }
}
