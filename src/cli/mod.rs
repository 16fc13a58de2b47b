//! The command line: one subcommand per mode. Each command's clap struct stays dumb; its
//! `validated()` turns it, once, into the options its `run` takes (every rule clap cannot say,
//! sizes and memory arithmetic, files the flags name loaded), so `run` never sees a flag.

mod bars;
mod check;
mod collectives;
mod common;
mod engine;
mod ep;
pub(crate) mod exit;
mod exploit;
mod external;
mod model;
mod replay;
mod route;
mod routes;
mod snapshot;
mod sweep;
#[cfg(test)]
mod synopsis;

use clap::{Parser, Subcommand};
use moe_audit::config::presets;
use moe_audit::error::{Result, Setting};
use std::borrow::Cow;
use std::io::Write;

use check::{CheckArgs, ZooArgs};
use collectives::CollectivesArgs;
use engine::EngineArgs;
use ep::EpArgs;
use exploit::ExploitArgs;
use external::PlanArgs;
use model::ModelArgs;
use replay::ReplayArgs;
use route::RouteArgs;
use routes::RoutesArgs;
use snapshot::SnapshotArgs;
use sweep::SweepArgs;

/// Audit Mixture-of-Experts routers for train/inference causality leaks.
#[derive(Debug, Parser)]
#[command(name = "moe-audit", version, about)]
pub(crate) struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub(crate) command: Command,
}

/// The commands.
#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// List the built-in router presets.
    Presets,
    /// Route seeded inputs (or given logits) and print the routing record and load summary.
    Route(RouteArgs),
    /// Audit routers for causality leaks: presets, router TOML files (on a seeded layer or the
    /// gate of a checkpoint), router commands, trace directories (exit 0 no leak, 1 leak, 2 error).
    Check(CheckArgs),
    /// Replay a router's witness file: exit 1 while it still shows the leak, 0 when not.
    Replay(ReplayArgs),
    /// Audit a whole model on token ids, every MoE layer compared: the built-in decoder with a
    /// router, or a model of yours over moe-audit/3 (exit 0 no leak, 1 leak, 2 error).
    Model(ModelArgs),
    /// Audit every preset at default sizes and print the verdicts beside load balance.
    Zoo(ZooArgs),
    /// Write the inputs of an audit for a router that cannot run as a subprocess (trace files).
    Plan(PlanArgs),
    /// Run a seeded layer expert-parallel once: per-rank traffic against the all-to-all formula,
    /// and the output against the single-device layer.
    Ep(EpArgs),
    /// Load balance against causality over a grid of routers and sizes: CSV, JSON, charts.
    Sweep(SweepArgs),
    /// Snapshot a router's decisions on fixed inputs (train and inference) to a `.snap` file,
    /// check one (exit 0 unchanged, 1 changed, 2 error), update one, or plan one for a harness.
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
    /// A running vLLM or SGLang server: seeded requests of token ids, their routes compared
    /// alone and among batch-mates, cached and recomputed, decoded and prefilled (exit 0 every
    /// axis of --must-hold held, 1 one changed, 2 error).
    Engine(EngineArgs),
}

/// Runs a parsed command, writing its output to `out`. Returns the process exit code.
pub(crate) fn run(cli: Cli, out: &mut dyn Write) -> Result<u8> {
    match cli.command {
        Command::Presets => {
            for p in presets() {
                let config = p.config()?;
                writeln!(out, "{:<22} {}", p.name, config.description).map_err(io_error)?;
            }
            Ok(exit::OK)
        }
        Command::Route(args) => route::run(args.validated()?, out),
        Command::Check(args) => check::run(args.validated()?, out),
        Command::Replay(args) => replay::run(&args.validated()?, out),
        Command::Model(args) => model::run(args.validated()?, out),
        Command::Zoo(args) => check::zoo(args.validated()?, out),
        Command::Plan(args) => external::run_plan(&args.validated()?, out),
        Command::Ep(args) => ep::run(args.validated()?, out),
        Command::Sweep(args) => sweep::run(args.validated()?, out),
        Command::Snapshot(args) => snapshot::run(args.validated()?, out),
        Command::Collectives(args) => collectives::run(args.validated()?, out),
        Command::Exploit(args) => exploit::run(args.validated()?, out),
        Command::Routes(args) => routes::run(args.validated()?, out),
        Command::Engine(args) => engine::run(args.validated()?, out),
    }
}

/// How the command line names `setting` in what it prints (every message and report, through
/// [`error::with_names`](moe_audit::error::with_names)): the flag that sets it, `--max-memory`
/// for `max_memory`, or the subcommand that is the setting (`snapshot update`).
pub(crate) fn flag(setting: Setting) -> Cow<'static, str> {
    use moe_audit::settings::{PLAN, UPDATE};
    match setting {
        s if s == UPDATE => "snapshot update".into(),
        s if s == PLAN => "snapshot plan".into(),
        s => format!("--{}", s.name().replace('_', "-")).into(),
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
    fn every_setting_is_named_as_a_flag_or_subcommand_the_command_line_has() {
        let cli = Cli::command();
        let mut flags = std::collections::BTreeSet::new();
        let mut commands = std::collections::BTreeSet::new();
        let mut stack = vec![(String::new(), &cli)];
        while let Some((path, c)) = stack.pop() {
            flags.extend(c.get_arguments().filter_map(|a| a.get_long()).map(|l| format!("--{l}")));
            for sub in c.get_subcommands() {
                let name = format!("{path}{}", sub.get_name());
                commands.insert(name.clone());
                stack.push((format!("{name} "), sub));
            }
        }
        let all: Vec<Setting> = moe_audit::settings::all().collect();
        let named: std::collections::BTreeSet<_> = all.iter().map(|&s| flag(s)).collect();
        assert_eq!(named.len(), all.len(), "two settings share a flag");
        for s in all {
            let f = flag(s);
            assert!(
                flags.contains(f.as_ref()) || commands.contains(f.as_ref()),
                "{f} (setting `{}`) is no flag",
                s.name()
            );
        }
    }
}
