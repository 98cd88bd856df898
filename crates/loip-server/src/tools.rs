//! Tool calls: OpenAI's `tools` and `tool_choice`, rendered through the model's chat template
//! (its `tools` variable), the model's answer parsed back into `tool_calls`.
//!
//! What the model writes depends on its template: Qwen2.5 / Qwen3 / Hermes templates ask for
//! `<tool_call>{"name": .., "arguments": {..}}</tool_call>` (one block per call), Llama 3.x
//! for a bare `{"name": .., "parameters": {..}}`, Mistral for `[TOOL_CALLS] [{..}, ..]`;
//! [`crate::tool_stream`] reads all three as they stream, [`Tools::parse`] a whole answer. When `tool_choice` forces a call (`"required"` or a named
//! function), decoding is constrained to the template's form with the tools' parameter
//! schemas, so the call always parses.

use serde_json::{json, Value};

use crate::error::ApiError;
use crate::grammar::Ask;
use crate::tool_stream::{assemble, ToolStream};

/// Most tools one request may declare.
const MAX_TOOLS: usize = 128;

/// What `tool_choice` asks for.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Choice {
    /// the model may answer or call (`"auto"`, the default with tools)
    Auto,
    /// the model must call one of the tools
    Required,
    /// the model must call this one
    Named(String),
}

/// A request's tools, checked.
#[derive(Debug, Clone)]
pub(crate) struct Tools {
    /// `[{"type": "function", "function": {"name", "description", "parameters"}}]` as sent
    pub(crate) list: Value,
    /// each tool's name and parameter schema (`{}` when it gave none)
    functions: Vec<(String, Value)>,
    pub(crate) choice: Choice,
}

impl Tools {
    /// Checks `tools` and `tool_choice`; `None` when there are no tools or the choice is
    /// `"none"` (the request is an ordinary chat then).
    pub(crate) fn from_request(
        tools: Option<&Value>,
        choice: Option<&Value>,
    ) -> Result<Option<Tools>, ApiError> {
        let bad = |m: String| Err(ApiError::bad(m));
        let list = match tools {
            None | Some(Value::Null) => return check_choice_without_tools(choice),
            Some(Value::Array(a)) if a.is_empty() => return check_choice_without_tools(choice),
            Some(Value::Array(a)) if a.len() > MAX_TOOLS => {
                return bad(format!("`tools` may have at most {MAX_TOOLS} entries"))
            }
            Some(Value::Array(a)) => a,
            Some(_) => return bad("`tools` must be an array".into()),
        };
        let mut functions = Vec::with_capacity(list.len());
        for (i, t) in list.iter().enumerate() {
            let f = &t["function"];
            let name = f["name"]
                .as_str()
                .filter(|n| !n.is_empty() && n.len() <= 64);
            match (t["type"].as_str(), name) {
                (Some("function"), Some(n)) => {
                    let params = match &f["parameters"] {
                        Value::Null => json!({}),
                        p @ Value::Object(_) => p.clone(),
                        _ => {
                            return bad(format!(
                                "`tools[{i}].function.parameters` must be an object"
                            ))
                        }
                    };
                    functions.push((n.to_string(), params));
                }
                _ => {
                    return bad(format!(
                        "`tools[{i}]` must be {{\"type\": \"function\", \"function\": {{\"name\": \
                         .. (1 to 64 characters), \"parameters\": {{..}}}}}}"
                    ))
                }
            }
        }
        let choice = match choice {
            None | Some(Value::Null) => Choice::Auto,
            Some(Value::String(s)) => match s.as_str() {
                "none" => return Ok(None),
                "auto" => Choice::Auto,
                "required" => Choice::Required,
                _ => {
                    return bad("`tool_choice` must be \"none\", \"auto\", \"required\" or \
                         {\"type\": \"function\", \"function\": {\"name\": ..}}"
                        .into())
                }
            },
            Some(v) => match v["function"]["name"].as_str() {
                Some(n) if functions.iter().any(|f| f.0 == n) => Choice::Named(n.to_string()),
                Some(n) => {
                    let n: String = n.chars().take(64).collect();
                    return bad(format!(
                        "`tool_choice` names `{n}`, which is not in `tools`"
                    ));
                }
                None => return bad("`tool_choice.function.name` is required".into()),
            },
        };
        Ok(Some(Tools {
            list: Value::Array(list.clone()),
            functions,
            choice,
        }))
    }

    /// The grammar a forced call follows (`None` for `auto`): one call of a named tool, or
    /// of any tool, in the template's form (`tags`: inside `<tool_call>` tags).
    pub(crate) fn forced(&self, tags: bool) -> Option<Ask> {
        let calls: Vec<Value> = self
            .functions
            .iter()
            .filter(|(n, _)| match &self.choice {
                Choice::Auto => false,
                Choice::Required => true,
                Choice::Named(want) => n == want,
            })
            .map(|(n, p)| {
                json!({"type": "object",
                       "properties": {"name": {"const": n}, "arguments": p},
                       "required": ["name", "arguments"], "additionalProperties": false})
            })
            .collect();
        if calls.is_empty() {
            return None;
        }
        let schema = json!({"anyOf": calls,
                            "x-guidance": {"whitespace_flexible": false,
                                           "item_separator": ", ", "key_separator": ": "}});
        Some(Ask::Lark(if tags {
            format!("start: \"<tool_call>\\n\" call \"\\n</tool_call>\"\ncall: %json {schema}\n")
        } else {
            format!("start: call\ncall: %json {schema}\n")
        }))
    }

    /// A reader of the answer's calls as it streams (call ids from `id`, see
    /// [`crate::tool_stream::call_id`]).
    pub(crate) fn stream(&self, id: &str) -> ToolStream {
        ToolStream::new(self.functions.iter().map(|f| f.0.clone()).collect(), id)
    }

    /// The calls in the model's whole `text` (see the module's doc), as OpenAI's
    /// `tool_calls`, and the text before them (the message's content); `None` when `text`
    /// holds no call of a declared tool. The same as the deltas of [`Tools::stream`].
    pub(crate) fn parse(&self, text: &str, id: &str) -> Option<(Option<String>, Value)> {
        let mut s = self.stream(id);
        let mut deltas = s.push(text);
        deltas.extend(s.finish());
        match assemble(&deltas) {
            (content, Some(calls)) => Some((content, calls)),
            (_, None) => None,
        }
    }
}

/// `tool_choice` without tools: only `"none"` (or nothing) makes sense.
fn check_choice_without_tools(choice: Option<&Value>) -> Result<Option<Tools>, ApiError> {
    match choice {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s == "none" || s == "auto" => Ok(None),
        Some(_) => Err(ApiError::bad("`tool_choice` needs `tools`")),
    }
}

/// An assistant message's `tool_calls` as a chat template takes them: `arguments` an object
/// (OpenAI sends a JSON string).
pub(crate) fn calls_for_template(calls: &Value, at: usize) -> Result<Value, ApiError> {
    let bad = || {
        ApiError::bad(format!(
            "messages[{at}].tool_calls must be [{{\"id\", \"type\": \"function\", \"function\": \
             {{\"name\", \"arguments\"}}}}] with arguments a JSON object (or its text)"
        ))
    };
    let list = calls.as_array().ok_or_else(bad)?;
    let mut out = Vec::with_capacity(list.len());
    for c in list {
        let f = &c["function"];
        let name = f["name"].as_str().ok_or_else(bad)?;
        let args = match &f["arguments"] {
            Value::String(s) => serde_json::from_str::<Value>(s).map_err(|_| bad())?,
            a @ Value::Object(_) => a.clone(),
            Value::Null => json!({}),
            _ => return Err(bad()),
        };
        let mut c = c.clone();
        c["function"] = json!({"name": name, "arguments": args});
        out.push(c);
    }
    Ok(Value::Array(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Tools {
        let tools = json!([{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}}]);
        Tools::from_request(Some(&tools), None).unwrap().unwrap()
    }

    #[test]
    fn the_three_forms_parse_into_tool_calls() {
        let t = weather();
        for text in [
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
            "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}",
            "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}]",
            "```json\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n```",
            "<tool_call>{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Paris\\\"}\"}",
        ] {
            let (content, calls) = t.parse(text, "x").unwrap_or_else(|| panic!("{text}"));
            assert_eq!(content, None);
            assert_eq!(calls[0]["function"]["name"], "get_weather");
            let args: Value =
                serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
            assert_eq!(args, json!({"city": "Paris"}));
            assert_eq!(calls[0]["id"], "x00000000");
        }
        let (content, calls) = t
            .parse("Let me look.\n<tool_call>{\"name\": \"get_weather\", \"arguments\": {}}</tool_call>\n<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}</tool_call>", "y")
            .unwrap();
        assert_eq!(content.as_deref(), Some("Let me look."));
        assert_eq!(calls.as_array().map(Vec::len), Some(2));
        // plain answers, unknown tools and broken JSON are not calls
        for text in [
            "It is sunny.",
            "{\"name\": \"other\", \"arguments\": {}}",
            "<tool_call>{oops",
        ] {
            assert!(t.parse(text, "z").is_none(), "{text}");
        }
    }

    #[test]
    fn tools_and_choices_are_checked() {
        let tools = json!([{"type": "function", "function": {"name": "f"}}]);
        let named = json!({"type": "function", "function": {"name": "f"}});
        let t = Tools::from_request(Some(&tools), Some(&named))
            .unwrap()
            .unwrap();
        assert_eq!(t.choice, Choice::Named("f".into()));
        let Some(Ask::Lark(g)) = t.forced(true) else {
            panic!()
        };
        assert!(g.starts_with("start: \"<tool_call>"), "{g}");
        assert!(Tools::from_request(Some(&tools), Some(&json!("none")))
            .unwrap()
            .is_none());
        assert!(Tools::from_request(Some(&tools), Some(&json!("auto")))
            .unwrap()
            .unwrap()
            .forced(false)
            .is_none());
        for (tools, choice) in [
            (json!([{"type": "function"}]), Value::Null),
            (
                json!([{"type": "retrieval", "function": {"name": "f"}}]),
                Value::Null,
            ),
            (json!({"a": 1}), Value::Null),
            (
                tools.clone(),
                json!({"type": "function", "function": {"name": "g"}}),
            ),
            (tools.clone(), json!("sometimes")),
            (json!([]), json!("required")),
        ] {
            assert!(
                Tools::from_request(Some(&tools), Some(&choice)).is_err(),
                "{tools} {choice}"
            );
        }
        let calls = json!([{"id": "a", "type": "function",
                            "function": {"name": "f", "arguments": "{\"x\": 1}"}}]);
        assert_eq!(
            calls_for_template(&calls, 0).unwrap()[0]["function"]["arguments"],
            json!({"x": 1})
        );
        assert!(
            calls_for_template(&json!([{"function": {"name": "f", "arguments": "{"}}]), 0).is_err()
        );
    }
}
