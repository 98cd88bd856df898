//! Lossless speculative decoding of one request: on this machine in memory or from slice
//! files under a budget (each offloaded block is read once per verify step of up to `k + 1`
//! positions), or through a cluster's pipeline (each verify step one micro-batch). `loip
//! generate --speculate`, `loip local --speculate` and `loip bench speculate` run it.
//!
//! Invariant: the tokens are those of the same request without speculation (see
//! `loip_engine::speculate`); only the number of forward steps changes.
//!
//! ```no_run
//! use loip::backend::Source;
//! use loip::speculate::{self, Spec};
//! use loip_engine::{Flow, GenerateOptions, SamplingParams, Speculate};
//!
//! fn main() -> anyhow::Result<()> {
//!     let ckpt = loip::model::open("smollm2")?;
//!     let prompt = [504u32, 2365, 282, 504, 2365, 282, 504];
//!     let spec = Spec { source: Speculate::Lookup, ..Spec::default() };
//!     let opts = GenerateOptions {
//!         max_tokens: 32,
//!         sampling: SamplingParams::default(),
//!         eos_ids: Vec::new(),
//!         min_tokens: 0,
//!     };
//!     let run = speculate::run(
//!         Source::Memory(ckpt),
//!         &Default::default(),
//!         &prompt,
//!         &opts,
//!         &spec,
//!         None,
//!         &mut |_| Flow::Continue,
//!     )?;
//!     println!("{} tokens, {} drafts kept", run.out.out.new_ids.len(), run.out.stats.accepted);
//!     Ok(())
//! }
//! ```

#![deny(missing_docs)]

use anyhow::{bail, Context, Result};
use loip_engine::generate::Flow;
use loip_engine::speculate::draft::{self_draft, self_draft_layers, vocab_matches, ModelDrafter};
use loip_engine::speculate::lookup::Lookup;
use loip_engine::speculate::{generate_speculative, Drafter, SpecOptions, SpecOutput, Speculate};
use loip_engine::{GenerateOptions, Generator, Model};
use loip_model::tokenizer::Tokenizer;
use loip_model::{Checkpoint, ModelConfig};
use loip_runtime::cluster_run::Session;
use loip_runtime::local::{LocalModel, LocalOptions};
use loip_runtime::{MemoryReport, StepTimes};

use crate::backend::{OffloadOptions, Source};

/// How a request speculates (`--speculate`, `--draft`, `--speculate-k`,
/// `--speculate-fixed`).
#[derive(Debug, Clone)]
pub struct Spec {
    /// where drafts come from (`Off`: no speculation)
    pub source: Speculate,
    /// the draft model of [`Speculate::Draft`] (a known name, an HF directory or a GGUF
    /// file), run in memory; its tokenizer must be the target's; `self:L`: the target's own
    /// first `L` layers, final norm and head ([`self_draft_of`])
    pub draft: Option<String>,
    /// most drafts verified in one step  // tokens
    pub k: usize,
    /// always verify up to `k` drafts (no adaptation from the acceptance rate and the step
    /// costs)
    pub fixed: bool,
}

impl Default for Spec {
    fn default() -> Self {
        Spec {
            source: Speculate::Off,
            draft: None,
            k: 8,
            fixed: false,
        }
    }
}

impl Spec {
    /// Whether speculation is on.
    pub fn on(&self) -> bool {
        self.source != Speculate::Off
    }

    /// The engine's options; `offloaded`: steps are load-bound (a position more costs
    /// little), else compute-bound.
    pub fn options(&self, offloaded: bool) -> SpecOptions {
        SpecOptions {
            k_max: self.k,
            adaptive: !self.fixed,
            prior_per_row: if offloaded { 0.03 } else { 0.25 },
            step_prior: Vec::new(),
        }
    }
}

/// A speculative run's result, and the device's numbers when it ran from slice files.
pub struct SpecRun {
    /// tokens, timings and what speculation did
    pub out: SpecOutput,
    /// how the device's budget is spent (from slice files)
    pub memory: Option<MemoryReport>,
    /// the device's compute, stall and load totals (from slice files)
    pub times: Option<StepTimes>,
}

/// Opens the draft model of `spec` and checks that its token ids are the target's: the
/// same vocabulary, token for token, and the same special ids (without tokenizers on
/// either side, token ids in and out, the vocabulary size and special ids).
pub fn open_draft(
    spec: &Spec,
    target: &ModelConfig,
    target_tok: Option<&Tokenizer>,
) -> Result<Checkpoint> {
    let name = spec
        .draft
        .as_deref()
        .context("--speculate draft needs --draft MODEL")?;
    if self_draft_layers(name)?.is_some() {
        bail!(
            "--draft {name} drafts with the model's own layers in memory (`loip generate` \
             without --mem); elsewhere use another model or --speculate lookup"
        );
    }
    let ckpt = crate::model::open(name)?;
    let refuse = |why: String| {
        anyhow::anyhow!("the draft model {name} cannot draft for this model: its {why}")
    };
    vocab_matches(target, &ckpt.config).map_err(refuse)?;
    let (tok, dtok) = match (target_tok, crate::model::tokenizer(&ckpt)) {
        (Some(tok), Ok(dtok)) => (tok, dtok),
        // neither has a tokenizer (token ids in and out): the config check is all there is
        (None, Err(_)) => return Ok(ckpt),
        (Some(_), Err(e)) => return Err(refuse(format!("tokenizer does not load ({e:#})"))),
        (None, Ok(_)) => return Err(refuse("tokenizer has no counterpart in the target".into())),
    };
    if tok.vocab_size() != dtok.vocab_size() {
        return Err(refuse(format!(
            "tokenizer has {} tokens, the target's {}",
            dtok.vocab_size(),
            tok.vocab_size()
        )));
    }
    if let Some(id) =
        (0..tok.vocab_size() as u32).find(|&i| tok.id_to_token(i) != dtok.id_to_token(i))
    {
        return Err(refuse(format!(
            "token {id} is {:?}, the target's {:?}",
            dtok.id_to_token(id),
            tok.id_to_token(id)
        )));
    }
    Ok(ckpt)
}

/// The layers of a self-draft (`--speculate draft --draft self:L`: the target's first `L`
/// layers, its final norm and head, in memory), `None` for any other speculation.
pub fn self_draft_of(spec: &Spec) -> Result<Option<usize>> {
    Ok(match (spec.source, spec.draft.as_deref()) {
        (Speculate::Draft, Some(name)) => self_draft_layers(name)?,
        _ => None,
    })
}

/// The draft model of [`Speculate::Draft`] bound from `draft` ([`open_draft`]), if any.
fn draft_model<'a>(spec: &Spec, draft: Option<&'a Checkpoint>) -> Result<Option<Model<'a>>> {
    Ok(match (spec.source, draft) {
        (Speculate::Draft, Some(d)) => Some(Model::from_checkpoint(d)?),
        (Speculate::Draft, None) => bail!("--speculate draft needs --draft MODEL"),
        _ => None,
    })
}

/// Runs `run` with the drafter asked for: the draft model (in memory here) or prompt
/// lookup.
fn with_drafter<T>(
    draft_model: Option<&Model<'_>>,
    opts: &GenerateOptions,
    run: impl FnOnce(&mut dyn Drafter) -> Result<T>,
) -> Result<T> {
    let mut lookup = Lookup::default();
    // under a sampled request the draft samples too (its drafts checked by the speculative
    // sampling rule: the target's distribution, other tokens than without speculation)
    let mut by_model = draft_model
        .map(|m| ModelDrafter::new(Generator::new(m, None), 0).sampling(&opts.sampling))
        .transpose()?;
    match by_model.as_mut() {
        Some(d) => run(d),
        None => run(&mut lookup),
    }
}

/// The cost model's time of a step of `n` positions of one sequence on `session`'s plan,
/// `n = 1..=k + 1` (the adaptive controller's prior until steps of each size are measured;
/// empty when the plan cannot be priced), from the parts of the step its plan was priced
/// with ([`Session::step`]).  // seconds
pub fn pipeline_step_prior(session: &Session, k: usize) -> Vec<f64> {
    let k = u32::try_from(k).unwrap_or(u32::MAX);
    loip_plan::speculate::verify_step_times(&session.step, k)
}

/// The engine's options of `spec` through `session`'s pipeline: a pipeline step is load-
/// and round-bound (a position more costs little) unless the plan's own prices
/// ([`pipeline_step_prior`]) say otherwise.
pub fn pipeline_options(session: &Session, spec: &Spec) -> SpecOptions {
    let mut o = spec.options(true);
    o.step_prior = pipeline_step_prior(session, spec.k);
    o
}

/// Runs `prompt` with `opts` and speculation `spec` through `session`'s pipeline (`loip
/// local --speculate`): each verify step is one micro-batch of `k + 1` positions, the
/// rejected positions' KV dropped on every device with the next step; drafts come from
/// prompt lookup or a draft model in memory here. Draft lengths adapt from the cost model's
/// step times of the session's plan ([`pipeline_step_prior`]) until the pipeline's own are
/// measured. `config` and `tokenizer`: the target's, to check the draft model against.
pub fn on_session(
    session: &Session,
    (config, tokenizer): (&ModelConfig, Option<&Tokenizer>),
    prompt: &[u32],
    opts: &GenerateOptions,
    spec: &Spec,
    on_token: &mut dyn FnMut(u32) -> Flow,
) -> Result<SpecOutput> {
    let max = loip_engine::speculate::MAX_REWIND;
    if spec.k > max {
        bail!("--speculate-k is at most {max} on a cluster");
    }
    let draft = (spec.source == Speculate::Draft)
        .then(|| open_draft(spec, config, tokenizer))
        .transpose()?;
    let model = draft_model(spec, draft.as_ref())?;
    let pipeline = session.pipeline();
    let seq = loip_runtime::coordinator::next_seq_id();
    let mut backend = pipeline.backend();
    let o = pipeline_options(session, spec);
    let out = with_drafter(model.as_ref(), opts, |d| {
        Ok(generate_speculative(
            &mut backend,
            seq,
            prompt,
            opts,
            d,
            &o,
            on_token,
        )?)
    });
    pipeline.release(&[seq]);
    out
}

/// Runs `prompt` with `opts` and speculation `spec` on `src` (memory or slice files, with
/// `offload`); `draft`: the draft model of [`Speculate::Draft`] ([`open_draft`]).
pub fn run(
    src: Source,
    offload: &OffloadOptions,
    prompt: &[u32],
    opts: &GenerateOptions,
    spec: &Spec,
    draft: Option<&Checkpoint>,
    on_token: &mut dyn FnMut(u32) -> Flow,
) -> Result<SpecRun> {
    if let Some(layers) = self_draft_of(spec)? {
        let Source::Memory(ckpt) = &src else {
            bail!(
                "a self-draft (--draft self:L) runs with the model in memory, not from slice files"
            )
        };
        let model = self_draft(ckpt, layers)?;
        return with_drafter(Some(&model), opts, |drafter| {
            in_memory(ckpt, prompt, opts, spec, drafter, on_token)
        });
    }
    let model = draft_model(spec, draft)?;
    with_drafter(model.as_ref(), opts, |drafter| {
        run_with(src, offload, prompt, opts, spec, drafter, on_token)
    })
}

fn run_with(
    src: Source,
    offload: &OffloadOptions,
    prompt: &[u32],
    opts: &GenerateOptions,
    spec: &Spec,
    drafter: &mut dyn Drafter,
    on_token: &mut dyn FnMut(u32) -> Flow,
) -> Result<SpecRun> {
    let context = prompt.len() + opts.max_tokens;
    match src {
        Source::Memory(ckpt) => in_memory(&ckpt, prompt, opts, spec, drafter, on_token),
        Source::Slices(dir) => {
            // the budget is the whole process's; the engine gets its share
            let mem_budget = match offload.mem {
                Some(m) => {
                    let b = crate::backend::engine_share(m, 1)?;
                    eprintln!("{b}");
                    Some(b.engine)
                }
                None => None,
            };
            let lopts = LocalOptions {
                mem_budget,
                rule: offload.rule,
                loader: offload.loader,
                overlap: offload.overlap,
                // a verify step's rejected rows are held until the rewind
                context: context + spec.k,
                max_step_tokens: prompt.len().max(spec.k + 1),
            };
            let mut model = LocalModel::open_batched(&dir, &lopts, 1)?;
            let memory = model.device.memory();
            let offloaded = memory.slot > 0;
            let o = spec.options(offloaded);
            model.device.take_times();
            let out = generate_speculative(&mut model, 0, prompt, opts, drafter, &o, on_token)?;
            Ok(SpecRun {
                out,
                memory: Some(memory),
                times: Some(model.device.take_times()),
            })
        }
        Source::Cluster(_) => {
            bail!("--speculate on a cluster runs in its serving loop (prompt lookup), not here")
        }
    }
}

/// [`run_with`] in memory.
fn in_memory(
    ckpt: &Checkpoint,
    prompt: &[u32],
    opts: &GenerateOptions,
    spec: &Spec,
    drafter: &mut dyn Drafter,
    on_token: &mut dyn FnMut(u32) -> Flow,
) -> Result<SpecRun> {
    let model = Model::from_checkpoint(ckpt)?;
    let mut gen = Generator::new(&model, None);
    let o = spec.options(false);
    let out = generate_speculative(&mut gen, 0, prompt, opts, drafter, &o, on_token)?;
    Ok(SpecRun {
        out,
        memory: None,
        times: None,
    })
}
