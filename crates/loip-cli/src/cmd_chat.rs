//! `loip chat`: a conversation with a model, one user turn per line of stdin, on any
//! placement (`loip generate`'s: in memory, from slice files with `--mem`, or a cluster).
//! The whole history (an optional `--system` message, then the user and assistant turns) is
//! rendered with the model's chat template at every turn, as `/v1/chat/completions` renders
//! its `messages`, so a turn gives the tokens the API gives for the same history.

use std::io::{BufRead, IsTerminal, Write};

use anyhow::{Context, Result};
use clap::Args;
use loip_model::chat::ChatMessage;

use crate::backend::{self, ClusterArgs, OffloadArgs};
use crate::request::{options, Printer, PromptArgs};

/// Arguments of `loip chat`.
#[derive(Args, Debug)]
#[command(after_long_help = "\
Type a message and Enter; the reply streams back. `/reset` forgets the conversation (the
system message stays), `/exit` or end of input (Ctrl-D) ends it. Without a terminal, each
line of stdin is a turn, echoed after `> ` so that the transcript reads as one.

Example:
  loip chat --model smollm2 --system 'You answer in one sentence.'")]
pub struct ChatArgs {
    /// Model: a known name (`smollm2`, `gemma3-270m`), an HF directory or a GGUF file (it
    /// needs a chat template).
    #[arg(long, short = 'm', default_value = "smollm2")]
    pub model: String,
    /// A system message that opens the conversation.
    #[arg(long)]
    pub system: Option<String>,
    /// Print one JSON object per turn (the user's text, the reply, prompt and new ids)
    /// instead of streaming text.
    #[arg(long)]
    pub json: bool,
    /// Longest context of the conversation, tokens (a turn whose history does not fit is
    /// refused; `/reset` starts over).
    #[arg(long, default_value_t = 4096)]
    pub context: usize,
    /// Sampling for every turn (`--prompt`, `--prompt-ids` and `--chat` are not used).
    #[command(flatten)]
    pub sampling: PromptArgs,
    #[command(flatten)]
    pub offload: OffloadArgs,
    #[command(flatten)]
    pub cluster: ClusterArgs,
}

/// `loip chat`.
pub fn run(mut a: ChatArgs) -> Result<()> {
    crate::cluster_ux::discover(&mut a.cluster)?;
    let (src, info) = backend::source(&a.model, &a.offload, &a.cluster)?;
    let tok = info
        .tokenizer
        .context("a chat needs the model's tokenizer")?;
    let tpl = info
        .chat?
        .with_context(|| format!("{} has no chat template", a.model))?;
    let context = info.config.max_position_embeddings.min(a.context.max(1));
    let how = backend::How {
        offload: &a.offload,
        cluster: &a.cluster,
        sizes: backend::Sizes {
            model: &a.model,
            loader: a.offload.loader,
            parallel: 1,
            // longer prompts run in steps of this many tokens
            max_step_tokens: context.min(512),
            context,
            pattern: loip_plan::Pattern::Sporadic,
            micro_batches: None,
            planned_context: context as u64,
            greedy: a.sampling.greedy(),
            no_replan: false,
            speculate_k: 0,
        },
        quiet: a.json,
    };
    let be = backend::open(src, &how)?.backend;
    let terminal = std::io::stdin().is_terminal();
    let mut history: Vec<ChatMessage> = a
        .system
        .iter()
        .map(|s| ChatMessage::new("system", s.clone()))
        .collect();
    let opening = history.len();
    let mut lines = std::io::stdin().lock().lines();
    loop {
        if terminal {
            eprint!("> ");
            let _ = std::io::stderr().flush();
        }
        let Some(line) = lines.next() else { break };
        let line = line.context("reading stdin")?;
        let said = line.trim();
        if !terminal && !a.json {
            println!("> {said}");
        }
        match said {
            "" => continue,
            "/exit" => break,
            "/reset" => {
                history.truncate(opening);
                eprintln!("(conversation forgotten)");
                continue;
            }
            _ => {}
        }
        history.push(ChatMessage::new("user", said.to_string()));
        let ids = tpl.encode(&tok, &history, true)?;
        if ids.len() + a.sampling.max_tokens > context {
            history.pop();
            eprintln!(
                "error: the conversation ({} tokens) and --max-tokens {} exceed --context \
                 {context}; /reset starts over",
                ids.len(),
                a.sampling.max_tokens
            );
            continue;
        }
        let opts = options(&info.config, &ids, &a.sampling)?;
        let mut printer = Printer::new(Some(&tok), a.sampling.stop.clone(), a.json);
        let out = be.generate(&ids, &opts, &mut |id| printer.on_token(id))?;
        let reply = printer.finish();
        if a.json {
            let v = serde_json::json!({"user": said, "text": reply, "prompt_ids": ids,
                                       "new_ids": out.new_ids});
            println!("{v}");
        } else {
            println!();
        }
        history.push(ChatMessage::new("assistant", reply));
    }
    be.shutdown();
    Ok(())
}
