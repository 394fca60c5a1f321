//! `engine plot`: runs' curves overlaid in one SVG or PNG (docs/plots.md).

use std::path::PathBuf;

use anyhow::{Result, bail};
use clap::{Args, ValueEnum};
use engine::plot::{Metric, Run, XAxis, runs};

#[derive(Clone, Copy, ValueEnum)]
enum MetricArg {
    /// The training loss.
    Loss,
    /// The validation loss, on the steps that evaluate (train.eval_every).
    EvalLoss,
    /// The learning rate.
    Lr,
    /// The global gradient norm before clipping.
    GradNorm,
    /// Tokens per second, all devices together.
    TokensPerS,
    /// Model FLOP utilisation.
    Mfu,
    /// The slowest rank's step time (a run on one device: its step time).
    StepTime,
}

#[derive(Clone, Copy, ValueEnum)]
enum XArg {
    /// Optimizer steps.
    Step,
    /// Tokens trained on, all devices together.
    Tokens,
}

#[derive(Args)]
pub struct PlotArgs {
    /// Run directories (the --run-dir of `engine train`), each with its metrics.jsonl; the
    /// legend names each by directory and recipe, and the config keys that differ between them.
    #[arg(value_name = "RUN_DIR", required = true)]
    runs: Vec<PathBuf>,
    /// The picture to write: FILE.svg or FILE.png.
    #[arg(long, value_name = "FILE")]
    out: PathBuf,
    /// What to draw.
    #[arg(long, value_enum, default_value = "loss")]
    metric: MetricArg,
    /// What the horizontal axis counts.
    #[arg(long, value_enum, default_value = "step")]
    x: XArg,
    /// A caption above the plot.
    #[arg(long, value_name = "TEXT")]
    title: Option<String>,
    /// The picture's size in pixels, WIDTHxHEIGHT.
    #[arg(long, value_name = "WxH", default_value = "900x540", value_parser = parse_size)]
    size: (u32, u32),
}

/// `WIDTHxHEIGHT`, each 100 to 8000 pixels (a PNG of 8000² is 192 MB of pixels).
fn parse_size(text: &str) -> Result<(u32, u32), String> {
    let bad = || format!("`{text}` is not WIDTHxHEIGHT with each 100 to 8000 pixels, e.g. 900x540");
    let (w, h) = text.split_once('x').ok_or_else(bad)?;
    let (w, h) = (w.parse::<u32>().map_err(|_| bad())?, h.parse::<u32>().map_err(|_| bad())?);
    if !(100..=8000).contains(&w) || !(100..=8000).contains(&h) {
        return Err(bad());
    }
    Ok((w, h))
}

pub fn run(args: PlotArgs) -> Result<()> {
    let png = match args.out.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase).as_deref() {
        Some("svg") => false,
        Some("png") => true,
        _ => bail!("--out {}: name a .svg or .png file", args.out.display()),
    };
    let metric = match args.metric {
        MetricArg::Loss => Metric::Loss,
        MetricArg::EvalLoss => Metric::EvalLoss,
        MetricArg::Lr => Metric::Lr,
        MetricArg::GradNorm => Metric::GradNorm,
        MetricArg::TokensPerS => Metric::TokensPerS,
        MetricArg::Mfu => Metric::Mfu,
        MetricArg::StepTime => Metric::StepTime,
    };
    let x = match args.x {
        XArg::Step => XAxis::Step,
        XArg::Tokens => XAxis::Tokens,
    };
    let runs = args.runs.iter().map(|d| Run::read(d)).collect::<Result<Vec<_>>>()?;
    let mut figure = runs::overlay(&runs, metric, x)?;
    figure.title = args.title.unwrap_or_default();
    let bytes = if png { figure.png(args.size)? } else { figure.svg(args.size)?.into_bytes() };
    engine::fsutil::write_atomic(&args.out, &bytes)?;
    println!("wrote {} ({} runs, {})", args.out.display(), runs.len(), metric.name());
    Ok(())
}
