//! `loip local --plot FILE`: memory per device over the run is drawn (PNG or SVG by the
//! file's extension) from the runtime's per-step samples, and `--help` says so.

mod common;
use common::*;

fn scratch(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("loip-plot-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn plot_is_written_as_png_and_svg_with_one_sample_per_step() {
    let model = fixture("tiny-llama");
    let dir = scratch("files");
    for (file, magic) in [("mem.png", &b"\x89PNG"[..]), ("mem.svg", &b"<svg"[..])] {
        let path = dir.join(file);
        let out = loip()
            .args([
                "local",
                "--model",
                &model,
                "--devices",
                "2",
                "--mem",
                "64MiB",
                "--prompt-ids",
                "1,5,9,23",
                "-n",
                "8",
                "--min-tokens",
                "8",
                "--json",
                "--plot",
            ])
            .arg(&path)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "loip local --plot failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(bytes.len() > 2000, "{file}: only {} bytes", bytes.len());
        let head = &bytes[..bytes.len().min(200)];
        assert!(
            head.windows(magic.len()).any(|w| w == magic),
            "{file} does not start as its format: {:?}",
            String::from_utf8_lossy(head)
        );
        // the samples the plot is drawn from: one per step per plan device
        let text = String::from_utf8_lossy(&out.stdout);
        let line = text.lines().rev().find(|l| l.starts_with('{')).unwrap();
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let memory = v["adaptation"]["memory"].as_array().unwrap();
        assert!(!memory.is_empty());
        for m in memory {
            // the prompt step and 7 decode steps
            assert_eq!(m.as_array().unwrap().len(), 8, "{m}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn help_explains_the_plot() {
    let out = loip().args(["local", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("--plot <PLOT>"), "{help}");
    assert!(help.contains("memory per device"), "{help}");
    assert!(help.contains(".svg"), "{help}");
}
