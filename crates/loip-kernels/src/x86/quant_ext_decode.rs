//! 256-bit decoders of the extra GGUF types: `Q5_0`, `Q5_1` (`crate::quant_ext`) and `Q2_K`,
//! `Q3_K`, `Q5_K`, `IQ4_NL`, `IQ4_XS` (`crate::quant_k_ext`).
//!
//! Each type's [`Decode`] writes a block's exact values (those of the scalar references, by
//! the same integer unpacking and the same f32 operations; a product with an exact `q · d` may
//! be fused with the following add), or hands them over in registers. The AVX2 row kernels
//! (`quant_ext_simd.rs`) and the AVX-512 ones (`quant_ext_avx512.rs`, whose `Fused` extends
//! [`Decode`]) both read the types through it.
//!
//! Safety: every `unsafe fn` here requires AVX2, FMA and F16C, checked by [`crate::simd`],
//! and the buffer lengths stated in its docs.

#[cfg(target_arch = "x86")]
use std::arch::x86::*;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use crate::quant_k_ext::{scale_iq4xs, scales_q3k, IQ4_TABLE};
use std::ptr::read_unaligned;
// exact f16 → f32 of the 2 bytes at `p`; 8 bytes zero-extended to 8 × i32
use super::avx2::{f16_scalar as f16_at, f16_splat, u8x8 as bytes8};

/// A stored type decoded one block at a time.
pub(super) trait Decode {
    /// elements per block (32 or 256)
    const ELEMS: usize;
    /// bytes per block
    const BYTES: usize;
    /// Writes the `ELEMS` exact values of the block at `p` to `out` (by default, the types
    /// with [`Decode::sub_octets`]: sub-block by sub-block).
    #[inline(always)]
    unsafe fn decode(p: *const u8, out: *mut f32) {
        let s = Self::sub_scales(p);
        for j in 0..Self::ELEMS / 32 {
            store4(out.add(32 * j), Self::sub_octets(p, &s, j));
        }
    }
    /// Whether [`Decode::octets`] is implemented (32-element types: the AVX2 dot then takes
    /// the values in registers).
    const OCTETS: bool = false;
    /// The 32 values of the block at `p` as 4 × 8 lanes.
    #[inline(always)]
    unsafe fn octets(_p: *const u8) -> [__m256; 4] {
        unreachable!("no register decoder")
    }
    /// [`Decode::octets`] for a dot product: the same values but for the sign of a zero
    /// (which no sum starting at `+0` can see).
    #[inline(always)]
    unsafe fn dot_octets(p: *const u8) -> [__m256; 4] {
        Self::octets(p)
    }
    /// Whether [`Decode::natural_rows`] is implemented (the AVX2 one-token dot then takes the
    /// activations permuted once per call).
    const NATURAL: bool = false;
    /// `out[r]` = the canonical dot of row `r` of `data` (rows of `rb` bytes, `cols`
    /// elements) with the activations `xp` in the order of `quant_ext_simd::permute_x`.
    #[inline(always)]
    unsafe fn natural_rows(_data: &[u8], _rb: usize, _cols: usize, _xp: &[f32], _out: &mut [f32]) {
        unreachable!("no natural-order dot")
    }
    /// Whether [`Decode::sub_octets`] is implemented (256-element types whose 32-element
    /// sub-blocks decode in registers once the block's scales are known).
    const SUB_OCTETS: bool = false;
    /// The exact per-group scales (and offsets) of the block at `p`, as
    /// [`Decode::sub_octets`] reads them.
    #[inline(always)]
    unsafe fn sub_scales(_p: *const u8) -> [f32; 32] {
        unreachable!("no register decoder")
    }
    /// The 32 values of sub-block `j` of the block at `p` as 4 × 8 lanes, `s` its
    /// [`Decode::sub_scales`]: the values [`Decode::decode`] writes there.
    #[inline(always)]
    unsafe fn sub_octets(_p: *const u8, _s: &[f32; 32], _j: usize) -> [__m256; 4] {
        unreachable!("no register decoder")
    }
}

/// Stores 4 × 8 values at `out`.
#[inline(always)]
unsafe fn store4(out: *mut f32, v: [__m256; 4]) {
    for (o, vo) in v.iter().enumerate() {
        _mm256_storeu_ps(out.add(8 * o), *vo);
    }
}

/// `v >> s` per 32-bit lane, `s` the same for all lanes.
#[inline(always)]
unsafe fn shr(v: __m256i, s: u32) -> __m256i {
    _mm256_srl_epi32(v, _mm_cvtsi32_si128(s as i32))
}

/// `q * d - m` with one rounding (`q * d` is exact, so this is the scalar `d * q - m`);
/// `d` and `m` are broadcast from memory.
#[inline(always)]
unsafe fn affine(q: __m256i, d: &f32, m: &f32) -> __m256 {
    _mm256_fmsub_ps(
        _mm256_cvtepi32_ps(q),
        _mm256_broadcast_ss(d),
        _mm256_broadcast_ss(m),
    )
}

/// `s * v` for the 8 integers `v` (exact conversion, one product each), stored at `out`.
#[inline(always)]
unsafe fn scaled8(out: *mut f32, s: f32, v: __m256i) {
    _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_set1_ps(s), _mm256_cvtepi32_ps(v)));
}

/// The byte shuffles of [`Q5::bytes`] and [`Q5::octet`], read from memory through an
/// opaque pointer (see [`q5_consts`]).
#[repr(C, align(32))]
struct Q5Consts {
    gather: [i8; 32],
    spread: [i8; 32],
    bit: [u8; 32],
    /// `pick[a]`: byte `4a + j` of each lane into dword `j`, zero-extended
    pick: [[i8; 32]; 4],
    /// qwords shifted by 0, 4, 0, 4
    shift: [i64; 4],
    /// bytes `0x0F`, then `0x10`
    low4: [i8; 32],
    high1: [i8; 32],
}

const fn q5_consts() -> Q5Consts {
    let mut c = Q5Consts {
        gather: [0; 32],
        spread: [0; 32],
        bit: [0; 32],
        pick: pickers(0),
        shift: [0, 4, 0, 4],
        low4: [0xF; 32],
        high1: [0x10; 32],
    };
    let mut i = 0;
    while i < 32 {
        let (l, k) = (i / 16, i % 16);
        // lane l: qs bytes 4l + j (k = j), 8 + 4l + j (k = 4 + j), then the same again
        c.gather[i] = (4 * l + 8 * ((k / 4) % 2) + k % 4) as i8;
        c.spread[i] = (k / 4) as i8;
        c.bit[i] = 1 << (4 * l + k % 4);
        i += 1;
    }
    c
}

static Q5_CONSTS: Q5Consts = q5_consts();

/// `vpshufb` controls: `[a]` puts byte `4a + j` of each lane into byte `at` of dword `j`, the
/// other bytes zero.
const fn pickers(at: usize) -> [[i8; 32]; 4] {
    let mut p = [[-1; 32]; 4];
    let mut i = 0;
    while i < 32 {
        let k = i % 16;
        if k % 4 == at {
            let mut a = 0;
            while a < 4 {
                p[a][i] = (4 * a + k / 4) as i8;
                a += 1;
            }
        }
        i += 1;
    }
    p
}

/// The constants of [`q5_0_rows`]' blocks (the bytes of each lane in the natural order).
#[repr(C, align(32))]
struct Q5Natural {
    /// qwords shifted by 0, 0, 4, 4: lane 1 gets the `qs` bytes' high nibbles
    shift: [i64; 4],
    low4: [i8; 32],
    /// byte `k` of lane `l`: `qh` byte `2l + k / 8`, bit `k % 8`
    spread: [i8; 32],
    bit: [u8; 32],
    /// `0x10`, negated where `bit` is `0x80` (a negative byte: `vpsignb` negates it back)
    high1: [i8; 32],
}

const fn q5_natural() -> Q5Natural {
    let mut c = Q5Natural {
        shift: [0, 0, 4, 4],
        low4: [0xF; 32],
        spread: [0; 32],
        bit: [0; 32],
        high1: [0x10; 32],
    };
    let mut i = 0;
    while i < 32 {
        let (l, k) = (i / 16, i % 16);
        c.spread[i] = (2 * l + k / 8) as i8;
        c.bit[i] = 1 << (k % 8);
        c.high1[i] = if k % 8 == 7 { -0x10 } else { 0x10 };
        i += 1;
    }
    c
}

static Q5_NATURAL: Q5Natural = q5_natural();

/// Blocks per segment of a row in [`q5_0_rows`] (even).
const SEG_BLOCKS: usize = 64;

/// The scales of a segment's blocks: `d` and `(2^15 + 16)·d` (256 bytes after `d`, as
/// [`q5_0_block`] reads them).
#[repr(C, align(32))]
struct Q5Scales {
    d: [f32; SEG_BLOCKS],
    dc: [f32; SEG_BLOCKS],
}

/// One Q5_0 block of [`q5_0_rows`] in assembly: its 32 values in the natural order of each
/// lane, then into 4 accumulators. `$b`: the block's byte offset from `{p}`; `$d`: its
/// scale's byte offset in the table `{d}` ([`Q5Scales`]: `d`, then `(2^15 + 16)·d` 256
/// bytes on); `$x`: the activations' byte offset from `{x}`; `$a0 .. $a3` the accumulators.
/// Registers: `ymm8` the words `0x4700`, `ymm9` the `qh` spread control, `ymm11` the bit
/// masks; `{c}` the other constants of [`Q5Natural`] (shift, low4 at 0, 32; high1 at 128);
/// `ymm10`, `ymm12..15` scratch.
#[rustfmt::skip]
macro_rules! q5_0_block {
    ($b:literal, $d:literal, $x:literal, $a0:literal, $a1:literal, $a2:literal, $a3:literal) => {
        concat!(
            // q: the 16 `qs` bytes in both lanes, lane 1's shifted by 4: low nibbles of
            // elements 0..16 | 16..32; or'ed with 0x10 where the element's `qh` bit is set
            "vbroadcasti128 ymm12, xmmword ptr [{p} + ", $b, " + 6]\n",
            "vpsrlvq ymm12, ymm12, ymmword ptr [{c}]\n",
            "vpand ymm12, ymm12, ymmword ptr [{c} + 32]\n",
            // (the element's bit isolated: 0 or `1 << k`, negative for k = 7; `vpsignb`
            // turns it into 0 or 0x10 with `high1`'s signs: one op fewer than compare + mask)
            "vpbroadcastd ymm13, dword ptr [{p} + ", $b, " + 2]\n",
            "vpshufb ymm13, ymm13, ymm9\n",
            "vpand ymm13, ymm13, ymm11\n",
            "vmovdqa ymm14, ymmword ptr [{c} + 128]\n",
            "vpsignb ymm13, ymm14, ymm13\n",
            "vpor ymm12, ymm12, ymm13\n",
            // the bytes as the high bytes of words, the words as the low halves of the
            // dwords 0x4700_0000 + (q << 8), the f32 2^15 + q (as `Q5::q5_0_dot`)
            "vpxor xmm13, xmm13, xmm13\n",
            "vpunpckhbw ymm14, ymm13, ymm12\n",
            "vpunpcklbw ymm13, ymm13, ymm12\n",
            // d and (2^15 + 16)·d (exact) from the table: loads, no vector op
            "vbroadcastss ymm12, dword ptr [{d} + ", $d, "]\n",
            "vbroadcastss ymm15, dword ptr [{d} + ", $d, " + 256]\n",
            q5_0_octet!("vpunpcklwd", "ymm10", "ymm13", $a0, $x, "0"),
            q5_0_octet!("vpunpckhwd", "ymm10", "ymm13", $a1, $x, "32"),
            q5_0_octet!("vpunpcklwd", "ymm13", "ymm14", $a2, $x, "64"),
            q5_0_octet!("vpunpckhwd", "ymm14", "ymm14", $a3, $x, "96"),
        )
    };
}

/// An octet of [`q5_0_block`]: the dwords `0x4700_0000 + (q << 8)` (the f32 `2^15 + q`)
/// unpacked from the words of `$w` into `$v`, `(2^15 + q)·d − (2^15 + 16)·d = (q − 16)·d`
/// (exact), then into the accumulator `$a` with the activations at `{x} + $x + $o`.
#[rustfmt::skip]
macro_rules! q5_0_octet {
    ($unpack:literal, $v:literal, $w:literal, $a:literal, $x:literal, $o:literal) => {
        concat!(
            $unpack, " ", $v, ", ", $w, ", ymm8\n",
            "vfmsub213ps ", $v, ", ymm12, ymm15\n",
            "vfmadd231ps ", $a, ", ", $v, ", ymmword ptr [{x} + ", $x, " + ", $o, "]\n",
        )
    };
}

/// `out[r]` = the canonical dot of row `r` of the Q5_0 rows `data` (rows of `rb` bytes,
/// `cols` elements) with the activations `xp` in the order of `quant_ext_simd::permute_x`.
///
/// Each block's bytes in the natural order of each lane (byte `k` of lane `l` is element
/// `16l + k`; no gathering shuffle) give vectors `a` of elements `4a .. 4a + 4` (lane 0) and
/// `16 + 4a ..` (lane 1), the values of [`Q5::q5_0_dot`]. Accumulator `4i + a` of a block
/// pair holds canonical lanes `32i + 4a ..` in its low half and `32i + 16 + 4a ..` in its high
/// half; they are put back in the canonical order before the reduction, so each canonical
/// lane takes the same products in the same order as [`Decode::dot_octets`]' dot. Written in
/// assembly for its registers: 8 accumulators, 3 constants and 5 scratch registers, the
/// other constants read from memory (from Rust, LLVM spilled accumulators, or reloaded all
/// constants every block when they came through [`super::avx2::opaque`]). The scales are
/// converted 8 blocks at a time into a table ([`Q5Scales`]) that the blocks read by
/// broadcast loads (no vector op per block for them).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_0_rows(data: &[u8], rb: usize, cols: usize, xp: &[f32], out: &mut [f32]) {
    debug_assert!(data.len() >= out.len() * rb && xp.len() == cols && rb == cols / 32 * 22);
    let mag = _mm256_set1_epi16(0x4700);
    let c16 = _mm256_set1_ps(32784.0);
    let c: *const Q5Natural = &Q5_NATURAL;
    let bit = _mm256_load_si256((*c).bit.as_ptr() as *const __m256i);
    let spread = _mm256_load_si256((*c).spread.as_ptr() as *const __m256i);
    // the prefetch at least MIN_AHEAD ahead: one row (616 bytes for Qwen2.5's 896 columns)
    // is too close for the lines to arrive in time (1 thread, CPU time, Xeon: 5.2–5.5 GB/s
    // one row ahead, 6.5–7.0 with 16 KiB, 6.0–6.8 with 32 KiB)
    let (blocks, xp, dist) = (cols / 32, xp.as_ptr(), rb.max(super::MIN_AHEAD));
    let mut t = Q5Scales {
        d: [0.0; SEG_BLOCKS],
        dc: [0.0; SEG_BLOCKS],
    };
    let (mut rows8, out_ptr) = (Folded8::new(out.len()), out.as_mut_ptr());
    for r in 0..out.len() {
        let row = data.as_ptr().add(r * rb);
        let mut a = [_mm256_setzero_ps(); 8];
        let mut b0 = 0;
        while b0 < blocks {
            // SEG_BLOCKS is even: a segment starts at an even block (accumulators 0..4)
            let n = SEG_BLOCKS.min(blocks - b0);
            let seg = row.add(22 * b0);
            // the scales, 8 at a time: the words gathered in two scalar registers (stored
            // one at a time, a vector load of them waited for the stores), converted, and
            // (2^15 + 16)·d; whole groups without a test per word (the tests cost a tenth of
            // a row of 28 blocks), the segment's last words past `n` as zeros
            let mut put = |i: usize, lo: u64, hi: u64| {
                let v = _mm256_cvtph_ps(_mm_set_epi64x(hi as i64, lo as i64));
                _mm256_store_ps(t.d.as_mut_ptr().add(i), v);
                _mm256_store_ps(t.dc.as_mut_ptr().add(i), _mm256_mul_ps(v, c16));
            };
            let word = |b: usize| u64::from(read_unaligned(seg.add(22 * b) as *const u16));
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
            let (xs, d) = (xp.add(32 * b0), t.d.as_ptr());
            for u in 0..n / 2 {
                let p = seg.add(44 * u);
                super::prefetch(p.wrapping_add(dist), 44);
                std::arch::asm!(
                    q5_0_block!("0", "0", "0", "ymm0", "ymm1", "ymm2", "ymm3"),
                    q5_0_block!("22", "4", "128", "ymm4", "ymm5", "ymm6", "ymm7"),
                    p = in(reg) p,
                    d = in(reg) d.add(2 * u),
                    x = in(reg) xs.add(64 * u),
                    c = in(reg) c,
                    inout("ymm0") a[0], inout("ymm1") a[1], inout("ymm2") a[2], inout("ymm3") a[3],
                    inout("ymm4") a[4], inout("ymm5") a[5], inout("ymm6") a[6], inout("ymm7") a[7],
                    in("ymm8") mag, in("ymm9") spread, in("ymm11") bit,
                    out("ymm10") _, out("ymm12") _, out("ymm13") _, out("ymm14") _, out("ymm15") _,
                    options(nostack, readonly, preserves_flags),
                );
            }
            if n % 2 != 0 {
                // the row's last block
                let u = n / 2;
                std::arch::asm!(
                    q5_0_block!("0", "0", "0", "ymm0", "ymm1", "ymm2", "ymm3"),
                    p = in(reg) seg.add(44 * u),
                    d = in(reg) d.add(2 * u),
                    x = in(reg) xs.add(64 * u),
                    c = in(reg) c,
                    inout("ymm0") a[0], inout("ymm1") a[1], inout("ymm2") a[2], inout("ymm3") a[3],
                    in("ymm8") mag, in("ymm9") spread, in("ymm11") bit,
                    out("ymm10") _, out("ymm12") _, out("ymm13") _, out("ymm14") _, out("ymm15") _,
                    options(nostack, readonly, preserves_flags),
                );
            }
            b0 += n;
        }
        rows8.put(r, natural_fold(&a), out_ptr);
    }
}

/// The constants of [`q6k_rows`]: the dword pickers (`pick[a]`: byte `4a + j` of each lane
/// into the high byte of dword `j`, zeros below), the masks of the `ql` nibbles and of the
/// `qh` bit pairs (at bits 4, 5), and the bytes `0x20`.
#[repr(C, align(32))]
struct Q6Consts {
    pick: [[i8; 32]; 4],
    low4: [i8; 32],
    bits45: [i8; 32],
    c32: [i8; 32],
}

const fn q6_consts() -> Q6Consts {
    Q6Consts {
        pick: pickers(3),
        low4: [0xF; 32],
        bits45: [0x30; 32],
        c32: [0x20; 32],
    }
}

static Q6_CONSTS: Q6Consts = q6_consts();

/// Blocks per segment of a row in [`q6k_rows`] (the scales of a segment are converted into
/// a table first).
const Q6_SEG: usize = 16;

/// Per block of a segment and per quarter `4n + m` (elements `128n + 32m ..`), the scales
/// `2^-24 · d · sc_g` of its two groups `g = 8n + 2m`, `g + 1`, each in 4 lanes (the lanes of
/// the quarter's first and second 16 elements, see [`q6k_rows`]).
#[repr(C, align(32))]
struct Q6Scales([[f32; 8]; 8 * Q6_SEG]);

/// The 6-bit values of a quarter of [`q6k_block`] into `ymm12` (the `ql` nibbles) and
/// `ymm13` (the `qh` bit pair at bits 4, 5): `lo`: the low nibbles of the `ql` bytes at
/// `{p} + $ql`, the `qh` bytes at `{p} + $qh` shifted left by `$shl`; `hi2`: the high
/// nibbles, the `qh` bits 4, 5 in place; `hi3`: the high nibbles, `qh` shifted right by 2.
#[rustfmt::skip]
macro_rules! q6k_bits {
    (lo, $ql:literal, $qh:literal, $shl:literal) => {
        concat!(
            "vpand ymm12, ymm10, ymmword ptr [{p} + ", $ql, "]\n",
            "vmovdqu ymm13, ymmword ptr [{p} + ", $qh, "]\n",
            "vpsllw ymm13, ymm13, ", $shl, "\n",
            "vpand ymm13, ymm13, ymm11\n",
        )
    };
    (hi2, $ql:literal, $qh:literal) => {
        concat!(
            "vmovdqu ymm12, ymmword ptr [{p} + ", $ql, "]\n",
            "vpsrlw ymm12, ymm12, 4\n",
            "vpand ymm12, ymm12, ymm10\n",
            "vpand ymm13, ymm11, ymmword ptr [{p} + ", $qh, "]\n",
        )
    };
    (hi3, $ql:literal, $qh:literal) => {
        concat!(
            "vmovdqu ymm12, ymmword ptr [{p} + ", $ql, "]\n",
            "vpsrlw ymm12, ymm12, 4\n",
            "vpand ymm12, ymm12, ymm10\n",
            "vmovdqu ymm13, ymmword ptr [{p} + ", $qh, "]\n",
            "vpsrlw ymm13, ymm13, 2\n",
            "vpand ymm13, ymm13, ymm11\n",
        )
    };
}

/// A 32-element quarter of [`q6k_block`]: its bytes `q` from [`q6k_bits`] (byte `k` of lane
/// `l` is element `16l + k`), `q − 32` (a signed byte), then octet by octet `a` the bytes
/// `4a ..` of each lane into the high bytes of dwords (`vpshufb`: the integers `(q − 32)·2^24`
/// of elements `4a ..` and `16 + 4a ..`), converted (exact), times the quarter's scales
/// (`{s} + $s`: `2^-24·d·sc` of the first group in the low lane, of the second in the high
/// lane): the one rounding of the exact `d·sc·(q − 32)`, the scalar value; into the
/// accumulators `$a0 .. $a3` with the permuted activations at `{x} + $x`.
#[rustfmt::skip]
macro_rules! q6k_quarter {
    ($bits:expr, $s:literal, $x:literal, $a0:literal, $a1:literal, $a2:literal, $a3:literal) => {
        concat!(
            $bits,
            "vpor ymm12, ymm12, ymm13\n",
            "vpsubb ymm12, ymm12, ymmword ptr [{c} + 192]\n",
            "vmovaps ymm14, ymmword ptr [{s} + ", $s, "]\n",
            q6k_octet!("ymm8", $a0, $x, "0"),
            q6k_octet!("ymm9", $a1, $x, "32"),
            q6k_octet!("ymmword ptr [{c} + 64]", $a2, $x, "64"),
            q6k_octet!("ymmword ptr [{c} + 96]", $a3, $x, "96"),
        )
    };
}

/// An octet of [`q6k_quarter`]: the dwords picked from `ymm12` by `$pick`, converted, scaled
/// by `ymm14`, into the accumulator `$a` with the activations at `{x} + $x + $o`.
#[rustfmt::skip]
macro_rules! q6k_octet {
    ($pick:literal, $a:literal, $x:literal, $o:literal) => {
        concat!(
            "vpshufb ymm15, ymm12, ", $pick, "\n",
            "vcvtdq2ps ymm15, ymm15\n",
            "vmulps ymm15, ymm15, ymm14\n",
            "vfmadd231ps ", $a, ", ymm15, ymmword ptr [{x} + ", $x, " + ", $o, "]\n",
        )
    };
}

/// One Q6_K block of [`q6k_rows`]: its 8 quarters (elements `32m ..` of each 128-element half
/// `n`: the `ql` bytes at `64n + 32 (m % 2)`, low nibbles for `m < 2`, the `qh` bits `2m,
/// 2m + 1` of the bytes at `128 + 32n`). Quarter `m` goes to accumulators `4 (m % 2) ..`.
/// Registers: `ymm0..7` the accumulators, `ymm8`, `ymm9` the first two pickers, `ymm10`,
/// `ymm11` the masks; `ymm12..15` scratch.
#[rustfmt::skip]
macro_rules! q6k_block {
    () => {
        concat!(
            q6k_quarter!(q6k_bits!(lo, "0", "128", "4"), "0", "0", "ymm0", "ymm1", "ymm2", "ymm3"),
            q6k_quarter!(q6k_bits!(lo, "32", "128", "2"), "32", "128", "ymm4", "ymm5", "ymm6", "ymm7"),
            q6k_quarter!(q6k_bits!(hi2, "0", "128"), "64", "256", "ymm0", "ymm1", "ymm2", "ymm3"),
            q6k_quarter!(q6k_bits!(hi3, "32", "128"), "96", "384", "ymm4", "ymm5", "ymm6", "ymm7"),
            q6k_quarter!(q6k_bits!(lo, "64", "160", "4"), "128", "512", "ymm0", "ymm1", "ymm2", "ymm3"),
            q6k_quarter!(q6k_bits!(lo, "96", "160", "2"), "160", "640", "ymm4", "ymm5", "ymm6", "ymm7"),
            q6k_quarter!(q6k_bits!(hi2, "64", "160"), "192", "768", "ymm0", "ymm1", "ymm2", "ymm3"),
            q6k_quarter!(q6k_bits!(hi3, "96", "160"), "224", "896", "ymm4", "ymm5", "ymm6", "ymm7"),
        )
    };
}

/// `out[r]` = the canonical dot of row `r` of the Q6_K rows `data` (rows of `rb` bytes, `cols`
/// elements) with the activations `xp` in the order of `quant_ext_simd::permute_x`.
///
/// As [`q5_0_rows`]: each quarter's bytes in the natural order of each lane (no cross-lane
/// shuffle), vectors `a` of elements `4a .. 4a + 4` (low half) and `16 + 4a ..` (high half),
/// accumulator `4i + a` holding canonical lanes `32i + 4a ..` and `32i + 16 + 4a ..`, put back
/// in the canonical order before the reduction: every canonical lane takes the same products
/// in the same order. The halves of a vector belong to two groups, so the scales come from a
/// table of one vector per quarter ([`Q6Scales`], built per segment of the row). Written in
/// assembly for its registers: 8 accumulators, 2 pickers and 2 masks for the whole call, 4
/// scratch registers (from Rust, LLVM reloaded constants or spilled accumulators).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn q6k_rows(data: &[u8], rb: usize, cols: usize, xp: &[f32], out: &mut [f32]) {
    debug_assert!(data.len() >= out.len() * rb && xp.len() == cols && rb == cols / 256 * 210);
    let c: *const Q6Consts = &Q6_CONSTS;
    let ld = |v: &[i8; 32]| _mm256_load_si256(v.as_ptr() as *const __m256i);
    let (pick0, pick1) = (ld(&(*c).pick[0]), ld(&(*c).pick[1]));
    let (low4, bits45) = (ld(&(*c).low4), ld(&(*c).bits45));
    // 2^-24: `d·2^-24` and `d·2^-24·sc` are exact (an f16 times a power of two and an i8)
    let unit = _mm256_set1_ps(1.0 / 16_777_216.0);
    // the 8 scales of a half in the order 0, 2, 4, 6, 1, 3, 5, 7 (`[2k | 2k + 1]` in-lane)
    let order = _mm_set_epi8(-1, -1, -1, -1, -1, -1, -1, -1, 7, 5, 3, 1, 6, 4, 2, 0);
    let (blocks, dist) = (cols / 256, rb.max(super::MIN_AHEAD));
    let mut t = Q6Scales([[0.0; 8]; 8 * Q6_SEG]);
    let (mut rows8, out_ptr) = (Folded8::new(out.len()), out.as_mut_ptr());
    for r in 0..out.len() {
        let row = data.as_ptr().add(r * rb);
        let mut a = [_mm256_setzero_ps(); 8];
        let mut b0 = 0;
        while b0 < blocks {
            let n = Q6_SEG.min(blocks - b0);
            let seg = row.add(210 * b0);
            for b in 0..n {
                let p = seg.add(210 * b);
                let d = _mm256_mul_ps(f16_splat(p.add(208)), unit);
                for h in 0..2 {
                    let sc = _mm_loadl_epi64(p.add(192 + 8 * h) as *const __m128i);
                    let sc = _mm256_cvtepi8_epi32(_mm_shuffle_epi8(sc, order));
                    let ds = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
                    let q = t.0.as_mut_ptr().add(8 * b + 4 * h) as *mut f32;
                    _mm256_store_ps(q, _mm256_permute_ps::<0x00>(ds));
                    _mm256_store_ps(q.add(8), _mm256_permute_ps::<0x55>(ds));
                    _mm256_store_ps(q.add(16), _mm256_permute_ps::<0xAA>(ds));
                    _mm256_store_ps(q.add(24), _mm256_permute_ps::<0xFF>(ds));
                }
            }
            let xs = xp.as_ptr().add(256 * b0);
            for b in 0..n {
                let p = seg.add(210 * b);
                super::prefetch(p.wrapping_add(dist), 210);
                std::arch::asm!(
                    q6k_block!(),
                    p = in(reg) p,
                    s = in(reg) t.0.as_ptr().add(8 * b),
                    x = in(reg) xs.add(256 * b),
                    c = in(reg) c,
                    inout("ymm0") a[0], inout("ymm1") a[1], inout("ymm2") a[2], inout("ymm3") a[3],
                    inout("ymm4") a[4], inout("ymm5") a[5], inout("ymm6") a[6], inout("ymm7") a[7],
                    in("ymm8") pick0, in("ymm9") pick1, in("ymm10") low4, in("ymm11") bits45,
                    out("ymm12") _, out("ymm13") _, out("ymm14") _, out("ymm15") _,
                    options(nostack, readonly, preserves_flags),
                );
            }
            b0 += n;
        }
        rows8.put(r, natural_fold(&a), out_ptr);
    }
}

/// The canonical fold (`avx2::fold`) of the accumulators of the natural-order dots
/// ([`q5_0_rows`], [`q6k_rows`]): accumulator `4i + a` holds canonical lanes `32i + 4a ..`
/// (low half) and `32i + 16 + 4a ..` (high half). The canonical accumulators are 128-bit
/// halves of these put together, and the fold's additions are lane by lane, so adding first
/// and moving the halves after gives the same sums of the same operands: with `s = a0 + a4`,
/// `t = a1 + a5`, `(c0 + c4) + (c2 + c6)` is `[s.lo | t.lo] + [s.hi | t.hi]` (4 shuffles in
/// place of 8).
#[inline(always)]
unsafe fn natural_fold(a: &[__m256; 8]) -> __m256 {
    let lo = |x: __m256, y: __m256| _mm256_permute2f128_ps::<0x20>(x, y);
    let hi = |x: __m256, y: __m256| _mm256_permute2f128_ps::<0x31>(x, y);
    let (s, t) = (_mm256_add_ps(a[0], a[4]), _mm256_add_ps(a[1], a[5]));
    let (u, v) = (_mm256_add_ps(a[2], a[6]), _mm256_add_ps(a[3], a[7]));
    _mm256_add_ps(
        _mm256_add_ps(lo(s, t), hi(s, t)),
        _mm256_add_ps(lo(u, v), hi(u, v)),
    )
}

/// Folded rows waiting for the horizontal part of the canonical reduction: 8 at a time by
/// one transposed tree (`avx2::hsum8`), the last few one by one.
struct Folded8 {
    u: [__m256; 8],
    /// the rows in whole groups of 8 (the rows from `whole` on reduce alone)
    whole: usize,
}

impl Folded8 {
    #[inline(always)]
    unsafe fn new(rows: usize) -> Folded8 {
        Folded8 {
            u: [_mm256_setzero_ps(); 8],
            whole: rows / 8 * 8,
        }
    }

    /// Row `r`'s folded vector `f` (rows in order, `r` below the count given to `new`); its
    /// sum goes to `out[r]`, at the latest with row `r | 7`'s.
    #[inline(always)]
    unsafe fn put(&mut self, r: usize, f: __m256, out: *mut f32) {
        if r >= self.whole {
            *out.add(r) = super::avx2::hsum(f);
            return;
        }
        self.u[r % 8] = f;
        if r % 8 == 7 {
            _mm256_storeu_ps(out.add(r - 7), super::avx2::hsum8(&self.u));
        }
    }
}

pub(super) struct Q5<const MIN: bool>;
impl<const MIN: bool> Q5<MIN> {
    /// The 32 five-bit values `q` of the block at `p` as bytes in a transposed order: byte
    /// `4a + j` of lane `l` is element `8a + 4l + j`, so that one in-lane byte shuffle per
    /// octet `a` zero-extends its 8 values into the 8 dword lanes (no cross-lane shuffle).
    ///
    /// The shuffle controls come from memory through an empty `asm!` that LLVM cannot see
    /// through: with constants, it turned the broadcasts and in-lane shuffles into
    /// cross-lane ones (`vpshufd` + `vpermq`, `vpunpcklbw` ×2 + `vpermq`); and as the
    /// barrier clobbers memory, the block's loads stay after the previous block's fmas
    /// (decoding two blocks ahead spilled the accumulators). Both cost 8.3 → 7.2 GB/s.
    #[inline(always)]
    unsafe fn bytes(p: *const u8) -> (__m256i, *const Q5Consts) {
        let mut c: *const Q5Consts = &Q5_CONSTS;
        std::arch::asm!("/* {0} */", inout(reg) c, options(nostack, preserves_flags));
        let ld = |v: &[i8; 32]| _mm256_load_si256(v.as_ptr() as *const __m256i);
        let off = if MIN { 4 } else { 2 };
        // low nibbles: lane l gathers `qs` bytes 4l.., 8 + 4l.. (elements 4l.., 8 + 4l..)
        // twice; the second copy (qword 1) shifted by 4 gives their high nibbles (+16)
        let qs = _mm256_broadcastsi128_si256(_mm_loadu_si128(p.add(off + 4) as *const __m128i));
        let t = _mm256_srlv_epi64(
            _mm256_shuffle_epi8(qs, ld(&(*c).gather)),
            _mm256_load_si256((*c).shift.as_ptr() as *const __m256i),
        );
        let nib = _mm256_and_si256(t, ld(&(*c).low4));
        // the high bit of element 8a + 4l + j is bit 4l + j of `qh` byte a: that byte in
        // the position, masked by the bit and compared with it (0xFF where set)
        let qh = _mm256_set1_epi32(read_unaligned(p.add(off) as *const u32) as i32);
        let bit = _mm256_load_si256((*c).bit.as_ptr() as *const __m256i);
        let spread = _mm256_shuffle_epi8(qh, ld(&(*c).spread));
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
        let q = _mm256_or_si256(nib, _mm256_and_si256(set, ld(&(*c).high1)));
        (q, c)
    }

    /// Octet `a` (elements `8a .. 8a + 8`) of [`Q5::bytes`] as 8 × f32 (exact).
    #[inline(always)]
    unsafe fn octet((q, c): (__m256i, *const Q5Consts), a: usize) -> __m256 {
        let pick = _mm256_load_si256((*c).pick[a].as_ptr() as *const __m256i);
        _mm256_cvtepi32_ps(_mm256_shuffle_epi8(q, pick))
    }

    /// The block's values (`q * d + m`, or Q5_0's `(q - 16) * d`), `EXACT` the sign of a
    /// zero too; without it Q5_0 takes [`Q5::q5_0_dot`] (the same exact values, but `+0`
    /// where `q = 16` and `d < 0`: the same sums in a dot, whose accumulators start at `+0`).
    #[inline(always)]
    unsafe fn values<const EXACT: bool>(p: *const u8) -> [__m256; 4] {
        let d = f16_splat(p);
        let q = Self::bytes(p);
        if MIN {
            // q * d exact: one rounding, like q * d + m
            let m = f16_splat(p.add(2));
            std::array::from_fn(|a| _mm256_fmadd_ps(Self::octet(q, a), d, m))
        } else if EXACT {
            let c16 = _mm256_set1_ps(16.0);
            std::array::from_fn(|a| _mm256_mul_ps(_mm256_sub_ps(Self::octet(q, a), c16), d))
        } else {
            Self::q5_0_dot(q.0, d)
        }
    }

    /// Q5_0's values for a dot product from [`Q5::bytes`] `q` and the scale `d`, without an
    /// integer conversion: each byte `q` becomes the high byte of a word (unpacked with zeros)
    /// and the word the low half of a dword whose high half is `0x4700` (unpacked with that),
    /// the f32 bits of `2^15 + q`. Then `(2^15 + q)·d − (2^15 + 16)·d` in one fms: the product
    /// `(2^15 + 16)·d` is exact (12 significant bits times the 11 of an f16), so the one
    /// rounding is that of the exact `(q − 16)·d`, which an f32 holds: the exact value, as the
    /// scalar `(q − 16)·d`, but `+0` for `q = 16`. Six in-lane unpacks take the place of four
    /// shuffles from memory and four conversions, and need no control vectors (a vector load
    /// each per block before: the AVX2 dot was bound by loads, two a cycle on Zen 5).
    #[inline(always)]
    unsafe fn q5_0_dot(q: __m256i, d: __m256) -> [__m256; 4] {
        // (LLVM keeps the constants in registers; the same speed with them hidden behind
        // an `asm!`, unlike `bytes`' shuffle controls)
        let (zero, mag) = (_mm256_setzero_si256(), _mm256_set1_epi16(0x4700));
        let dc = _mm256_mul_ps(d, _mm256_set1_ps(32784.0)); // (2^15 + 16)·d, exact
        let (lo, hi) = (_mm256_unpacklo_epi8(zero, q), _mm256_unpackhi_epi8(zero, q));
        // octet a: bytes 4a .. 4a + 4 of each lane
        let o = [
            _mm256_unpacklo_epi16(lo, mag),
            _mm256_unpackhi_epi16(lo, mag),
            _mm256_unpacklo_epi16(hi, mag),
            _mm256_unpackhi_epi16(hi, mag),
        ];
        o.map(|v| _mm256_fmsub_ps(_mm256_castsi256_ps(v), d, dc))
    }
}

impl<const MIN: bool> Decode for Q5<MIN> {
    const ELEMS: usize = 32;
    const BYTES: usize = if MIN { 24 } else { 22 };
    #[inline(always)]
    unsafe fn decode(p: *const u8, out: *mut f32) {
        store4(out, Self::values::<true>(p))
    }
    const OCTETS: bool = true;
    #[inline(always)]
    unsafe fn octets(p: *const u8) -> [__m256; 4] {
        Self::values::<true>(p)
    }
    #[inline(always)]
    unsafe fn dot_octets(p: *const u8) -> [__m256; 4] {
        Self::values::<false>(p)
    }
    const NATURAL: bool = !MIN;
    #[inline(always)]
    unsafe fn natural_rows(data: &[u8], rb: usize, cols: usize, xp: &[f32], out: &mut [f32]) {
        q5_0_rows(data, rb, cols, xp, out)
    }
}

/// One 32-element IQ4 block of scale `d` over the 16 bytes at `qs`: table lookups by byte
/// shuffle, then `d * value` (exact).
#[inline(always)]
unsafe fn iq4_octets(d: f32, qs: *const u8) -> [__m256; 4] {
    let table = _mm_loadu_si128(IQ4_TABLE.as_ptr() as *const __m128i);
    let q = _mm_loadu_si128(qs as *const __m128i);
    let m4 = _mm_set1_epi8(0xF);
    let lo = _mm_shuffle_epi8(table, _mm_and_si128(q, m4));
    let hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(q, 4), m4));
    let d = _mm256_set1_ps(d);
    let v = [lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)];
    let mut w = [_mm256_setzero_ps(); 4];
    for (wo, vo) in w.iter_mut().zip(v) {
        *wo = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(vo)));
    }
    w
}

pub(super) struct IQ4NL;
impl Decode for IQ4NL {
    const ELEMS: usize = 32;
    const BYTES: usize = 18;
    #[inline(always)]
    unsafe fn decode(p: *const u8, out: *mut f32) {
        store4(out, Self::octets(p))
    }
    const OCTETS: bool = true;
    #[inline(always)]
    unsafe fn octets(p: *const u8) -> [__m256; 4] {
        iq4_octets(f16_at(p), p.add(2))
    }
}

pub(super) struct IQ4XS;
impl Decode for IQ4XS {
    const ELEMS: usize = 256;
    const BYTES: usize = 136;
    const SUB_OCTETS: bool = true;
    /// `d * (ls - 32)` of the 8 sub-blocks, then zeros
    #[inline(always)]
    unsafe fn sub_scales(p: *const u8) -> [f32; 32] {
        let blk = std::slice::from_raw_parts(p, 8);
        let mut ls = [0i32; 8];
        for (i, l) in ls.iter_mut().enumerate() {
            *l = scale_iq4xs(blk, i) - 32;
        }
        let mut dl = [0f32; 32]; // d * (ls - 32) per block
        scaled8(
            dl.as_mut_ptr(),
            f16_at(p),
            _mm256_loadu_si256(ls.as_ptr() as *const __m256i),
        );
        dl
    }
    #[inline(always)]
    unsafe fn sub_octets(p: *const u8, s: &[f32; 32], j: usize) -> [__m256; 4] {
        iq4_octets(s[j], p.add(8 + 16 * j))
    }
}

pub(super) struct Q2K;
impl Decode for Q2K {
    const ELEMS: usize = 256;
    const BYTES: usize = 84;
    const SUB_OCTETS: bool = true;
    /// `d * sc_g` for the 16 groups, then `dmin * m_g`
    #[inline(always)]
    unsafe fn sub_scales(p: *const u8) -> [f32; 32] {
        let mut s = [0f32; 32];
        let m4 = _mm256_set1_epi32(0xF);
        for (i, at) in [0, 8].into_iter().enumerate() {
            let sc = bytes8(p.add(at));
            scaled8(
                s.as_mut_ptr().add(8 * i),
                f16_at(p.add(80)),
                _mm256_and_si256(sc, m4),
            );
            scaled8(
                s.as_mut_ptr().add(16 + 8 * i),
                f16_at(p.add(82)),
                _mm256_srli_epi32(sc, 4),
            );
        }
        s
    }
    /// Sub-block `4 n + j`: bits `2 j` of the 32 bytes of half `n`, groups `8 n + 2 j + h`.
    #[inline(always)]
    unsafe fn sub_octets(p: *const u8, s: &[f32; 32], sb: usize) -> [__m256; 4] {
        let (n, j) = (sb / 4, sb % 4);
        let q = p.add(16 + 32 * n);
        let m3 = _mm256_set1_epi32(3);
        let mut w = [_mm256_setzero_ps(); 4];
        for (o, wo) in w.iter_mut().enumerate() {
            let (h, k) = (o / 2, o % 2);
            let g = 8 * n + 2 * j + h;
            let v = _mm256_and_si256(shr(bytes8(q.add(8 * (2 * h + k))), 2 * j as u32), m3);
            *wo = affine(v, &s[g], &s[16 + g]);
        }
        w
    }
}

pub(super) struct Q3K;
impl Decode for Q3K {
    const ELEMS: usize = 256;
    const BYTES: usize = 110;
    const SUB_OCTETS: bool = true;
    /// `d * (sc_g - 32)` for the 16 groups, then zeros
    #[inline(always)]
    unsafe fn sub_scales(p: *const u8) -> [f32; 32] {
        let sc = scales_q3k(std::slice::from_raw_parts(p.add(96), 12));
        let mut s = [0f32; 32];
        let (d, c32) = (f16_at(p.add(108)), _mm256_set1_epi32(32));
        for i in 0..2 {
            let v = _mm256_sub_epi32(bytes8(sc.as_ptr().add(8 * i)), c32);
            scaled8(s.as_mut_ptr().add(8 * i), d, v);
        }
        s
    }
    /// Sub-block `4 n + j`: bits `2 j` of the 32 bytes of half `n` and bit `4 n + j` of the
    /// high-bit mask, groups `8 n + 2 j + h`.
    #[inline(always)]
    unsafe fn sub_octets(p: *const u8, s: &[f32; 32], sb: usize) -> [__m256; 4] {
        let (n, j) = (sb / 4, sb % 4);
        let q = p.add(32 + 32 * n);
        let (m3, c4, zero) = (
            _mm256_set1_epi32(3),
            _mm256_set1_epi32(4),
            _mm256_setzero_si256(),
        );
        let bit = _mm256_set1_epi32(1 << (4 * n + j));
        let mut w = [_mm256_setzero_ps(); 4];
        for (o, wo) in w.iter_mut().enumerate() {
            let h = o / 2;
            let dl = _mm256_broadcast_ss(&s[8 * n + 2 * j + h]);
            let ql = _mm256_and_si256(shr(bytes8(q.add(8 * o)), 2 * j as u32), m3);
            // a clear high bit subtracts 4
            let hm = bytes8(p.add(8 * o));
            let clear = _mm256_cmpeq_epi32(_mm256_and_si256(hm, bit), zero);
            let qv = _mm256_sub_epi32(ql, _mm256_and_si256(clear, c4));
            *wo = _mm256_mul_ps(dl, _mm256_cvtepi32_ps(qv));
        }
        w
    }
}

pub(super) struct Q5K;
impl Decode for Q5K {
    const ELEMS: usize = 256;
    const BYTES: usize = 176;
    const SUB_OCTETS: bool = true;
    /// `d * sc_k` for the 8 sub-blocks, then `dmin * m_k`, then zeros
    #[inline(always)]
    unsafe fn sub_scales(p: *const u8) -> [f32; 32] {
        let mut s = [0f32; 32];
        s[..16].copy_from_slice(&super::avx2::k4_scales(p));
        s
    }
    /// Sub-block `2 c + h`: nibble `h` of the 32 bytes of chunk `c`, bit `2 c + h` of the
    /// high bits.
    #[inline(always)]
    unsafe fn sub_octets(p: *const u8, s: &[f32; 32], sub: usize) -> [__m256; 4] {
        let (c, h) = (sub / 2, sub % 2);
        let (qh, ql) = (p.add(16), p.add(48 + 32 * c));
        let (m4, one) = (_mm256_set1_epi32(0xF), _mm256_set1_epi32(1));
        let mut w = [_mm256_setzero_ps(); 4];
        for (o, wo) in w.iter_mut().enumerate() {
            let lo = _mm256_and_si256(shr(bytes8(ql.add(8 * o)), 4 * h as u32), m4);
            let hb = _mm256_and_si256(shr(bytes8(qh.add(8 * o)), sub as u32), one);
            let q = _mm256_or_si256(lo, _mm256_slli_epi32(hb, 4));
            *wo = affine(q, &s[sub], &s[8 + sub]);
        }
        w
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Q5_0's dot values (`q5_0_dot`: no conversion, `2^15 + q` by its bits) are the exact
    /// `(q − 16)·d` of every `q` at every position for every finite f16 scale (zero,
    /// subnormal, the largest), but for the sign of a zero.
    #[test]
    fn q5_0_dot_values_are_exact_for_every_scale() {
        if !(is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c"))
        {
            return;
        }
        let mut block = [0u8; 22];
        let mut got = [0f32; 32];
        for shift in 0..32 {
            // element e holds q = (e + shift) mod 32
            let q = |e: usize| (e + shift) % 32;
            let qh: u32 = (0..32).map(|e| ((q(e) >> 4) as u32) << e).sum();
            block[2..6].copy_from_slice(&qh.to_le_bytes());
            for j in 0..16 {
                block[6 + j] = (q(j) & 15) as u8 | ((q(j + 16) & 15) as u8) << 4;
            }
            for bits in 0..=u16::MAX {
                let d = half::f16::from_bits(bits);
                if !d.is_finite() {
                    continue;
                }
                block[..2].copy_from_slice(&bits.to_le_bytes());
                // SAFETY: AVX2, FMA and F16C checked above; `block` is one Q5_0 block
                let w = unsafe { Q5::<false>::dot_octets(block.as_ptr()) };
                for (a, v) in w.iter().enumerate() {
                    // SAFETY: 8 floats into 8 floats
                    unsafe { _mm256_storeu_ps(got.as_mut_ptr().add(8 * a), *v) };
                }
                for (e, g) in got.iter().enumerate() {
                    let want = (q(e) as f32 - 16.0) * d.to_f32();
                    assert!(
                        g.to_bits() == want.to_bits() || (*g == 0.0 && want == 0.0),
                        "d {bits:#06x} q {} at {e}: {g} vs {want}",
                        q(e)
                    );
                }
            }
        }
    }
}
