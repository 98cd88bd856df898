//! The canonical order of floating-point operations, and its portable scalar model.
//!
//! Every kernel path (AVX-512, AVX2, scalar) performs exactly these IEEE-754 operations in
//! exactly this order, so results are bit-identical across paths, machines with different
//! SIMD support, batch sizes, thread counts and weight addresses.
//!
//! **Dot product** of a row `w` (already dequantized, exactly) with `x`, `cols` elements:
//! - Elements are split into groups of 16 ([`LANES`]); the `cols % 16` elements after the last
//!   full group form the *tail*.
//! - Group `g` goes to accumulator `g % 4` ([`ACCS`]); lane `l` of an accumulator collects
//!   elements `16 g + l`, in increasing `g`, with a fused multiply-add:
//!   `acc[g % 4][l] = fma(w[16g+l], x[16g+l], acc[g % 4][l])`, starting from `+0.0`.
//! - The accumulators are combined lane-wise as `(acc0 + acc2) + (acc1 + acc3)`, then the 16
//!   lanes are halved: `v[l] + v[l+8]`, then `+4`, `+2`, `+1` ([`reduce`]).
//! - The tail is accumulated sequentially, `t = fma(w[j], x[j], t)` from `+0.0`, and added
//!   last: `sum + t` (only when the tail is not empty).
//!
//! A second order, the integer-dot order of [`crate::intdot`] (activations quantized to int16
//! per 32-element block, one fma per lane per block, the same [`reduce`]), is implemented for
//! Q8_0 and Q5_0 but not switched on.
//!
//! The dequantized weights are the exact values of `dequant`. A SIMD path may compute them
//! differently (a 16-entry table, or `fma(q, d, m)` instead of `q * d + m`) only where the
//! result is provably identical: `q * d` is exact for every ggml type (at most 24 significant
//! bits), so one rounding of `q * d + m` gives the same value either way.
//!
//! **Attention** uses the canonical dot per (head, position), the canonical exp, the canonical
//! sum (the dot with ones) and, for the value rows, one fma per element in increasing position.
//!
//! **exp** ([`exp`]): a Cephes-style range reduction and degree-6 polynomial built only from
//! correctly rounded operations (add, mul, fma, comparisons), accurate to about 1 ulp.
//! Results below about 2.4e-38 (inputs below -86.6) are flushed to `+0.0`; inputs above
//! 88.7228 give `+inf`; NaN gives NaN.
//!
//! **Gated activations** ([`Act`]): `gate[i] = v / (1 + exp(arg)) * up[i]`, each operation
//! rounded in this order, with `arg = -v` (SiLU) or `v * fma(v * v, C1, C0)` (PyTorch's tanh
//! GELU rewritten with the canonical exp, see [`Act::GeluTanh`]).

/// Lanes of one canonical group.
pub(crate) const LANES: usize = 16;
/// Independent accumulators of the canonical dot product.
pub(crate) const ACCS: usize = 4;

/// Canonical horizontal reduction of four 16-lane accumulators.
#[inline]
pub(crate) fn reduce(acc: &[[f32; LANES]; ACCS]) -> f32 {
    let mut v = [0f32; LANES];
    for l in 0..LANES {
        v[l] = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
    }
    let mut width = LANES / 2;
    while width > 0 {
        for l in 0..width {
            v[l] += v[l + width];
        }
        width /= 2;
    }
    v[0]
}

/// Canonical dot product state for the portable path: feed elements in order with
/// [`Dot::push`], then call [`Dot::finish`].
pub(crate) struct Dot {
    acc: [[f32; LANES]; ACCS],
    tail: f32,
    /// elements in full groups (`cols / 16 * 16`)
    full: usize,
    has_tail: bool,
}

impl Dot {
    /// A dot product over rows of `cols` elements.
    #[inline]
    pub(crate) fn new(cols: usize) -> Dot {
        Dot {
            acc: [[0.0; LANES]; ACCS],
            tail: 0.0,
            full: cols / LANES * LANES,
            has_tail: cols % LANES != 0,
        }
    }

    /// Accumulates `w[j] * x[j]` for the elements `start .. start + w.len()` of the row
    /// (`x` holds the same elements). Calls must cover the row in order.
    ///
    /// Whole groups go lane by lane through a fixed-length loop that the compiler turns into
    /// vector fmas (NEON on aarch64, where fma is part of the base instruction set); the
    /// operations per accumulator lane are the same as element by element.
    #[inline]
    pub(crate) fn push(&mut self, start: usize, w: &[f32], x: &[f32]) {
        let n = w.len().min(x.len());
        let mut j = 0;
        while j < n {
            let e = start + j;
            if e % LANES == 0 && e + LANES <= self.full && j + LANES <= n {
                let a = &mut self.acc[(e / LANES) % ACCS];
                let (wg, xg) = (&w[j..j + LANES], &x[j..j + LANES]);
                for l in 0..LANES {
                    a[l] = wg[l].mul_add(xg[l], a[l]);
                }
                j += LANES;
                continue;
            }
            if e < self.full {
                let a = &mut self.acc[(e / LANES) % ACCS][e % LANES];
                *a = w[j].mul_add(x[j], *a);
            } else {
                self.tail = w[j].mul_add(x[j], self.tail);
            }
            j += 1;
        }
    }

    /// The canonical sum.
    #[inline]
    pub(crate) fn finish(&self) -> f32 {
        let s = reduce(&self.acc);
        if self.has_tail {
            s + self.tail
        } else {
            s
        }
    }
}

/// Canonical dot product of two f32 slices of the same length (portable path).
pub(crate) fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let mut d = Dot::new(a.len());
    d.push(0, a, b);
    d.finish()
}

/// x86 `minps` semantics: `a < b ? a : b` (the second operand on NaN or equality).
#[inline(always)]
pub(crate) fn vmin(a: f32, b: f32) -> f32 {
    if a < b {
        a
    } else {
        b
    }
}

/// x86 `maxps` semantics: `a > b ? a : b`.
#[inline(always)]
pub(crate) fn vmax(a: f32, b: f32) -> f32 {
    if a > b {
        a
    } else {
        b
    }
}

/// Constants of the canonical exp, shared with the SIMD paths.
pub(crate) mod exp_consts {
    /// inputs below this give +0.0
    pub const LO: f32 = -86.6;
    /// inputs above this give +inf
    pub const HI: f32 = 88.722_83;
    /// log2(e)
    pub const LOG2E: f32 = std::f32::consts::LOG2_E;
    /// 1.5 × 2^23: adding it rounds to an integer (ties to even)
    pub const MAGIC: f32 = 12_582_912.0;
    /// ln 2 split so that `n * LN2_HI` is exact
    pub const LN2_HI: f32 = 0.693_359_4;
    /// ln 2 − LN2_HI
    pub const LN2_LO: f32 = -2.121_944_4e-4;
    /// polynomial for e^r on [-ln2/2, ln2/2] (Cephes expf), highest degree first
    pub const P: [f32; 6] = [
        1.987_569_1e-4,
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5, // Cephes' 5.0000001201e-1 rounded to f32
    ];
}

/// Canonical exp (portable path); see the module docs.
#[inline]
pub(crate) fn exp(x: f32) -> f32 {
    use exp_consts::*;
    let xc = vmax(LO, vmin(HI, x));
    let t = xc * LOG2E + MAGIC;
    let nf = t - MAGIC;
    let r = nf.mul_add(-LN2_HI, xc);
    let r = nf.mul_add(-LN2_LO, r);
    let mut p = P[0];
    for &c in &P[1..] {
        p = p.mul_add(r, c);
    }
    let r2 = r * r;
    let y = p.mul_add(r2, r) + 1.0;
    // 2^(n-1) built from the exponent bits; n = bits(t) - bits(MAGIC) is in [-125, 128]
    let n = (t.to_bits() as i32).wrapping_sub(MAGIC.to_bits() as i32);
    let scale = f32::from_bits((n.wrapping_add(126) as u32) << 23);
    let res = (y * scale) * 2.0;
    let res = if x < LO { 0.0 } else { res };
    if x > HI {
        f32::INFINITY
    } else {
        res
    }
}

/// The activation of a gated MLP: `gate[i] = act(gate[i]) * up[i]`. Both are
/// `v / (1 + exp(arg(v)))` with the canonical exp, and differ only in `arg` ([`Act::arg`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Act {
    /// SwiGLU: `silu(v) = v / (1 + exp(-v))`.
    Silu,
    /// GeGLU with PyTorch's `gelu(approximate="tanh")`,
    /// `0.5 v (1 + tanh(√(2/π) (v + 0.044715 v³)))`, computed as
    /// `v / (1 + exp(-2√(2/π) (v + 0.044715 v³)))` (the same function: `(1 + tanh z) / 2` is
    /// `1 / (1 + exp(-2z))`), so that it needs only the canonical exp, and no libm `tanhf`
    /// whose results differ between C libraries.
    GeluTanh,
}

/// Constants of the canonical tanh GELU ([`Act::GeluTanh`]).
pub(crate) mod gelu_consts {
    /// √(2/π)
    const BETA: f64 = 0.797_884_560_802_865_4;
    /// `-2√(2/π)`: the argument of the exp is `v * fma(v * v, C1, C0)`
    pub const C0: f32 = (-2.0 * BETA) as f32;
    /// `-2√(2/π) · 0.044715`
    pub const C1: f32 = (-2.0 * BETA * 0.044715) as f32;
}

impl Act {
    /// The exp's argument: `-v` (SiLU), or `v * fma(v * v, C1, C0)` (tanh GELU), rounded
    /// after each operation as written.
    #[inline(always)]
    pub(crate) fn arg(self, v: f32) -> f32 {
        match self {
            Act::Silu => -v,
            Act::GeluTanh => v * (v * v).mul_add(gelu_consts::C1, gelu_consts::C0),
        }
    }
}

/// Portable gated activation (`gate[i] = v / (1 + exp(act.arg(v))) * up[i]` with
/// `v = gate[i]`, canonical exp): the portable path of [`crate::silu_mul`] and
/// [`crate::gelu_tanh_mul`] and the SIMD paths' remainder.
pub(crate) fn act_mul_scalar(act: Act, gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        let v = *g;
        *g = v / (1.0 + crate::canon::exp(act.arg(v))) * u;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ulp_diff(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    #[test]
    fn exp_is_accurate() {
        let mut worst = 0;
        let mut x = -86.5f32;
        while x < 88.7 {
            let got = exp(x);
            let want = (x as f64).exp() as f32;
            let u = ulp_diff(got, want);
            worst = worst.max(u);
            assert!(u <= 2, "exp({x}) = {got}, want {want} ({u} ulp)");
            x += 0.0137;
        }
        assert!(worst <= 2);
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-0.0), 1.0);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn gelu_tanh_matches_pytorch_formula() {
        // against 0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³))) in f64
        let want = |x: f64| {
            let z = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
            0.5 * x * (1.0 + z.tanh())
        };
        let gelu = |x: f32| {
            let mut g = [x];
            act_mul_scalar(Act::GeluTanh, &mut g, &[1.0]);
            g[0]
        };
        let (mut worst_rel, mut worst_abs) = (0f64, 0f64);
        let mut x = -12.0f32;
        while x < 12.0 {
            let (got, w) = (gelu(x) as f64, want(x as f64));
            if x > -3.0 {
                // where the output is not tiny: a few ulp
                worst_rel = worst_rel.max((got - w).abs() / w.abs().max(1e-30));
            } else {
                // the tail towards -0 (|output| < 0.004)
                worst_abs = worst_abs.max((got - w).abs());
            }
            x += 0.001_37;
        }
        assert!(worst_rel < 1e-6, "relative error {worst_rel}");
        assert!(worst_abs < 1e-8, "absolute error {worst_abs}");
        assert_eq!(gelu(0.0), 0.0);
        assert_eq!(gelu(1e20), 1e20);
        assert_eq!(gelu(f32::INFINITY), f32::INFINITY);
        assert_eq!(gelu(-1e20), 0.0);
        // -inf · 0 in PyTorch's form, -inf / inf here
        assert!(gelu(f32::NEG_INFINITY).is_nan());
        assert!(gelu(f32::NAN).is_nan());
    }

    #[test]
    fn reduce_order() {
        // lane halving: only lanes 0 and 8 of acc0 set -> plain sum
        let mut acc = [[0f32; LANES]; ACCS];
        acc[0][0] = 1.0;
        acc[1][8] = 2.0;
        acc[3][15] = 4.0;
        assert_eq!(reduce(&acc), 7.0);
    }

    #[test]
    fn dot_with_tail() {
        let a: Vec<f32> = (0..37).map(|i| i as f32).collect();
        let b = vec![1.0f32; 37];
        assert_eq!(dot_f32(&a, &b), (0..37).sum::<i32>() as f32);
    }
}
