//! Structured output: `response_format` (`json_object`, `json_schema`) and `grammar` (Lark, as
//! `llguidance` takes it) compiled into token masks over the tokenizer's vocabulary.
//!
//! `llguidance` does the work: JSON Schema → grammar, an Earley parser over a lazy lexer, and
//! a token trie of the vocabulary that turns the parser's state into the set of tokens that
//! may come next (tens of microseconds a step on 150k-token vocabularies). This module only
//! builds its tokenizer view once per server (on the first constrained request), compiles
//! each grammar once (a small cache keyed by the grammar's text), and adapts a compiled
//! grammar to the engine's [`Constraint`] trait. The mask touches a copy of the logits; the
//! model's logits and log-probabilities are never changed.
//!
//! Everything here reads hostile input: a schema or grammar that fails to compile, or uses
//! a feature `llguidance` does not support, is a 400 with its message; compiling is bounded
//! by `llguidance`'s parser limits; a panic inside it is caught and reported as a 400.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, OnceLock};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use loip_engine::{Constrained, Constraint, ConstraintState};
use loip_model::tokenizer::Tokenizer;
use serde_json::{json, Value};

use crate::error::ApiError;

/// Compiled grammars kept for reuse.
const CACHE: usize = 32;

/// What a request asks its output to follow.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Ask {
    /// a JSON schema (`{"type": "object"}` for `json_object`)
    Json(Value),
    /// a Lark grammar (`llguidance`'s dialect)
    Lark(String),
}

impl Ask {
    /// The cache key: the kind and the text.
    fn key(&self) -> String {
        match self {
            Ask::Json(v) => format!("json:{v}"),
            Ask::Lark(g) => format!("lark:{g}"),
        }
    }

    /// The grammar `llguidance` compiles. JSON is compact with a space after `:` and `,`
    /// (as models write it) unless the schema sets its own `x-guidance` options.
    fn top_level(&self) -> TopLevelGrammar {
        match self {
            Ask::Json(schema) => {
                let mut schema = schema.clone();
                if let Some(o) = schema.as_object_mut() {
                    o.entry("x-guidance").or_insert_with(|| {
                        json!({"whitespace_flexible": false, "item_separator": ", ",
                               "key_separator": ": "})
                    });
                }
                TopLevelGrammar::from_json_schema(schema)
            }
            Ask::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        }
    }
}

/// The server's grammar compiler: the tokenizer's view, made on first use, and the cache.
pub(crate) struct Grammars {
    /// ids the logits have (the model's vocabulary, which may exceed the tokenizer's)
    vocab: usize,
    factory: OnceLock<Result<Arc<ParserFactory>, String>>,
    /// most recently used last
    cache: Mutex<Vec<(String, Arc<Compiled>)>>,
}

impl Grammars {
    pub(crate) fn new(vocab: usize) -> Grammars {
        Grammars {
            vocab,
            factory: OnceLock::new(),
            cache: Mutex::new(Vec::new()),
        }
    }

    /// The compiled `ask` (from the cache, or compiled now), as the engine takes it; a 400
    /// naming `field` when it does not compile.
    pub(crate) fn constraint(
        &self,
        tok: &Tokenizer,
        ask: &Ask,
        field: &str,
    ) -> Result<Constrained, ApiError> {
        let key = ask.key();
        if let Ok(mut cache) = self.cache.lock() {
            if let Some(at) = cache.iter().position(|(k, _)| *k == key) {
                let hit = cache.remove(at);
                let c = hit.1.clone();
                cache.push(hit);
                return Ok(Constrained(c));
            }
        }
        let factory = self
            .factory
            .get_or_init(|| factory(tok, self.vocab).map(Arc::new))
            .as_ref()
            .map_err(|e| ApiError::bad(format!("`{field}`: {e}")))?;
        let compiled =
            Arc::new(compile(factory, ask).map_err(|e| {
                ApiError::bad(format!("`{field}` cannot be used: {}", clip(&e, 400)))
            })?);
        if let Ok(mut cache) = self.cache.lock() {
            if cache.len() >= CACHE {
                cache.remove(0);
            }
            cache.push((key, compiled.clone()));
        }
        Ok(Constrained(compiled))
    }
}

/// At most `n` characters of `s`.
fn clip(s: &str, n: usize) -> String {
    s.chars().take(n).collect()
}

/// `llguidance`'s view of the tokenizer: each id's bytes (special tokens marked so that no
/// text matches them), padded with empty tokens to the model's vocabulary.
fn factory(tok: &Tokenizer, vocab: usize) -> Result<ParserFactory, String> {
    let fail =
        |e: &dyn std::fmt::Display| format!("this model's tokenizer cannot be constrained: {e}");
    let text = tok.to_json().map_err(|e| fail(&e))?;
    let json: Value = serde_json::from_str(&text).map_err(|e| fail(&e))?;
    let mut words = llguidance::token_bytes_from_tokenizer_json(&json).map_err(|e| fail(&e))?;
    let n = words.len().max(vocab);
    words.resize(n, Vec::new());
    let n32 = u32::try_from(n).map_err(|e| fail(&e))?;
    // the trie's own end token: an id past the vocabulary, allowed where the grammar may end
    // (the sequence's real end ids are put back in its place, see `Masking::mask`)
    words.push(Vec::new());
    let trie = TokTrie::from(&TokRxInfo::new(n32 + 1, n32), &words);
    let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
    let mut f = ParserFactory::new_simple(&env).map_err(|e| fail(&e))?;
    f.quiet();
    Ok(f)
}

/// Compiles `ask`, a panic inside the compiler included as an error.
fn compile(factory: &ParserFactory, ask: &Ask) -> Result<Compiled, String> {
    let grammar = ask.top_level();
    let made = catch_unwind(AssertUnwindSafe(|| factory.create_parser(grammar)))
        .map_err(|_| "the grammar compiler failed on it".to_string())?
        .map_err(|e| e.to_string())?;
    let matcher = Matcher::new(Ok(made));
    if let Some(e) = matcher.get_error() {
        return Err(e);
    }
    Ok(Compiled {
        start: Mutex::new(matcher),
    })
}

/// One compiled grammar: its matcher at the start, copied for each sequence.
pub(crate) struct Compiled {
    start: Mutex<Matcher>,
}

impl Constraint for Compiled {
    fn start(&self) -> Box<dyn ConstraintState> {
        let m = match self.start.lock() {
            Ok(m) => m.deep_clone(),
            Err(poisoned) => poisoned.into_inner().deep_clone(),
        };
        Box::new(Masking { m })
    }
}

/// One sequence's matcher.
struct Masking {
    m: Matcher,
}

impl Masking {
    /// The tokens allowed next (the trie's end token where the grammar may end).
    fn allowed(&mut self) -> Option<SimpleVob> {
        let m = &mut self.m;
        catch_unwind(AssertUnwindSafe(|| m.compute_mask_or_eos()))
            .ok()?
            .ok()
    }
}

impl ConstraintState for Masking {
    fn mask(&mut self, logits: &mut [f32], eos: &[u32]) -> bool {
        let Some(allowed) = self.allowed() else {
            return false;
        };
        let end = allowed.len().saturating_sub(1) as u32;
        let may_end = allowed.is_allowed(end);
        let kept: Vec<(usize, f32)> = eos
            .iter()
            .filter_map(|&e| logits.get(e as usize).map(|&l| (e as usize, l)))
            .collect();
        let mut any = false;
        for (i, l) in logits.iter_mut().enumerate() {
            if (i as u32) < end && allowed.is_allowed(i as u32) {
                any |= l.is_finite();
            } else {
                *l = f32::NEG_INFINITY;
            }
        }
        for (e, l) in kept {
            logits[e] = if may_end { l } else { f32::NEG_INFINITY };
            any |= may_end && l.is_finite();
        }
        any
    }

    fn advance(&mut self, id: u32) -> bool {
        let m = &mut self.m;
        matches!(
            catch_unwind(AssertUnwindSafe(|| m.consume_token(id))),
            Ok(Ok(()))
        )
    }

    fn box_clone(&self) -> Box<dyn ConstraintState> {
        Box::new(Masking {
            m: self.m.deep_clone(),
        })
    }
}
