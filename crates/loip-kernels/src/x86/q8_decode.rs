//! The AVX2 one-token dot of Q8_0 rows (Qwen2.5's head, 146 MB a token) in assembly, in the
//! natural byte order of each lane, as `quant_ext_decode::q5_0_rows` reads Q5_0.
//!
//! A block's 32 signed bytes `q`, xor'ed with `0x80`, are the unsigned `q + 128`; unpacked as
//! the high bytes of words and those words as the low halves of dwords under the words
//! `0x4700`, they are the f32 `2^15 + 128 + q` without a conversion. One fused
//! `(2^15 + 128 + q)·d − (2^15 + 128)·d` gives `q·d` exactly (the product is exact in the
//! fma, `(2^15 + 128)·d` has 20 significant bits, and `q·d` 19), the value of `dequant` but
//! for the sign of a zero, which no sum starting at `+0` can see. Per 32 weights: 15 vector
//! instructions (`vpxor`, 2 byte and 4 word unpacks, 4 `vfmsub`, 4 `vfmadd`) against 18 for
//! `avx2::Q80` (its scale's broadcast and conversion, 4 `vpmovsxbd`, 4 conversions, 4
//! products, 4 fmas): the scales are converted 8 at a time into a table, as for Q5_0.
//!
//! An infinite scale gives `inf − inf = NaN` in this form where `dequant` gives `±inf` (or
//! NaN for `q = 0`): a row with a non-finite scale (seen when its scales are converted) is
//! computed again by `avx2::rows_quant::<Q80>`, so every row has the scalar path's bits.
//!
//! Safety: every `unsafe fn` here requires AVX2, FMA and F16C, checked by [`crate::simd`],
//! and the buffer lengths stated in its docs.

#[cfg(target_arch = "x86")]
use std::arch::x86::*;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use std::ptr::read_unaligned;

use super::quant_ext_decode::{natural_fold, Folded8};

/// Blocks per segment of a row (even).
const SEG_BLOCKS: usize = 64;
/// Bytes of a Q8_0 block: the f16 scale, then 32 signed bytes.
const BLOCK: usize = 34;

/// The scales of a segment's blocks: `d` and `(2^15 + 128)·d` (256 bytes after `d`, as
/// [`q8_0_block`] reads them).
#[repr(C, align(32))]
struct Q8Scales {
    d: [f32; SEG_BLOCKS],
    dc: [f32; SEG_BLOCKS],
}

/// One Q8_0 block in assembly: its 32 values in the natural order of each lane (vector `a`:
/// elements `4a .. 4a + 4` in the low half, `16 + 4a ..` in the high half), then into 4
/// accumulators. `$b`: the block's byte offset from `{p}`; `$d`: its scale's byte offset in
/// the table `{d}` ([`Q8Scales`]); `$x`: the activations' byte offset from `{x}`; `$a0 ..
/// $a3` the accumulators. Registers: `ymm8` the words `0x4700`, `ymm9` the bytes `0x80`;
/// `ymm10..15` scratch.
#[rustfmt::skip]
macro_rules! q8_0_block {
    ($b:literal, $d:literal, $x:literal, $a0:literal, $a1:literal, $a2:literal, $a3:literal) => {
        concat!(
            // q + 128 as unsigned bytes
            "vpxor ymm12, ymm9, ymmword ptr [{p} + ", $b, " + 2]\n",
            // the bytes as the high bytes of words
            "vpxor xmm13, xmm13, xmm13\n",
            "vpunpckhbw ymm14, ymm13, ymm12\n",
            "vpunpcklbw ymm13, ymm13, ymm12\n",
            // d and (2^15 + 128)·d (exact) from the table: loads, no vector op
            "vbroadcastss ymm12, dword ptr [{d} + ", $d, "]\n",
            "vbroadcastss ymm15, dword ptr [{d} + ", $d, " + 256]\n",
            q8_0_octet!("vpunpcklwd", "ymm10", "ymm13", $a0, $x, "0"),
            q8_0_octet!("vpunpckhwd", "ymm10", "ymm13", $a1, $x, "32"),
            q8_0_octet!("vpunpcklwd", "ymm13", "ymm14", $a2, $x, "64"),
            q8_0_octet!("vpunpckhwd", "ymm14", "ymm14", $a3, $x, "96"),
        )
    };
}

/// An octet of [`q8_0_block`]: the dwords `0x4700_0000 + ((q + 128) << 8)` (the f32
/// `2^15 + 128 + q`) unpacked from the words of `$w` into `$v`, `(2^15 + 128 + q)·d −
/// (2^15 + 128)·d = q·d` (exact), then into the accumulator `$a` with the activations at
/// `{x} + $x + $o`.
#[rustfmt::skip]
macro_rules! q8_0_octet {
    ($unpack:literal, $v:literal, $w:literal, $a:literal, $x:literal, $o:literal) => {
        concat!(
            $unpack, " ", $v, ", ", $w, ", ymm8\n",
            "vfmsub213ps ", $v, ", ymm12, ymm15\n",
            "vfmadd231ps ", $a, ", ", $v, ", ymmword ptr [{x} + ", $x, " + ", $o, "]\n",
        )
    };
}

/// `out[r]` = the canonical dot of row `r` of the Q8_0 rows `data` (rows of `rb` bytes,
/// `cols` elements) with the activations `x`; `xp` holds them in the order of
/// `quant_ext_simd::permute_x`. Accumulator `4i + a` of a block pair holds canonical lanes
/// `32i + 4a ..` (low half) and `32i + 16 + 4a ..` (high half), put back in the canonical
/// order by `natural_fold`, so each canonical lane takes the same products in the same
/// order as `avx2::dot_quant::<Q80>`'s.
///
/// # Safety
/// AVX2/FMA/F16C available; `data.len() >= out.len() * rb`, `rb == cols / 32 * 34`,
/// `x.len() == xp.len() == cols`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q8_0_rows(
    data: &[u8],
    rb: usize,
    cols: usize,
    x: &[f32],
    xp: &[f32],
    out: &mut [f32],
) {
    debug_assert!(data.len() >= out.len() * rb && xp.len() == cols && x.len() == cols);
    debug_assert!(rb == cols / 32 * BLOCK);
    let mag = _mm256_set1_epi16(0x4700);
    let flip = _mm256_set1_epi8(-128);
    let c128 = _mm256_set1_ps(32896.0);
    let (inf, abs) = (_mm256_set1_ps(f32::INFINITY), _mm256_set1_ps(-0.0));
    let (blocks, xs0, dist) = (cols / 32, xp.as_ptr(), rb.max(super::MIN_AHEAD));
    let mut t = Q8Scales {
        d: [0.0; SEG_BLOCKS],
        dc: [0.0; SEG_BLOCKS],
    };
    // rows with a non-finite scale, computed again at the end
    let mut redo: Vec<usize> = Vec::new();
    let (mut rows8, out_ptr) = (Folded8::new(out.len()), out.as_mut_ptr());
    for r in 0..out.len() {
        let row = data.as_ptr().add(r * rb);
        let mut a = [_mm256_setzero_ps(); 8];
        // lanes set where a scale is ±inf or NaN
        let mut bad = _mm256_setzero_ps();
        let mut b0 = 0;
        while b0 < blocks {
            let n = SEG_BLOCKS.min(blocks - b0);
            let seg = row.add(BLOCK * b0);
            // the scales, 8 at a time (as `q5_0_rows`: the words gathered in two scalar
            // registers; the segment's last words past `n` as zeros)
            let mut put = |i: usize, lo: u64, hi: u64| {
                let v = _mm256_cvtph_ps(_mm_set_epi64x(hi as i64, lo as i64));
                bad = _mm256_or_ps(
                    bad,
                    _mm256_cmp_ps::<_CMP_NLT_UQ>(_mm256_andnot_ps(abs, v), inf),
                );
                _mm256_store_ps(t.d.as_mut_ptr().add(i), v);
                _mm256_store_ps(t.dc.as_mut_ptr().add(i), _mm256_mul_ps(v, c128));
            };
            let word = |b: usize| u64::from(read_unaligned(seg.add(BLOCK * b) as *const u16));
            let four =
                |b: usize| word(b) | word(b + 1) << 16 | word(b + 2) << 32 | word(b + 3) << 48;
            let mut i = 0;
            while i + 8 <= n {
                put(i, four(i), four(i + 4));
                i += 8;
            }
            if i < n {
                let part = |b: usize| {
                    (0..4).fold(0, |q, j| {
                        if b + j < n {
                            q | word(b + j) << (16 * j)
                        } else {
                            q
                        }
                    })
                };
                put(i, part(i), part(i + 4));
            }
            let (xs, d) = (xs0.add(32 * b0), t.d.as_ptr());
            for u in 0..n / 2 {
                let p = seg.add(2 * BLOCK * u);
                super::prefetch(p.wrapping_add(dist), 2 * BLOCK);
                std::arch::asm!(
                    q8_0_block!("0", "0", "0", "ymm0", "ymm1", "ymm2", "ymm3"),
                    q8_0_block!("34", "4", "128", "ymm4", "ymm5", "ymm6", "ymm7"),
                    p = in(reg) p,
                    d = in(reg) d.add(2 * u),
                    x = in(reg) xs.add(64 * u),
                    inout("ymm0") a[0], inout("ymm1") a[1], inout("ymm2") a[2], inout("ymm3") a[3],
                    inout("ymm4") a[4], inout("ymm5") a[5], inout("ymm6") a[6], inout("ymm7") a[7],
                    in("ymm8") mag, in("ymm9") flip,
                    out("ymm10") _, out("ymm12") _, out("ymm13") _, out("ymm14") _, out("ymm15") _,
                    options(nostack, readonly, preserves_flags),
                );
            }
            if n % 2 != 0 {
                // the row's last block
                let u = n / 2;
                std::arch::asm!(
                    q8_0_block!("0", "0", "0", "ymm0", "ymm1", "ymm2", "ymm3"),
                    p = in(reg) seg.add(2 * BLOCK * u),
                    d = in(reg) d.add(2 * u),
                    x = in(reg) xs.add(64 * u),
                    inout("ymm0") a[0], inout("ymm1") a[1], inout("ymm2") a[2], inout("ymm3") a[3],
                    in("ymm8") mag, in("ymm9") flip,
                    out("ymm10") _, out("ymm12") _, out("ymm13") _, out("ymm14") _, out("ymm15") _,
                    options(nostack, readonly, preserves_flags),
                );
            }
            b0 += n;
        }
        if _mm256_movemask_ps(bad) != 0 {
            redo.push(r);
        }
        rows8.put(r, natural_fold(&a), out_ptr);
    }
    for r in redo {
        super::avx2::rows_quant::<super::avx2::Q80>(
            &data[r * rb..(r + 1) * rb],
            rb,
            cols,
            x,
            1,
            &mut out[r..r + 1],
        );
    }
}
