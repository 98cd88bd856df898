//! The integer-dot order of Q8_0 and Q5_0 ([`crate::intdot`]) on AVX-512 (BW) and AVX2.
//!
//! A block's 32 integers are decoded to int8 in a 256-bit register ([`Block`]; Q5_0: nibbles
//! and high bits unpacked as ggml does), then it is one `vpmaddwd` of its 32 sign-extended weights with the token's 32 int16
//! activations: lane `l` gets `q[2l]·xq[2l] + q[2l+1]·xq[2l+1]` (AVX2: two 256-bit halves,
//! lanes 0..8 and 8..16), converted to f32 and accumulated with one fma by the block's factor
//! `d · dx`, computed 16 blocks at a time and broadcast from memory. Blocks go to the
//! canonical accumulators in fours (block `b` to accumulator `b % 4`), so their indices are
//! known at compile time and the accumulators stay in registers.
//!
//! AVX-512: one token takes tiles of 4 rows (each activation block loaded once for the four),
//! batches tiles of 1 row × up to 4 tokens (each weight block sign-extended once for the
//! tokens). AVX2: one row and one token at a time (8 accumulator registers of 16).

#[cfg(target_arch = "x86")]
use std::arch::x86::*;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use crate::dtype::DType;
use crate::quantx::{QuantX, BLOCK, Q5_0_BYTES, Q8_0_BYTES, SEG};

/// A block type of the integer-dot order: its bytes and its 32 integers as int8.
trait Block {
    const BYTES: usize;
    /// The 32 integers of the block at `p`, in element order.
    unsafe fn q(p: *const u8) -> __m256i;
}

struct Q80;
impl Block for Q80 {
    const BYTES: usize = Q8_0_BYTES;
    #[inline(always)]
    unsafe fn q(p: *const u8) -> __m256i {
        _mm256_loadu_si256(p.add(2) as *const __m256i)
    }
}

struct Q50;
impl Block for Q50 {
    const BYTES: usize = Q5_0_BYTES;
    #[inline(always)]
    unsafe fn q(p: *const u8) -> __m256i {
        let qs = _mm_loadu_si128(p.add(6) as *const __m128i);
        let m4 = _mm_set1_epi8(0x0F);
        let lo = _mm_and_si128(qs, m4);
        let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), m4);
        let nib = _mm256_set_m128i(hi, lo);
        // bit j of qh to byte j: broadcast, spread bytes, set every other bit, compare
        let qh = (p.add(2) as *const u32).read_unaligned();
        let spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32(qh as i32),
            _mm256_setr_epi64x(
                0,
                0x0101_0101_0101_0101,
                0x0202_0202_0202_0202,
                0x0303_0303_0303_0303,
            ),
        );
        let bit = _mm256_cmpeq_epi8(
            _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe)),
            _mm256_set1_epi64x(-1),
        );
        let q5 = _mm256_or_si256(nib, _mm256_and_si256(bit, _mm256_set1_epi8(0x10)));
        _mm256_sub_epi8(q5, _mm256_set1_epi8(16))
    }
}

/// The widened f16 scales of blocks `b0 .. b0 + m` (`m <= 16`) of the row at `p`, zero after.
#[inline(always)]
unsafe fn scales<B: Block>(p: *const u8, b0: usize, m: usize) -> [u16; SEG] {
    let mut h = [0u16; SEG];
    for (k, hk) in h.iter_mut().enumerate().take(m) {
        *hk = (p.add((b0 + k) * B::BYTES) as *const u16).read_unaligned();
    }
    h
}

/// Canonical dots of R rows with N tokens (`t0 ..`) of `qx`, AVX-512.
#[inline(always)]
unsafe fn tile512<B: Block, const R: usize, const N: usize>(
    p: [*const u8; R],
    qx: &QuantX,
    t0: usize,
) -> [[f32; N]; R] {
    let nb = qx.cols / BLOCK;
    let rb = nb * B::BYTES;
    let mut acc = [[[_mm512_setzero_ps(); 4]; N]; R];
    let mut sc = [[[0f32; SEG]; N]; R];
    let xq: [*const i16; N] = std::array::from_fn(|t| qx.xq.as_ptr().add((t0 + t) * qx.cols));
    let dx: [*const f32; N] = std::array::from_fn(|t| qx.dx.as_ptr().add((t0 + t) * qx.stride));
    let mut b0 = 0;
    while b0 < nb {
        let m = (nb - b0).min(SEG);
        for r in 0..R {
            let h = scales::<B>(p[r], b0, m);
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(h.as_ptr() as *const __m256i));
            for t in 0..N {
                let f = _mm512_mul_ps(d, _mm512_loadu_ps(dx[t].add(b0)));
                _mm512_storeu_ps(sc[r][t].as_mut_ptr(), f);
            }
        }
        let mut k = 0;
        while k < m {
            if N == 1 {
                // the same blocks of the rows of the next tile
                for row in p {
                    super::prefetch(row.wrapping_add(R * rb + (b0 + k) * B::BYTES), 4 * B::BYTES);
                }
            }
            // block b0 + k + j goes to accumulator j (b0 and k are multiples of 4)
            for j in 0..4 {
                if k + j >= m {
                    break;
                }
                let b = b0 + k + j;
                let xv: [__m512i; N] =
                    std::array::from_fn(|t| _mm512_loadu_si512(xq[t].add(BLOCK * b) as *const _));
                for r in 0..R {
                    let q = _mm512_cvtepi8_epi16(B::q(p[r].add(b * B::BYTES)));
                    for t in 0..N {
                        let pf = _mm512_cvtepi32_ps(_mm512_madd_epi16(q, xv[t]));
                        let f = _mm512_set1_ps(sc[r][t][k + j]);
                        acc[r][t][j] = _mm512_fmadd_ps(pf, f, acc[r][t][j]);
                    }
                }
            }
            k += 4;
        }
        b0 += m;
    }
    let mut out = [[0f32; N]; R];
    for r in 0..R {
        for t in 0..N {
            out[r][t] = super::avx512::reduce(&acc[r][t]);
        }
    }
    out
}

/// Canonical dot of one row with token `t` of `qx`, AVX2.
#[inline(always)]
unsafe fn dot256<B: Block>(p: *const u8, qx: &QuantX, t: usize) -> f32 {
    let nb = qx.cols / BLOCK;
    // a[2i], a[2i + 1]: the halves of accumulator i
    let mut acc = [_mm256_setzero_ps(); 8];
    let mut sc = [0f32; SEG];
    let xq = qx.xq.as_ptr().add(t * qx.cols);
    let dx = qx.dx.as_ptr().add(t * qx.stride);
    let mut b0 = 0;
    while b0 < nb {
        let m = (nb - b0).min(SEG);
        let h = scales::<B>(p, b0, m);
        for half in 0..2 {
            let d = _mm256_cvtph_ps(_mm_loadu_si128(h.as_ptr().add(8 * half) as *const __m128i));
            let f = _mm256_mul_ps(d, _mm256_loadu_ps(dx.add(b0 + 8 * half)));
            _mm256_storeu_ps(sc.as_mut_ptr().add(8 * half), f);
        }
        let mut k = 0;
        while k < m {
            for j in 0..4 {
                if k + j >= m {
                    break;
                }
                let b = b0 + k + j;
                let f = _mm256_broadcast_ss(&sc[k + j]);
                let q8 = B::q(p.add(b * B::BYTES));
                for half in 0..2 {
                    let q = _mm256_cvtepi8_epi16(if half == 0 {
                        _mm256_castsi256_si128(q8)
                    } else {
                        _mm256_extracti128_si256(q8, 1)
                    });
                    let xv = _mm256_loadu_si256(xq.add(BLOCK * b + 16 * half) as *const __m256i);
                    let pf = _mm256_cvtepi32_ps(_mm256_madd_epi16(q, xv));
                    acc[2 * j + half] = _mm256_fmadd_ps(pf, f, acc[2 * j + half]);
                }
            }
            k += 4;
        }
        b0 += m;
    }
    super::avx2::reduce(&acc)
}

/// `out[r * n + t]` = canonical integer dot of row `r` of `data` with token `t` of `qx`.
///
/// # Safety
/// `WIDE`: AVX-512F and AVX-512BW available; always AVX2, FMA and F16C. `dtype` is Q8_0 or
/// Q5_0 (another is read as Q8_0). `data` holds `out.len() / n` rows of `qx.cols` elements, `n = qx.tokens() > 0`, and `qx.dx` has
/// `n × qx.stride` entries.
pub(crate) unsafe fn rows<const WIDE: bool>(
    dtype: DType,
    data: &[u8],
    qx: &QuantX,
    out: &mut [f32],
) {
    match (WIDE, dtype) {
        (true, DType::Q5_0) => rows512::<Q50>(data, qx, out),
        (true, _) => rows512::<Q80>(data, qx, out),
        (false, DType::Q5_0) => rows256::<Q50>(data, qx, out),
        (false, _) => rows256::<Q80>(data, qx, out),
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn rows512<B: Block>(data: &[u8], qx: &QuantX, out: &mut [f32]) {
    let n = qx.tokens();
    let rb = qx.cols / BLOCK * B::BYTES;
    let rows = out.len() / n;
    let row = |r: usize| data.as_ptr().add(r * rb);
    if n == 1 {
        let mut r = 0;
        while r + 4 <= rows {
            let v = tile512::<B, 4, 1>([row(r), row(r + 1), row(r + 2), row(r + 3)], qx, 0);
            for i in 0..4 {
                out[r + i] = v[i][0];
            }
            r += 4;
        }
        for (r, o) in out.iter_mut().enumerate().skip(r) {
            *o = tile512::<B, 1, 1>([row(r)], qx, 0)[0][0];
        }
        return;
    }
    for (r, o) in out.chunks_exact_mut(n).enumerate() {
        let p = [row(r)];
        let mut t = 0;
        while t + 4 <= n {
            o[t..t + 4].copy_from_slice(&tile512::<B, 1, 4>(p, qx, t)[0]);
            t += 4;
        }
        match n - t {
            3 => o[t..].copy_from_slice(&tile512::<B, 1, 3>(p, qx, t)[0]),
            2 => o[t..].copy_from_slice(&tile512::<B, 1, 2>(p, qx, t)[0]),
            1 => o[t] = tile512::<B, 1, 1>(p, qx, t)[0][0],
            _ => {}
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows256<B: Block>(data: &[u8], qx: &QuantX, out: &mut [f32]) {
    let n = qx.tokens();
    let rb = qx.cols / BLOCK * B::BYTES;
    for (r, o) in out.chunks_exact_mut(n).enumerate() {
        let p = data.as_ptr().add(r * rb);
        for (t, v) in o.iter_mut().enumerate() {
            *v = dot256::<B>(p, qx, t);
        }
    }
}
