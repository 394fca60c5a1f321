//! `engine recipes list|show`.

use anyhow::Result;
use clap::Subcommand;
use engine::config::{Config, Remat, recipe};
use engine::model::Model;
use engine::model::memory::{self, Target};

use super::RecipeArgs;

#[derive(Subcommand)]
pub enum RecipesCommand {
    /// List the built-in recipes with their sizes.
    List,
    /// Show a recipe resolved (defaults, `extends`, overrides), its parameter count and
    /// training FLOPs per token.
    Show {
        /// Recipe name or TOML file.
        #[arg(value_name = "NAME|FILE")]
        recipe: String,
        /// Override a key (repeatable).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
    },
}

pub fn run(cmd: RecipesCommand) -> Result<()> {
    match cmd {
        RecipesCommand::List => {
            println!("{:<16} {:>16}  description", "recipe", "parameters");
            for (name, _) in recipe::builtin() {
                let r = engine::config::resolve(name, &[])?;
                let count = r.config.model.param_count();
                println!("{name:<16} {:>16}  {}", group(count.total), r.config.description);
            }
            Ok(())
        }
        RecipesCommand::Show { recipe, set } => {
            let r = RecipeArgs { recipe, set }.resolve(&[])?;
            print!("{}", show(&r.name, &r.config));
            Ok(())
        }
    }
}

/// The text of `engine recipes show`.
fn show(name: &str, c: &Config) -> String {
    let m = &c.model;
    let count = m.param_count();
    let seq = c.train.seq_len;
    let flops = m.train_flops_per_token(seq);
    let mut out = format!("# recipe {name}: {}\n", c.description);
    out += &toml::to_string(c).expect("a config serialises");
    out += "\n# size\n";
    out += &format!("parameters         {:>20}  ({:.2} B)\n", group(count.total), count.total as f64 / 1e9);
    if m.moe.is_some() {
        out += &format!("active per token   {:>20}  ({:.2} B)\n", group(count.active), count.active as f64 / 1e9);
    }
    out += &format!("embedding          {:>20}\n", group(count.embedding));
    out += &format!(
        "training FLOPs/token at seq_len {seq}: {:.4e}  (6 x {} matmul parameters + attention {:.4e})\n",
        flops,
        group(((flops - attention_flops(c)) / 6.0).round() as u64),
        attention_flops(c)
    );
    out += &format!(
        "tokens per step    {:>20}  (batch {} x seq {} x grad_accum {})\n",
        group((c.train.batch_size * seq * c.train.grad_accum) as u64),
        c.train.batch_size,
        seq,
        c.train.grad_accum
    );
    out += &memory_table(c);
    out += "\nFLOP convention: a multiply-add is 2 FLOPs and training costs 3 forward passes, so a token costs\n\
            6 x (weights it multiplies with: projections, routed experts, output head; not the input lookup)\n\
            + 12 x layers x heads x head_dim x K, K = mean keys a query attends to. Causal halving is applied:\n\
            K = (seq_len + 1) / 2 under the causal mask, min(i + 1, window) per query with a sliding window.\n";
    out
}

/// Estimated memory per device for the recipe's batch shape, on CUDA (bf16 activations, f32
/// master weights) and CPU (f32), and under each recomputation policy.
fn memory_table(c: &Config) -> String {
    let (batch, seq) = (c.train.batch_size, c.train.seq_len);
    let gib = |b: usize| format!("{:.2} GiB", engine::backend::gib(b));
    let mut model = Model::new(&c.model);
    model.remat = c.train.remat;
    let gpu = memory::estimate(&model, batch, seq, Target::Cuda { sm_count: 132 });
    let cpu = memory::estimate(&model, batch, seq, Target::Cpu);
    let mut out = format!(
        "\n# memory per device, micro-batch {batch} x {seq}, remat = {} (estimate; CUDA adds its context, ~0.5 GiB)\n",
        remat_name(c.train.remat)
    );
    out += &format!("{:<28} {:>14} {:>14}\n", "", "cuda (bf16)", "cpu (f32)");
    for (name, g, p) in [
        ("parameters", gpu.parameters, cpu.parameters),
        ("gradients", gpu.gradients, cpu.gradients),
        ("AdamW moments", gpu.optimizer, cpu.optimizer),
        ("activations", gpu.activations, cpu.activations),
        ("backend scratch", gpu.scratch, cpu.scratch),
        ("total", gpu.total(), cpu.total()),
    ] {
        out += &format!("{name:<28} {:>14} {:>14}\n", gib(g), gib(p));
    }
    for remat in [Remat::None, Remat::Minimal, Remat::Full] {
        model.remat = remat;
        let g = memory::estimate(&model, batch, seq, Target::Cuda { sm_count: 132 });
        out += &format!("{:<28} {:>14}\n", format!("total with remat = {}", remat_name(remat)), gib(g.total()));
    }
    out
}

fn remat_name(r: Remat) -> &'static str {
    match r {
        Remat::None => "none",
        Remat::Minimal => "minimal",
        Remat::Full => "full",
    }
}

fn attention_flops(c: &Config) -> f64 {
    let m = &c.model;
    12.0 * (m.n_layers * m.n_heads * m.head_dim) as f64 * m.mean_keys_attended(c.train.seq_len)
}

pub use engine::config::count::group;
