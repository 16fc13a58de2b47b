//! `moe-audit check` (the CI gate) and `moe-audit zoo` (every preset at default sizes).

use super::bars::AuditBar;
use super::exit;
use super::external::ExternalArgs;
use super::{io_error, MemoryArgs, SizeArgs};
use clap::{Args, ValueEnum};
use moe_audit::analyze::{audit_configs, AuditOptions, Probe, Report, RouterReport, Witness};
use moe_audit::config::{presets, RouterConfig};
use moe_audit::error::{Error, Result};
use moe_audit::parallel::{split_batch, Communicator};
use moe_audit::render::{
    json, render_github, render_junit, render_markdown, render_replay, render_text, render_zoo, witness_path,
    write_witnesses,
};
use moe_audit::MemoryBudget;
use moe_audit::RunSizes;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Arguments of `moe-audit check`.
#[derive(Debug, Args)]
pub struct CheckArgs {
    /// Preset names or router TOML files.
    #[arg(required_unless_present_any = ["replay", "router_cmd", "traces", "model", "model_cmd"], conflicts_with = "replay")]
    pub routers: Vec<String>,
    /// Replay a witness file: exit 1 if it still shows the leak, 0 if not (a witness of an
    /// external router replays against `--router-cmd`).
    #[arg(long, value_name = "WITNESS.json")]
    pub replay: Option<PathBuf>,
    /// Probes to run, comma separated: P prefix, F future, N neighbour, R re-batch, D repeat,
    /// S replay, M mode, L layout; X numerics (bf16/f16 routing flips, accumulator swamping) is
    /// opt-in.
    #[arg(long, default_value_t = Probe::default_list(), help_heading = "Audit")]
    pub probes: String,
    /// Sizes of the seeded layer's calls.
    #[command(flatten, next_help_heading = "Audit")]
    pub sizes: SizeArgs,
    /// Trials of the randomised probes.
    #[arg(long, default_value_t = RunSizes::default().trials, help_heading = "Audit")]
    pub trials: usize,
    /// Seed of the layer, the inputs and every random choice.
    #[arg(long, default_value_t = 0, help_heading = "Audit")]
    pub seed: u64,
    /// Verdicts that make the check exit 1, comma separated: `leak` (a causality leak or a
    /// broken invariant), `drift` (probe X: routing in bf16 or f16 differs from f32).
    #[arg(long, value_name = "VERDICTS", default_value = "leak", value_parser = FailOn::parse, help_heading = "Audit")]
    pub fail_on: FailOn,
    /// Route every prefix in P (time quadratic in --seq-len) instead of searching them; the
    /// verdicts and witnesses are the same, the counts cover every prefix.
    #[arg(long, help_heading = "Audit")]
    pub exhaustive: bool,
    /// Report format.
    #[arg(long, value_enum, default_value_t = CheckFormat::Text, help_heading = "Output")]
    pub format: CheckFormat,
    /// Write the report here instead of stdout.
    #[arg(long, value_name = "FILE", help_heading = "Output")]
    pub output: Option<PathBuf>,
    /// Write one witness file per leak here (`<router>-<probe>.json`).
    #[arg(long, value_name = "DIR", help_heading = "Output")]
    pub witness_dir: Option<PathBuf>,
    /// The memory limit.
    #[command(flatten)]
    pub memory: MemoryArgs,
    /// Also print GitHub Actions `::error::` annotations, one per leak, on stdout.
    #[arg(long, help_heading = "Output")]
    pub github: bool,
    /// Routers outside moe-audit.
    #[command(flatten)]
    pub external: ExternalArgs,
    /// Whole models on token ids.
    #[command(flatten)]
    pub model: super::model::ModelArgs,
    /// Expert-parallel ranks of the layout probe (L), which runs the layer on them [default: 2;
    /// with --comm mpi, the MPI world size].
    #[arg(long, help_heading = "Parallel")]
    pub ranks: Option<usize>,
    /// How the ranks communicate: threads of this process, or MPI, one rank per process under
    /// `mpirun -np R` (rank 0 prints the report; needs a build with `--features mpi`).
    #[arg(long, value_enum, default_value_t = CommKind::InProcess, help_heading = "Parallel")]
    pub comm: CommKind,
}

/// Communicators of `check --comm`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CommKind {
    /// In-process ranks (threads).
    #[value(name = "inproc")]
    InProcess,
    /// MPI ranks (one per process).
    Mpi,
}

/// Report formats of `check`.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum CheckFormat {
    /// One row per router × probe, for a terminal.
    Text,
    /// The whole report.
    Json,
    /// A table for a CI step summary.
    Markdown,
    /// JUnit XML: one test case per router × probe.
    Junit,
    /// One self-contained HTML page (with --output FILE): verdicts, witnesses, load balance.
    Html,
}

impl CheckArgs {
    fn options(&self) -> Result<AuditOptions> {
        let ranks = self.ranks.unwrap_or(RunSizes::default().ranks);
        let sizes = self.sizes.validated(self.trials, ranks)?;
        if self.ranks.is_some() {
            split_batch(sizes.batch, ranks)?;
        }
        Ok(AuditOptions {
            probes: Probe::parse_list(&self.probes)?,
            batch: sizes.batch,
            seq_len: sizes.seq_len,
            trials: sizes.trials,
            seed: self.seed,
            ranks,
            exhaustive: self.exhaustive,
        })
    }
}

/// `analyze::audit_configs` with a progress bar on a terminal.
fn audit_all(
    configs: Vec<RouterConfig>,
    options: &AuditOptions,
    sizes: (usize, usize),
    budget: MemoryBudget,
    comm: Option<&dyn Communicator>,
) -> Result<Report> {
    let bar = AuditBar::stderr(configs.len() * options.probes.len());
    let report = audit_configs(configs, options, sizes, budget, comm, &bar);
    bar.finish();
    report
}

pub(super) fn run(args: &CheckArgs, out: &mut dyn Write) -> Result<u8> {
    if let Some(code) = super::model::run(args, out)? {
        return Ok(code);
    }
    if let Some(path) = &args.replay {
        return replay(args, path, args.memory.budget(), out);
    }
    match args.comm {
        CommKind::InProcess => audit_and_report(args, out, None),
        CommKind::Mpi => run_mpi(args, out),
    }
}

/// Every MPI rank audits alike (the layout probe's layer run is collective); rank 0 reports. A
/// failing rank aborts every rank with its error and exit code 2.
#[cfg(feature = "mpi")]
fn run_mpi(args: &CheckArgs, out: &mut dyn Write) -> Result<u8> {
    let comm = moe_audit::parallel::mpi::MpiComm::init()?;
    let size = comm.size();
    let result = match args.ranks {
        Some(r) if r != size => {
            Err(Error::Usage(format!("--ranks {r} differs from the MPI world size {size} (mpirun -np)")))
        }
        _ => audit_and_report(args, out, Some(&comm)),
    };
    result.or_else(|e| comm.abort(&e))
}

#[cfg(not(feature = "mpi"))]
fn run_mpi(_: &CheckArgs, _: &mut dyn Write) -> Result<u8> {
    Err(no_mpi())
}

#[cfg(not(feature = "mpi"))]
pub(super) fn no_mpi() -> Error {
    Error::Usage("--comm mpi: this moe-audit was built without MPI (cargo build --features mpi)".into())
}

fn audit_and_report(args: &CheckArgs, out: &mut dyn Write, comm: Option<&dyn Communicator>) -> Result<u8> {
    let budget = args.memory.budget();
    let mut options = args.external.options(args.options()?, budget)?;
    if let Some(comm) = comm {
        options.ranks = comm.size();
        split_batch(options.batch, comm.size())?;
    }
    let configs = args.routers.iter().map(|r| RouterConfig::load(r)).collect::<Result<Vec<_>>>()?;
    moe_audit::names::check_unique(configs.iter().map(|c| c.name.as_str())).map_err(Error::Usage)?;
    let mut report = if args.external.real_gate() {
        Report { options: options.clone(), routers: Vec::new() }
    } else {
        audit_all(configs.clone(), &options, (args.sizes.hidden, args.sizes.ffn), budget, comm)?
    };
    report.routers.extend(args.external.audit(configs, &options, budget)?);
    name_exhaustive(&mut report);
    // Routers named in their handshake or manifest too, before any file is written.
    moe_audit::names::check_unique(report.routers.iter().map(|r| r.router.as_str())).map_err(Error::Usage)?;
    if comm.is_some_and(|c| c.rank() != 0) {
        return Ok(exit::failed_if(args.fail_on.fails(&report)));
    }
    // The witnesses and the report file are one set, renamed into place together.
    let mut staged = moe_audit::files::Staged::new();
    if let Some(dir) = &args.witness_dir {
        write_witnesses(&report, dir, &mut staged)?;
    }
    let has_witness = |router: &str, probe: Probe| {
        report
            .routers
            .iter()
            .find(|r| r.router == router)
            .and_then(|r| r.finding(probe))
            .is_some_and(|f| f.witness.is_some())
    };
    let text = match args.format {
        CheckFormat::Text => render_text(&report, &|router, probe| {
            let dir = args.witness_dir.as_ref()?;
            has_witness(router, probe).then(|| witness_path(dir, router, probe).display().to_string())
        }),
        CheckFormat::Json => json(&report),
        CheckFormat::Markdown => render_markdown(&report),
        CheckFormat::Junit => render_junit(&report),
        CheckFormat::Html => moe_audit::render::check_html(&report),
    };
    match &args.output {
        Some(path) => staged.write(path, text.as_bytes())?,
        None => out.write_all(text.as_bytes()).map_err(io_error)?,
    }
    staged.commit()?;
    if args.github {
        out.write_all(render_github(&report).as_bytes()).map_err(io_error)?;
    }
    Ok(exit::failed_if(args.fail_on.fails(&report)))
}

/// Which verdicts fail a check (`--fail-on`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FailOn {
    /// A causality leak, a broken invariant, or a verdict a random router made inconclusive.
    pub leak: bool,
    /// Precision drift (probe X).
    pub drift: bool,
}

impl FailOn {
    fn parse(list: &str) -> std::result::Result<FailOn, String> {
        let mut on = FailOn { leak: false, drift: false };
        for word in list.split(',').map(str::trim) {
            match word {
                "leak" => on.leak = true,
                "drift" => on.drift = true,
                _ => return Err(format!("unknown verdict `{word}`: expected a comma-separated list of leak, drift")),
            }
        }
        Ok(on)
    }

    /// Whether `report` has a verdict that fails.
    pub fn fails(self, report: &Report) -> bool {
        (self.leak && report.fails()) || (self.drift && report.routers.iter().any(RouterReport::drifts))
    }
}

/// A prefix probe that searched its prefixes says which flag routes them all (the library's
/// note names no flag).
fn name_exhaustive(report: &mut Report) {
    for f in report.routers.iter_mut().flat_map(|r| r.findings.iter_mut()).filter(|f| f.searched) {
        f.note.push_str(" (--exhaustive routes all)");
    }
}

/// Replays a witness from its file, or, with `--router-cmd`, against the live router.
fn replay(args: &CheckArgs, path: &Path, budget: MemoryBudget, out: &mut dyn Write) -> Result<u8> {
    let witness = Witness::read_within(path, budget)?;
    let replay = match args.external.cmd.router_cmd.as_slice() {
        [] => witness.replay(path)?,
        [command] => {
            let timeout = args.external.cmd.timeout()?;
            let router = moe_audit::external::ExternalRouter::spawn(
                command,
                timeout,
                args.seed,
                args.external.mode.into(),
                budget,
            )?;
            witness.replay_on(path, &router)?
        }
        _ => return Err(Error::Usage("--replay takes one --router-cmd".into())),
    };
    let text = render_replay(&replay);
    out.write_all(text.as_bytes()).map_err(io_error)?;
    // An X witness is drift: it fails as the audit that wrote it did, under `--fail-on drift`.
    let fails = if replay.witness.probe == Probe::X { args.fail_on.drift } else { args.fail_on.leak };
    Ok(exit::failed_if(replay.reproduces() && fails))
}

/// Arguments of `moe-audit zoo`.
#[derive(Debug, Args)]
pub struct ZooArgs {
    /// Seed of the layers, the inputs and every random choice.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

pub(super) fn zoo(args: &ZooArgs, out: &mut dyn Write) -> Result<u8> {
    let options = AuditOptions { seed: args.seed, ..AuditOptions::default() };
    let configs = presets().iter().map(|p| p.config()).collect::<Result<Vec<_>>>()?;
    let sizes = RunSizes::default();
    let report = audit_all(configs, &options, (sizes.hidden, sizes.ffn), MemoryBudget::from_request(None), None)?;
    out.write_all(render_zoo(&report).as_bytes()).map_err(io_error)?;
    Ok(exit::OK)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn fail_on_takes_a_list_of_verdicts() {
        assert_eq!(FailOn::parse("leak"), Ok(FailOn { leak: true, drift: false }));
        assert_eq!(FailOn::parse("leak, drift"), Ok(FailOn { leak: true, drift: true }));
        assert_eq!(FailOn::parse("drift"), Ok(FailOn { leak: false, drift: true }));
        assert!(FailOn::parse("leaks").unwrap_err().contains("unknown verdict `leaks`"));
        assert!(FailOn::parse("").is_err());
    }

    #[test]
    fn the_default_probes_are_probe_all() {
        let cli = crate::cli::Cli::parse_from(["moe-audit", "check", "mixtral"]);
        let crate::cli::Command::Check(args) = cli.command else { panic!("not check") };
        assert_eq!(Probe::parse_list(&args.probes).unwrap(), Probe::ALL.to_vec());
    }
}
