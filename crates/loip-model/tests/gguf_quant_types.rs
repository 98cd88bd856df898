//! GGUF files the project writes with every matrix in one of the extra ggml types (`Q2_K`,
//! `Q3_K`, `Q5_K`, `IQ4_NL`, `IQ4_XS`, `Q5_0`, `Q5_1`) open, keep their type and bytes, and
//! multiply as the kernels' scalar reference does. Blocks from real files, written by
//! llama.cpp's quantizer (`tests/fixtures/real_blocks`, `gen.py` there), round-trip: through a
//! GGUF the bytes come back unchanged, and they decode to ggml's own values, bit for bit,
//! in the kernels' dequantization and in both matmul paths. (`Q5_0` has its real file in the
//! Gemma 3 270M golden test.)

mod common;
#[path = "../../loip-kernels/tests/common/mod.rs"]
mod kernels_common;

use common::TempDir;
use loip_kernels::{matmul, matmul_ref, DType};
use loip_model::gguf_write::GgufWriter;
use loip_model::names::{suffix, EMBED_TOKENS};
use loip_model::{layer_tensor_name, model_tensors, preset_config, Checkpoint, GgufValue};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const TYPES: [DType; 7] = [
    DType::Q2K,
    DType::Q3K,
    DType::Q5K,
    DType::IQ4NL,
    DType::IQ4XS,
    DType::Q5_0,
    DType::Q5_1,
];

#[test]
fn extra_types_load_and_multiply() {
    let mut cfg = preset_config("tiny").unwrap();
    // 256-element blocks: every matrix row a whole number of super-blocks
    (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) = (256, 512, 1);
    (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) = (4, 2, 64);
    cfg.tie_word_embeddings = true;
    let mut rng = ChaCha8Rng::seed_from_u64(15);
    for dtype in TYPES {
        let mut w = GgufWriter::new();
        w.llama_metadata(&cfg);
        w.kv(
            "tokenizer.ggml.tokens",
            GgufValue::Array(
                (0..cfg.vocab_size)
                    .map(|i| GgufValue::Str(format!("t{i}")))
                    .collect(),
            ),
        );
        let mut written = Vec::new();
        for spec in model_tensors(&cfg) {
            let gname = loip_model::gguf::hf_to_gguf_name(&spec.name).unwrap();
            let (ty, data) = match spec.shape[..] {
                [n] => (DType::F32, vec![0u8; 4 * n]),
                [r, c] => (dtype, kernels_common::random_matrix(dtype, r, c, &mut rng)),
                _ => unreachable!(),
            };
            w.tensor(gname, ty, &spec.shape, data.clone());
            written.push((spec.name.clone(), spec.shape.clone(), data));
        }
        let dir = TempDir::new("quant-types");
        let path = dir.join("m.gguf");
        w.write(&path).unwrap();
        let ck = Checkpoint::open(&path).unwrap();
        for (name, shape, data) in &written {
            let [rows, cols] = shape[..] else { continue };
            let m = ck.matrix(name, rows, cols).unwrap();
            assert_eq!(m.dtype, dtype, "{name}");
            // q and k rows are permuted back from GGUF's order; the others are the bytes
            let permuted = name.ends_with(suffix::Q_PROJ) || name.ends_with(suffix::K_PROJ);
            if !permuted {
                assert!(m.data == &data[..], "{dtype} {name}: bytes changed");
            }
            let x: Vec<f32> = (0..cols).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
            let (mut y, mut y_ref) = (vec![0f32; rows], vec![0f32; rows]);
            matmul(&m, &x, &mut y).unwrap();
            matmul_ref(&m, &x, &mut y_ref).unwrap();
            for (a, b) in y.iter().zip(&y_ref) {
                assert!(
                    (a - b).abs() <= 1e-3 * (1.0 + b.abs()),
                    "{dtype} {name}: {a} vs {b}"
                );
            }
        }
        let down = layer_tensor_name(0, suffix::DOWN_PROJ);
        assert_eq!(ck.tensor_info(&down).unwrap().dtype, dtype);
        assert!(ck.has(EMBED_TOKENS));
    }
}

/// A row that is not whole blocks of an extra type, or data shorter than its shape, is a clear
/// error naming the tensor and type, not a panic.
#[test]
fn extra_type_shapes_are_checked() {
    use loip_model::gguf::GgufFile;
    for dtype in TYPES {
        let id = loip_model::gguf::ggml_type_of(dtype);
        let be = dtype.block_elems();
        let mut w = GgufWriter::new();
        w.tensor_raw(
            "a",
            id,
            &[(be + 16) as u64, 2],
            vec![0u8; 4 * dtype.block_bytes()],
        );
        let e = GgufFile::parse(&w.to_bytes().unwrap(), std::path::Path::new("x.gguf"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("tensor a") && e.contains(dtype.name()), "{e}");
        let mut w = GgufWriter::new();
        // 8 blocks announced, 1 stored (more than the alignment padding short)
        w.tensor_raw("b", id, &[be as u64, 8], vec![0u8; dtype.block_bytes()]);
        assert!(
            GgufFile::parse(&w.to_bytes().unwrap(), std::path::Path::new("x.gguf")).is_err(),
            "{dtype}: short data accepted"
        );
    }
}

/// Real-file blocks per type: name of the fixture, type.
const REAL: [(&str, DType); 6] = [
    ("Q5_1", DType::Q5_1),
    ("Q2_K", DType::Q2K),
    ("Q3_K", DType::Q3K),
    ("Q5_K", DType::Q5K),
    ("IQ4_NL", DType::IQ4NL),
    ("IQ4_XS", DType::IQ4XS),
];

fn real_fixture(name: &str, ext: &str) -> Vec<u8> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/real_blocks")
        .join(format!("{name}.{ext}"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn real_file_blocks_round_trip_to_ggml_values() {
    use loip_kernels::{dequant_row, Matrix};
    use loip_model::gguf::GgufFile;
    for (name, dtype) in REAL {
        let blocks = real_fixture(name, "blocks");
        let want: Vec<f32> = real_fixture(name, "f32")
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let (be, bb) = (dtype.block_elems(), dtype.block_bytes());
        let rows = blocks.len() / bb;
        assert_eq!((rows * bb, rows * be), (blocks.len(), want.len()), "{name}");
        // through a GGUF: the type and the bytes are kept
        let mut w = GgufWriter::new();
        w.tensor("blk.0.ffn_down.weight", dtype, &[rows, be], blocks.clone());
        let bytes = w.to_bytes().unwrap();
        let g = GgufFile::parse(&bytes, std::path::Path::new("real.gguf")).unwrap();
        let t = &g.tensors[0];
        assert_eq!((t.dtype, t.hf_shape()), (dtype, vec![rows, be]), "{name}");
        let stored = &bytes[t.offset as usize..(t.offset + t.nbytes) as usize];
        assert!(stored == &blocks[..], "{name}: bytes changed");
        // decoded: ggml's values, bit for bit (one block per row)
        let m = Matrix::new(dtype, rows, be, stored).unwrap();
        let mut row = vec![0f32; be];
        for r in 0..rows {
            dequant_row(&m, r, &mut row).unwrap();
            for (i, (a, b)) in row.iter().zip(&want[r * be..(r + 1) * be]).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{name} block {r} element {i}: {a} vs {b}");
            }
        }
        // multiplied: a one-hot input picks each column, in the SIMD and the scalar path
        let (mut y, mut y_ref) = (vec![0f32; rows], vec![0f32; rows]);
        for c in 0..be {
            let mut x = vec![0f32; be];
            x[c] = 1.0;
            matmul(&m, &x, &mut y).unwrap();
            matmul_ref(&m, &x, &mut y_ref).unwrap();
            for r in 0..rows {
                let g = want[r * be + c];
                assert!(y[r] == g && y_ref[r] == g, "{name} [{r}, {c}]: {} {} vs {g}", y[r], y_ref[r]);
            }
        }
    }
}
