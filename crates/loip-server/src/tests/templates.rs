//! Issue 34: tools through the chat formats of Qwen3, Llama 3.x and Mistral (templates
//! written in those formats, `crates/loip-model/tests/fixtures/templates`): the tools are
//! described to the model, each family's call is read back into `tool_calls` (streamed and
//! whole alike), and the calls with the tool's answer render back through the template in
//! the family's own form — Mistral's included, which takes only 9-character call ids.

use loip_model::chat::{ChatMessage, ChatTemplate};
use serde_json::{json, Value};

use crate::tool_stream::{assemble, request_part};
use crate::tools::{calls_for_template, Tools};

const QWEN3: &str = include_str!("../../../loip-model/tests/fixtures/templates/qwen3_tools.jinja");
const LLAMA3: &str =
    include_str!("../../../loip-model/tests/fixtures/templates/llama3_tools.jinja");
const MISTRAL: &str =
    include_str!("../../../loip-model/tests/fixtures/templates/mistral_tools.jinja");

/// One family: its template, the marks of its tool description, what its model writes for
/// a call, and the marks of the call and the answer rendered back (`{id}`: the call's id).
struct Family {
    name: &'static str,
    template: &'static str,
    described: &'static [&'static str],
    written: &'static str,
    content: Option<&'static str>,
    rendered: &'static [&'static str],
}

const FAMILIES: [Family; 3] = [
    Family {
        name: "qwen3",
        template: QWEN3,
        described: &["<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\"", "<|im_start|>assistant\n"],
        written: "<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
        content: Some("<think>\nThe user wants the weather.\n</think>"),
        rendered: &[
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>",
            "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>",
        ],
    },
    Family {
        name: "llama3",
        template: LLAMA3,
        described: &[
            "Environment: ipython",
            "\"name\": \"get_weather\",\n        \"description\"",
            "<|start_header_id|>assistant<|end_header_id|>\n\n",
        ],
        written: "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}",
        content: None,
        rendered: &[
            "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}<|eot_id|>",
            "<|start_header_id|>ipython<|end_header_id|>\n\nsunny<|eot_id|>",
        ],
    },
    Family {
        name: "mistral",
        template: MISTRAL,
        described: &["[AVAILABLE_TOOLS] [{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Weather in a city\", \"parameters\": {"],
        written: "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}]",
        content: None,
        rendered: &[
            "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}, \"id\": \"{id}\"}]</s>",
            "[TOOL_RESULTS] {\"content\": \"sunny\", \"call_id\": \"{id}\"}[/TOOL_RESULTS]",
        ],
    },
];

fn message(role: &str, content: &str) -> ChatMessage {
    ChatMessage::new(role, content)
}

#[test]
fn issue_34_tools_round_trip_through_qwen3_llama3_and_mistral_formats() {
    let tools_json = super::tool_calls::tools();
    let tools = Tools::from_request(Some(&tools_json), None)
        .unwrap()
        .unwrap();
    for f in &FAMILIES {
        let t = ChatTemplate::new(f.template.into(), Some("<s>".into()), Some("</s>".into()))
            .unwrap_or_else(|e| panic!("{}: {e}", f.name));
        assert!(t.supports_tools(), "{}", f.name);
        let user = message("user", "Weather in Paris?");
        let prompt = t
            .render_tools(std::slice::from_ref(&user), Some(&tools_json), true)
            .unwrap_or_else(|e| panic!("{}: {e}", f.name));
        for mark in f.described {
            assert!(
                prompt.contains(mark),
                "{}: {mark:?} not in {prompt}",
                f.name
            );
        }
        assert!(!prompt.contains("\\u003c"), "{}: HTML-escaped JSON", f.name);
        // the model's call, whole and streamed a character at a time
        let id = request_part(0x5eed);
        let (content, calls) = tools
            .parse(f.written, &id)
            .unwrap_or_else(|| panic!("{}: no call in {}", f.name, f.written));
        assert_eq!(content.as_deref(), f.content, "{}", f.name);
        let mut s = tools.stream(&id);
        let mut deltas: Vec<_> = f
            .written
            .chars()
            .flat_map(|c| s.push(&c.to_string()))
            .collect();
        deltas.extend(s.finish());
        assert_eq!(
            assemble(&deltas),
            (content, Some(calls.clone())),
            "{}",
            f.name
        );
        let call = &calls[0];
        assert_eq!(call["function"]["name"], "get_weather", "{}", f.name);
        let args: Value =
            serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(args, json!({"city": "Paris"}), "{}", f.name);
        let call_id = call["id"].as_str().unwrap().to_string();
        // the call and the tool's answer go back through the template
        let mut assistant = message("assistant", "");
        assistant.tool_calls = Some(calls_for_template(&calls, 1).unwrap());
        let mut answer = message("tool", "sunny");
        answer.tool_call_id = Some(call_id.clone());
        let next = t
            .render_tools(&[user, assistant, answer], Some(&tools_json), true)
            .unwrap_or_else(|e| panic!("{}: {e}", f.name));
        for mark in f.rendered {
            let mark = mark.replace("{id}", &call_id);
            assert!(next.contains(&mark), "{}: {mark:?} not in {next}", f.name);
        }
    }
}

/// Mistral's template refuses call ids other than 9 letters and digits (the ids this server
/// gives are such), and turns that do not alternate.
#[test]
fn issue_34_mistral_checks_call_ids_and_turns() {
    let t = ChatTemplate::new(MISTRAL.into(), Some("<s>".into()), Some("</s>".into())).unwrap();
    let calls = json!([{"id": "call_1", "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]);
    let mut assistant = message("assistant", "");
    assistant.tool_calls = Some(calls);
    let msgs = [message("user", "x"), assistant];
    let err = t.render(&msgs, true).unwrap_err().to_string();
    assert!(err.contains("length 9"), "{err}");
    let twice = [message("user", "a"), message("user", "b")];
    let err = t.render(&twice, true).unwrap_err().to_string();
    assert!(err.contains("alternate"), "{err}");
}
