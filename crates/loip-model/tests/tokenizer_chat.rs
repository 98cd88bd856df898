//! Chat templates: the SmolLM2 template against the Hugging Face reference rendering, loading
//! from an HF directory, and the Jinja features HF templates rely on.

use std::path::{Path, PathBuf};

use loip_model::chat::{ChatError, ChatMessage, ChatTemplate, RENDER_MAX_BYTES};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/smollm2")
}

fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("tokenizer_chat-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn smollm2_template() -> ChatTemplate {
    let src = std::fs::read_to_string(fixtures().join("chat_template.jinja")).unwrap();
    ChatTemplate::new(src, Some("<|im_start|>".into()), Some("<|im_end|>".into())).unwrap()
}

fn user(text: &str) -> ChatMessage {
    ChatMessage::new("user", text)
}

#[test]
fn smollm2_template_matches_reference() {
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("expected.json")).unwrap())
            .unwrap();
    let chat = &expected["chat"];
    let messages: Vec<ChatMessage> = serde_json::from_value(chat["messages"].clone()).unwrap();
    let rendered = smollm2_template().render(&messages, true).unwrap();
    assert_eq!(rendered, chat["rendered"].as_str().unwrap());
}

#[test]
fn smollm2_template_variants() {
    let t = smollm2_template();
    let sys = ChatMessage::new("system", "Be brief.");
    assert_eq!(
        t.render(&[sys, user("Hi")], false).unwrap(),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    );
    let out = t
        .render(&[user("Hi"), ChatMessage::new("assistant", "Hello!")], true)
        .unwrap();
    assert!(out.starts_with("<|im_start|>system\nYou are a helpful AI assistant named SmolLM"));
    assert!(out.ends_with("<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>assistant\n"));
}

#[test]
fn hf_semantics_trim_blocks_bos_and_pycompat() {
    let src = "{{ bos_token }}{% for m in messages %}\n  {% if m.role == 'user' %}\n[{{ m.content.strip() }}]{{ eos_token }}\n  {% endif %}\n{% endfor %}\n";
    let t = ChatTemplate::new(src.into(), Some("<s>".into()), Some("</s>".into())).unwrap();
    let out = t
        .render(
            &[
                user("  a  "),
                ChatMessage::new("assistant", "x"),
                user("b\n"),
            ],
            false,
        )
        .unwrap();
    assert_eq!(out, "<s>[a]</s>\n[b]</s>\n");
    assert_eq!(t.bos_token(), Some("<s>"));

    // Undefined bos/eos render as empty, as with Jinja2's default Undefined.
    let t = ChatTemplate::new(
        "{{ bos_token }}{{ messages[0]['content'] | upper }}".into(),
        None,
        None,
    )
    .unwrap();
    assert_eq!(t.render(&[user("hi")], false).unwrap(), "HI");
}

#[test]
fn raise_exception_fails_the_render() {
    let src = "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}\
               {{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}\
               {{ m['content'] }}{% endfor %}";
    let t = ChatTemplate::new(src.into(), None, None).unwrap();
    assert_eq!(t.render(&[user("ok")], false).unwrap(), "ok");
    let err = t
        .render(&[ChatMessage::new("tool", "x")], false)
        .unwrap_err();
    assert!(matches!(err, ChatError::Render(_)));
    assert!(
        err.to_string()
            .contains("Only user and assistant roles are supported!"),
        "{err}"
    );
}

#[test]
fn loop_controls_and_namespace() {
    let src = "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}\
               {% set ns.n = ns.n + 1 %}{{ m.content }}{% endfor %}:{{ ns.n }}";
    let t = ChatTemplate::new(src.into(), None, None).unwrap();
    assert_eq!(
        t.render(&[user("a"), user("b"), user("c")], false).unwrap(),
        "ab:2"
    );
}

#[test]
fn syntax_error_is_reported_at_construction() {
    let err =
        ChatTemplate::new("{% for m in messages %}{{ m.content }}".into(), None, None).unwrap_err();
    assert!(matches!(err, ChatError::Syntax(_)), "{err}");
}

#[test]
fn from_hf_dir_list_form_and_token_objects() {
    let dir = scratch("list");
    let config = serde_json::json!({
        "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": false},
        "eos_token": "</s>",
        "chat_template": [
            {"name": "tool_use", "template": "TOOLS"},
            {"name": "default", "template": "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}{{ eos_token }}{% endfor %}"}
        ]
    });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    let t = ChatTemplate::from_hf_dir(&dir).unwrap().expect("template");
    assert_eq!(t.render(&[user("hi")], false).unwrap(), "<s>user: hi</s>");

    // chat_template.jinja wins over tokenizer_config.json; bos/eos still come from the config.
    std::fs::write(dir.join("chat_template.jinja"), "J{{ eos_token }}").unwrap();
    let t = ChatTemplate::from_hf_dir(&dir).unwrap().expect("template");
    assert_eq!(t.render(&[user("hi")], false).unwrap(), "J</s>");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn from_hf_dir_string_form_missing_and_bad() {
    let dir = scratch("string");
    assert!(
        ChatTemplate::from_hf_dir(&dir).unwrap().is_none(),
        "empty dir has no template"
    );

    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"eos_token": "</s>"}"#,
    )
    .unwrap();
    assert!(
        ChatTemplate::from_hf_dir(&dir).unwrap().is_none(),
        "config without template"
    );

    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"chat_template": "{{ messages | length }}"}"#,
    )
    .unwrap();
    let t = ChatTemplate::from_hf_dir(&dir).unwrap().expect("template");
    assert_eq!(t.render(&[user("a"), user("b")], false).unwrap(), "2");

    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"chat_template": [{"name": "rag", "template": "x"}]}"#,
    )
    .unwrap();
    let err = ChatTemplate::from_hf_dir(&dir).unwrap_err();
    assert!(matches!(err, ChatError::Config { .. }));
    assert!(err.to_string().contains("default"), "{err}");

    std::fs::write(dir.join("tokenizer_config.json"), "{oops").unwrap();
    assert!(matches!(
        ChatTemplate::from_hf_dir(&dir),
        Err(ChatError::Config { .. })
    ));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn chat_message_serde() {
    let m: ChatMessage = serde_json::from_str(r#"{"role": "user", "content": "hi"}"#).unwrap();
    assert_eq!(m, user("hi"));
    assert_eq!(
        serde_json::to_value(&m).unwrap(),
        serde_json::json!({"role": "user", "content": "hi"})
    );
}

/// A template comes with the model file, so it is hostile until it has rendered: one that
/// would run for hours or take all memory stops with an error (minijinja's fuel), at once.
#[test]
fn a_pathological_template_stops_with_an_error() {
    let hostile = [
        // 10^10 iterations
        "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
        // a string doubled 40 times (16 TiB)
        "{% set ns = namespace(s='xxxxxxxxxxxxxxxx') %}{% for i in range(40) %}\
         {% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
        // unbounded recursion
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    ];
    for src in hostile {
        let t = ChatTemplate::new(src.into(), None, None).unwrap();
        let start = std::time::Instant::now();
        let err = t.render(&[user("hi")], true).unwrap_err();
        eprintln!("{err} ({:?})", start.elapsed());
        assert!(
            matches!(err, ChatError::TooMuchWork | ChatError::Render(_)),
            "{err}"
        );
    }
    let t = ChatTemplate::new(hostile[0].into(), None, None).unwrap();
    let err = t.render(&[user("hi")], true).unwrap_err();
    assert!(matches!(err, ChatError::TooMuchWork), "{err}");
    assert!(err.to_string().contains("more work than allowed"), "{err}");
}

/// Issue 37 (3): a render is bounded in output bytes as well as in work. `tojson`'s indent
/// is clamped (an indent of 10^8 allocated 621 MB before the fuel ran out; 10^9 aborted the
/// process), and a template writing past [`RENDER_MAX_BYTES`] stops with an error instead of
/// growing its output.
#[test]
fn finding_3_template_renders_are_bounded_in_output_bytes() {
    let msgs = [
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "hi"),
    ];
    let render = |src: &str| {
        ChatTemplate::new(src.into(), None, None)
            .unwrap()
            .render(&msgs, true)
    };
    let clamped = render("{{ messages|tojson(indent=16)|length }}").unwrap();
    for huge in ["100000000", "1000000000"] {
        let src = format!("{{{{ messages|tojson(indent={huge})|length }}}}");
        assert_eq!(render(&src).unwrap(), clamped, "indent={huge}");
        let src = format!("{{{{ 'a\nb'|indent({huge}, true) }}}}");
        assert_eq!(render(&src).unwrap(), format!("{0}a\n{0}b", " ".repeat(16)));
    }
    assert_eq!(
        render("{{ messages|tojson(indent=true) }}").unwrap(),
        render("{{ messages|tojson(indent=2) }}").unwrap()
    );
    // 40,000 writes of 1 KB: 40 MB of output in little work
    const { assert!(40_000_000 > RENDER_MAX_BYTES) };
    let src = "{% set s = 'x' * 1000 %}{% for i in range(40000) %}{{ s }}{% endfor %}";
    let err = render(src).unwrap_err();
    assert!(matches!(err, ChatError::TooLong), "{err}");
    assert!(err.to_string().contains("more than"), "{err}");
}

/// The budget leaves real templates room: SmolLM2's renders 1,000 messages of 500
/// characters (half the API's body limit) well within it.
#[test]
fn a_long_conversation_renders_within_the_budget() {
    let messages: Vec<ChatMessage> = (0..1000)
        .map(|i| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            ChatMessage::new(role, "word ".repeat(100))
        })
        .collect();
    let text = smollm2_template().render(&messages, true).unwrap();
    assert!(text.len() > 500_000, "{}", text.len());
}
