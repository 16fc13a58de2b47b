//! The command line: clap structs (dumb), one function per command, output formats.

mod check;
mod collectives;
mod ep;
mod exploit;
mod external;
mod model;
mod route;
mod routes;
mod snapshot;
mod sweep;

use crate::config::presets;
use crate::error::{Result, Setting};
use clap::{Parser, Subcommand};
use std::io::Write;

pub use check::{verdicts, CheckArgs, CommKind, ZooArgs};
pub use collectives::{CollectivesArgs, CollectivesFormat};
pub use ep::{EpArgs, EpFormat};
pub use exploit::{ExploitArgs, ExploitFormat};
pub use external::{ExternalArgs, PlanArgs};
pub use model::ModelArgs;
pub use route::RouteArgs;
pub use routes::RoutesArgs;
pub use snapshot::SnapshotArgs;
pub use sweep::SweepArgs;

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
            Ok(0)
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

/// An error as the command line says it: each setting the library names (`` setting `max_memory` ``)
/// written as its flag (`--max-memory`).
pub fn message(e: &crate::Error) -> String {
    Setting::ALL.iter().fold(e.to_string(), |text, &s| text.replace(&s.to_string(), flag(s)))
}

/// The flag that sets `setting`.
fn flag(setting: Setting) -> &'static str {
    match setting {
        Setting::Batch => "--batch",
        Setting::SeqLen => "--seq-len",
        Setting::Hidden => "--hidden",
        Setting::Ffn => "--ffn",
        Setting::Trials => "--trials",
        Setting::Ranks => "--ranks",
        Setting::Probes => "--probes",
        Setting::Timeout => "--timeout",
        Setting::MaxMemory => "--max-memory",
        Setting::Update => "--update",
        Setting::Traces => "--traces",
        Setting::Plan => "--plan",
        Setting::Logits => "--logits",
        Setting::HiddenStates => "--hidden-states",
    }
}

pub(crate) fn io_error(e: std::io::Error) -> crate::Error {
    crate::Error::input("<stdout>", e.to_string())
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
    fn library_errors_name_settings_and_the_cli_names_flags() {
        let e = crate::error::ensure_positive(&[(Setting::Batch, 2), (Setting::SeqLen, 0)]).unwrap_err();
        assert_eq!(e.to_string(), "setting `seq_len` must be at least 1");
        assert_eq!(message(&e), "--seq-len must be at least 1");
        // Field names that merely look like settings stay as they are.
        let e = crate::Error::Usage("unknown field `seq_len`".into());
        assert_eq!(message(&e), "unknown field `seq_len`");
        // Every setting has its own flag.
        let flags: std::collections::BTreeSet<_> = Setting::ALL.iter().map(|&s| flag(s)).collect();
        assert_eq!(flags.len(), Setting::ALL.len());
    }
}
