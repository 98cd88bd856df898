//! Issue 34: request fields (none silently ignored), seeds, models, tokenize, log-probabilities, penalties and bias.

use axum::body::Body;
use axum::http::Request;
use serde_json::{json, Value};
use tower::ServiceExt;

use super::*;
use crate::app::router;

/// Issue 34: no field is silently ignored. An unknown field, or a known one this server does
/// not implement with a value that asks for something, is a 400 naming it; the neutral
/// values OpenAI clients send for fields they do not use are accepted.
#[tokio::test]
async fn issue_34_no_field_is_silently_ignored() {
    let app = tiny_app();
    for (body, needle) in [
        (r#"{"prompt": [1], "frobnicate": 1}"#, "`frobnicate`"),
        (r#"{"prompt": [1], "logprobs": 1000000000}"#, "`logprobs`"),
        (r#"{"prompt": [1], "logprobs": true}"#, "`logprobs`"),
        (r#"{"prompt": [1], "echo": true}"#, "`echo`"),
        (
            r#"{"prompt": [1], "logit_bias": {"999": 10}}"#,
            "logit_bias",
        ),
        (r#"{"prompt": [1], "logit_bias": {"x": 10}}"#, "logit_bias"),
        (
            r#"{"prompt": [1], "frequency_penalty": 5}"#,
            "frequency_penalty",
        ),
        (r#"{"prompt": [1], "top_logprobs": 2}"#, "top_logprobs"),
        (
            r#"{"messages": [{"role": "user", "content": "1"}], "top_logprobs": 2}"#,
            "top_logprobs",
        ),
        (
            r#"{"prompt": [1], "response_format": {"type": "json_object"}}"#,
            "`response_format`",
        ),
        (
            r#"{"prompt": [1], "tools": [{"type": "function"}]}"#,
            "`tools`",
        ),
        (r#"{"prompt": [1], "stream_options": {"x": 1}}"#, "`x`"),
        (
            r#"{"messages": [{"role": "tool", "content": "1", "tool_call_id": 5}]}"#,
            "tool_call_id",
        ),
        (
            r#"{"messages": [{"role": "user", "content": "1", "extra": 2}]}"#,
            "`extra`",
        ),
    ] {
        let path = if body.contains("messages") {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        };
        let (s, v) = call(&app, "POST", path, body.into()).await;
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert_eq!(s, 400, "{body}: {v}");
        assert!(msg.contains(needle), "{body}: {msg}");
    }
    let neutral = r#"{"prompt": [1], "max_tokens": 1, "logprobs": null,
        "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "tools": [],
        "tool_choice": "none", "response_format": {"type": "text"}, "user": "u", "echo": false,
        "best_of": 1, "n": 1, "suffix": null, "model": "tiny"}"#;
    let (s, v) = call(&app, "POST", "/v1/completions", neutral.into()).await;
    assert_eq!(s, 200, "{v}");
}

/// Issue 34: a request without a seed gets a fresh one, reported in the response; sending
/// that seed back reproduces the response.
#[tokio::test]
async fn issue_34_requests_without_a_seed_are_seeded_afresh() {
    let app = tiny_app();
    let body = r#"{"prompt": [1, 5, 9], "max_tokens": 8, "temperature": 1, "ignore_eos": true,
                   "return_token_ids": true}"#;
    let mut seeds = Vec::new();
    let mut first = None;
    for _ in 0..3 {
        let (s, v) = call(&app, "POST", "/v1/completions", body.into()).await;
        assert_eq!(s, 200, "{v}");
        seeds.push(v["seed"].as_u64().expect("the seed is reported"));
        first.get_or_insert(v);
    }
    seeds.dedup();
    assert_eq!(seeds.len(), 3, "{seeds:?}");
    let first = first.unwrap();
    let again = format!(
        r#"{{"prompt": [1, 5, 9], "max_tokens": 8, "temperature": 1, "ignore_eos": true,
             "return_token_ids": true, "seed": {}}}"#,
        first["seed"]
    );
    let (s, v) = call(&app, "POST", "/v1/completions", again.into()).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        v["choices"][0]["token_ids"],
        first["choices"][0]["token_ids"]
    );
    assert_eq!(v["seed"], first["seed"]);
}

/// Issue 34: a request naming another model is 404 `model_not_found` (an alias is served);
/// `GET /v1/models/{id}` answers for the served model.
#[tokio::test]
async fn issue_34_unknown_models_are_404_and_models_by_id_answer() {
    let app = tiny_app();
    let body = |m: &str| format!(r#"{{"prompt": [1], "max_tokens": 1, "model": "{m}"}}"#);
    let (s, v) = call(&app, "POST", "/v1/completions", body("gpt-4o").into()).await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (404, Some("model_not_found")),
        "{v}"
    );
    for m in ["tiny", "tiny-alias"] {
        let (s, v) = call(&app, "POST", "/v1/completions", body(m).into()).await;
        assert_eq!(s, 200, "{v}");
    }
    let (s, v) = call(&app, "GET", "/v1/models/tiny", vec![]).await;
    assert_eq!((s, v["id"].as_str()), (200, Some("tiny")), "{v}");
    assert!(v["context_length"].as_u64().is_some(), "{v}");
    let (s, v) = call(&app, "GET", "/v1/models/gpt-4o", vec![]).await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (404, Some("model_not_found")),
        "{v}"
    );
}

/// Issue 34: `/tokenize` gives a completion prompt's ids, `/detokenize` their text back;
/// ids outside the vocabulary and models without a tokenizer are 400.
#[tokio::test]
async fn issue_34_tokenize_and_detokenize_round_trip() {
    let app = tokenized_app();
    let (s, v) = call(
        &app,
        "POST",
        "/tokenize",
        br#"{"content": "hi there"}"#.to_vec(),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let ids = v["tokens"].clone();
    assert_eq!(ids.as_array().map(Vec::len), Some(8), "{v}");
    let (s, v) = post(&app, "/detokenize", &json!({"tokens": ids})).await;
    assert_eq!((s, v["content"].as_str()), (200, Some("hi there")), "{v}");
    let (s, v) = call(
        &app,
        "POST",
        "/tokenize",
        br#"{"content": "hi", "with_pieces": true}"#.to_vec(),
    )
    .await;
    assert_eq!(
        (s, v["tokens"][1]["piece"].as_str()),
        (200, Some("i")),
        "{v}"
    );
    // the prompt of a completion tokenizes the same way
    let (s, v) = call(
        &app,
        "POST",
        "/v1/completions",
        br#"{"prompt": "hi there", "max_tokens": 1, "return_token_ids": true}"#.to_vec(),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["prompt_token_ids"], ids);
    let (s, _) = call(
        &app,
        "POST",
        "/detokenize",
        br#"{"tokens": [256]}"#.to_vec(),
    )
    .await;
    assert_eq!(s, 400);
    let (s, v) = call(
        &tiny_app(),
        "POST",
        "/tokenize",
        br#"{"content": "x"}"#.to_vec(),
    )
    .await;
    assert_eq!(s, 400, "{v}");
    // a chat request runs through the template and the tokenizer
    let chat = br#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}"#;
    let (s, v) = call(&app, "POST", "/v1/chat/completions", chat.to_vec()).await;
    assert_eq!(s, 200, "{v}");
}

/// The logits of the tiny fixture after `prompt`, from the engine alone.
fn tiny_logits(prompt: &[u32]) -> Vec<f32> {
    use loip_engine::StepBackend;
    let dir = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/tiny-llama"
    );
    let ckpt = loip_model::Checkpoint::open(std::path::Path::new(dir)).unwrap();
    let model = loip_engine::Model::from_checkpoint(&ckpt).unwrap();
    let mut gen = loip_engine::Generator::new(&model, None);
    gen.step(0, prompt, 0).unwrap()
}

/// Issue 34: `logprobs` are the log-softmax of the model's own logits (the engine's, bit
/// for bit), do not change the tokens, and come streamed too, one entry per token.
#[tokio::test]
async fn issue_34_logprobs_are_the_log_softmax_of_the_model_logits() {
    let app = tiny_app();
    let prompt = [1u32, 5, 9];
    let plain = json!({"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": true,
                       "return_token_ids": true});
    let (s, want) = post(&app, "/v1/completions", &plain).await;
    assert_eq!(s, 200, "{want}");
    let mut asked = plain.clone();
    asked["logprobs"] = json!(3);
    let (s, v) = post(&app, "/v1/completions", &asked).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        v["choices"][0]["token_ids"],
        want["choices"][0]["token_ids"]
    );
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(
        lp["token_logprobs"].as_array().map(Vec::len),
        Some(6),
        "{lp}"
    );
    let first = v["choices"][0]["token_ids"][0].as_u64().unwrap() as u32;
    let engine = loip_engine::sampling::logprob_of(&tiny_logits(&prompt), first, 3);
    let got = lp["token_logprobs"][0].as_f64().unwrap() as f32;
    assert_eq!(
        got.to_bits(),
        engine.logprob.to_bits(),
        "{got} vs {}",
        engine.logprob
    );
    let top = lp["top_logprobs"][0].as_object().unwrap();
    assert_eq!(top.len(), 3);
    assert_eq!(
        top[&format!("[{first}]")].as_f64().unwrap() as f32,
        engine.logprob
    );
    // streamed: each token's entry in the chunk that carries its text
    let mut streamed = asked.clone();
    streamed["stream"] = json!(true);
    let chunks = events(&app, "/v1/completions", streamed).await;
    let values: Vec<Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["logprobs"]["token_logprobs"].as_array())
        .flatten()
        .cloned()
        .collect();
    assert_eq!(Value::from(values), lp["token_logprobs"]);
}

/// Issue 34: chat `logprobs: true` with `top_logprobs`, whole and streamed.
#[tokio::test]
async fn issue_34_chat_logprobs_whole_and_streamed() {
    let app = tokenized_app();
    let body = json!({"messages": [{"role": "system", "content": "s"},
                                   {"role": "user", "content": "hi"}],
                      "max_tokens": 4, "temperature": 0, "ignore_eos": true,
                      "logprobs": true, "top_logprobs": 2});
    let (s, v) = post(&app, "/v1/chat/completions", &body).await;
    assert_eq!(s, 200, "{v}");
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 4, "{v}");
    assert_eq!(content[0]["top_logprobs"].as_array().map(Vec::len), Some(2));
    assert!(content[0]["logprob"].as_f64().unwrap() <= 0.0);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let chunks = events(&app, "/v1/chat/completions", streamed).await;
    let entries: Vec<Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array())
        .flatten()
        .cloned()
        .collect();
    assert_eq!(&entries, content);
}

/// Issue 34: `logit_bias` and the penalties change what is sampled, never the logits: a
/// bias of +100 makes every token that id; −100 on the greedy token takes it away; seeded
/// runs with penalties repeat.
#[tokio::test]
async fn issue_34_logit_bias_and_penalties_shape_the_sampling() {
    let app = tiny_app();
    let run = |extra: Value| {
        let app = app.clone();
        async move {
            let mut body = json!({"prompt": [1, 5, 9], "max_tokens": 5, "temperature": 0,
                                  "ignore_eos": true, "return_token_ids": true});
            for (k, v) in extra.as_object().unwrap() {
                body[k] = v.clone();
            }
            let (s, v) = post(&app, "/v1/completions", &body).await;
            assert_eq!(s, 200, "{v}");
            v["choices"][0]["token_ids"].clone()
        }
    };
    assert_eq!(
        run(json!({"logit_bias": {"42": 100}})).await,
        json!([42, 42, 42, 42, 42])
    );
    let greedy = run(json!({})).await;
    let first = greedy[0].as_u64().unwrap();
    let banned = run(json!({"logit_bias": {first.to_string(): -100}})).await;
    assert!(
        banned.as_array().unwrap().iter().all(|t| t != &greedy[0]),
        "{banned}"
    );
    // penalties run through the engine's decoding (its tests check what they do)
    let penalised = run(json!({"presence_penalty": 2, "frequency_penalty": 2})).await;
    assert_eq!(penalised.as_array().map(Vec::len), Some(5));
    let sampled = json!({"temperature": 1, "seed": 7, "repetition_penalty": 1.3,
                         "frequency_penalty": 0.5});
    assert_eq!(run(sampled.clone()).await, run(sampled).await);
}

/// The fuzz target's entry (`check_request`) on 4,000 mutated bodies of its seeds: it
/// answers every one, and accepts the seeds themselves.
#[test]
fn check_request_answers_every_mutated_body() {
    let seeds: [(&[u8], bool); 2] = [
        (
            br#"{"prompt": [1, 5, 9], "max_tokens": 3, "stop": ["a"], "logprobs": 2,
                "logit_bias": {"5": -100}, "frequency_penalty": 0.5}"#,
            false,
        ),
        (
            br#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
                "logprobs": true, "top_logprobs": 2, "presence_penalty": 1,
                "response_format": {"type": "text"}, "stream_options": {"include_usage": true}}"#,
            true,
        ),
    ];
    for (body, chat) in seeds {
        assert_eq!(crate::check_request(body, chat, 256), Ok(()));
    }
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let mut refused = 0;
    for i in 0..4000 {
        let (seed, chat) = seeds[i % 2];
        let body = mutate(&mut rng, seed);
        if let Err(m) = crate::check_request(&body, chat, 256) {
            assert!(!m.is_empty());
            refused += 1;
        }
    }
    assert!(refused > 0);
}

/// Issue 34: with `--cors ORIGIN` a preflight is answered 204 before the key is checked and
/// every response allows the origin; `/metrics` lists the request counters from the start.
#[tokio::test]
async fn issue_34_cors_preflight_and_metrics_from_the_start() {
    let app = keyed_app(Some("s3cret")); // with a key, the test app allows https://app.example
    let req = Request::builder()
        .method("OPTIONS")
        .uri("/v1/chat/completions")
        .header("origin", "https://app.example")
        .header("access-control-request-method", "POST")
        .body(Body::empty())
        .unwrap();
    let resp = router(app.clone()).oneshot(req).await.unwrap();
    assert_eq!(resp.status().as_u16(), 204);
    let h = resp.headers();
    assert_eq!(h["access-control-allow-origin"], "https://app.example");
    assert!(h["access-control-allow-headers"]
        .to_str()
        .unwrap()
        .contains("authorization"));
    let (s, _) = call(&app, "GET", "/v1/models", vec![]).await;
    assert_eq!(s, 401);
    let resp = router(app.clone())
        .oneshot(keyed_get("/metrics"))
        .await
        .unwrap();
    assert_eq!(
        resp.headers()["access-control-allow-origin"],
        "https://app.example"
    );
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&bytes);
    if crate::metrics::init().is_some() {
        for series in ["loip_requests_total", "loip_queue_depth"] {
            assert!(text.contains(series), "{series} in {text}");
        }
    }
    // without --cors no CORS header
    let resp = router(tiny_app())
        .oneshot(
            Request::builder()
                .uri("/health")
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert!(resp.headers().get("access-control-allow-origin").is_none());
}

/// Issue 34: `n` choices (up to `--parallel`), each its own sequence seeded `seed + index`
/// sharing the prompt's KV: choice 1 of seed 7 is choice 0 of seed 8, choice 0 that of seed
/// 7 alone; streamed, every chunk names its choice and the usage counts all of them.
#[tokio::test]
async fn issue_34_n_choices_are_served() {
    let app = tiny_app(); // --parallel 2
    let body = |seed: u64, n: u64| {
        json!({"prompt": [1, 5, 9], "max_tokens": 4, "temperature": 1, "seed": seed, "n": n,
               "ignore_eos": true, "return_token_ids": true})
    };
    let (s, two) = post(&app, "/v1/completions", &body(7, 2)).await;
    assert_eq!(s, 200, "{two}");
    assert_eq!(two["choices"].as_array().map(Vec::len), Some(2));
    assert_eq!(two["choices"][1]["index"], 1);
    assert_eq!(two["usage"]["completion_tokens"], 8);
    let (_, next) = post(&app, "/v1/completions", &body(8, 1)).await;
    assert_eq!(
        two["choices"][1]["token_ids"],
        next["choices"][0]["token_ids"]
    );
    let (_, one) = post(&app, "/v1/completions", &body(7, 1)).await;
    assert_eq!(
        two["choices"][0]["token_ids"],
        one["choices"][0]["token_ids"]
    );
    // The second choice copied the prompt's KV (all of it but its last token) unless the
    // first was gone before it came; long choices leave it time.
    let mut long = body(7, 2);
    long["max_tokens"] = json!(100);
    for _ in 0..5 {
        if app.backend.stats().shared_tokens > 0 {
            break;
        }
        let (s, v) = post(&app, "/v1/completions", &long).await;
        assert_eq!(s, 200, "{v}");
    }
    assert!(app.backend.stats().shared_tokens >= 2);
    let mut streamed = body(7, 2);
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let chunks = events(&app, "/v1/completions", streamed).await;
    let finished: Vec<u64> = chunks
        .iter()
        .filter(|c| c["choices"][0]["finish_reason"].is_string())
        .filter_map(|c| c["choices"][0]["index"].as_u64())
        .collect();
    assert_eq!(finished.len(), 2, "{chunks:?}");
    assert!(finished.contains(&0) && finished.contains(&1));
    let usage = chunks.last().unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 8, "{usage}");
    let text = |i: u64| -> String {
        chunks
            .iter()
            .filter(|c| c["choices"][0]["index"].as_u64() == Some(i))
            .filter_map(|c| c["choices"][0]["text"].as_str())
            .collect()
    };
    assert_eq!(text(0), two["choices"][0]["text"].as_str().unwrap());
    assert_eq!(text(1), two["choices"][1]["text"].as_str().unwrap());
}
