//! The scalar references of the GGUF K-quants beyond Q4_K / Q6_K: `Q2_K`, `Q3_K`, `Q5_K`
//! (llama.cpp's Q2_K, Q3_K_M and Q5_K_M mixes), and of the non-linear `IQ4_NL` / `IQ4_XS`.
//!
//! Layouts (ggml `block_q2_K`, `block_q3_K`, `block_q5_K`, `block_iq4_nl`, `block_iq4_xs`),
//! little-endian, f16 scales:
//! - `Q2_K`, 256 elements, 84 bytes: `scales[16]` (low nibble scale, high nibble min),
//!   `qs[64]` (2-bit values), `d`, `dmin`. Half `n` (128 elements) reads `qs[32n..32n+32]`;
//!   within it, shift `2j` gives elements `32j + l` (`l < 16`, byte `l`, scale `8n + 2j`) and
//!   `32j + 16 + l` (byte `16 + l`, scale `8n + 2j + 1`). Value `(d·sc) · q − (dmin·m)`.
//! - `Q3_K`, 256 elements, 110 bytes: `hmask[32]`, `qs[64]`, `scales[12]` (16 × 6 bits), `d`.
//!   Same element order as Q2_K; the third bit is bit `4n + j` of `hmask[l]` (resp.
//!   `hmask[16 + l]`), and a clear bit subtracts 4. Value `(d·(sc − 32)) · (q − 4·!h)`.
//! - `Q5_K`, 256 elements, 176 bytes: `d`, `dmin`, `scales[12]` (as Q4_K), `qh[32]`,
//!   `qs[128]`. Chunk `c` (64 elements): low nibbles of `qs[32c..]` with bit `2c` of `qh`
//!   (sub-block `2c`), then high nibbles with bit `2c + 1` (sub-block `2c + 1`).
//!   Value `(d·sc) · q − (dmin·m)`.
//! - `IQ4_NL`, 32 elements, 18 bytes: `d`, `qs[16]`; element `j < 16` is
//!   `d · K[qs[j] & 15]`, element `j + 16` is `d · K[qs[j] >> 4]` ([`IQ4_TABLE`]).
//! - `IQ4_XS`, 256 elements, 136 bytes: `d`, `u16 scales_h`, `scales_l[4]`, `qs[128]`; block
//!   `b` (32 elements) has the 6-bit scale `ls` (low nibble `b % 2` of `scales_l[b / 2]`, high
//!   bits `2b` of `scales_h`) and is an IQ4_NL block of scale `d · (ls − 32)` over
//!   `qs[16b..16b+16]`.
//!
//! Each value is computed with ggml's operations in ggml's order (`dequantize_row_*`), and
//! every product is exact: a scale (an f16, at most 11 significant bits, times an integer of
//! at most 7 bits) times a value of at most 7 bits fits in 24 bits. So a SIMD path may fuse
//! `(d·sc)·q − m` into one fma and get the same bits.

use crate::dtype::DType;
use crate::scales::scale_min_k4;
use half::f16;

/// The 16 IQ4 values (ggml `kvalues_iq4nl`), indexed by nibble.
pub(crate) const IQ4_TABLE: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// The 16 signed 6-bit scales of a Q3_K block from its 12 scale bytes (ggml's `kmask`
/// unpacking), before subtracting 32.
#[inline]
pub(crate) fn scales_q3k(s: &[u8]) -> [u8; 16] {
    let w = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    let (a0, a1, tmp) = (w(0), w(1), w(2));
    const M1: u32 = 0x0303_0303;
    const M2: u32 = 0x0f0f_0f0f;
    let aux = [
        (a0 & M2) | ((tmp & M1) << 4),
        (a1 & M2) | (((tmp >> 2) & M1) << 4),
        ((a0 >> 4) & M2) | (((tmp >> 4) & M1) << 4),
        ((a1 >> 4) & M2) | (((tmp >> 6) & M1) << 4),
    ];
    let mut out = [0u8; 16];
    for (o, a) in out.chunks_exact_mut(4).zip(aux) {
        o.copy_from_slice(&a.to_le_bytes());
    }
    out
}

/// The 6-bit scale of block `b` (< 8) of an IQ4_XS super-block `blk`.
#[inline]
pub(crate) fn scale_iq4xs(blk: &[u8], b: usize) -> i32 {
    let sh = u16::from_le_bytes([blk[2], blk[3]]) as i32;
    let lo = (blk[4 + b / 2] as i32 >> (4 * (b % 2))) & 0xF;
    lo | (((sh >> (2 * b)) & 3) << 4)
}

/// Dequantizes whole blocks of `bytes` (`Q2_K`, `Q3_K`, `Q5_K`, `IQ4_NL`, `IQ4_XS`) into
/// `out` (`out.len()` elements). Panics on another dtype or inconsistent lengths (internal
/// callers check them).
pub(crate) fn dequant_ext(dtype: DType, bytes: &[u8], out: &mut [f32]) {
    let (be, bb) = (dtype.block_elems(), dtype.block_bytes());
    assert_eq!(bytes.len() / bb * be, out.len(), "dequant_ext lengths");
    let blocks = out.chunks_exact_mut(be).zip(bytes.chunks_exact(bb));
    match dtype {
        DType::Q2K => blocks.for_each(|(o, b)| q2k(b, o)),
        DType::Q3K => blocks.for_each(|(o, b)| q3k(b, o)),
        DType::Q5K => blocks.for_each(|(o, b)| q5k(b, o)),
        DType::IQ4NL => blocks.for_each(|(o, b)| iq4(f16_at(b, 0), &b[2..18], o)),
        DType::IQ4XS => blocks.for_each(|(o, b)| {
            let d = f16_at(b, 0);
            for (i, o) in o.chunks_exact_mut(32).enumerate() {
                let dl = d * (scale_iq4xs(b, i) - 32) as f32;
                iq4(dl, &b[8 + 16 * i..24 + 16 * i], o);
            }
        }),
        other => panic!("dequant_ext: {other}"),
    }
}

/// One 32-element IQ4 block of scale `d` over the 16 bytes `qs`.
#[inline]
fn iq4(d: f32, qs: &[u8], o: &mut [f32]) {
    for j in 0..16 {
        o[j] = d * IQ4_TABLE[(qs[j] & 0xF) as usize] as f32;
        o[j + 16] = d * IQ4_TABLE[(qs[j] >> 4) as usize] as f32;
    }
}

fn q2k(b: &[u8], o: &mut [f32]) {
    let (d, min) = (f16_at(b, 80), f16_at(b, 82));
    for n in 0..2 {
        let q = &b[16 + 32 * n..48 + 32 * n];
        for j in 0..4 {
            let shift = 2 * j;
            for h in 0..2 {
                let sc = b[8 * n + 2 * j + h];
                let dl = d * (sc & 0xF) as f32;
                let ml = min * (sc >> 4) as f32;
                let o = &mut o[128 * n + 32 * j + 16 * h..][..16];
                for (l, v) in o.iter_mut().enumerate() {
                    *v = dl * ((q[16 * h + l] >> shift) & 3) as f32 - ml;
                }
            }
        }
    }
}

fn q3k(b: &[u8], o: &mut [f32]) {
    let d = f16_at(b, 108);
    let scales = scales_q3k(&b[96..108]);
    let hm = &b[..32];
    for n in 0..2 {
        let q = &b[32 + 32 * n..64 + 32 * n];
        for j in 0..4 {
            let (shift, m) = (2 * j, 1u8 << (4 * n + j));
            for h in 0..2 {
                let dl = d * (scales[8 * n + 2 * j + h] as i32 - 32) as f32;
                let o = &mut o[128 * n + 32 * j + 16 * h..][..16];
                for (l, v) in o.iter_mut().enumerate() {
                    let i = 16 * h + l;
                    let sub = if hm[i] & m != 0 { 0 } else { 4 };
                    *v = dl * (((q[i] >> shift) & 3) as i32 - sub) as f32;
                }
            }
        }
    }
}

fn q5k(b: &[u8], o: &mut [f32]) {
    let (d, min) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qh) = (&b[4..16], &b[16..48]);
    for c in 0..4 {
        let ql = &b[48 + 32 * c..80 + 32 * c];
        for h in 0..2 {
            let (sc, m) = scale_min_k4(2 * c + h, scales);
            let (dl, ml) = (d * sc as f32, min * m as f32);
            let bit = 2 * c + h;
            let o = &mut o[64 * c + 32 * h..][..32];
            for (l, v) in o.iter_mut().enumerate() {
                let lo = (ql[l] >> (4 * h)) & 0xF;
                let q = lo | (((qh[l] >> bit) & 1) << 4);
                *v = dl * q as f32 - ml;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::Matrix;
    use crate::matmul::matmul_at;
    use crate::simd::{supported, Level};
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// gguf-py's numpy dequantization of random blocks (`tests/fixtures/quants/gen.py`).
    const FIXTURES: [(DType, &[u8], &[u8]); 7] = [
        (
            DType::Q5_0,
            include_bytes!("../tests/fixtures/quants/Q5_0.blocks"),
            include_bytes!("../tests/fixtures/quants/Q5_0.f32"),
        ),
        (
            DType::Q5_1,
            include_bytes!("../tests/fixtures/quants/Q5_1.blocks"),
            include_bytes!("../tests/fixtures/quants/Q5_1.f32"),
        ),
        (
            DType::Q2K,
            include_bytes!("../tests/fixtures/quants/Q2_K.blocks"),
            include_bytes!("../tests/fixtures/quants/Q2_K.f32"),
        ),
        (
            DType::Q3K,
            include_bytes!("../tests/fixtures/quants/Q3_K.blocks"),
            include_bytes!("../tests/fixtures/quants/Q3_K.f32"),
        ),
        (
            DType::Q5K,
            include_bytes!("../tests/fixtures/quants/Q5_K.blocks"),
            include_bytes!("../tests/fixtures/quants/Q5_K.f32"),
        ),
        (
            DType::IQ4NL,
            include_bytes!("../tests/fixtures/quants/IQ4_NL.blocks"),
            include_bytes!("../tests/fixtures/quants/IQ4_NL.f32"),
        ),
        (
            DType::IQ4XS,
            include_bytes!("../tests/fixtures/quants/IQ4_XS.blocks"),
            include_bytes!("../tests/fixtures/quants/IQ4_XS.f32"),
        ),
    ];

    fn f32s(b: &[u8]) -> Vec<f32> {
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    /// The scalar reference and every SIMD decoder give gguf-py's values, bit for bit.
    #[test]
    fn dequant_matches_gguf_py() {
        for (dtype, blocks, want) in FIXTURES {
            let want = f32s(want);
            assert_eq!(
                blocks.len() / dtype.block_bytes() * dtype.block_elems(),
                want.len()
            );
            let mut got = vec![0f32; want.len()];
            crate::dequant::dequant_into(dtype, blocks, &mut got);
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{dtype} element {i}: {a} vs {b}");
            }
            #[cfg(any(target_arch = "x86_64", target_arch = "x86"))]
            if supported(Level::Avx2) {
                let mut simd = vec![0f32; want.len()];
                // one row per block: every row decoder call starts at a block
                let cols = dtype.block_elems();
                // SAFETY: AVX2 checked; `blocks` holds want.len() / cols rows of cols elements
                unsafe { crate::x86::quant_ext_simd::dequant_rows(dtype, blocks, cols, &mut simd) };
                let same = simd
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{dtype}: AVX2 decoder differs from gguf-py");
            }
        }
    }

    /// Random blocks with finite scales of `dtype` (the f16 fields set, the rest random).
    fn random_blocks(dtype: DType, blocks: usize, rng: &mut ChaCha8Rng) -> Vec<u8> {
        let mut data = vec![0u8; blocks * dtype.block_bytes()];
        rng.fill(&mut data[..]);
        let at: &[usize] = match dtype {
            DType::Q5_0 | DType::IQ4NL | DType::IQ4XS => &[0],
            DType::Q5_1 | DType::Q5K => &[0, 2],
            DType::Q2K => &[80, 82],
            DType::Q3K => &[108],
            other => panic!("{other}"),
        };
        for b in data.chunks_exact_mut(dtype.block_bytes()) {
            for &i in at {
                let v = f16::from_f32(rng.gen_range(-0.05f32..0.05));
                b[i..i + 2].copy_from_slice(&v.to_bits().to_le_bytes());
            }
        }
        data
    }

    /// Every SIMD level gives the portable path's bits, single tokens and batches, for shapes
    /// with whole 256-element segments, a partial last segment and a last half chunk.
    #[test]
    fn levels_are_bit_identical() {
        let mut rng = ChaCha8Rng::seed_from_u64(25);
        for dtype in crate::tests::EXT {
            let be = dtype.block_elems();
            let shapes: &[(usize, usize, usize)] = if be == 32 {
                &[
                    (3, 32, 1),
                    (9, 640, 1),
                    (7, 896, 2),
                    (5, 96, 9),
                    (6, 1024, 3),
                ]
            } else {
                &[(3, 256, 1), (9, 768, 1), (5, 1280, 2), (4, 512, 9)]
            };
            for &(rows, cols, n) in shapes {
                let data = random_blocks(dtype, rows * cols / be, &mut rng);
                let w = Matrix::new(dtype, rows, cols, &data).unwrap();
                let x: Vec<f32> = (0..n * cols).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
                let mut want = vec![0f32; rows * n];
                matmul_at(Level::Scalar, &w, &x, &mut want).unwrap();
                let mut reference = vec![0f32; rows * n];
                crate::matmul::matmul_ref(&w, &x, &mut reference).unwrap();
                for (a, b) in want.iter().zip(&reference) {
                    assert!(
                        (a - b).abs() <= 1e-3 * (1.0 + b.abs()),
                        "{dtype}: {a} vs {b}"
                    );
                }
                for level in [Level::Avx2, Level::Avx512] {
                    if !supported(level) {
                        continue;
                    }
                    let mut got = vec![0f32; rows * n];
                    matmul_at(level, &w, &x, &mut got).unwrap();
                    let same = want
                        .iter()
                        .zip(&got)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{dtype} {rows}x{cols} n={n} at {level:?}");
                }
            }
        }
    }
}
