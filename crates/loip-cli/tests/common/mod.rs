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

/// Runs `cmd`, which must succeed, and parses the last JSON line of its stdout.
pub fn json_run(cmd: &mut Command) -> serde_json::Value {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("no JSON in {text}"));
    serde_json::from_str(line).unwrap()
}

pub mod api;
