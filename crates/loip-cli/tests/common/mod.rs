//! Helpers shared by the CLI's integration tests.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;

/// The built `loip` binary.
pub fn loip() -> Command {
    Command::new(env!("CARGO_BIN_EXE_loip"))
}

/// The path of a test fixture under `tests/fixtures` at the repository root.
pub fn fixture(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
        .to_string_lossy()
        .into_owned()
}

pub mod api;
