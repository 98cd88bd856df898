//! The memory budget is real: a model three times the budget runs, and the process's peak
//! resident set (VmHWM) stays within the budget plus a fixed overhead — on the first run too,
//! which splits the checkpoint into the slice cache before it generates (a split reads with
//! one bounded buffer; pages of a file mapping would count in the resident set).

mod common;
use common::*;

use std::path::PathBuf;

use loip_kernels::DType;

/// Peak RSS of the process beyond its budget: the binary's code and data, the allocator,
/// thread stacks, the manifest and the page-aligned rounding of buffers. Measured here at
/// ~10 MiB for a 2-core run; 24 MiB leaves headroom for other machines' libc and thread
/// counts while still failing if even one extra 30 MiB MLP block were kept in memory.
const OVERHEAD: u64 = 24 << 20;

#[test]
fn peak_rss_stays_within_budget_with_a_third_of_the_model() {
    let root = std::env::temp_dir().join(format!("loip-rss-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let (ckpt, slices) = (root.join("ckpt"), root.join("slices"));
    // 8 layers of ~30 MiB (attention 5 MiB + MLP 25 MiB, bf16), small vocabulary: layers
    // dominate, as in the models the budget matters for.
    let cfg = loip_model::ModelConfig::from_hf_json(
        r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":1024,
            "intermediate_size":4096,"num_hidden_layers":8,"num_attention_heads":16,
            "num_key_value_heads":4,"vocab_size":2048,"rms_norm_eps":1e-5,"rope_theta":10000.0,
            "max_position_embeddings":512,"tie_word_embeddings":false}"#,
    )
    .unwrap();
    loip_model::synth_checkpoint(&cfg, DType::BF16, None, &ckpt, 1, &|_, _| {}).unwrap();
    let st = loip()
        .args(["split"])
        .arg(&ckpt)
        .arg("--out")
        .arg(&slices)
        .status()
        .unwrap();
    assert!(st.success());
    let model_bytes: u64 = std::fs::read_dir(&slices)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().extension().is_some_and(|x| x == "slice"))
        .map(|e| e.metadata().unwrap().len())
        .sum();
    let budget = model_bytes / 3;
    let run_on = |model: &std::path::Path, args: &[&str]| -> serde_json::Value {
        let out = loip()
            .env("LOIP_CACHE", root.join("cache"))
            .args(["--threads", "2", "generate", "--model"])
            .arg(model)
            .args(["--prompt-ids", "1,2,3,4", "-n", "4", "--json"])
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let run = |args: &[&str]| run_on(&slices, args);
    // First run: the checkpoint itself under --mem, split into the (empty) cache first.
    let first = run_on(&ckpt, &["--mem", &budget.to_string()]);
    let first_peak = first["peak_rss_bytes"].as_u64().unwrap();
    eprintln!("first run (split included): budget {budget} B, peak RSS {first_peak} B");
    assert!(
        first_peak <= budget + OVERHEAD,
        "first run: peak RSS {first_peak} exceeds budget {budget} + {OVERHEAD}"
    );
    let cached = std::fs::read_dir(root.join("cache").join("slices"))
        .unwrap()
        .count();
    assert_eq!(cached, 1, "the first run split into the cache");
    let limited = run(&["--mem", &budget.to_string()]);
    let peak = limited["peak_rss_bytes"].as_u64().unwrap();
    eprintln!(
        "model {model_bytes} B, budget {budget} B, peak RSS {peak} B, memory {}",
        limited["memory"]
    );
    assert!(
        peak <= budget + OVERHEAD,
        "peak RSS {peak} exceeds budget {budget} + {OVERHEAD}"
    );
    assert!(limited["memory"]["slot"].as_u64().unwrap() > 0);
    // Same tokens as with the whole model resident.
    let full = run(&[]);
    assert_eq!(limited["new_ids"], full["new_ids"]);
    assert_eq!(first["new_ids"], full["new_ids"]);
    assert!(
        full["peak_rss_bytes"].as_u64().unwrap() > model_bytes,
        "the unlimited run holds the model"
    );
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn a_budget_too_small_is_refused_with_what_needs_how_much() {
    let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-llama");
    let out = loip()
        .args(["generate", "--model"])
        .arg(&fixture)
        .args(["--prompt-ids", "1,2", "--mem", "20KiB"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("a budget of 20.0 KiB leaves nothing for the engine")
            && err.contains("the smallest budget that works is"),
        "{err}"
    );
}
