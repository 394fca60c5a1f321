//! `engine eval`: loss, perplexity, logits and gradients of a model on given tokens, or the
//! LAMBADA last-word accuracy.

use std::path::PathBuf;

use anyhow::{Result, anyhow, bail};
use clap::{Args, ValueEnum};
use engine::data::tokenizer::TextTokenizer;
use engine::eval::{Loaded, evaluate, lambada, read_tokens, write_dumps};

#[derive(Clone, Copy, ValueEnum)]
enum Task {
    /// Next-token loss on --tokens.
    Loss,
    /// Last-word accuracy on --data (LAMBADA JSONL).
    Lambada,
}

#[derive(Args)]
#[command(group(clap::ArgGroup::new("model").required(true).args(["checkpoint", "hf"])))]
pub struct EvalArgs {
    /// An engine checkpoint directory.
    #[arg(long, value_name = "CKPT")]
    checkpoint: Option<PathBuf>,
    /// A Hugging Face model directory.
    #[arg(long, value_name = "DIR")]
    hf: Option<PathBuf>,
    /// What to evaluate.
    #[arg(long, value_enum, default_value = "loss")]
    task: Task,
    /// The tokens (task loss): a JSON array of equally long token-id arrays, or a token shard.
    #[arg(long, value_name = "FILE")]
    tokens: Option<PathBuf>,
    /// Sequence length a shard is cut into [default: the model's max_position_embeddings, at most 2048].
    #[arg(long, value_name = "N")]
    seq_len: Option<usize>,
    /// Write the logits as safetensors (tensor `logits`, f32, [batch, sequence, vocab]).
    #[arg(long, value_name = "OUT")]
    dump_logits: Option<PathBuf>,
    /// Write the gradient of the training objective for every parameter as safetensors.
    #[arg(long, value_name = "OUT")]
    dump_grads: Option<PathBuf>,
    /// The passages (task lambada): JSON lines with a `text` field.
    #[arg(long, value_name = "FILE")]
    data: Option<PathBuf>,
    /// The tokenizer (task lambada) [default: the model's tokenizer.json or tokenizer.model].
    #[arg(long, value_name = "FILE")]
    tokenizer: Option<PathBuf>,
    /// Attention stops at each EOS: a token attends only to its own document of the packed
    /// sequence (as training with data.document_mask).
    #[arg(long)]
    document_mask: bool,
    /// The EOS id that ends a document (with --document-mask) [default: the model's config.json
    /// eos_token_id].
    #[arg(long, value_name = "ID")]
    eos: Option<u32>,
    /// Positions restart at each document (with --document-mask; GPT models' learned positions).
    #[arg(long)]
    reset_positions: bool,
}

pub fn run(args: EvalArgs) -> Result<()> {
    let mut model = Loaded::open(args.checkpoint.as_deref(), args.hf.as_deref())?;
    if args.document_mask {
        model.mask_documents(args.eos, args.reset_positions)?;
    } else if args.eos.is_some() || args.reset_positions {
        bail!("--eos and --reset-positions go with --document-mask");
    }
    match args.task {
        Task::Loss => {
            let tokens = args.tokens.as_ref().ok_or_else(|| anyhow!("--task loss needs --tokens FILE"))?;
            let seq = args.seq_len.unwrap_or(model.config().max_seq_len.min(2048));
            if seq < 2 {
                bail!("--seq-len must be at least 2");
            }
            let batch = read_tokens(tokens, seq)?;
            let (result, dumps) = evaluate(&model, &batch, args.dump_logits.is_some(), args.dump_grads.is_some())?;
            write_dumps(&model, &batch, &dumps, args.dump_logits.as_deref(), args.dump_grads.as_deref())?;
            println!("{}", serde_json::to_string(&result)?);
        }
        Task::Lambada => {
            let data = args.data.as_ref().ok_or_else(|| anyhow!("--task lambada needs --data FILE.jsonl"))?;
            let tokenizer = match (&args.tokenizer, &args.hf, &args.checkpoint) {
                (Some(t), _, _) => TextTokenizer::open(t)?,
                (None, Some(dir), _) => {
                    TextTokenizer::open(dir).map_err(|e| anyhow!("{e}; name the tokenizer with --tokenizer FILE"))?
                }
                (None, None, Some(ck)) => TextTokenizer::open(&ck.join("hf"))
                    .map_err(|_| anyhow!("the checkpoint carries no tokenizer; name one with --tokenizer FILE"))?,
                _ => unreachable!("clap requires a model"),
            };
            println!("{}", serde_json::to_string(&lambada(&model, &tokenizer, data)?)?);
        }
    }
    Ok(())
}
