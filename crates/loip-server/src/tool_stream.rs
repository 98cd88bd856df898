//! Tool calls read as the model writes them: the answer's text in, OpenAI's deltas out
//! (content, then per call its id and name, then its `arguments` in fragments).
//!
//! The forms read ([`crate::tools`]): `<tool_call>{..}</tool_call>` blocks anywhere after
//! some content (Qwen2.5 / Qwen3 / Hermes), and at the start of the answer a bare
//! `{"name", "parameters" | "arguments"}` (Llama 3.x), `[TOOL_CALLS] [{..}, ..]` (Mistral) or
//! a fenced JSON call. A call is given out once its name is read and names a declared tool;
//! its arguments then stream as the model writes them (the JSON text itself; arguments
//! written as a JSON string are given whole once the string ends).
//!
//! Invariants:
//! - The same text gives the same deltas however it is cut into pieces, so a streamed answer
//!   and a whole one agree: [`assemble`] of the deltas is the whole answer.
//! - Content is the text before the first call, without the whitespace that precedes the
//!   call; text between and after calls is not content. Text that may begin a call is held
//!   back until it does or cannot.
//! - An answer in which no call of a declared tool is found is all content (given out at
//!   [`ToolStream::finish`] where it was held back).
//! - Work per character is O(1) but for the whitespace held back (a run of it is re-read at
//!   each character while it lasts); nothing held grows beyond the answer's text.

use serde_json::{json, Value};

/// One piece of a streamed answer.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Delta {
    /// more of the message's content
    Content(String),
    /// call `index` begins
    Call {
        /// its place among the answer's calls
        index: usize,
        /// [`call_id`]
        id: String,
        /// the tool
        name: String,
    },
    /// more of call `index`'s arguments (JSON text)
    Args {
        /// the call
        index: usize,
        /// the fragment
        text: String,
    },
}

const TAG: &str = "<tool_call>";
/// What may begin an answer that is a call, besides [`TAG`].
const STARTS: [&str; 4] = [TAG, "[TOOL_CALLS]", "```", "{"];

/// Where the reader is.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    /// at the start: the text may still begin with a call's form
    Start,
    /// content, until a `<tool_call>` tag
    Text,
    /// after a `<tool_call>` tag: whitespace, then the call's `{`
    Tagged,
    /// between tagged calls: looking for the next tag
    Seek,
    /// after `[TOOL_CALLS]`: whitespace, then `[`
    ListOpen,
    /// in the call list: `{` begins a call, `]` ends the list
    List,
    /// after a fence's backticks: its language name, whitespace, then the call's `{`
    Fence,
    /// nothing more is read
    Done,
}

/// Where a call object's reader is at its top level.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Expect {
    Key,
    Colon,
    Value,
    Comma,
}

/// One call object read incrementally from its `{`: its name and its arguments' text.
#[derive(Debug, Default)]
struct CallScan {
    depth: usize, // of objects and arrays, the call's own included
    in_str: bool,
    esc: bool,
    expect: Option<Expect>, // `None` before the `{`
    key: String,            // the top-level key being read (its JSON literal)
    field: Field,           // which field the value being read is
    value: String,          // the top-level value being read (its JSON text)
    name: Option<String>,
    args: String, // the arguments' JSON text so far
    args_done: bool,
    closed: bool,
}

#[derive(Debug, Default, Clone, Copy, PartialEq)]
enum Field {
    #[default]
    Other,
    Name,
    Args,
}

impl CallScan {
    /// Reads `c`; afterwards [`CallScan::closed`] says whether the object ended.
    fn feed(&mut self, c: char) {
        let Some(expect) = self.expect else {
            if c == '{' {
                self.depth = 1;
                self.expect = Some(Expect::Key);
            }
            return;
        };
        match expect {
            Expect::Key => self.key_char(c),
            Expect::Colon => {
                if c == ':' {
                    self.field = match serde_json::from_str::<String>(&self.key).as_deref() {
                        Ok("name") if self.name.is_none() => Field::Name,
                        Ok("arguments" | "parameters") if !self.args_done => Field::Args,
                        _ => Field::Other,
                    };
                    self.value.clear();
                    self.expect = Some(Expect::Value);
                }
            }
            Expect::Value => self.value_char(c),
            Expect::Comma => match c {
                ',' => self.next_key(),
                '}' => self.close(),
                _ => {}
            },
        }
    }

    /// Reads `c` inside a string: whether it ends the string.
    fn string_char(&mut self, c: char) -> bool {
        if self.esc {
            self.esc = false;
        } else if c == '\\' {
            self.esc = true;
        } else if c == '"' {
            self.in_str = false;
            return true;
        }
        false
    }

    fn key_char(&mut self, c: char) {
        if self.in_str {
            self.key.push(c);
            if self.string_char(c) {
                self.expect = Some(Expect::Colon);
            }
            return;
        }
        match c {
            '"' => {
                self.in_str = true;
                self.key.clear();
                self.key.push(c);
            }
            '}' => self.close(),
            _ => {}
        }
    }

    fn value_char(&mut self, c: char) {
        if self.value.is_empty() && c.is_whitespace() {
            return;
        }
        let scalar = !self.value.starts_with(['"', '{', '[']) && !self.value.is_empty();
        if scalar && (c == ',' || c == '}') {
            self.end_value();
            if c == ',' {
                self.next_key();
            } else {
                self.close();
            }
            return;
        }
        self.value.push(c);
        if self.field == Field::Args {
            self.args.push(c);
        }
        if self.in_str {
            if self.string_char(c) && self.depth == 1 {
                self.end_value();
            }
            return;
        }
        match c {
            '"' => self.in_str = true,
            '{' | '[' => self.depth += 1,
            '}' | ']' => {
                self.depth = self.depth.saturating_sub(1);
                if self.depth == 1 {
                    self.end_value();
                }
            }
            _ => {}
        }
    }

    fn end_value(&mut self) {
        match self.field {
            Field::Name => self.name = serde_json::from_str::<String>(&self.value).ok(),
            Field::Args => {
                let trimmed = self.args.trim_end().len();
                self.args.truncate(trimmed);
                self.args_done = true;
            }
            Field::Other => {}
        }
        self.field = Field::Other;
        self.expect = Some(Expect::Comma);
    }

    fn next_key(&mut self) {
        self.expect = Some(Expect::Key);
    }

    fn close(&mut self) {
        self.depth = 0;
        self.closed = true;
    }

    /// Whether the arguments are written as a JSON string (given whole at their end).
    fn args_quoted(&self) -> bool {
        self.args.starts_with('"')
    }
}

/// Reads an answer's tool calls as its text comes (see the module's doc).
#[derive(Debug)]
pub(crate) struct ToolStream {
    /// the declared tools' names
    names: Vec<String>,
    /// the request's part of the call ids
    id: String,
    mode: Mode,
    /// the answer so far
    text: String,
    /// bytes of `text` given out as content
    content: usize,
    /// calls given out
    calls: usize,
    /// the call object being read, whether it was given out, bytes of its arguments given
    scan: Option<(CallScan, bool, usize)>,
    /// the last characters read while seeking a tag // bytes
    window: String,
}

impl ToolStream {
    /// A reader for the tools `names`; call ids are [`call_id`]`(id, n)`.
    pub(crate) fn new(names: Vec<String>, id: &str) -> ToolStream {
        ToolStream {
            names,
            id: id.to_string(),
            mode: Mode::Start,
            text: String::new(),
            content: 0,
            calls: 0,
            scan: None,
            window: String::new(),
        }
    }

    /// Reads `piece` of the answer; the deltas it completes.
    pub(crate) fn push(&mut self, piece: &str) -> Vec<Delta> {
        let mut out = Vec::new();
        for c in piece.chars() {
            self.text.push(c);
            self.read(c, &mut out);
        }
        coalesce(out)
    }

    /// The end of the answer: what was held back, when it held no call.
    pub(crate) fn finish(&mut self) -> Vec<Delta> {
        let mut out = Vec::new();
        if self.calls == 0 && self.content < self.text.len() {
            out.push(Delta::Content(self.text[self.content..].to_string()));
            self.content = self.text.len();
        }
        self.mode = Mode::Done;
        out
    }

    fn read(&mut self, c: char, out: &mut Vec<Delta>) {
        if self.scan.is_some() {
            return self.scan_char(c, out);
        }
        match self.mode {
            Mode::Start => {
                let t = self.text.trim_start();
                if t.is_empty() || STARTS.iter().any(|s| s.starts_with(t) && s.len() > t.len()) {
                    return; // may still begin a call
                }
                self.mode = if t.starts_with(TAG) {
                    Mode::Tagged
                } else if t.starts_with("[TOOL_CALLS]") {
                    Mode::ListOpen
                } else if t.starts_with("```") {
                    Mode::Fence
                } else if t == "{" {
                    self.begin(c, out);
                    return;
                } else {
                    Mode::Text
                };
                if self.mode == Mode::Text {
                    self.text_out(out);
                }
            }
            Mode::Text => self.text_out(out),
            Mode::Tagged => match c {
                '{' => self.begin(c, out),
                c if c.is_whitespace() => {}
                _ => self.mode = Mode::Seek,
            },
            Mode::Seek => {
                self.window.push(c);
                if self.window.ends_with(TAG) {
                    self.window.clear();
                    self.mode = Mode::Tagged;
                } else if self.window.len() > 4 * TAG.len() {
                    let keep = self.window.len() - TAG.len();
                    let cut = (keep..self.window.len())
                        .find(|&i| self.window.is_char_boundary(i))
                        .unwrap_or(keep);
                    self.window.drain(..cut);
                }
            }
            Mode::ListOpen => match c {
                '[' => self.mode = Mode::List,
                c if c.is_whitespace() => {}
                _ => self.mode = Mode::Done,
            },
            Mode::List => match c {
                '{' => self.begin(c, out),
                ',' => {}
                c if c.is_whitespace() => {}
                _ => self.mode = Mode::Done,
            },
            Mode::Fence => match c {
                '{' => self.begin(c, out),
                c if c.is_ascii_alphanumeric() || c.is_whitespace() => {}
                _ => self.mode = Mode::Done,
            },
            Mode::Done => {}
        }
    }

    /// Gives out the content that cannot begin a tag: all but trailing whitespace and a
    /// partial tag; at a whole tag, the content before it and a call next.
    fn text_out(&mut self, out: &mut Vec<Delta>) {
        let pending = &self.text[self.content..];
        if let Some(at) = pending.find(TAG) {
            let before = pending[..at].trim_end();
            if !before.is_empty() {
                out.push(Delta::Content(before.to_string()));
            }
            self.content += before.len();
            self.mode = Mode::Tagged;
            return;
        }
        let partial = (1..TAG.len())
            .rev()
            .find(|&j| pending.len() >= j && pending.ends_with(&TAG[..j]))
            .unwrap_or(0);
        let keep_from = pending[..pending.len() - partial].trim_end().len();
        if keep_from > 0 {
            out.push(Delta::Content(pending[..keep_from].to_string()));
            self.content += keep_from;
        }
    }

    /// A call object begins with `c` (its `{`).
    fn begin(&mut self, c: char, out: &mut Vec<Delta>) {
        self.scan = Some((CallScan::default(), false, 0));
        self.scan_char(c, out);
    }

    fn scan_char(&mut self, c: char, out: &mut Vec<Delta>) {
        let Some((scan, given, sent)) = self.scan.as_mut() else {
            return;
        };
        scan.feed(c);
        if !*given {
            if let Some(name) = scan.name.as_ref().filter(|n| self.names.contains(n)) {
                out.push(Delta::Call {
                    index: self.calls,
                    id: call_id(&self.id, self.calls),
                    name: name.clone(),
                });
                self.calls += 1;
                *given = true;
            }
        }
        let index = self.calls.saturating_sub(1);
        if *given && !scan.args_quoted() && scan.args.len() > *sent {
            out.push(Delta::Args {
                index,
                text: scan.args[*sent..].to_string(),
            });
            *sent = scan.args.len();
        }
        if !scan.closed {
            return;
        }
        if *given && *sent == 0 {
            let text = if scan.args.is_empty() {
                "{}".to_string()
            } else {
                serde_json::from_str::<String>(&scan.args).unwrap_or_default()
            };
            out.push(Delta::Args { index, text });
        }
        self.scan = None;
        self.mode = match self.mode {
            Mode::Tagged => Mode::Seek,
            Mode::List => Mode::List,
            _ => Mode::Done,
        };
    }
}

/// Call `n`'s id: 9 letters and digits (what Mistral's templates require back), the
/// request's part (its first 7 characters) then `n` in base 36.
pub(crate) fn call_id(request: &str, n: usize) -> String {
    const DIGITS: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut id: String = request
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .chain(std::iter::repeat('0'))
        .take(7)
        .collect();
    let n = n % (36 * 36);
    id.push(DIGITS[n / 36] as char);
    id.push(DIGITS[n % 36] as char);
    id
}

/// 7 letters and digits from `random`: a request's part of its call ids.
pub(crate) fn request_part(random: u64) -> String {
    const DIGITS: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut r = random;
    (0..7)
        .map(|_| {
            let d = DIGITS[(r % 36) as usize] as char;
            r /= 36;
            d
        })
        .collect()
}

/// Merges neighbouring deltas of the same kind (one per piece read).
fn coalesce(deltas: Vec<Delta>) -> Vec<Delta> {
    let mut out: Vec<Delta> = Vec::with_capacity(deltas.len());
    for d in deltas {
        match (out.last_mut(), d) {
            (Some(Delta::Content(a)), Delta::Content(b)) => a.push_str(&b),
            (Some(Delta::Args { index: i, text: a }), Delta::Args { index: j, text: b })
                if *i == j =>
            {
                a.push_str(&b)
            }
            (_, d) => out.push(d),
        }
    }
    out
}

/// The whole answer the deltas make: its content (`None` when empty) and its calls in
/// OpenAI's shape (`None` when none).
pub(crate) fn assemble(deltas: &[Delta]) -> (Option<String>, Option<Value>) {
    let mut content = String::new();
    let mut calls: Vec<Value> = Vec::new();
    for d in deltas {
        match d {
            Delta::Content(t) => content.push_str(t),
            Delta::Call { id, name, .. } => calls.push(
                json!({"id": id, "type": "function", "function": {"name": name, "arguments": ""}}),
            ),
            Delta::Args { index, text } => {
                if let Some(Value::String(a)) = calls
                    .get_mut(*index)
                    .and_then(|c| c["function"].get_mut("arguments"))
                {
                    a.push_str(text);
                }
            }
        }
    }
    (
        (!content.is_empty()).then_some(content),
        (!calls.is_empty()).then_some(Value::Array(calls)),
    )
}

/// A chat stream's delta of `d` (a call's first delta names it; the next ones carry
/// arguments), as OpenAI streams tool calls.
pub(crate) fn delta_json(d: &Delta) -> Value {
    match d {
        Delta::Content(t) => json!({"content": t}),
        Delta::Call { index, id, name } => json!({"tool_calls": [{"index": index, "id": id,
            "type": "function", "function": {"name": name, "arguments": ""}}]}),
        Delta::Args { index, text } => {
            json!({"tool_calls": [{"index": index, "function": {"arguments": text}}]})
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn whole(text: &str) -> (Option<String>, Option<Value>) {
        let mut s = ToolStream::new(vec!["get_weather".into(), "add".into()], "t");
        let mut d = s.push(text);
        d.extend(s.finish());
        assemble(&d)
    }

    /// Every cut of `text` into two pieces, and one piece per character, give the deltas'
    /// sum of the whole text.
    fn check_cuts(text: &str) {
        let want = whole(text);
        let names = || vec!["get_weather".to_string(), "add".to_string()];
        let cuts: Vec<usize> = (0..=text.len())
            .filter(|&i| text.is_char_boundary(i))
            .collect();
        for &i in &cuts {
            let mut s = ToolStream::new(names(), "t");
            let mut d = s.push(&text[..i]);
            d.extend(s.push(&text[i..]));
            d.extend(s.finish());
            assert_eq!(assemble(&d), want, "{text:?} cut at {i}");
        }
        let mut s = ToolStream::new(names(), "t");
        let mut d: Vec<Delta> = text.chars().flat_map(|c| s.push(&c.to_string())).collect();
        d.extend(s.finish());
        assert_eq!(assemble(&d), want, "{text:?} by characters");
    }

    #[test]
    fn calls_stream_name_first_then_argument_fragments() {
        let mut s = ToolStream::new(vec!["get_weather".into()], "r");
        let mut d = Vec::new();
        for piece in [
            "Let me look.\n<tool",
            "_call>\n{\"name\": \"get_",
            "weather\", \"arguments\": {\"ci",
            "ty\": \"Paris\"}}\n</tool_call>",
        ] {
            d.extend(s.push(piece));
        }
        d.extend(s.finish());
        assert_eq!(
            d,
            vec![
                Delta::Content("Let me look.".into()),
                Delta::Call {
                    index: 0,
                    id: "r00000000".into(),
                    name: "get_weather".into()
                },
                Delta::Args {
                    index: 0,
                    text: "{\"ci".into()
                },
                Delta::Args {
                    index: 0,
                    text: "ty\": \"Paris\"}".into()
                },
            ]
        );
    }

    #[test]
    fn the_forms_give_the_same_answer_however_cut() {
        for text in [
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
            "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}",
            "[TOOL_CALLS] [{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": [2, {\"c\": \"}\"}]}}, {\"name\": \"get_weather\", \"arguments\": {}}]",
            "```json\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n```",
            "<tool_call>{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Paris\\\"}\"}",
            "<tool_call>{\"arguments\": {\"a\": 1}, \"name\": \"add\"}</tool_call>",
            "Sure.  \n<tool_call>{\"name\": \"add\"}</tool_call> then <tool_call>{\"name\": \"nope\"}</tool_call><tool_call>{\"name\": \"add\", \"arguments\": {\"a\": 2}}</tool_call>",
            "It is sunny. <tool_ca",
            "  {not json",
            "<tool_call>{oops",
            "{\"name\": \"other\", \"arguments\": {}}",
            "héllo wörld ```",
        ] {
            check_cuts(text);
        }
        let (content, calls) = whole(
            "Sure.  \n<tool_call>{\"name\": \"add\"}</tool_call> then <tool_call>{\"name\": \"nope\"}</tool_call><tool_call>{\"name\": \"add\", \"arguments\": {\"a\": 2}}</tool_call>",
        );
        assert_eq!(content.as_deref(), Some("Sure."));
        let calls = calls.unwrap();
        assert_eq!(calls[0]["function"]["arguments"], "{}");
        assert_eq!(calls[1]["function"]["arguments"], "{\"a\": 2}");
        assert_eq!(calls[1]["id"], "t00000001");
        // arguments first, then the name; arguments as a string
        let (_, calls) = whole("<tool_call>{\"arguments\": {\"a\": 1}, \"name\": \"add\"}");
        assert_eq!(calls.unwrap()[0]["function"]["arguments"], "{\"a\": 1}");
        let (_, calls) = whole("<tool_call>{\"name\": \"add\", \"arguments\": \"{\\\"a\\\": 3}\"}");
        assert_eq!(calls.unwrap()[0]["function"]["arguments"], "{\"a\": 3}");
        // no call of a declared tool: all content, as written
        for text in [" It is sunny. <tool_ca", "<tool_call>{oops", "  {not json"] {
            assert_eq!(whole(text), (Some(text.to_string()), None));
        }
    }
}
