//! Token log-probabilities in OpenAI's shapes: a completion's `{tokens, token_logprobs,
//! top_logprobs, text_offset}` and a chat completion's `{content: [{token, logprob, bytes,
//! top_logprobs}]}`, whole or per streamed chunk.
//!
//! Invariant: the numbers are the engine's ([`loip_engine::sampling::logprob_of`]: the
//! log-softmax of the model's own logits, before penalties or bias), sent as they are; a
//! token that could not be chosen (−∞) is sent as −9999, as OpenAI does, since JSON has no
//! infinity.

use loip_engine::TokenLogprob;
use loip_model::tokenizer::Tokenizer;
use serde_json::{json, Map, Value};

use crate::wire::Kind;

/// What JSON carries for −∞.
const FLOOR: f32 = -9999.0;

/// Builds the `logprobs` objects of one response, chunk after chunk (the completion shape's
/// `text_offset` runs on over the chunks).
pub(crate) struct Logprobs<'t> {
    kind: Kind,
    tok: Option<&'t Tokenizer>,
    /// bytes of completion text before the next token  // bytes
    offset: usize,
}

impl<'t> Logprobs<'t> {
    pub(crate) fn new(kind: Kind, tok: Option<&'t Tokenizer>) -> Self {
        Logprobs {
            kind,
            tok,
            offset: 0,
        }
    }

    /// A token's text: its decoding alone (`[id]` without a tokenizer).
    fn text(&self, id: u32) -> String {
        match self.tok {
            Some(t) => t.decode(&[id], false).unwrap_or_default(),
            None => format!("[{id}]"),
        }
    }

    /// The `logprobs` object of `lps` (the tokens of one chunk, or of the whole response).
    pub(crate) fn object(&mut self, lps: &[TokenLogprob]) -> Value {
        match self.kind {
            Kind::Completion => {
                let mut tokens = Vec::new();
                let mut values = Vec::new();
                let mut tops = Vec::new();
                let mut offsets = Vec::new();
                for lp in lps {
                    let text = self.text(lp.id);
                    offsets.push(self.offset);
                    self.offset += text.len();
                    tokens.push(text);
                    values.push(finite(lp.logprob));
                    let top: Map<String, Value> = lp
                        .top
                        .iter()
                        .map(|&(id, v)| (self.text(id), json!(finite(v))))
                        .collect();
                    tops.push(top);
                }
                json!({"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                       "text_offset": offsets})
            }
            Kind::Chat => {
                let entry = |id: u32, v: f32| {
                    let text = self.text(id);
                    json!({"token": text, "logprob": finite(v), "bytes": text.as_bytes()})
                };
                let content: Vec<Value> = lps
                    .iter()
                    .map(|lp| {
                        let mut e = entry(lp.id, lp.logprob);
                        let top: Vec<Value> = lp.top.iter().map(|&(id, v)| entry(id, v)).collect();
                        if let Some(o) = e.as_object_mut() {
                            o.insert("top_logprobs".into(), json!(top));
                        }
                        e
                    })
                    .collect();
                json!({"content": content, "refusal": null})
            }
        }
    }
}

fn finite(v: f32) -> f32 {
    if v.is_finite() {
        v
    } else {
        FLOOR
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_of_both_endpoints() {
        let lps = [
            TokenLogprob {
                id: 5,
                logprob: -0.5,
                top: vec![(5, -0.5), (7, f32::NEG_INFINITY)],
            },
            TokenLogprob {
                id: 12,
                logprob: -1.25,
                top: vec![],
            },
        ];
        let mut c = Logprobs::new(Kind::Completion, None);
        let v = c.object(&lps[..1]);
        assert_eq!(v["tokens"], json!(["[5]"]));
        assert_eq!(v["top_logprobs"][0]["[7]"], json!(-9999.0));
        let v = c.object(&lps[1..]);
        assert_eq!(v["text_offset"], json!([3]));
        assert_eq!(v["token_logprobs"], json!([-1.25]));
        let v = Logprobs::new(Kind::Chat, None).object(&lps);
        assert_eq!(v["content"][0]["token"], "[5]");
        assert_eq!(v["content"][0]["bytes"], json!(b"[5]".to_vec()));
        assert_eq!(
            v["content"][0]["top_logprobs"][1]["logprob"],
            json!(-9999.0)
        );
        assert_eq!(v["content"][1]["logprob"], json!(-1.25));
    }
}
