//! Run-time choice of the SIMD path.
//!
//! The instruction set is detected once (`is_x86_feature_detected!`, cached in a `OnceLock`);
//! no code is compiled with a global `target-cpu`. Every path computes the same canonical
//! order of operations (see [`crate::canon`]), so the choice changes speed, never results.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

/// A SIMD code path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Level {
    /// portable Rust, `f32::mul_add`
    Scalar,
    /// AVX2 + FMA + F16C, 256-bit
    #[cfg_attr(
        not(any(target_arch = "x86_64", target_arch = "x86")),
        allow(dead_code)
    )]
    Avx2,
    /// AVX-512F (+ AVX2, FMA, F16C), 512-bit
    #[cfg_attr(
        not(any(target_arch = "x86_64", target_arch = "x86")),
        allow(dead_code)
    )]
    Avx512,
    /// NEON (aarch64 base architecture), 128-bit
    #[cfg_attr(
        not(all(target_arch = "aarch64", target_endian = "little")),
        allow(dead_code)
    )]
    Neon,
}

impl Level {
    /// The name printed by benchmarks.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Level::Scalar => "scalar",
            Level::Avx2 => "avx2",
            Level::Avx512 => "avx512",
            Level::Neon => "neon",
        }
    }
}

static DETECTED: OnceLock<Level> = OnceLock::new();
static FORCE_SCALAR: AtomicBool = AtomicBool::new(false);
/// A speed switch that is on when its flag is set or when an environment variable has a
/// given value (read once); results are bit-identical either way.
pub(crate) struct Switch {
    flag: AtomicBool,
    env: OnceLock<bool>,
    /// variable name and the value that turns the switch on
    var: (&'static str, &'static str),
}

impl Switch {
    pub(crate) const fn new(var: &'static str, value: &'static str) -> Switch {
        Switch {
            flag: AtomicBool::new(false),
            env: OnceLock::new(),
            var: (var, value),
        }
    }

    pub(crate) fn set(&self, on: bool) {
        self.flag.store(on, Ordering::Relaxed);
    }

    pub(crate) fn on(&self) -> bool {
        self.flag.load(Ordering::Relaxed)
            || *self
                .env
                .get_or_init(|| std::env::var(self.var.0).is_ok_and(|v| v == self.var.1))
    }
}

static PER_ROW_BATCHES: Switch = Switch::new("LOIP_BATCHES", "per-row");
static LANE_TILES: Switch = Switch::new("LOIP_GEMM", "lanes");
static NO_SHORT_TILES: Switch = Switch::new("LOIP_SHORT", "off");

/// The best level this CPU supports (detected once), lowered by the `LOIP_SIMD` environment
/// variable (`avx2` or `scalar`) when set, for benchmarks and end-to-end tests of the other paths.
pub(crate) fn detected() -> Level {
    *DETECTED.get_or_init(|| {
        let best = detect();
        match std::env::var("LOIP_SIMD").as_deref() {
            Ok("scalar") => Level::Scalar,
            Ok("avx2") if best == Level::Avx512 => Level::Avx2,
            _ => best,
        }
    })
}

#[cfg(any(target_arch = "x86_64", target_arch = "x86"))]
fn detect() -> Level {
    let avx2 = is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c");
    if avx2 && is_x86_feature_detected!("avx512f") {
        Level::Avx512
    } else if avx2 {
        Level::Avx2
    } else {
        Level::Scalar
    }
}

/// NEON is part of the aarch64 base architecture: no run-time check needed.
#[cfg(all(target_arch = "aarch64", target_endian = "little"))]
fn detect() -> Level {
    Level::Neon
}

#[cfg(not(any(
    target_arch = "x86_64",
    target_arch = "x86",
    all(target_arch = "aarch64", target_endian = "little")
)))]
fn detect() -> Level {
    Level::Scalar
}

/// The level the kernels use now: the detected one, unless [`set_force_scalar`] is on.
pub(crate) fn current() -> Level {
    if FORCE_SCALAR.load(Ordering::Relaxed) {
        Level::Scalar
    } else {
        detected()
    }
}

/// Whether `level` can run on this CPU (tests ask for each level explicitly).
#[cfg(test)]
pub(crate) fn supported(level: Level) -> bool {
    matches!(
        (level, detected()),
        (Level::Scalar, _)
            | (Level::Avx2, Level::Avx2 | Level::Avx512)
            | (Level::Avx512, Level::Avx512)
            | (Level::Neon, Level::Neon)
    )
}

/// Which SIMD path the kernels use at run time: `"avx512"`, `"avx2"`, `"neon"` or `"scalar"`.
pub fn simd_level() -> &'static str {
    current().name()
}

/// Forces the portable scalar path for every kernel in this process (`false` restores the
/// detected path). Results are bit-identical either way; only speed changes. Meant for
/// benchmarks and tests.
pub fn set_force_scalar(force: bool) {
    FORCE_SCALAR.store(force, Ordering::Relaxed);
}

/// Makes batched (n > 1) matmuls use the per-row dot kernels instead of the register-tiled
/// one (`false` restores the tiled kernel, unless the environment variable
/// `LOIP_BATCHES=per-row` asks for the per-row kernels in the whole process, for end-to-end
/// A/B runs). Results are bit-identical either way; only speed
/// changes. Meant for benchmarks that compare the two side by side.
pub fn set_per_row_batches(per_row: bool) {
    PER_ROW_BATCHES.set(per_row);
}

/// Whether [`set_per_row_batches`] is on.
#[cfg_attr(
    not(any(target_arch = "x86_64", target_arch = "x86")),
    allow(dead_code)
)]
pub(crate) fn per_row_batches() -> bool {
    PER_ROW_BATCHES.on()
}

/// Makes AVX2 matmuls of 16 tokens or more use the token-lane tiles (`x86::gemm::lanes`: 8
/// tokens per register, 6 rows × 16 tokens per tile) for whole groups of 16 tokens (`false`
/// restores the column-lane tiles, unless the environment variable `LOIP_GEMM=lanes` asks for
/// them in the whole process, for end-to-end A/B runs). Off by default: end to end they
/// prefilled slower than the column-lane tiles (CHANGELOG.md, the token-lane tiles).
/// Results are bit-identical either way; only speed changes.
pub fn set_lane_tiles(on: bool) {
    LANE_TILES.set(on);
}

/// Whether the token-lane tiles are on ([`set_lane_tiles`] or `LOIP_GEMM=lanes`).
#[cfg_attr(
    not(any(target_arch = "x86_64", target_arch = "x86")),
    allow(dead_code)
)]
pub(crate) fn lane_tiles() -> bool {
    LANE_TILES.on()
}

/// Turns off the AVX-512 in-register tiles of short batches (5 to 8 tokens of Q4_0, Q4_1,
/// Q8_0: `x86::gemm::short`), so that those batches take the per-row kernels (`false`
/// turns them back on, unless the environment variable `LOIP_SHORT=off` turns them off in the
/// whole process, for end-to-end A/B runs). Results are bit-identical either way; only speed
/// changes.
pub fn set_short_tiles_off(off: bool) {
    NO_SHORT_TILES.set(off);
}

/// Whether the short-batch tiles are off ([`set_short_tiles_off`] or `LOIP_SHORT=off`).
#[cfg_attr(
    not(any(target_arch = "x86_64", target_arch = "x86")),
    allow(dead_code)
)]
pub(crate) fn short_tiles_off() -> bool {
    NO_SHORT_TILES.on()
}

/// `level` if this CPU runs it, else the scalar path.
#[inline]
pub(crate) fn usable(level: Level) -> Level {
    match (level, detected()) {
        (Level::Avx512, Level::Avx512) => Level::Avx512,
        (Level::Avx2, Level::Avx2 | Level::Avx512) => Level::Avx2,
        #[cfg(all(target_arch = "aarch64", target_endian = "little"))]
        (Level::Neon, Level::Neon) => Level::Neon,
        _ => Level::Scalar,
    }
}
