//! Issue 34: tool calls on the tiny fixture with a Qwen2.5-style template (abridged): a forced
//! call always parses into `tool_calls` that follow the tool's schema, whole and streamed;
//! assistant calls and `tool` answers are taken back; templates without tools refuse them.

use serde_json::{json, Value};

use super::*;

/// Qwen2.5's tool template, cut down to fit the fixture's 256-token context (one token a
/// byte): the same tags and turns, tools by name only.
const QWEN_LIKE: &str = include_str!("qwen_like.jinja");

pub(super) fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object",
                           "properties": {"city": {"type": "string", "maxLength": 8}},
                           "required": ["city"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "add",
            "parameters": {"type": "object",
                           "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                          "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                           "required": ["a", "b"], "additionalProperties": false}}}
    ])
}

fn ask(choice: Value, seed: u64) -> Value {
    json!({"messages": [{"role": "user", "content": "Hi?"}],
           "tools": tools(), "tool_choice": choice, "max_tokens": 100,
           "temperature": 1, "seed": seed})
}

/// A call's name and its arguments parsed, checked against the two tools' schemas.
fn check_call(call: &Value) -> String {
    assert_eq!(call["type"], "function", "{call}");
    assert!(
        call["id"]
            .as_str()
            .is_some_and(|id| id.len() == 9 && id.chars().all(|c| c.is_ascii_alphanumeric())),
        "{call}"
    );
    let name = call["function"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let args: Value = serde_json::from_str(call["function"]["arguments"].as_str().unwrap_or(""))
        .unwrap_or_else(|e| panic!("{call}: {e}"));
    match name.as_str() {
        "get_weather" => assert!(
            args["city"]
                .as_str()
                .is_some_and(|c| c.chars().count() <= 8)
                && args.as_object().is_some_and(|o| o.len() == 1),
            "{args}"
        ),
        "add" => assert!(
            ["a", "b"]
                .iter()
                .all(|k| args[k].as_i64().is_some_and(|n| (0..=99).contains(&n))),
            "{args}"
        ),
        other => panic!("unknown tool {other}"),
    }
    name
}

#[tokio::test]
async fn issue_34_forced_tool_calls_parse_and_follow_the_schema() {
    let app = templated_app(QWEN_LIKE);
    let named = json!({"type": "function", "function": {"name": "add"}});
    for seed in 0..3 {
        for (choice, want) in [(named.clone(), Some("add")), (json!("required"), None)] {
            let (s, v) = post(&app, "/v1/chat/completions", &ask(choice, seed)).await;
            assert_eq!(s, 200, "{v}");
            let c = &v["choices"][0];
            assert_eq!(c["finish_reason"], "tool_calls", "{v}");
            assert_eq!(c["message"]["content"], Value::Null, "{v}");
            let name = check_call(&c["message"]["tool_calls"][0]);
            if let Some(w) = want {
                assert_eq!(name, w);
            }
        }
    }
    // Streamed: the role, then per call its id and name, then its arguments in fragments as
    // they are written; accumulated as the OpenAI client does, the same answer as whole.
    let body = ask(named, 7);
    let (_, whole) = post(&app, "/v1/chat/completions", &body).await;
    let chunks = events(&app, "/v1/chat/completions", {
        let mut b = body.clone();
        b["stream"] = json!(true);
        b
    })
    .await;
    let deltas: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array())
        .flatten()
        .collect();
    assert!(deltas.len() > 2, "arguments come in fragments: {chunks:?}");
    assert!(deltas[0]["id"].is_string() && deltas[0]["function"]["name"] == "add");
    assert!(deltas[1..]
        .iter()
        .all(|d| d["id"].is_null() && d["index"] == 0));
    let calls = accumulate(&chunks);
    let want = &whole["choices"][0]["message"]["tool_calls"];
    assert_eq!(calls.len(), 1, "{chunks:?}");
    assert_eq!(check_call(&calls[0]), "add");
    assert_eq!(
        calls[0]["function"]["arguments"], want[0]["function"]["arguments"],
        "{chunks:?}"
    );
    let last = chunks
        .last()
        .map(|c| c["choices"][0]["finish_reason"].clone());
    assert_eq!(last, Some(json!("tool_calls")), "{chunks:?}");
}

/// The tool calls of a chat stream's chunks, accumulated as OpenAI's clients do: a delta
/// with a new `index` begins a call (its id and name), the next ones append to its
/// `arguments`.
fn accumulate(chunks: &[Value]) -> Vec<Value> {
    let mut calls: Vec<Value> = Vec::new();
    let deltas = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array())
        .flatten();
    for d in deltas {
        let i = d["index"].as_u64().unwrap() as usize;
        if i == calls.len() {
            calls.push(json!({"id": d["id"], "type": "function",
                              "function": {"name": d["function"]["name"], "arguments": ""}}));
        }
        let args = d["function"]["arguments"].as_str().unwrap_or_default();
        let have = calls[i]["function"]["arguments"]
            .as_str()
            .unwrap_or_default();
        calls[i]["function"]["arguments"] = json!(format!("{have}{args}"));
    }
    calls
}

#[tokio::test]
async fn issue_34_tool_answers_are_taken_back_and_bad_tools_refused() {
    let app = templated_app(QWEN_LIKE);
    // (no `tools` here: the template would describe them, past the fixture's context)
    let back = json!({"messages": [
        {"role": "user", "content": "Hi?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
        "max_tokens": 4, "temperature": 0});
    let (s, v) = post(&app, "/v1/chat/completions", &back).await;
    assert_eq!(s, 200, "{v}");
    for (body, needle) in [
        (
            json!({"messages": [{"role": "user", "content": "x"}],
                   "tools": [{"type": "function"}]}),
            "tools[0]",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "tools": tools(),
                   "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "`nope`",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}, {"role": "assistant",
                   "tool_calls": [{"function": {"name": "add", "arguments": "{oops"}}]}],
                   "tools": tools()}),
            "messages[1].tool_calls",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "tools": tools(),
                   "tool_choice": "required", "response_format": {"type": "json_object"}}),
            "forced",
        ),
    ] {
        let (s, v) = post(&app, "/v1/chat/completions", &body).await;
        assert_eq!(s, 400, "{body}: {v}");
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains(needle), "{body}: {msg}");
    }
    // SmolLM2's template has no tools: refused rather than silently dropped
    let body = json!({"messages": [{"role": "user", "content": "x"}], "tools": tools()});
    let (s, v) = post(&tokenized_app(), "/v1/chat/completions", &body).await;
    assert_eq!(s, 400, "{v}");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .contains("does not describe tools"));
}

/// Issue 34: `/slots` lists one place per `--parallel`, idle between requests.
#[tokio::test]
async fn issue_34_slots_list_the_places() {
    let app = tiny_app();
    let (s, v) = call(
        &app,
        "POST",
        "/v1/completions",
        br#"{"prompt": [1], "max_tokens": 2}"#.to_vec(),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let (s, v) = call(&app, "GET", "/slots", vec![]).await;
    assert_eq!(s, 200, "{v}");
    let places = v.as_array().cloned().unwrap_or_default();
    assert_eq!(places.len(), 2, "{v}");
    assert!(
        places
            .iter()
            .all(|p| p["is_processing"] == false && p["n_ctx"].as_u64() > Some(0)),
        "{v}"
    );
}
