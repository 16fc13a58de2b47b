//! The command line: clap structs (dumb), one function per command, output formats.

mod bars;
mod check;
mod collectives;
mod ep;
pub(crate) mod exit;
mod exploit;
mod external;
mod model;
mod route;
mod routes;
mod snapshot;
mod sweep;
#[cfg(test)]
mod synopsis;

use clap::{Args, Parser, Subcommand};
use moe_audit::config::presets;
use moe_audit::error::{Result, Setting};
use moe_audit::RunSizes;
use std::io::Write;

use check::{CheckArgs, ZooArgs};
use collectives::CollectivesArgs;
use ep::EpArgs;
use exploit::ExploitArgs;
use external::PlanArgs;
use route::RouteArgs;
use routes::RoutesArgs;
use snapshot::SnapshotArgs;
use sweep::SweepArgs;

/// Audit Mixture-of-Experts routers for train/inference causality leaks.
#[derive(Debug, Parser)]
#[command(name = "moe-audit", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// List the built-in router presets.
    Presets,
    /// Route seeded inputs (or given logits) and print the routing record and load summary.
    Route(RouteArgs),
    /// Audit routers for causality leaks (exit 0 no leak, 1 leak, 2 error).
    Check(CheckArgs),
    /// Audit every preset at default sizes and print the verdicts beside load balance.
    Zoo(ZooArgs),
    /// Write the inputs of an audit for a router that cannot run as a subprocess (trace files).
    Plan(PlanArgs),
    /// Run a seeded layer expert-parallel once: per-rank traffic against the all-to-all formula,
    /// and the output against the single-device layer.
    Ep(EpArgs),
    /// Load balance against causality over a grid of routers and sizes: CSV, JSON, charts.
    Sweep(SweepArgs),
    /// Snapshot a router's decisions on fixed inputs (train and inference) to a `.snap` file, or
    /// check one (exit 0 unchanged, 1 changed, 2 error).
    Snapshot(SnapshotArgs),
    /// Gradient-like payloads all-reduced with every algorithm × wire × accumulator precision
    /// against the exact sum: error, swamping, bias, traffic (exit 1 when a bias exceeds --max-bias).
    Collectives(CollectivesArgs),
    /// Train a tiny decoder through each router on i.i.d. tokens: does its training-mode loss go
    /// below the causal floor ln V? (exit 0 no, 1 yes, 2 error)
    Exploit(ExploitArgs),
    /// Rollout against trainer routing records: align, diagnose replay bugs, measure the
    /// disagreement (exit 0 ok, 1 a defect or over --max-disagreement, 2 bad input).
    Routes(RoutesArgs),
}

/// Runs a parsed command, writing its output to `out`. Returns the process exit code.
pub fn run(cli: Cli, out: &mut dyn Write) -> Result<u8> {
    match cli.command {
        Command::Presets => {
            for p in presets() {
                let config = p.config()?;
                writeln!(out, "{:<22} {}", p.name, config.description).map_err(io_error)?;
            }
            Ok(exit::OK)
        }
        Command::Route(args) => route::run(&args, out),
        Command::Check(args) => check::run(&args, out),
        Command::Zoo(args) => check::zoo(&args, out),
        Command::Plan(args) => external::run_plan(&args, out),
        Command::Ep(args) => ep::run(&args, out),
        Command::Sweep(args) => sweep::run(&args, out),
        Command::Snapshot(args) => snapshot::run(&args, out),
        Command::Collectives(args) => collectives::run(&args, out),
        Command::Exploit(args) => exploit::run(&args, out),
        Command::Routes(args) => routes::run(&args, out),
    }
}

/// The flag that sets `setting`.
pub fn flag(setting: Setting) -> &'static str {
    match setting {
        Setting::Batch => "--batch",
        Setting::SeqLen => "--seq-len",
        Setting::Hidden => "--hidden",
        Setting::Ffn => "--ffn",
        Setting::Trials => "--trials",
        Setting::Ranks => "--ranks",
        Setting::Probes => "--probes",
        Setting::Timeout => "--timeout",
        Setting::RouterCmd => "--router-cmd",
        Setting::MaxMemory => "--max-memory",
        Setting::Update => "--update",
        Setting::Traces => "--traces",
        Setting::Plan => "--plan",
        Setting::Logits => "--logits",
        Setting::HiddenStates => "--hidden-states",
        Setting::Vocab => "--vocab",
        Setting::Steps => "--steps",
        Setting::Seeds => "--seeds",
        Setting::Lr => "--lr",
        Setting::EvalBatches => "--eval-batches",
        Setting::CurvePoints => "--curve-points",
        Setting::ProbeBatches => "--probe-batches",
        Setting::MaxDisagreement => "--max-disagreement",
        Setting::MaxBias => "--max-bias",
        Setting::Mode => "--mode",
        Setting::Config => "--config",
        Setting::WitnessDir => "--witness-dir",
        Setting::Output => "--output",
    }
}

/// `--batch`, `--seq-len`, `--hidden`, `--ffn`: a seeded layer's call, declared once for `check`
/// and `ep`, with [`RunSizes`]' defaults.
#[derive(Debug, Args)]
pub struct SizeArgs {
    /// Sequences per call (split evenly over expert-parallel ranks).
    #[arg(long, default_value_t = RunSizes::default().batch)]
    pub batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = RunSizes::default().seq_len)]
    pub seq_len: usize,
    /// Hidden size of the seeded layer.
    #[arg(long, default_value_t = RunSizes::default().hidden)]
    pub hidden: usize,
    /// Expert FFN size of the seeded layer.
    #[arg(long, default_value_t = RunSizes::default().ffn)]
    pub ffn: usize,
}

impl SizeArgs {
    /// These sizes with `trials` and `ranks`, checked.
    pub fn validated(&self, trials: usize, ranks: usize) -> Result<RunSizes> {
        let sizes =
            RunSizes { batch: self.batch, seq_len: self.seq_len, hidden: self.hidden, ffn: self.ffn, trials, ranks };
        sizes.validate()?;
        Ok(sizes)
    }
}

/// `--max-memory`, declared once for every command.
#[derive(Debug, Args)]
pub struct MemoryArgs {
    /// Refuse to start a run estimated to need more memory (e.g. `4GiB`; default: half of
    /// physical memory).
    #[arg(long, value_name = "SIZE", value_parser = moe_audit::memory::parse_size, allow_hyphen_values = true)]
    pub max_memory: Option<bytesize::ByteSize>,
}

impl MemoryArgs {
    /// The budget in force.
    pub fn budget(&self) -> moe_audit::MemoryBudget {
        moe_audit::MemoryBudget::from_request(self.max_memory)
    }
}

pub(crate) fn io_error(e: std::io::Error) -> moe_audit::Error {
    moe_audit::Error::input("<stdout>", e.to_string())
}

/// A clap parser of one of `all` by its `name`, each value with its `about` as help (what
/// `#[derive(ValueEnum)]` gives a type of this crate, for the library's enums).
fn one_of<T: Copy + Send + Sync + 'static, const N: usize>(
    all: [T; N],
    name: fn(T) -> &'static str,
    about: fn(T) -> &'static str,
) -> impl clap::builder::TypedValueParser<Value = T> {
    use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
    PossibleValuesParser::new(all.map(|v| PossibleValue::new(name(v)).help(about(v))))
        .map(move |s| all.into_iter().find(|&v| name(v) == s).expect("clap checked the value"))
}

/// [`one_of`] the precisions of the collectives.
fn precision() -> impl clap::builder::TypedValueParser<Value = moe_audit::parallel::reduce::Precision> {
    use moe_audit::parallel::reduce::Precision;
    one_of(Precision::ALL, Precision::name, Precision::about)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn every_setting_has_its_own_flag() {
        let flags: std::collections::BTreeSet<_> = Setting::ALL.iter().map(|&s| flag(s)).collect();
        assert_eq!(flags.len(), Setting::ALL.len());
        assert!(flags.iter().all(|f| f.starts_with("--")));
    }
}
