//! Handler tests through `tower::ServiceExt::oneshot`: no socket, the tiny fixture.
//! [`security`]: issue 37's findings on the API; [`fields`]: issue 34's request fields;
//! [`speculate`]: issue 31's `speculate` field; [`structured`], [`tool_calls`] and
//! [`templates`]: issue 34's structured output, tool calls and tool chat formats. The
//! request helpers ([`call`], [`post`], [`events`]) are shared here.

mod fields;
mod prompt_cache;
mod security;
mod speculate;
mod structured;
mod templates;
mod tool_calls;

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::Request;
use serde_json::Value;
use tower::ServiceExt;

use crate::app::{router, App};
use crate::wire::MAX_BODY;
use crate::{Backend, Limits, ServedModel, ServerConfig};

pub(super) fn tiny_app() -> Arc<App> {
    keyed_app(None)
}

/// The tiny fixture (no tokenizer, no chat template) on this machine; `--max-prompt 64`,
/// `--max-tokens-limit 100`, a 1 s body timeout.
pub(super) fn keyed_app(key: Option<&str>) -> Arc<App> {
    app_with(key, 2, 64)
}

/// The tiny fixture with `parallel` generations at once and `max_queue` waiting.
pub(super) fn app_with(key: Option<&str>, parallel: usize, max_queue: usize) -> Arc<App> {
    build_app(key, parallel, max_queue, false, "")
}

/// The tiny fixture with a byte-level tokenizer of its 256 ids (one token per byte) and
/// SmolLM2's chat template (its control tokens spelled as bytes); `--max-prompt 200`.
pub(super) fn tokenized_app() -> Arc<App> {
    build_app(None, 2, 64, true, SMOLLM2_TEMPLATE)
}

const SMOLLM2_TEMPLATE: &str =
    include_str!("../../../../tests/fixtures/smollm2/chat_template.jinja");

/// [`tokenized_app`] with another chat template.
pub(super) fn templated_app(template: &str) -> Arc<App> {
    build_app(None, 2, 64, true, template)
}

fn byte_tokenizer() -> loip_model::tokenizer::Tokenizer {
    let mut alphabet: Vec<char> = tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet()
        .into_iter()
        .collect();
    alphabet.sort_unstable();
    let vocab = loip_model::tokenizer::GgufVocab {
        model: "gpt2".into(),
        pre: Some("smollm".into()),
        tokens: alphabet.iter().map(char::to_string).collect(),
        token_types: vec![],
        merges: vec![],
        scores: vec![],
        bos: None,
        eos: None,
        add_bos: false,
    };
    loip_model::tokenizer::Tokenizer::from_gguf_vocab(vocab).unwrap()
}

fn build_app(
    key: Option<&str>,
    parallel: usize,
    max_queue: usize,
    text: bool,
    template: &str,
) -> Arc<App> {
    let dir = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/tiny-llama"
    );
    let ckpt = loip_model::Checkpoint::open(std::path::Path::new(dir)).unwrap();
    let cfg = ServerConfig {
        name: "tiny".into(),
        aliases: vec!["tiny-alias".into()],
        parallel,
        max_queue,
        max_prompt: if text { 200 } else { 64 },
        max_tokens_limit: 100,
        context: ckpt.config.max_position_embeddings,
        api_key: key.map(str::to_string),
        cors: key.map(|_| "https://app.example".to_string()),
        limits: Limits {
            max_connections: 8,
            max_connections_per_addr: 2,
            header_timeout: Duration::from_secs(5),
            body_timeout: Duration::from_secs(1),
        },
        speculate: loip_engine::Speculate::Off,
        speculate_k: 8,
    };
    let model = ServedModel {
        config: ckpt.config.clone(),
        tokenizer: text.then(byte_tokenizer),
        chat: text
            .then(|| loip_model::chat::ChatTemplate::new(template.into(), None, None).unwrap()),
    };
    let backend = Backend::local(ckpt, parallel).unwrap();
    Arc::new(App::new(&cfg, model, Arc::new(backend)))
}

pub(super) async fn call(app: &Arc<App>, method: &str, path: &str, body: Vec<u8>) -> (u16, Value) {
    let req = Request::builder()
        .method(method)
        .uri(path)
        .body(Body::from(body))
        .unwrap();
    send(app, req).await
}

/// `POST path` with a JSON body: the status and the JSON answer.
pub(super) async fn post(app: &Arc<App>, path: &str, body: &Value) -> (u16, Value) {
    call(app, "POST", path, body.to_string().into_bytes()).await
}

/// The `data:` payloads of the server-sent event stream `POST path` answers (a 200).
pub(super) async fn events(app: &Arc<App>, path: &str, body: Value) -> Vec<Value> {
    let req = Request::builder()
        .method("POST")
        .uri(path)
        .body(Body::from(body.to_string()))
        .unwrap();
    let resp = router(app.clone()).oneshot(req).await.unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap();
    String::from_utf8_lossy(&bytes)
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

#[tokio::test]
async fn handlers_answer_without_a_socket() {
    let app = tiny_app();
    let (s, v) = call(&app, "GET", "/v1/models", vec![]).await;
    assert_eq!((s, v["data"][0]["id"].as_str()), (200, Some("tiny")));
    let ok = br#"{"prompt": [1, 5, 9], "max_tokens": 4, "temperature": 0, "ignore_eos": true,
                  "return_token_ids": true}"#;
    let (s, v) = call(&app, "POST", "/v1/completions", ok.to_vec()).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 4);
    assert_eq!(
        v["choices"][0]["token_ids"].as_array().map(Vec::len),
        Some(4)
    );
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    for (body, status, needle) in [
        (&b"{nope"[..], 400, "invalid JSON"),
        (br#"{"max_tokens": 3}"#, 400, "`prompt` is required"),
        (br#"{"prompt": [1], "temperature": 3}"#, 400, "temperature"),
        (br#"{"prompt": [1], "top_p": 0}"#, 400, "top_p"),
        (
            br#"{"prompt": [1], "max_tokens": 101}"#,
            400,
            "--max-tokens-limit",
        ),
        (
            br#"{"prompt": [1], "max_tokens": 100, "n": 3}"#,
            400,
            "n must be from 1 to 2",
        ),
        (br#"{"prompt": [1, 99999]}"#, 400, "vocabulary"),
        (br#"{"prompt": [-1]}"#, 400, "unsigned"),
        (
            br#"{"prompt": [1], "max_tokens": "3"}"#,
            400,
            "invalid `max_tokens`",
        ),
        (b"[1, 2]", 400, "JSON object"),
        (br#"{"prompt": [1]} x"#, 400, "trailing"),
        (br#"{"prompt": "text"}"#, 400, "no tokenizer"),
        (br#"{"prompt": [[1], [2]]}"#, 400, "one prompt"),
    ] {
        let (s, v) = call(&app, "POST", "/v1/completions", body.to_vec()).await;
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert_eq!(s, status, "{v}");
        assert!(msg.contains(needle), "{msg}");
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }
    let long = format!("{{\"prompt\": {:?}}}", vec![1u32; 65]);
    let (s, v) = call(&app, "POST", "/v1/completions", long.into_bytes()).await;
    assert_eq!(s, 400, "{v}");
    let (s, _) = call(&app, "POST", "/v1/completions", vec![b' '; MAX_BODY + 1]).await;
    assert_eq!(s, 413);
    let (s, v) = call(&app, "GET", "/v2/nothing", vec![]).await;
    assert_eq!(s, 404, "{v}");
    let (s, _) = call(&app, "GET", "/v1/completions", vec![]).await;
    assert_eq!(s, 405);
    let (s, v) = call(
        &app,
        "POST",
        "/v1/chat/completions",
        br#"{"messages": []}"#.to_vec(),
    )
    .await;
    assert_eq!(s, 400, "{v}");
}

pub(super) async fn send(app: &Arc<App>, req: Request<Body>) -> (u16, Value) {
    let resp = router(app.clone()).oneshot(req).await.unwrap();
    let status = resp.status().as_u16();
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

/// `GET path` with the test key `s3cret`.
pub(super) fn keyed_get(path: &str) -> Request<Body> {
    Request::builder()
        .uri(path)
        .header("authorization", "Bearer s3cret")
        .body(Body::empty())
        .unwrap()
}

fn models_with(auth: Option<&str>) -> Request<Body> {
    let mut b = Request::builder().method("GET").uri("/v1/models");
    if let Some(a) = auth {
        b = b.header("authorization", a);
    }
    b.body(Body::empty()).unwrap()
}

#[tokio::test]
async fn api_key_is_required_on_v1_only() {
    let app = keyed_app(Some("s3cret"));
    for auth in [None, Some("Bearer wrong"), Some("s3cret"), Some("Bearer ")] {
        let (s, v) = send(&app, models_with(auth)).await;
        assert_eq!(s, 401, "{auth:?}: {v}");
        assert_eq!(v["error"]["code"], "invalid_api_key");
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }
    let (s, v) = send(&app, models_with(Some("Bearer s3cret"))).await;
    assert_eq!((s, v["data"][0]["id"].as_str()), (200, Some("tiny")));
    let (s, v) = call(&app, "POST", "/v1/completions", b"{}".to_vec()).await;
    assert_eq!(s, 401, "{v}");
    let (s, _) = call(&app, "GET", "/health", vec![]).await;
    assert_eq!(s, 200);
}

/// A body that never arrives.
fn endless() -> Body {
    Body::from_stream(futures_util::stream::pending::<
        Result<axum::body::Bytes, std::io::Error>,
    >())
}

/// A body that never arrives: with a `Content-Length` over the limit it is 413 at once,
/// unread; without, 408 after `--body-timeout` (1 s here).
#[tokio::test]
async fn finding_9_bodies_that_never_arrive_are_refused_in_time() {
    let app = tiny_app();
    for (length, want) in [(Some("99999999999"), 413), (None, 408)] {
        let mut req = Request::builder().method("POST").uri("/v1/completions");
        if let Some(l) = length {
            req = req.header("content-length", l);
        }
        let req = req.body(endless()).unwrap();
        let answered = tokio::time::timeout(Duration::from_secs(10), send(&app, req)).await;
        let (s, v) = answered.expect("answered without the body");
        assert_eq!(s, want, "{v}");
    }
}

#[tokio::test]
async fn finding_10_a_long_id_prompt_is_refused_before_it_is_read() {
    let app = tiny_app(); // --max-prompt 64
    let long = format!("{{\"prompt\": [{:?}]}}", vec![1u32; 100_000]);
    let (s, v) = call(&app, "POST", "/v1/completions", long.into_bytes()).await;
    assert_eq!(s, 400, "{v}");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .contains("--max-prompt"));
}

#[tokio::test]
async fn finding_13_errors_name_no_paths() {
    let app = tiny_app(); // a model without tokenizer or chat template
    for (path, body) in [
        ("/v1/completions", r#"{"prompt": "text"}"#),
        (
            "/v1/chat/completions",
            r#"{"messages": [{"role": "user", "content": "hi"}]}"#,
        ),
    ] {
        let (s, v) = call(&app, "POST", path, body.as_bytes().to_vec()).await;
        assert_eq!(s, 400, "{v}");
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(!msg.contains('/') && !msg.is_empty(), "{msg}");
    }
}

/// xorshift64: a fixed, dependency-free stream of test inputs.
pub(super) struct Rng(pub(super) u64);

impl Rng {
    pub(super) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    pub(super) fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Mutates `seed` a few times: byte flips, inserted JSON fragments, cut and repeated ranges.
pub(super) fn mutate(rng: &mut Rng, seed: &[u8]) -> Vec<u8> {
    const PIECES: &[&str] = &[
        "null",
        "-1",
        "1e999",
        "0.5",
        "[]",
        "{}",
        "[",
        "{",
        "}",
        "\"",
        ",",
        ":",
        "true",
        "99999999999999999999",
        "\"\\u0000\"",
        "\"\\ud800\"",
        "\"stream\": true",
        "\"max_tokens\": 0",
        "\"top_k\": 4294967296",
        "\"stop\": [\"\"]",
        "\"n\": 2",
        "\"messages\": [{\"role\": 1}]",
        "\"prompt\": [[]]",
        "\"temperature\": 1e-300",
        "\"min_tokens\": 18446744073709551615",
        "\"content\": [{\"type\": \"text\"}]",
    ];
    let mut b = seed.to_vec();
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(b.len() + 1);
        match rng.below(5) {
            0 if !b.is_empty() => {
                let i = rng.below(b.len());
                b[i] ^= 1 << rng.below(8);
            }
            1 => {
                let p = PIECES[rng.below(PIECES.len())].as_bytes();
                b.splice(at..at, p.iter().copied());
            }
            2 => {
                let end = (at + rng.below(16)).min(b.len());
                b.drain(at..end);
            }
            3 => {
                let end = (at + rng.below(32)).min(b.len());
                let part = b[at..end].to_vec();
                b.splice(at..at, part);
            }
            _ => b.insert(at.min(b.len()), (rng.next() & 0xff) as u8),
        }
    }
    b
}

/// Bounded fuzzing of the JSON bodies: 3,000 mutated bodies (1,500 per endpoint) through the
/// router; none may panic or get a 5xx, and every refusal is OpenAI's error object.
#[tokio::test]
async fn json_bodies_fuzzed_get_4xx_or_an_answer_never_a_panic() {
    let app = tiny_app();
    let seeds: &[(&str, &[u8])] = &[
        (
            "/v1/completions",
            br#"{"prompt": [1, 5, 9], "max_tokens": 3, "temperature": 0, "stop": ["a"], "seed": 1}"#,
        ),
        (
            "/v1/chat/completions",
            br#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}], "max_tokens": 2, "stream": true}"#,
        ),
    ];
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let (mut ok, mut refused) = (0, 0);
    for i in 0..3000 {
        let (path, seed) = seeds[i % seeds.len()];
        let body = mutate(&mut rng, seed);
        let req = Request::builder()
            .method("POST")
            .uri(path)
            .body(Body::from(body.clone()))
            .unwrap();
        let resp = router(app.clone()).oneshot(req).await.unwrap();
        let status = resp.status();
        let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
            .await
            .unwrap();
        let text = String::from_utf8_lossy(&body);
        assert!(!status.is_server_error(), "{status} for {text}");
        if status.is_client_error() {
            let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
            assert!(v["error"]["message"].is_string(), "{status} {v} for {text}");
            refused += 1;
        } else {
            ok += 1;
        }
    }
    assert_eq!(ok + refused, 3000);
    assert!(refused > 0 && ok > 0, "{ok} answered, {refused} refused");
}
