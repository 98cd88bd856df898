//! `--speculate`: lossless speculative decoding of one request on this machine, in memory
//! or from slice files under `--mem` (each offloaded block is read once per verify step of
//! up to `k + 1` positions), or through a cluster's pipeline (`loip local`). Shared by `loip
//! generate`, `loip local` and `loip bench speculate`.
//!
//! Invariant: the tokens are those of the same request without speculation (see
//! `loip_engine::speculate`); only the number of forward steps changes.

use anyhow::{bail, Context, Result};
use clap::Args;
use loip_engine::generate::Flow;
use loip_engine::speculate::draft::{vocab_matches, ModelDrafter};
use loip_engine::speculate::lookup::Lookup;
use loip_engine::speculate::{generate_speculative, Drafter, SpecOptions, SpecOutput, Speculate};
use loip_engine::{GenerateOptions, Generator, Model};
use loip_model::tokenizer::Tokenizer;
use loip_model::{Checkpoint, ModelConfig};
use loip_runtime::local::{LocalModel, LocalOptions};
use loip_runtime::MemoryReport;
use loip_runtime::StepTimes;

use crate::backend::{OffloadArgs, Source};

/// Speculative decoding flags.
#[derive(Args, Debug, Clone)]
pub struct SpecArgs {
    /// Speculative decoding: `lookup` (drafts from n-gram matches in the prompt and the
    /// output so far), `draft` (a smaller model with the same tokenizer, --draft), or `off`.
    /// Drafts are verified k + 1 positions per forward; the tokens are the same.
    #[arg(long, default_value = "off")]
    pub speculate: Speculate,
    /// The draft model of `--speculate draft` (`smollm2`, an HF directory or a GGUF file),
    /// run in memory; its tokenizer must be the target's.
    #[arg(long)]
    pub draft: Option<String>,
    /// Most draft tokens verified in one step.
    #[arg(long, default_value_t = 8)]
    pub speculate_k: usize,
    /// Always verify up to --speculate-k drafts (no adaptation from the acceptance rate
    /// and the measured step costs).
    #[arg(long)]
    pub speculate_fixed: bool,
}

impl SpecArgs {
    /// Whether speculation is on.
    pub fn on(&self) -> bool {
        self.speculate != Speculate::Off
    }

    /// The engine's options; `offloaded`: steps are load-bound (a position more costs little).
    pub fn options(&self, offloaded: bool) -> SpecOptions {
        SpecOptions {
            k_max: self.speculate_k,
            adaptive: !self.speculate_fixed,
            prior_per_row: if offloaded { 0.03 } else { 0.25 },
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

/// Opens the draft model of `--draft` and checks that its token ids are the target's: the
/// same vocabulary, token for token, and the same special ids (without tokenizers on
/// either side, token ids in and out, the vocabulary size and special ids).
pub fn open_draft(
    spec: &SpecArgs,
    target: &ModelConfig,
    target_tok: Option<&Tokenizer>,
) -> Result<Checkpoint> {
    let name = spec
        .draft
        .as_deref()
        .context("--speculate draft needs --draft MODEL")?;
    let ckpt = loip::model::open(name)?;
    let refuse = |why: String| {
        anyhow::anyhow!("the draft model {name} cannot draft for this model: its {why}")
    };
    vocab_matches(target, &ckpt.config).map_err(refuse)?;
    let (tok, dtok) = match (target_tok, loip::model::tokenizer(&ckpt)) {
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

/// The draft model of `--speculate draft` bound from `draft` ([`open_draft`]), if any.
fn draft_model<'a>(spec: &SpecArgs, draft: Option<&'a Checkpoint>) -> Result<Option<Model<'a>>> {
    Ok(match (spec.speculate, draft) {
        (Speculate::Draft, Some(d)) => Some(Model::from_checkpoint(d)?),
        (Speculate::Draft, None) => bail!("--speculate draft needs --draft MODEL"),
        _ => None,
    })
}

/// Runs `run` with the drafter `spec` asks for: the draft model (in memory here) or prompt
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

/// Runs `prompt` with `opts` and speculation `spec` through a cluster's `pipeline` (`loip
/// local --speculate`): each verify step is one micro-batch of `k + 1` positions, the
/// rejected positions' KV dropped on every device with the next step; drafts come from
/// prompt lookup or a draft model in memory here.
/// `config` and `tokenizer`: the target's, to check the draft model against.
pub fn on_pipeline(
    pipeline: &loip_runtime::coordinator::Pipeline,
    (config, tokenizer): (&ModelConfig, Option<&Tokenizer>),
    prompt: &[u32],
    opts: &GenerateOptions,
    spec: &SpecArgs,
    on_token: &mut dyn FnMut(u32) -> Flow,
) -> Result<SpecOutput> {
    let max = loip_engine::speculate::MAX_REWIND;
    if spec.speculate_k > max {
        bail!("--speculate-k is at most {max} on a cluster");
    }
    let draft = (spec.speculate == Speculate::Draft)
        .then(|| open_draft(spec, config, tokenizer))
        .transpose()?;
    let model = draft_model(spec, draft.as_ref())?;
    let seq = loip_runtime::coordinator::next_seq_id();
    let mut backend = pipeline.backend();
    // a pipeline step is load- and round-bound: a position more costs little
    let o = spec.options(true);
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

/// Runs `prompt` with `opts` and speculation `spec` on `src` (memory or slice files);
/// `draft`: the draft model of `--speculate draft` ([`open_draft`]).
pub fn run(
    src: Source,
    offload: &OffloadArgs,
    prompt: &[u32],
    opts: &GenerateOptions,
    spec: &SpecArgs,
    draft: Option<&Checkpoint>,
    on_token: &mut dyn FnMut(u32) -> Flow,
) -> Result<SpecRun> {
    let model = draft_model(spec, draft)?;
    with_drafter(model.as_ref(), opts, |drafter| {
        run_with(src, offload, prompt, opts, spec, drafter, on_token)
    })
}

fn run_with(
    src: Source,
    offload: &OffloadArgs,
    prompt: &[u32],
    opts: &GenerateOptions,
    spec: &SpecArgs,
    drafter: &mut dyn Drafter,
    on_token: &mut dyn FnMut(u32) -> Flow,
) -> Result<SpecRun> {
    let context = prompt.len() + opts.max_tokens;
    match src {
        Source::Memory(ckpt) => {
            let model = Model::from_checkpoint(&ckpt)?;
            let mut gen = Generator::new(&model, None);
            let o = spec.options(false);
            let out = generate_speculative(&mut gen, 0, prompt, opts, drafter, &o, on_token)?;
            Ok(SpecRun {
                out,
                memory: None,
                times: None,
            })
        }
        Source::Slices(dir) => {
            // --mem is the whole process's budget; the engine gets its share
            let mem_budget = match offload.mem.as_deref() {
                Some(m) => {
                    let b = crate::backend::engine_share(loip_plan::parse_bytes(m)?, 1)?;
                    eprintln!("{b}");
                    Some(b.engine)
                }
                None => None,
            };
            let lopts = LocalOptions {
                mem_budget,
                rule: offload.offload_blocks,
                loader: offload.loader,
                overlap: !offload.no_overlap,
                // a verify step's rejected rows are held until the rewind
                context: context + spec.speculate_k,
                max_step_tokens: prompt.len().max(spec.speculate_k + 1),
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
