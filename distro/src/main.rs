use clap::Parser;

/// Builds reproducible, dated, multi-arch OCI images of the engine.
#[derive(Parser)]
#[command(name = "distro", version)]
struct Cli {}

fn main() {
    Cli::parse();
}
