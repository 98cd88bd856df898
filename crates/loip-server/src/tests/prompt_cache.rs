//! The prompt cache through the API: a chat's next turn, whose prompt begins with the last
//! request's prompt and answer, copies that KV instead of computing it, and gets the tokens
//! it gets with the cache off.

use serde_json::{json, Value};

use super::*;

fn ids(v: &Value) -> Vec<u64> {
    v["choices"][0]["token_ids"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default()
}

#[tokio::test]
async fn a_next_turn_reuses_the_finished_requests_kv() {
    let app = tiny_app(); // --parallel 2: two kept sequences by default
    let body = |prompt: &[u64]| {
        json!({"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": true,
               "return_token_ids": true})
    };
    let first: Vec<u64> = (0..20).map(|i| (i * 37 + 5) % 200).collect();
    let (s, a) = post(&app, "/v1/completions", &body(&first)).await;
    assert_eq!(s, 200, "{a}");
    let answer = ids(&a);
    assert_eq!(answer.len(), 6);
    let st = app.backend.stats();
    assert_eq!(st.prompt_cache_sequences, 1);
    // its KV holds the prompt and the answer but its last token
    assert_eq!(st.prompt_cache_tokens, 20 + 5);
    let next: Vec<u64> = [&first[..], &answer[..], &[1, 2, 3]].concat();
    let before = st.shared_tokens;
    let (s, cached) = post(&app, "/v1/completions", &body(&next)).await;
    assert_eq!(s, 200, "{cached}");
    assert_eq!(app.backend.stats().shared_tokens - before, 25);
    // off: what was kept is freed, the same turn computes its whole prompt, same tokens
    app.backend
        .set_prompt_cache(loip_engine::PromptCacheOptions::keep(0));
    let (s, computed) = post(&app, "/v1/completions", &body(&next)).await;
    assert_eq!(s, 200, "{computed}");
    assert_eq!(ids(&cached), ids(&computed));
    let st = app.backend.stats();
    assert_eq!(
        st.shared_tokens - before,
        25,
        "nothing copied with the cache off"
    );
    assert_eq!((st.prompt_cache_sequences, st.prompt_cache_tokens), (0, 0));
}
