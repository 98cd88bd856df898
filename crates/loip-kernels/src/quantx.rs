//! The int16 activations of the integer-dot order ([`crate::intdot`], whose module docs
//! define them) and its block sizes: what the portable model and the x86 kernels share.

/// Elements per block (of the weights and of the int16 activations).
pub(crate) const BLOCK: usize = 32;
/// Bytes of one Q8_0 block: an f16 scale and 32 int8.
pub(crate) const Q8_0_BYTES: usize = 34;
/// Bytes of one Q5_0 block: an f16 scale, 32 high bits, 16 bytes of low nibbles.
pub(crate) const Q5_0_BYTES: usize = 22;
/// Largest int16 activation.
const XQ_MAX: f32 = 32767.0;
/// `1.5 · 2^23`: adding and subtracting it rounds to an integer (ties to even).
const MAGIC: f32 = 12_582_912.0;
/// Blocks per scale segment of the SIMD kernels; `dx` rows are padded to a multiple.
pub(crate) const SEG: usize = 16;

/// The int16 activations of `n` tokens: `xq[t * cols + e]`, and per block the factor
/// `dx[t * stride + b]` (`stride` = blocks per row rounded up to [`SEG`], the padding zero).
pub(crate) struct QuantX {
    pub(crate) xq: Vec<i16>,
    pub(crate) dx: Vec<f32>,
    pub(crate) cols: usize,
    pub(crate) stride: usize,
}

impl QuantX {
    /// Tokens held.
    pub(crate) fn tokens(&self) -> usize {
        self.xq.len().checked_div(self.cols).unwrap_or(0)
    }

    /// The activations of tokens `t0 .. t0 + n` (a copy).
    #[cfg(test)]
    pub(crate) fn slice(&self, t0: usize, n: usize) -> QuantX {
        QuantX {
            xq: self.xq[t0 * self.cols..(t0 + n) * self.cols].to_vec(),
            dx: self.dx[t0 * self.stride..(t0 + n) * self.stride].to_vec(),
            cols: self.cols,
            stride: self.stride,
        }
    }
}

/// Canonical int16 quantization of the `x.len() / cols` token rows of `x` (see
/// [`crate::intdot`]'s docs). `cols` must be a multiple of [`BLOCK`].
pub(crate) fn quantize(x: &[f32], cols: usize) -> QuantX {
    debug_assert!(cols % BLOCK == 0 && x.len() % cols.max(1) == 0);
    let nb = cols / BLOCK;
    let stride = nb.next_multiple_of(SEG);
    let n = x.len().checked_div(cols).unwrap_or(0);
    let mut xq = vec![0i16; x.len()];
    let mut dx = vec![0f32; n * stride];
    for t in 0..n {
        let xt = &x[t * cols..(t + 1) * cols];
        let qt = &mut xq[t * cols..(t + 1) * cols];
        let dt = &mut dx[t * stride..t * stride + nb];
        for ((xb, qb), d) in xt
            .chunks_exact(BLOCK)
            .zip(qt.chunks_exact_mut(BLOCK))
            .zip(dt)
        {
            *d = quantize_block(xb, qb);
        }
    }
    QuantX {
        xq,
        dx,
        cols,
        stride,
    }
}

/// One block: writes `xq`, returns `dx`.
#[inline]
fn quantize_block(x: &[f32], xq: &mut [i16]) -> f32 {
    let amax = x
        .iter()
        .map(|v| v.to_bits() & 0x7fff_ffff)
        .fold(0, u32::max);
    if amax >= 0x7f80_0000 {
        return f32::from_bits(amax);
    }
    let d = f32::from_bits(amax) / XQ_MAX;
    if d != 0.0 {
        for (q, &v) in xq.iter_mut().zip(x) {
            // |v / d| <= 32767: the magic addition rounds it to an integer, ties to even
            *q = (((v / d) + MAGIC) - MAGIC) as i16;
        }
    }
    d
}
