//! In-crate tests (SIMD levels compared bit for bit).
