//! `engine recipes list|show`.

use anyhow::Result;
use clap::Subcommand;
use engine::config::{Config, recipe};

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
    out += "\nFLOP convention: a multiply-add is 2 FLOPs and training costs 3 forward passes, so a token costs\n\
            6 x (weights it multiplies with: projections, routed experts, output head; not the input lookup)\n\
            + 12 x layers x heads x head_dim x K, K = mean keys a query attends to. Causal halving is applied:\n\
            K = (seq_len + 1) / 2 under the causal mask, min(i + 1, window) per query with a sliding window.\n";
    out
}

fn attention_flops(c: &Config) -> f64 {
    let m = &c.model;
    12.0 * (m.n_layers * m.n_heads * m.head_dim) as f64 * m.mean_keys_attended(c.train.seq_len)
}

pub use engine::config::count::group;
