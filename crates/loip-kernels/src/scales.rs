//! The 6-bit scales and mins of a `Q4_K` / `Q5_K` block, unpacked as ggml's
//! `get_scale_min_k4`: shared by the scalar decoders (`dequant`, `quant_k_ext`) and the SIMD
//! kernels, below all of them.

/// ggml `get_scale_min_k4`: the 6-bit scale and min of sub-block `j` (0..8) of a Q4_K block.
#[inline]
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// All 8 scales and 8 mins of a Q4_K block from its 12 scale bytes at `q`, as packed bytes
/// (`[sc_0..3, sc_4..7]`, `[m_0..3, m_4..7]`, little-endian): [`scale_min_k4`] for every
/// sub-block at once, with 32-bit integer operations.
///
/// # Safety
/// `q` must point to 12 readable bytes.
#[inline(always)]
#[cfg_attr(
    not(any(target_arch = "x86_64", target_arch = "x86")),
    allow(dead_code)
)]
pub(crate) unsafe fn unpack_scales_k4(q: *const u8) -> [[u32; 2]; 2] {
    let a = std::ptr::read_unaligned(q as *const u32); // bytes 0..4
    let b = std::ptr::read_unaligned(q.add(4) as *const u32); // bytes 4..8
    let c = std::ptr::read_unaligned(q.add(8) as *const u32); // bytes 8..12
    let (a, b, c) = (u32::from_le(a), u32::from_le(b), u32::from_le(c));
    let sc_hi = (c & 0x0F0F_0F0F) | (((a >> 6) & 0x0303_0303) << 4);
    let m_hi = ((c >> 4) & 0x0F0F_0F0F) | (((b >> 6) & 0x0303_0303) << 4);
    [[a & 0x3F3F_3F3F, sc_hi], [b & 0x3F3F_3F3F, m_hi]]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpack_scales_k4_matches_ggml() {
        let mut q = [0u8; 12];
        for seed in 0..200u32 {
            for (i, b) in q.iter_mut().enumerate() {
                *b = (seed.wrapping_mul(2654435761).rotate_left(i as u32 * 5) >> 7) as u8
                    ^ (i as u8 * 37);
            }
            // SAFETY: q has 12 bytes
            let [sc, m] = unsafe { unpack_scales_k4(q.as_ptr()) };
            let (sc, m) = (
                [sc[0].to_le_bytes(), sc[1].to_le_bytes()].concat(),
                [m[0].to_le_bytes(), m[1].to_le_bytes()].concat(),
            );
            for j in 0..8 {
                assert_eq!(scale_min_k4(j, &q), (sc[j], m[j]), "sub-block {j}");
            }
        }
    }
}
