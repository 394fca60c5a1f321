//! Command-line interface: argument definitions and dispatch to one module per command.

mod bench;
mod data;
mod device;
mod eval;
mod export_hf;
mod flight;
mod goodput;
mod gpu_test;
mod import_hf;
mod info;
mod launch;
mod plot;
mod recipes;
mod test_all;
mod train;

use anyhow::{Context, Result};
use clap::error::ErrorKind;
use clap::{Args, Parser, Subcommand};
use engine::backend::cuda::CudaFailure;
use engine::config::{self, Override, Resolved};

/// Trains Llama, Mistral and Mixtral style models with explicit forward and backward passes.
#[derive(Parser)]
#[command(name = "engine", version, about, max_term_width = 100)]
pub struct Cli {
    /// CPU threads for the CPU backend, at most the cores available [default: all cores; env:
    /// ENGINE_THREADS]
    #[arg(long, global = true, value_name = "N")]
    threads: Option<usize>,
    /// Device to train and benchmark on: the first CUDA GPU when there is one (auto), the CPU,
    /// or a CUDA GPU or an error [default: auto; env: ENGINE_DEVICE]
    #[arg(long, global = true, value_enum, value_name = "DEVICE")]
    device: Option<device::DeviceArg>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a model from a recipe: on the embedded corpus, synthetic tokens or prepared shards;
    /// from scratch, a Hugging Face model, or a checkpoint to resume.
    Train(train::TrainArgs),
    /// Prepare training data: tokenize text and JSONL files into token shards.
    #[command(subcommand)]
    Data(data::DataCommand),
    /// Convert a Hugging Face model directory into an engine checkpoint.
    ImportHf(import_hf::ImportArgs),
    /// Convert an engine checkpoint into a Hugging Face model directory.
    ExportHf(export_hf::ExportArgs),
    /// Evaluate a model: loss, perplexity, logits and gradients on tokens, or LAMBADA accuracy.
    Eval(eval::EvalArgs),
    /// List the built-in recipes, or show one resolved with its parameter count and FLOPs.
    #[command(subcommand)]
    Recipes(recipes::RecipesCommand),
    /// Measure step time, tokens/s, TFLOP/s and MFU of recipes, and the GEMM rate.
    Bench(bench::BenchArgs),
    /// Show a run's goodput: its wall time trained and lost by cause (start-up, checkpoints,
    /// evaluation, data, steps recomputed after restarts), for its last attempt and all of them.
    Goodput(goodput::GoodputArgs),
    /// Show the devices, versions and flags in effect.
    Info,
    /// Start one process per local device, each running the given engine command.
    Launch(launch::LaunchArgs),
    /// Multi-process diagnostics.
    #[command(subcommand)]
    Dist(launch::DistCommand),
    /// Diagnose a failed job from its flight records (RUN_DIR/flight/rank-R.json): which
    /// collective each rank was in, at which sequence number, and which rank is behind.
    Flight(flight::FlightArgs),
    /// Check the CUDA backend against the CPU reference on this machine's GPU (or its CPU
    /// emulator): every kernel, model parity, graphs, recomputation, memory, training.
    GpuTest(gpu_test::GpuTestArgs),
    /// The test suite of the images: loss curves against baselines, checkpoint resumption, a
    /// Hugging Face round trip, data preparation, CPU/GPU parity, throughput (docs/test-all.md).
    TestAll(test_all::TestAllArgs),
    /// Draw runs' curves (loss, eval loss, learning rate, gradient norm, tokens/s, MFU, step
    /// time) overlaid, by step or by tokens, into an SVG or PNG (docs/plots.md).
    Plot(plot::PlotArgs),
    /// Record the baselines test-all compares with.
    #[command(subcommand)]
    Baselines(test_all::BaselinesCommand),
}

/// A recipe and its overrides, shared by the commands that resolve one.
#[derive(Args, Clone)]
pub struct RecipeArgs {
    /// A built-in recipe name (see `engine recipes list`) or a path to a recipe TOML file.
    #[arg(long, value_name = "NAME|FILE")]
    recipe: String,
    /// Override a recipe key, e.g. `--set model.n_layers=4` (repeatable; applied after
    /// ENGINE_DEFAULT_FLAGS and ENGINE_FLAGS).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
}

impl RecipeArgs {
    /// Resolves the recipe with, in order, `ENGINE_DEFAULT_FLAGS`, `ENGINE_FLAGS`, `--set` and
    /// `extra` overrides.
    pub fn resolve(&self, extra: &[Override]) -> Result<Resolved> {
        let mut overrides = Vec::new();
        for var in ["ENGINE_DEFAULT_FLAGS", "ENGINE_FLAGS"] {
            if let Ok(list) = std::env::var(var) {
                overrides.extend(Override::from_list(&list, var));
            }
        }
        overrides.extend(self.set.iter().map(|s| Override { text: s.clone(), origin: "--set".into() }));
        overrides.extend_from_slice(extra);
        config::resolve(&self.recipe, &overrides)
    }
}

/// Parses the command line. Help and the version print as clap prints them; a parse error
/// becomes one line on stderr (the message, clap's tips, where to read more; the usage block is
/// left out) and exit code 2, as every other error.
impl Cli {
    /// Whether the command goes on when its standard output's reader goes away (`train … |
    /// head`): a training run, whose lines are in its run directory too, stops only on a stop
    /// signal, with a checkpoint; the other commands die quietly of SIGPIPE, as Unix tools do.
    pub fn outlives_its_reader(&self) -> bool {
        matches!(self.command, Command::Train(_) | Command::Launch(_))
    }
}

pub fn parse() -> Cli {
    match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let kind = e.kind();
            if matches!(
                kind,
                ErrorKind::DisplayHelp
                    | ErrorKind::DisplayVersion
                    | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
            ) {
                e.exit();
            }
            engine::say!("{}", one_line(&e.render().to_string(), kind));
            std::process::exit(2);
        }
    }
}

/// clap's error text as one line: its first paragraph with any list in it joined by commas,
/// then its other paragraphs (tips, "For more information, ...") in parentheses, without the
/// usage. For an unexpected argument that starts with `-`, a tip on giving an option such a
/// value (`--separator=---`), which clap's own tip (`-- ---`, for positional arguments) does not
/// cover.
fn one_line(text: &str, kind: ErrorKind) -> String {
    let mut paragraphs: Vec<String> = Vec::new();
    for block in text.split("\n\n") {
        let lines: Vec<&str> = block.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
        let Some((first, rest)) = lines.split_first() else { continue };
        if first.starts_with("Usage:") {
            continue;
        }
        let mut p = first.to_string();
        for (i, l) in rest.iter().enumerate() {
            p.push_str(if i == 0 && p.ends_with(':') { " " } else { ", " });
            p.push_str(l);
        }
        let p = p.trim_end_matches('.');
        // "For more information, ..." reads as a clause inside the parentheses.
        paragraphs.push(p.strip_prefix("For more").map_or(p.to_owned(), |rest| format!("for more{rest}")));
    }
    if kind == ErrorKind::UnknownArgument
        && let Some(arg) = paragraphs.first().and_then(|p| p.split('\'').nth(1))
        && looks_like_a_value(arg)
    {
        paragraphs.insert(
            1,
            format!(
                "tip: if '{arg}' is meant as the value of the option before it, join them with '=': --OPTION={arg}"
            ),
        );
    }
    match paragraphs.split_first() {
        Some((first, rest)) if !rest.is_empty() => format!("{first} ({})", rest.join("; ")),
        Some((first, _)) => first.clone(),
        None => "error: invalid command line (see --help)".into(),
    }
}

/// Whether an unexpected argument that starts with `-` looks like a value (`---`, `-5`, `-=-`)
/// rather than a mistyped option (`--stpes`, `-x`).
fn looks_like_a_value(arg: &str) -> bool {
    let name = arg.trim_start_matches('-');
    arg.starts_with('-')
        && (name.is_empty()
            || name.starts_with(|c: char| c.is_ascii_digit())
            || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_'))
}

/// Runs a parsed command line.
pub fn run(cli: Cli) -> Result<()> {
    let threads = match cli.threads {
        Some(n) => Some((n, "--threads")),
        None => match std::env::var("ENGINE_THREADS") {
            Ok(v) => Some((
                v.trim().parse().with_context(|| format!("ENGINE_THREADS = `{v}` is not a number"))?,
                "ENGINE_THREADS",
            )),
            Err(_) => None,
        },
    };
    if let Some((n, flag)) = threads {
        anyhow::ensure!(n > 0, "{flag} must be at least 1");
        // More threads than cores only add switching to every product (each is split into one
        // task per thread), and thousands take tens of seconds to start.
        let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
        anyhow::ensure!(
            n <= cores,
            "{flag} {n}: this process may use {cores} CPU cores, and more threads than cores only slow the CPU backend down; use at most {cores} (or leave it unset for all of them)"
        );
        rayon::ThreadPoolBuilder::new().num_threads(n).build_global().context("cannot start the thread pool")?;
    }
    let device = match cli.device {
        Some(d) => d,
        None => device::DeviceArg::from_env()?.unwrap_or_default(),
    };
    let trains = matches!(
        cli.command,
        Command::Train(_)
            | Command::Eval(_)
            | Command::Bench(_)
            | Command::Launch(_)
            | Command::GpuTest(_)
            | Command::TestAll(_)
            | Command::Baselines(_)
    );
    crate::TRAINS.store(trains, std::sync::atomic::Ordering::Relaxed);
    match cli.command {
        Command::Train(args) => train::run(args, device),
        Command::Data(cmd) => data::run(cmd),
        Command::ImportHf(args) => import_hf::run(args),
        Command::ExportHf(args) => export_hf::run(args),
        Command::Eval(args) => eval::run(args),
        Command::Recipes(cmd) => recipes::run(cmd),
        Command::Bench(args) => bench::run(args, device),
        Command::Goodput(args) => goodput::run(args),
        Command::Info => info::run(),
        Command::Launch(args) => launch::launch(args),
        Command::Dist(cmd) => launch::check(cmd),
        Command::Flight(args) => flight::run(args),
        Command::GpuTest(args) => gpu_test::run(args),
        Command::TestAll(args) => test_all::run(args, device),
        Command::Baselines(cmd) => test_all::baselines(cmd, device),
        Command::Plot(args) => plot::run(args),
    }
}

/// Writes the command's final error line: to standard error, or, in a process started by
/// `engine launch`, to the pipe it reads ([`launch::ERROR_FD`]), which prints the lines of its
/// processes once each, identical lines folded into one. Standard error when the descriptor
/// cannot be written.
pub fn report_error(line: &str) {
    let text = format!("{line}\n");
    if let Some(fd) = std::env::var(launch::ERROR_FD).ok().and_then(|v| v.parse::<i32>().ok()) {
        // SAFETY: writes a buffer this function owns; a descriptor that is not open fails (EBADF).
        let written = unsafe { libc::write(fd, text.as_ptr().cast(), text.len()) };
        if written == text.len() as isize {
            return;
        }
    }
    engine::say!("{line}");
}

/// Panics are bugs: report them in one line with where they happened, without a backtrace
/// unless RUST_BACKTRACE asks for one, and exit with 101 as Rust does. One is not a bug: a CUDA
/// call that failed while running ([`CudaFailure`]), which is one `error:` line with exit code 1,
/// the code of an operation that failed without its input being wrong.
///
/// The process ends from the hook, whichever thread panicked and whatever RUST_BACKTRACE says:
/// Rust's own handling would end only that thread, and a helper thread that dies (a collective's
/// reader, a checkpoint writer) leaves the others waiting for it, up to a collective's timeout.
pub fn install_panic_hook() {
    let default = std::panic::take_hook();
    let backtrace = std::env::var_os("RUST_BACKTRACE").is_some();
    std::panic::set_hook(Box::new(move |info| {
        let is_bug = !info.payload().is::<CudaFailure>();
        let (line, code) = panic_report(info.payload(), info.location());
        if backtrace && is_bug {
            // Rust's report: the message, the thread and the backtrace.
            default(info);
        } else {
            engine::say!("{line}");
        }
        std::process::exit(code);
    }));
}

/// The line and exit code for a panic with `payload`, raised at `place`.
fn panic_report(payload: &(dyn std::any::Any + Send), place: Option<&std::panic::Location>) -> (String, i32) {
    if let Some(failure) = payload.downcast_ref::<CudaFailure>() {
        return (format!("error: {failure}"), 1);
    }
    let message = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_default();
    let place = place.map(|l| format!(" at {}:{}", l.file(), l.line())).unwrap_or_default();
    (format!("internal error: {message}{place} (please report it; RUST_BACKTRACE=1 shows more)"), 101)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cuda_failure_is_one_error_line_with_exit_code_1_and_other_panics_are_bugs() {
        let failure: Box<dyn std::any::Any + Send> =
            Box::new(CudaFailure("CUDA error (the step): CUDA_ERROR_ILLEGAL_ADDRESS".into()));
        let (line, code) = panic_report(failure.as_ref(), None);
        assert_eq!(code, 1);
        assert!(line.starts_with("error: CUDA error (the step): CUDA_ERROR_ILLEGAL_ADDRESS; the GPU"), "{line}");
        assert!(!line.contains('\n'), "{line}");
        let bug: Box<dyn std::any::Any + Send> = Box::new(String::from("index out of bounds"));
        let (line, code) = panic_report(bug.as_ref(), None);
        assert_eq!(
            (line.as_str(), code),
            ("internal error: index out of bounds (please report it; RUST_BACKTRACE=1 shows more)", 101)
        );
    }
}
