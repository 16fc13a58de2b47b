//! `moe-audit check` (the CI gate: routers, built-in or outside moe-audit) and `moe-audit zoo`
//! (every preset at default sizes).

use super::bars::AuditBar;
use super::common::{AuditArgs, CommKind, FailOn, MemoryArgs, ReportArgs, SizeArgs};
use super::exit;
use super::external::ExternalArgs;
use super::io_error;
use clap::{ArgGroup, Args, ValueEnum};
use moe_audit::analyze::{Audit, AuditOptions, Probe, Report};
use moe_audit::check::{Check, Target};
use moe_audit::config::presets;
#[cfg(feature = "mpi")]
use moe_audit::error::Error;
use moe_audit::error::Result;
use moe_audit::parallel::{split_batch, Communicator};
use moe_audit::render::{
    json, render_github, render_junit, render_markdown, render_text, render_zoo, witness_path, write_witnesses,
};
use moe_audit::MemoryBudget;
use moe_audit::RunSizes;
use std::io::Write;
use std::path::PathBuf;

/// Arguments of `moe-audit check`.
#[derive(Debug, Args)]
#[command(group(ArgGroup::new("subjects").args(["routers", "router_cmd", "traces"]).required(true).multiple(true)))]
pub(crate) struct CheckArgs {
    /// Preset names or router TOML files.
    pub(crate) routers: Vec<String>,
    // Probes to run: the help lists the registry's (`analyze/probe/mod.rs`).
    #[arg(long, help = Probe::help(Audit::Router), default_value_t = Probe::default_list(), help_heading = "Audit")]
    pub(crate) probes: String,
    /// Sizes of the seeded layer's calls.
    #[command(flatten, next_help_heading = "Audit")]
    pub(crate) sizes: SizeArgs,
    /// Trials, seed, and the verdicts that fail the check.
    #[command(flatten, next_help_heading = "Audit")]
    pub(crate) audit: AuditArgs,
    /// Route every prefix in P (time quadratic in --seq-len) instead of searching them; the
    /// verdicts and witnesses are the same, the counts cover every prefix.
    #[arg(long, help_heading = "Audit")]
    pub(crate) exhaustive: bool,
    /// Report format.
    #[arg(long, value_enum, default_value_t = CheckFormat::Text, help_heading = "Output")]
    pub(crate) format: CheckFormat,
    /// Where the report and its witnesses go.
    #[command(flatten, next_help_heading = "Output")]
    pub(crate) report: ReportArgs,
    /// The memory limit.
    #[command(flatten)]
    pub(crate) memory: MemoryArgs,
    /// Also print GitHub Actions `::error::` annotations, one per leak, on stdout.
    #[arg(long, help_heading = "Output")]
    pub(crate) github: bool,
    /// Routers outside moe-audit.
    #[command(flatten)]
    pub(crate) external: ExternalArgs,
    /// Expert-parallel ranks of the layout probe (L), which runs the layer on them [default: 2;
    /// with --comm mpi, the MPI world size].
    #[arg(long, help_heading = "Parallel")]
    pub(crate) ranks: Option<usize>,
    /// How the ranks communicate: threads of this process, or MPI, one rank per process under
    /// `mpirun -np R` (rank 0 prints the report; needs a build with `--features mpi`).
    #[arg(long, value_enum, default_value_t = CommKind::InProcess, help_heading = "Parallel")]
    pub(crate) comm: CommKind,
}

/// Report formats of `check`.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum CheckFormat {
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

/// A validated `check`: what to audit, how, and where the report goes.
#[derive(Debug)]
pub(crate) struct CheckOptions {
    /// The targets and the audit's options (the plan's, for traces).
    check: Check,
    /// `--ranks` as given (MPI checks it against the world size).
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    ranks: Option<usize>,
    comm: CommKind,
    budget: MemoryBudget,
    fail_on: FailOn,
    format: CheckFormat,
    output: Option<PathBuf>,
    witness_dir: Option<PathBuf>,
    github: bool,
}

impl CheckArgs {
    /// Every rule on the flags that clap cannot say, in one place: the audit's options, then the
    /// targets (the configs loaded), then the check they make (the plan's options for traces).
    pub(crate) fn validated(&self) -> Result<CheckOptions> {
        let budget = self.memory.budget();
        let (options, layer) = self.audit_options()?;
        let targets = self.external.targets(&self.routers, layer, &options.probes)?;
        Ok(CheckOptions {
            check: Check::new(targets, options, budget)?,
            ranks: self.ranks,
            comm: self.comm,
            budget,
            fail_on: self.audit.fail_on,
            format: self.format,
            output: self.report.output.clone(),
            witness_dir: self.report.witness_dir.clone(),
            github: self.github,
        })
    }

    /// The audit's options, and the seeded layer's hidden and FFN sizes.
    fn audit_options(&self) -> Result<(AuditOptions, (usize, usize))> {
        let ranks = self.ranks.unwrap_or(RunSizes::default().ranks);
        let sizes = self.sizes.validated(self.audit.trials, ranks)?;
        if self.ranks.is_some() {
            split_batch(sizes.batch, ranks)?;
        }
        let options = AuditOptions {
            probes: Probe::parse_list(&self.probes)?,
            batch: sizes.batch,
            seq_len: sizes.seq_len,
            trials: sizes.trials,
            seed: self.audit.seed,
            ranks,
            exhaustive: self.exhaustive,
        };
        Ok((options, (sizes.hidden, sizes.ffn)))
    }
}

pub(super) fn run(check: CheckOptions, out: &mut dyn Write) -> Result<u8> {
    match check.comm {
        CommKind::InProcess => audit_and_report(check, out, None),
        CommKind::Mpi => run_mpi(check, out),
    }
}

/// Every MPI rank audits alike (the layout probe's layer run is collective); rank 0 reports. A
/// failing rank aborts every rank with its error and exit code 2.
#[cfg(feature = "mpi")]
fn run_mpi(check: CheckOptions, out: &mut dyn Write) -> Result<u8> {
    let comm = moe_audit::parallel::mpi::MpiComm::init()?;
    let size = comm.size();
    let result = match check.ranks {
        Some(r) if r != size => {
            Err(Error::usage(format!("--ranks {r} differs from the MPI world size {size} (mpirun -np)")))
        }
        _ => audit_and_report(check, out, Some(&comm)),
    };
    result.or_else(|e| comm.abort(&e))
}

#[cfg(not(feature = "mpi"))]
fn run_mpi(_: CheckOptions, _: &mut dyn Write) -> Result<u8> {
    Err(super::common::no_mpi())
}

fn audit_and_report(check: CheckOptions, out: &mut dyn Write, comm: Option<&dyn Communicator>) -> Result<u8> {
    let bar = AuditBar::stderr(check.check.probe_runs());
    let report = check.check.run(check.budget, comm, &bar);
    bar.finish();
    let mut report = report?;
    name_exhaustive(&mut report);
    if comm.is_some_and(|c| c.rank() != 0) {
        return Ok(exit::failed_if(check.fail_on.fails(&report)));
    }
    // The witnesses and the report file are one set, renamed into place together.
    let mut staged = moe_audit::files::Staged::new();
    if let Some(dir) = &check.witness_dir {
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
    let text = match check.format {
        CheckFormat::Text => render_text(&report, &|router, probe| {
            let dir = check.witness_dir.as_ref()?;
            has_witness(router, probe).then(|| witness_path(dir, router, probe).display().to_string())
        }),
        CheckFormat::Json => json(&report),
        CheckFormat::Markdown => render_markdown(&report),
        CheckFormat::Junit => render_junit(&report),
        CheckFormat::Html => moe_audit::render::check_html(&report),
    };
    match &check.output {
        Some(path) => staged.write(path, text.as_bytes())?,
        None => out.write_all(text.as_bytes()).map_err(io_error)?,
    }
    staged.commit()?;
    if check.github {
        out.write_all(render_github(&report).as_bytes()).map_err(io_error)?;
    }
    Ok(exit::failed_if(check.fail_on.fails(&report)))
}

/// A prefix probe that searched its prefixes says which flag routes them all (the library's
/// note names no flag).
fn name_exhaustive(report: &mut Report) {
    for f in report.routers.iter_mut().flat_map(|r| r.findings.iter_mut()).filter(|f| f.searched) {
        f.note.push_str(" (--exhaustive routes all)");
    }
}

/// Arguments of `moe-audit zoo`.
#[derive(Debug, Args)]
pub(crate) struct ZooArgs {
    // Probes to run, one column each: the help lists the registry's, as `check`'s does.
    #[arg(long, help = Probe::help(Audit::Router), default_value_t = Probe::default_list())]
    pub(crate) probes: String,
    /// Seed of the layers, the inputs and every random choice.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
}

impl ZooArgs {
    /// The audit's options: the defaults, with these probes and this seed.
    pub(crate) fn validated(&self) -> Result<AuditOptions> {
        Ok(AuditOptions { probes: Probe::parse_list(&self.probes)?, seed: self.seed, ..AuditOptions::default() })
    }
}

pub(super) fn zoo(options: AuditOptions, out: &mut dyn Write) -> Result<u8> {
    let configs = presets().iter().map(|p| p.config()).collect::<Result<Vec<_>>>()?;
    let sizes = RunSizes::default();
    let targets = vec![Target::Configs { configs, hidden: sizes.hidden, ffn: sizes.ffn }];
    let budget = MemoryBudget::from_request(None);
    let check = Check::new(targets, options, budget)?;
    let bar = AuditBar::stderr(check.probe_runs());
    let report = check.run(budget, None, &bar);
    bar.finish();
    out.write_all(render_zoo(&report?).as_bytes()).map_err(io_error)?;
    Ok(exit::OK)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn the_default_probes_are_probe_all() {
        let cli = crate::cli::Cli::parse_from(["moe-audit", "check", "mixtral"]);
        let crate::cli::Command::Check(args) = cli.command else { panic!("not check") };
        assert_eq!(Probe::parse_list(&args.probes).unwrap(), Probe::DEFAULT.to_vec());
    }
}
