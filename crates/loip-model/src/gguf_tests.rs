//! Unit tests of [`super`]: name maps, the q/k permutation, type tables.

use super::*;

#[test]
fn names_map_both_ways() {
    for (g, h) in [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output_norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
        (
            "blk.3.attn_norm.weight",
            "model.layers.3.input_layernorm.weight",
        ),
        (
            "blk.0.attn_q.weight",
            "model.layers.0.self_attn.q_proj.weight",
        ),
        (
            "blk.0.attn_output.weight",
            "model.layers.0.self_attn.o_proj.weight",
        ),
        (
            "blk.1.attn_k_norm.weight",
            "model.layers.1.self_attn.k_norm.weight",
        ),
        (
            "blk.29.ffn_norm.weight",
            "model.layers.29.post_attention_layernorm.weight",
        ),
        (
            "blk.2.ffn_down.weight",
            "model.layers.2.mlp.down_proj.weight",
        ),
    ] {
        assert_eq!(gguf_to_hf_name(g).as_deref(), Some(h));
        assert_eq!(hf_to_gguf_name(h).as_deref(), Some(g));
    }
    assert_eq!(gguf_to_hf_name("blk.x.attn_q.weight"), None);
    assert_eq!(
        gguf_to_hf_name("blk.0.attn_q.bias").as_deref(),
        Some("model.layers.0.self_attn.q_proj.bias")
    );
    assert_eq!(
        hf_to_gguf_name("model.layers.2.self_attn.v_proj.bias").as_deref(),
        Some("blk.2.attn_v.bias")
    );
    assert_eq!(gguf_to_hf_name("blk.0.attn_output.bias"), None);
    assert_eq!(gguf_to_hf_name("rope_freqs.weight"), None);
}

/// The row map against a literal transcription of numpy's
/// `w.reshape(n_head, 2, d // 2, cols).swapaxes(1, 2).reshape(rows, cols)` on row ids.
#[test]
fn qk_permutation_matches_llama_cpp_permute() {
    let (n_head, d) = (3usize, 8usize);
    let rows: Vec<usize> = (0..n_head * d).collect();
    // reshape to [h][s][i] (s in 0..2, i in 0..d/2), swap to [h][i][s], flatten.
    let mut permuted = Vec::new();
    for h in 0..n_head {
        for i in 0..d / 2 {
            for s in 0..2 {
                permuted.push(rows[h * d + s * (d / 2) + i]);
            }
        }
    }
    for (gguf_row, &hf_row) in permuted.iter().enumerate() {
        let head = gguf_row / d;
        assert_eq!(head * d + gguf_qk_row_to_hf(gguf_row % d, d), hf_row);
    }
}

#[test]
fn type_tables_agree() {
    for d in [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q4K,
        DType::Q6K,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q2K,
        DType::Q3K,
        DType::Q5K,
        DType::IQ4NL,
        DType::IQ4XS,
    ] {
        let id = ggml_type_of(d);
        assert_eq!(dtype_from_ggml(id), Some(d));
        assert_eq!(ggml_type_name(id), Some(d.name()));
    }
    assert_eq!(type_label(13), "Q5_K (13)");
    assert_eq!(type_label(16), "IQ2_XXS (16)");
    assert_eq!(dtype_from_ggml(16), None);
    assert_eq!(dtype_from_ggml(6), Some(DType::Q5_0));
    assert_eq!(type_label(77), "unknown (77)");
}
