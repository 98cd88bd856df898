//! Issue 31's API side: the request field `speculate` (`"lookup"` or `"off"`, a bad value
//! refused with 400), greedy and seeded outputs with `speculate: "lookup"` token for token
//! those without while batch neighbours share the steps, and the `/metrics` counters of
//! drafted and accepted tokens.

use axum::body::Body;
use axum::http::Request;
use serde_json::Value;
use tower::ServiceExt;

use super::{call, tiny_app};
use crate::app::router;

/// A completion on the tiny fixture: a prompt that repeats itself (so lookup drafts), 40
/// tokens past EOS; `extra` adds fields.
fn body(prompt: &[u32], extra: &str) -> Vec<u8> {
    format!(
        r#"{{"prompt": {prompt:?}, "max_tokens": 40, "ignore_eos": true,
            "return_token_ids": true{extra}}}"#
    )
    .into_bytes()
}

fn ids(v: &Value) -> Vec<u64> {
    v["choices"][0]["token_ids"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default()
}

/// The value of `series{source="lookup"}` in the `/metrics` text.
async fn lookup_metric(app: &std::sync::Arc<crate::app::App>, series: &str) -> Option<f64> {
    let req = Request::builder()
        .uri("/metrics")
        .body(Body::empty())
        .unwrap();
    let resp = router(app.clone()).oneshot(req).await.unwrap();
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let p = format!("{series}{{source=\"lookup\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&p))
        .and_then(|v| v.trim().parse().ok())
}

#[tokio::test]
async fn issue_31_speculate_lookup_gives_the_same_tokens_beside_neighbours() {
    let app = tiny_app(); // 2 generations at once: each request has a neighbour
    let prompt: Vec<u32> = (0..24).map(|i| 5 + (i % 4) * 9).collect();
    let neighbour: Vec<u32> = (0..11).map(|i| 3 + (i % 3) * 17).collect();
    for sampling in [
        r#", "temperature": 0"#,
        r#", "temperature": 0.9, "seed": 7"#,
    ] {
        let plain = body(&prompt, sampling);
        let spec = body(&prompt, &format!(r#"{sampling}, "speculate": "lookup""#));
        let off = body(&prompt, &format!(r#"{sampling}, "speculate": "off""#));
        let other = body(&neighbour, &format!(r#"{sampling}, "speculate": "lookup""#));
        let other_plain = body(&neighbour, sampling);
        let (a, b) = tokio::join!(
            call(&app, "POST", "/v1/completions", plain),
            call(&app, "POST", "/v1/completions", other_plain),
        );
        let (c, d) = tokio::join!(
            call(&app, "POST", "/v1/completions", spec),
            call(&app, "POST", "/v1/completions", other),
        );
        let (e, _) = tokio::join!(
            call(&app, "POST", "/v1/completions", off),
            call(&app, "POST", "/v1/completions", body(&neighbour, sampling)),
        );
        for (s, v) in [&a, &b, &c, &d, &e] {
            assert_eq!(*s, 200, "{v}");
        }
        assert_eq!(ids(&a.1).len(), 40, "{sampling}");
        assert_eq!(
            ids(&c.1),
            ids(&a.1),
            "{sampling}: speculating beside a neighbour"
        );
        assert_eq!(
            ids(&d.1),
            ids(&b.1),
            "{sampling}: the speculating neighbour"
        );
        assert_eq!(ids(&e.1), ids(&a.1), "{sampling}: speculate off");
        assert_eq!(c.1["choices"][0]["text"], a.1["choices"][0]["text"]);
    }
    if crate::metrics::init().is_some() {
        let drafted = lookup_metric(&app, "loip_speculate_drafted_total").await;
        let accepted = lookup_metric(&app, "loip_speculate_accepted_total").await;
        assert!(drafted.is_some_and(|d| d > 0.0), "{drafted:?}");
        assert!(
            accepted.is_some_and(|a| a <= drafted.unwrap_or(0.0)),
            "{accepted:?}"
        );
        assert!(lookup_metric(&app, "loip_speculate_acceptance")
            .await
            .is_some_and(|r| (0.0..=1.0).contains(&r)));
    }
}

#[tokio::test]
async fn issue_31_a_bad_speculate_value_is_refused() {
    let app = tiny_app();
    for (extra, needle) in [
        (r#", "speculate": "fast""#, "`speculate` must be"),
        (r#", "speculate": "draft""#, "no draft model"),
        (r#", "speculate": 3"#, "speculate"),
        (r#", "speculate": "LOOKUP""#, "`speculate` must be"),
    ] {
        let (s, v) = call(&app, "POST", "/v1/completions", body(&[1, 2, 3], extra)).await;
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert_eq!(s, 400, "{extra}: {v}");
        assert!(msg.contains(needle), "{extra}: {msg}");
    }
    let chat = br#"{"messages": [{"role": "user", "content": "x"}], "speculate": "maybe"}"#;
    let (s, v) = call(&app, "POST", "/v1/chat/completions", chat.to_vec()).await;
    assert_eq!(s, 400, "{v}");
}
