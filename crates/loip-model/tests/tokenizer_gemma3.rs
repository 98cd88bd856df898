//! Gemma 3 270M's SentencePiece tokenizer rebuilt from its GGUF metadata gives the ids and
//! text of the HF tokenizer (the fixture's prompts and greedy continuations). The model is
//! fetched and verified on first use (cached).

mod common;

use loip_model::tokenizer::Tokenizer;
use loip_model::Checkpoint;
use serde_json::Value;

#[test]
fn gemma3_gguf_tokenizer_matches_hf() {
    let path = loip_model::fetch::fetch_gemma3_270m().expect("fetch Gemma 3 270M");
    let ck = Checkpoint::open(&path).unwrap();
    let tok = Tokenizer::from_gguf_metadata(ck.gguf_metadata.as_ref().unwrap()).unwrap();
    let text =
        std::fs::read_to_string(common::fixture("gemma3-270m").join("expected.json")).unwrap();
    let exp: Value = serde_json::from_str(&text).unwrap();
    let ids = |v: &Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    for case in exp["cases"].as_array().unwrap() {
        let prompt = case["prompt"].as_str().unwrap();
        assert_eq!(
            tok.encode(prompt, true).unwrap(),
            ids(&case["input_ids"]),
            "{prompt}"
        );
        let new = ids(&case["greedy_new_ids"]);
        assert_eq!(
            tok.decode(&new, true).unwrap(),
            case["greedy_text"].as_str().unwrap(),
            "{prompt}"
        );
    }
}
