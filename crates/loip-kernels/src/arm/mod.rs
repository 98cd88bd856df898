//! aarch64 kernels (Jetson, Raspberry Pi, phones): NEON, which every aarch64 CPU has, so the
//! path needs no run-time detection beyond the architecture ([`crate::simd`]).
//!
//! Same values and the same canonical order as [`crate::canon`] and the x86 paths, so an ARM
//! device gives the bits an x86 machine gives. `LOIP_SIMD=scalar` forces the portable path
//! (the in-crate tests compare the two bit for bit).

pub(crate) mod neon;
