//! The sizes a server runs with under a budget: the largest context, then the most sequences
//! at once, whose KV cache and working buffers fit the process's `--mem` on a model's slice
//! files, checked without loading anything; or a refusal that names the flags and the bytes.

use std::path::Path;

use anyhow::{bail, Result};

use crate::backend::OffloadOptions;

/// `--context` when not given (at most the model's limit).  // tokens
pub const DEFAULT_CONTEXT: usize = 4096;
/// `--parallel` when not given.
pub const DEFAULT_PARALLEL: usize = 4;
/// `--max-prompt` when not given.  // tokens
pub const DEFAULT_MAX_PROMPT: usize = 2048;
/// The smallest context the fit tries.  // tokens
pub const MIN_CONTEXT: usize = 256;

/// The sizes the user set (`None`: the fit chooses).
#[derive(Debug, Clone, Copy)]
pub struct Asked {
    /// `--context`  // tokens
    pub context: Option<usize>,
    /// `--parallel`
    pub parallel: Option<usize>,
    /// `--max-prompt`  // tokens
    pub max_prompt: Option<usize>,
}

/// The sizes served with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// one sequence's prompt + new tokens at most  // tokens
    pub context: usize,
    /// sequences at once
    pub parallel: usize,
    /// longest prompt, one step's tokens  // tokens
    pub max_prompt: usize,
}

impl std::fmt::Display for Limits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "--context {} --max-prompt {} --parallel {}",
            self.context, self.max_prompt, self.parallel
        )
    }
}

/// The sizes to try, best first: the largest context (the one asked, else the default
/// within the model's `limit`, halved down to [`MIN_CONTEXT`]), then at each the most
/// sequences (the ones asked, else [`DEFAULT_PARALLEL`] down to 1). A prompt not asked for
/// takes at most half the context.
pub fn candidates(asked: Asked, limit: usize) -> Vec<Limits> {
    let limit = limit.max(1);
    let contexts: Vec<usize> = match asked.context {
        Some(c) => vec![c.min(limit).max(1)],
        None => {
            let mut c = DEFAULT_CONTEXT.min(limit);
            let mut v = vec![c];
            while c / 2 >= MIN_CONTEXT {
                c /= 2;
                v.push(c);
            }
            v
        }
    };
    let parallels: Vec<usize> = match asked.parallel {
        Some(p) => vec![p],
        None => (1..=DEFAULT_PARALLEL).rev().collect(),
    };
    let mut out = Vec::with_capacity(contexts.len() * parallels.len());
    for &context in &contexts {
        for &parallel in &parallels {
            let max_prompt = asked
                .max_prompt
                .unwrap_or_else(|| DEFAULT_MAX_PROMPT.min((context / 2).max(1)));
            out.push(Limits {
                context,
                parallel,
                max_prompt,
            });
        }
    }
    out
}

/// What [`fit`] chose and the line that says why.
pub struct Fitted {
    /// the sizes to serve with
    pub sizes: Limits,
    /// one line saying why
    pub why: String,
}

/// The first of [`candidates`] whose KV cache and working buffers fit `mem` (the whole
/// process's budget) on the model's slice files in `dir`, checked without loading anything;
/// when none does, an error naming the flags and the numbers of the smallest.
pub fn fit(
    dir: &Path,
    offload: &OffloadOptions,
    mem: u64,
    limit: usize,
    asked: Asked,
) -> Result<Fitted> {
    use loip_runtime::local::{local_spec_for, LocalOptions};
    use loip_runtime::RuntimeError;
    let manifest = loip_model::slice::Manifest::load(dir)?;
    let all = candidates(asked, limit);
    let b = loip_plan::units::format_bytes;
    // why the first (the defaults) and the last tried were refused
    let (mut first, mut refused): (Option<String>, Option<String>) = (None, None);
    for (i, sizes) in all.iter().enumerate() {
        if i == 1 {
            first.clone_from(&refused);
        }
        let budget = match crate::backend::budget_split(mem, sizes.parallel) {
            Ok(budget) => budget,
            Err(e) if e.downcast_ref::<loip_runtime::memory::TooSmall>().is_some() => {
                refused = Some(format!("{e}"));
                continue;
            }
            Err(e) => return Err(e),
        };
        let opts = LocalOptions {
            mem_budget: Some(budget.engine),
            rule: offload.rule,
            loader: offload.loader,
            overlap: offload.overlap,
            context: sizes.context,
            max_step_tokens: sizes.max_prompt,
        };
        match local_spec_for(&manifest, &opts, sizes.parallel) {
            Ok(_) => {
                let chose = asked.context.is_none()
                    || asked.parallel.is_none()
                    || asked.max_prompt.is_none();
                let why = if i == 0 {
                    format!("serving with {sizes}: they fit --mem {}", b(mem))
                } else if chose {
                    format!(
                        "serving with {sizes}: the largest that fit --mem {} ({} refused: {})",
                        b(mem),
                        all[0],
                        first.as_deref().unwrap_or("too large")
                    )
                } else {
                    format!("serving with {sizes}")
                };
                return Ok(Fitted { sizes: *sizes, why });
            }
            Err(RuntimeError::KvDoesNotFit {
                budget: engine,
                needed,
                kv,
                working,
                ..
            }) => {
                refused = Some(format!(
                    "the device needs {} (KV {}, working buffers {}) of the engine's {}",
                    b(needed),
                    b(kv),
                    b(working),
                    b(engine)
                ));
            }
            Err(e) => return Err(e.into()),
        }
    }
    let smallest = all.last().copied().unwrap_or(Limits {
        context: MIN_CONTEXT,
        parallel: 1,
        max_prompt: MIN_CONTEXT / 2,
    });
    bail!(
        "--mem {} does not serve this model even at {smallest} ({}); give a larger --mem, \
         or a smaller --context, --max-prompt or --parallel",
        b(mem),
        refused.as_deref().unwrap_or("does not fit")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fit_tries_the_largest_context_first_then_parallelism() {
        let none = Asked {
            context: None,
            parallel: None,
            max_prompt: None,
        };
        let c = candidates(none, 8192);
        assert_eq!(
            c[0],
            Limits {
                context: 4096,
                parallel: 4,
                max_prompt: 2048
            }
        );
        assert_eq!(c[1].parallel, 3);
        assert_eq!(
            (c[4].context, c[4].parallel, c[4].max_prompt),
            (2048, 4, 1024)
        );
        let last = c[c.len() - 1];
        assert_eq!(
            (last.context, last.parallel, last.max_prompt),
            (256, 1, 128)
        );
        // what the user set is kept; the model's limit caps the context
        let set = Asked {
            context: Some(9000),
            parallel: Some(2),
            max_prompt: None,
        };
        assert_eq!(
            candidates(set, 2048),
            vec![Limits {
                context: 2048,
                parallel: 2,
                max_prompt: 1024
            }]
        );
    }
}
