//! Tokenizers built from small hand-made vocabularies: a `tokenizer.json` written here and a
//! `GgufVocab` assembled here. No files outside the test's own scratch dir, no network.

use std::path::PathBuf;

use loip_model::tokenizer::{GgufVocab, StreamDecoder, Tokenizer, TokenizerError};

/// GPT-2's byte → printable-char table (`bytes_to_unicode`).
fn byte_chars() -> Vec<char> {
    let mut out = vec!['\0'; 256];
    let mut extra = 0u32;
    for b in 0..=255u32 {
        let printable =
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        out[b as usize] = if printable {
            char::from_u32(b).unwrap()
        } else {
            extra += 1;
            char::from_u32(255 + extra).unwrap()
        };
    }
    out
}

const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
/// Merges, highest priority first, in byte-level spelling.
const MERGES: [&str; 10] = [
    "h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor ld", "1 2", "12 3",
];
const USER_TOKEN: &str = "<tool>";

/// Token list: specials, the 256 byte chars, merge results, then one user-defined token.
fn tokens() -> Vec<String> {
    let mut t: Vec<String> = SPECIALS.iter().map(|s| s.to_string()).collect();
    t.extend(byte_chars().iter().map(|c| c.to_string()));
    // "ld" is needed by "Ġwor ld"; give it its own merge-less entry (never produced by merges).
    for m in MERGES {
        t.push(m.replace(' ', ""));
    }
    t.push("ld".into());
    t.push(USER_TOKEN.into());
    t
}

fn vocab(pre: &str, add_bos: bool) -> GgufVocab {
    let tokens = tokens();
    let mut types = vec![1; tokens.len()];
    types[..3].fill(3);
    *types.last_mut().unwrap() = 4;
    let mut merges: Vec<String> = MERGES.iter().map(|s| s.to_string()).collect();
    merges.insert(6, "l d".into()); // "ld" before "Ġwor ld"
    GgufVocab {
        model: "gpt2".into(),
        pre: Some(pre.into()),
        tokens,
        token_types: types,
        merges,
        scores: Vec::new(),
        bos: Some(1),
        eos: Some(2),
        add_bos,
    }
}

fn id(t: &Tokenizer, tok: &str) -> u32 {
    t.token_to_id(tok)
        .unwrap_or_else(|| panic!("no token {tok:?}"))
}

#[test]
fn gguf_encode_decode_round_trip() {
    let t = Tokenizer::from_gguf_vocab(vocab("smollm", false)).unwrap();
    assert_eq!(t.vocab_size(), tokens().len());
    let ids = t.encode("hello world", false).unwrap();
    assert_eq!(ids, vec![id(&t, "hello"), id(&t, "Ġworld")]);
    assert_eq!(t.decode(&ids, false).unwrap(), "hello world");
    for text in [
        "hello world",
        "héllo wörld 🦀\n\ttabs  and  spaces",
        "",
        "1234 x12",
    ] {
        let ids = t.encode(text, true).unwrap();
        assert_eq!(t.decode(&ids, false).unwrap(), text, "{ids:?}");
    }
    assert_eq!(t.id_to_token(id(&t, "Ġworld")).as_deref(), Some("Ġworld"));
}

#[test]
fn gguf_special_tokens_are_single_ids() {
    let t = Tokenizer::from_gguf_vocab(vocab("smollm", false)).unwrap();
    let ids = t.encode("<|im_start|>hello<|im_end|>", false).unwrap();
    assert_eq!(ids, vec![1, id(&t, "hello"), 2]);
    assert_eq!(
        t.decode(&ids, false).unwrap(),
        "<|im_start|>hello<|im_end|>"
    );
    assert_eq!(t.decode(&ids, true).unwrap(), "hello");
    // User-defined tokens match as one id too, but are not special: kept when skipping.
    let user = id(&t, USER_TOKEN);
    let ids = t.encode("hello<tool>hello", false).unwrap();
    assert_eq!(ids, vec![id(&t, "hello"), user, id(&t, "hello")]);
    assert_eq!(t.decode(&ids, true).unwrap(), "hello<tool>hello");
}

#[test]
fn gguf_add_bos() {
    let t = Tokenizer::from_gguf_vocab(vocab("smollm", true)).unwrap();
    assert_eq!(t.encode("hello", true).unwrap(), vec![1, id(&t, "hello")]);
    assert_eq!(t.encode("hello", false).unwrap(), vec![id(&t, "hello")]);
    let no_bos = Tokenizer::from_gguf_vocab(vocab("smollm", false)).unwrap();
    assert_eq!(no_bos.encode("hello", true).unwrap(), vec![id(&t, "hello")]);
}

#[test]
fn gguf_digits_follow_the_pre_tokenizer() {
    let one = |t: &Tokenizer, s: &str| id(t, s);
    // smollm: every digit alone, so the "1 2" merge never applies.
    let t = Tokenizer::from_gguf_vocab(vocab("smollm", false)).unwrap();
    let digits: Vec<u32> = ["1", "2", "3", "4", "5"]
        .iter()
        .map(|d| one(&t, d))
        .collect();
    assert_eq!(t.encode("12345", false).unwrap(), digits);
    // gpt2: a run of digits is one piece; merges apply.
    let t = Tokenizer::from_gguf_vocab(vocab("gpt2", false)).unwrap();
    assert_eq!(
        t.encode("12345", false).unwrap(),
        vec![one(&t, "123"), one(&t, "4"), one(&t, "5")]
    );
    // llama-bpe: at most three digits per piece.
    let t = Tokenizer::from_gguf_vocab(vocab("llama-bpe", false)).unwrap();
    assert_eq!(
        t.encode("1212", false).unwrap(),
        vec![one(&t, "12"), one(&t, "1"), one(&t, "2")]
    );
    assert_eq!(
        t.decode(&t.encode("hello world 1212", false).unwrap(), false)
            .unwrap(),
        "hello world 1212"
    );
    // Unknown names fall back to gpt2.
    let t = Tokenizer::from_gguf_vocab(vocab("no-such-pre", false)).unwrap();
    assert_eq!(
        t.encode("12345", false).unwrap(),
        vec![one(&t, "123"), one(&t, "4"), one(&t, "5")]
    );
}

#[test]
fn gguf_rejects_bad_input() {
    let mut v = vocab("smollm", false);
    v.model = "bert".into();
    let err = Tokenizer::from_gguf_vocab(v).unwrap_err();
    assert!(matches!(err, TokenizerError::UnsupportedModel { .. }));
    assert!(err.to_string().contains("\"bert\""), "{err}");
    // SentencePiece needs one score per piece.
    let mut v = vocab("smollm", false);
    v.model = "llama".into();
    let err = Tokenizer::from_gguf_vocab(v).unwrap_err();
    assert!(err.to_string().contains("scores"), "{err}");

    let mut v = vocab("smollm", false);
    v.merges.push("nospace".into());
    assert!(matches!(
        Tokenizer::from_gguf_vocab(v),
        Err(TokenizerError::InvalidVocab(_))
    ));

    let mut v = vocab("smollm", false);
    v.merges.push("zz qq".into()); // not in the vocabulary
    assert!(matches!(
        Tokenizer::from_gguf_vocab(v),
        Err(TokenizerError::InvalidVocab(_))
    ));

    let mut v = vocab("smollm", true);
    v.bos = Some(1_000_000);
    assert!(matches!(
        Tokenizer::from_gguf_vocab(v),
        Err(TokenizerError::InvalidVocab(_))
    ));

    let mut v = vocab("smollm", false);
    v.token_types.pop();
    assert!(matches!(
        Tokenizer::from_gguf_vocab(v),
        Err(TokenizerError::InvalidVocab(_))
    ));

    let t = Tokenizer::from_gguf_vocab(vocab("smollm", false)).unwrap();
    let n = t.vocab_size() as u32;
    assert!(
        matches!(t.decode(&[3, n], false), Err(TokenizerError::IdOutOfRange { id, .. }) if id == n)
    );
}

#[test]
fn stream_decoder_joins_split_utf8() {
    let t = Tokenizer::from_gguf_vocab(vocab("smollm", false)).unwrap();
    let text = "hello wörld 🦀 héllo";
    let ids = t.encode(text, false).unwrap();
    let mut d = StreamDecoder::new(&t);
    let mut out = String::new();
    let mut held_back = 0;
    for &i in &ids {
        match d.push(i).unwrap() {
            Some(piece) => {
                assert!(!piece.contains('\u{FFFD}'), "{piece:?}");
                out.push_str(&piece);
            }
            None => held_back += 1,
        }
    }
    out.push_str(&d.finish().unwrap());
    assert_eq!(out, text);
    assert!(
        held_back >= 4,
        "multi-byte chars must be held back ({held_back})"
    );

    // Special tokens: skipped by default, kept on request.
    let ids = t.encode("<|im_start|>hello<|im_end|>", false).unwrap();
    let mut d = StreamDecoder::new(&t);
    let pieces: Vec<_> = ids.iter().filter_map(|&i| d.push(i).unwrap()).collect();
    assert_eq!(pieces.concat(), "hello");
    let mut d = StreamDecoder::with_skip_special(&t, false);
    let pieces: Vec<_> = ids.iter().filter_map(|&i| d.push(i).unwrap()).collect();
    assert_eq!(pieces.concat(), "<|im_start|>hello<|im_end|>");

    // An incomplete character at the end comes out as U+FFFD on finish.
    let crab = t.encode("🦀", false).unwrap();
    let mut d = StreamDecoder::new(&t);
    for &i in &crab[..crab.len() - 1] {
        assert_eq!(d.push(i).unwrap(), None);
    }
    assert_eq!(d.finish().unwrap(), "\u{FFFD}");
}

/// A minimal HF `tokenizer.json` for the same vocabulary (SmolLM2-style pipeline).
fn tokenizer_json() -> serde_json::Value {
    let v = vocab("smollm", false);
    let vocab_map: serde_json::Map<String, serde_json::Value> = v
        .tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), serde_json::json!(i)))
        .collect();
    let added: Vec<_> = SPECIALS
        .iter()
        .enumerate()
        .map(|(i, s)| {
            serde_json::json!({"id": i, "content": s, "single_word": false, "lstrip": false,
                               "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}
        ]},
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}}},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "vocab": vocab_map, "merges": v.merges}
    })
}

fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("tokenizer_hand-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn tokenizer_json_matches_gguf_build() {
    let dir = scratch("json");
    let path = dir.join("tokenizer.json");
    std::fs::write(
        &path,
        serde_json::to_string_pretty(&tokenizer_json()).unwrap(),
    )
    .unwrap();
    let from_json = Tokenizer::from_file(&path).unwrap();
    let from_gguf = Tokenizer::from_gguf_vocab(vocab("smollm", true)).unwrap();
    for text in [
        "hello world",
        "<|im_start|>hello<|im_end|>\n12345",
        "héllo 🦀 wörld",
        " hello  world ",
    ] {
        for special in [false, true] {
            let a = from_json.encode(text, special).unwrap();
            assert_eq!(
                a,
                from_gguf.encode(text, special).unwrap(),
                "{text:?} special={special}"
            );
            assert_eq!(
                from_json.decode(&a, false).unwrap(),
                if special {
                    format!("<|im_start|>{text}")
                } else {
                    text.to_string()
                }
            );
        }
    }
    assert_eq!(
        from_json.encode("1 2", false).unwrap(),
        vec![
            id(&from_json, "1"),
            id(&from_json, "Ġ"),
            id(&from_json, "2")
        ]
    );
    assert_eq!(
        from_json.encode("hello", true).unwrap(),
        vec![1, id(&from_json, "hello")]
    );
    assert_eq!(
        from_json
            .decode(&[1, id(&from_json, "hello")], true)
            .unwrap(),
        "hello"
    );
    assert_eq!(from_json.token_to_id("<|im_end|>"), Some(2));
    assert_eq!(from_json.vocab_size(), tokens().len());

    let missing = dir.join("missing.json");
    assert!(matches!(
        Tokenizer::from_file(&missing),
        Err(TokenizerError::Load { .. })
    ));
    std::fs::write(dir.join("bad.json"), "{not json").unwrap();
    assert!(matches!(
        Tokenizer::from_file(&dir.join("bad.json")),
        Err(TokenizerError::Load { .. })
    ));
    let _ = std::fs::remove_dir_all(&dir);
}

fn metadata_of(v: &GgufVocab) -> loip_model::GgufMetadata {
    use loip_model::GgufValue as G;
    let strs = |xs: &[String]| G::Array(xs.iter().map(|s| G::Str(s.clone())).collect());
    let mut kv = std::collections::BTreeMap::new();
    kv.insert("tokenizer.ggml.model".to_string(), G::Str(v.model.clone()));
    kv.insert(
        "tokenizer.ggml.pre".to_string(),
        G::Str(v.pre.clone().unwrap()),
    );
    kv.insert("tokenizer.ggml.tokens".to_string(), strs(&v.tokens));
    kv.insert("tokenizer.ggml.merges".to_string(), strs(&v.merges));
    kv.insert(
        "tokenizer.ggml.token_type".to_string(),
        G::Array(v.token_types.iter().map(|&t| G::I32(t)).collect()),
    );
    kv.insert(
        "tokenizer.ggml.bos_token_id".to_string(),
        G::U32(v.bos.unwrap()),
    );
    kv.insert(
        "tokenizer.ggml.eos_token_id".to_string(),
        G::U32(v.eos.unwrap()),
    );
    kv.insert(
        "tokenizer.ggml.add_bos_token".to_string(),
        G::Bool(v.add_bos),
    );
    kv.insert(
        "tokenizer.chat_template".to_string(),
        G::Str(
            "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"
                .into(),
        ),
    );
    loip_model::GgufMetadata {
        version: 3,
        alignment: 32,
        kv,
    }
}

#[test]
fn from_gguf_metadata() {
    let v = vocab("smollm", true);
    let mut meta = metadata_of(&v);
    let back = GgufVocab::from_metadata(&meta).unwrap();
    assert_eq!(
        (
            &back.model,
            &back.pre,
            &back.tokens,
            &back.token_types,
            &back.merges
        ),
        (&v.model, &v.pre, &v.tokens, &v.token_types, &v.merges)
    );
    assert_eq!(
        (back.bos, back.eos, back.add_bos),
        (v.bos, v.eos, v.add_bos)
    );
    let t = Tokenizer::from_gguf_metadata(&meta).unwrap();
    assert_eq!(t.encode("hello", true).unwrap(), vec![1, id(&t, "hello")]);

    let chat = loip_model::chat::ChatTemplate::from_gguf_metadata(&meta)
        .unwrap()
        .unwrap();
    let msgs = [loip_model::chat::ChatMessage::new("user", "hi")];
    assert_eq!(
        chat.render(&msgs, false).unwrap(),
        "<|im_start|>hi<|im_end|>"
    );

    meta.kv.insert(
        "tokenizer.ggml.tokens".into(),
        loip_model::GgufValue::U32(3),
    );
    let err = GgufVocab::from_metadata(&meta).unwrap_err();
    assert!(err.to_string().contains("tokenizer.ggml.tokens"), "{err}");
    meta.kv.remove("tokenizer.ggml.model");
    assert!(matches!(
        GgufVocab::from_metadata(&meta),
        Err(TokenizerError::InvalidVocab(_))
    ));
    meta.kv.remove("tokenizer.chat_template");
    assert!(loip_model::chat::ChatTemplate::from_gguf_metadata(&meta)
        .unwrap()
        .is_none());
}
