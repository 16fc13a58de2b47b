//! `moe-audit model`: whole-model audits on token ids (the built-in decoder, or a model over
//! `moe-audit/3`), and the replay of their witnesses.

use super::common::{AuditArgs, FailOn, MemoryArgs, ReportArgs, SizeArgs, TimeoutArgs};
use super::exit;
use super::io_error;
use clap::{ArgGroup, Args, ValueEnum};
use moe_audit::analyze::{Audit, Probe};
use moe_audit::config::RouterConfig;
use moe_audit::error::{Error, Result};
use moe_audit::model::audit::{replay, TokenWitness};
use moe_audit::model::{audit_model, Builtin, BuiltinSpec, Model, ModelAuditOptions, ModelProcess, ModelReport};
use moe_audit::render::{render_model_replay, render_model_text};
use moe_audit::MemoryBudget;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Arguments of `moe-audit model`.
#[derive(Debug, Args)]
#[command(group(ArgGroup::new("model").args(["router", "cmd"]).required(true)))]
pub(crate) struct ModelArgs {
    /// Audit the built-in decoder (token embeddings, --layers × (causal attention + FFN), layer
    /// 0 dense and the others MoE with this router: a preset name or a router TOML file).
    #[arg(value_name = "ROUTER")]
    pub(crate) router: Option<String>,
    /// Audit a model in a command speaking moe-audit/3 on stdin/stdout (docs/PROTOCOL.md), run
    /// with `sh -c`.
    #[arg(long = "model-cmd", alias = "cmd", value_name = "COMMAND", help_heading = "Model")]
    pub(crate) cmd: Option<String>,
    /// How long the model command may take.
    #[command(flatten, next_help_heading = "Model")]
    pub(crate) timeout: TimeoutArgs,
    /// Decoder layers of the built-in model (layer 0 dense).
    #[arg(long, default_value_t = 4, conflicts_with = "cmd", help_heading = "Model")]
    pub(crate) layers: usize,
    /// Vocabulary of the built-in model.
    #[arg(long, default_value_t = 256, conflicts_with = "cmd", help_heading = "Model")]
    pub(crate) vocab: usize,
    /// A layer of the built-in model whose attention sees later tokens (a deliberate bug the
    /// audit must catch).
    #[arg(long, value_name = "LAYER", conflicts_with = "cmd", help_heading = "Model")]
    pub(crate) non_causal: Option<usize>,
    // Probes to run: the help lists the registry's (`analyze/probe/mod.rs`).
    #[arg(long, help = Probe::help(Audit::Model), default_value_t = default_probes(), help_heading = "Audit")]
    pub(crate) probes: String,
    /// Sizes of the audit's calls (and of the built-in model).
    #[command(flatten, next_help_heading = "Audit")]
    pub(crate) sizes: SizeArgs,
    /// Trials, seed, and the verdicts that fail the audit.
    #[command(flatten, next_help_heading = "Audit")]
    pub(crate) audit: AuditArgs,
    /// Positions the generation probe (G) prefills before feeding one token at a time
    /// [default: half of --seq-len].
    #[arg(long, help_heading = "Audit")]
    pub(crate) prefill: Option<usize>,
    /// Report format.
    #[arg(long, value_enum, default_value_t = ModelFormat::Text, help_heading = "Output")]
    pub(crate) format: ModelFormat,
    /// Where the report and its witnesses go.
    #[command(flatten, next_help_heading = "Output")]
    pub(crate) report: ReportArgs,
    /// Replay a witness of this model instead of auditing it: exit 1 while the token still
    /// changes, 0 when not.
    #[arg(long, value_name = "WITNESS.json", conflicts_with_all = ["probes", "prefill", "trials", "format", "output", "witness_dir"], help_heading = "Output")]
    pub(crate) replay: Option<PathBuf>,
    /// The memory limit.
    #[command(flatten)]
    pub(crate) memory: MemoryArgs,
}

fn default_probes() -> String {
    Probe::MODEL.iter().map(Probe::to_string).collect::<Vec<_>>().join(",")
}

/// Report formats of `model`.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum ModelFormat {
    /// One row per layer × probe, for a terminal.
    Text,
    /// The whole report.
    Json,
    /// One self-contained page: heatmaps of where routing changed, drift, generation (docs/HTML.md).
    Html,
}

/// A validated `model`: which model, and what to do with it.
#[derive(Debug)]
pub(crate) struct ModelOptions {
    source: Source,
    /// The largest call of the audit (R pads a quarter of the sequence on), checked against the
    /// memory limit once the built-in model exists.
    largest_call: (usize, usize),
    action: Action,
    fail_on: FailOn,
    budget: MemoryBudget,
}

/// Where the model comes from.
#[derive(Debug)]
enum Source {
    Builtin(Box<BuiltinSpec>),
    Command { command: String, timeout: Duration },
}

/// An audit, or the replay of a witness.
#[derive(Debug)]
enum Action {
    Audit { options: ModelAuditOptions, format: ModelFormat, output: Option<PathBuf>, witness_dir: Option<PathBuf> },
    Replay(PathBuf),
}

impl ModelArgs {
    /// Every rule on the flags that clap cannot say, in one place; loads the router.
    pub(crate) fn validated(&self) -> Result<ModelOptions> {
        let (batch, seq_len) = (self.sizes.batch, self.sizes.seq_len);
        let source = match (&self.cmd, &self.router) {
            (Some(command), _) => Source::Command { command: command.clone(), timeout: self.timeout.validated()? },
            (None, Some(router)) => Source::Builtin(Box::new(BuiltinSpec {
                router: RouterConfig::load(router)?,
                layers: self.layers,
                vocab: self.vocab,
                hidden: self.sizes.hidden,
                ffn: self.sizes.ffn,
                seed: self.audit.seed,
                non_causal: self.non_causal,
            })),
            (None, None) => unreachable!("clap requires ROUTER or --model-cmd"),
        };
        let action = match &self.replay {
            Some(path) => Action::Replay(path.clone()),
            None => Action::Audit {
                options: ModelAuditOptions {
                    probes: Probe::parse_list_for(&self.probes, Audit::Model)?,
                    batch,
                    seq_len,
                    trials: self.audit.trials,
                    seed: self.audit.seed,
                    prefill: self.prefill.unwrap_or(seq_len / 2),
                },
                format: self.format,
                output: self.report.output.clone(),
                witness_dir: self.report.witness_dir.clone(),
            },
        };
        Ok(ModelOptions {
            source,
            largest_call: moe_audit::model::audit::largest_call(batch, seq_len),
            action,
            fail_on: self.audit.fail_on,
            budget: self.memory.budget(),
        })
    }
}

/// Audits the model, or replays a witness on it.
pub(super) fn run(m: ModelOptions, out: &mut dyn Write) -> Result<u8> {
    let model = open(m.source, m.largest_call, m.budget)?;
    let (options, format, output, witness_dir) = match m.action {
        Action::Replay(path) => return replay_witness(model.as_ref(), &path, m.budget, m.fail_on, out),
        Action::Audit { options, format, output, witness_dir } => (options, format, output, witness_dir),
    };
    let report = audit_model(model.as_ref(), &options)?;
    let text = match format {
        ModelFormat::Text => render_model_text(&report),
        ModelFormat::Json => serde_json::to_string_pretty(&report).expect("a report always serialises") + "\n",
        ModelFormat::Html => moe_audit::render::model_html(&report),
    };
    let mut staged = moe_audit::files::Staged::new();
    if let Some(dir) = &witness_dir {
        write_witnesses(&report, dir, &mut staged)?;
    }
    match &output {
        Some(path) => staged.write(path, text.as_bytes())?,
        None => out.write_all(text.as_bytes()).map_err(io_error)?,
    }
    staged.commit()?;
    Ok(exit::failed_if(report.findings.iter().any(|f| m.fail_on.counts(f.verdict))))
}

/// The model, the built-in one checked to fit in memory at the audit's largest call.
fn open(source: Source, (batch, seq_len): (usize, usize), budget: MemoryBudget) -> Result<Box<dyn Model>> {
    match source {
        Source::Command { command, timeout } => Ok(Box::new(ModelProcess::spawn(&command, timeout, budget)?)),
        Source::Builtin(spec) => {
            let model = Builtin::new(*spec)?;
            budget.ensure_fits(
                &format!("the audit of model `{}`", model.info().name),
                model.call_bytes(batch, seq_len),
            )?;
            Ok(Box::new(model))
        }
    }
}

/// One witness file per leaking probe: `<model>-<probe letter>.json`.
fn write_witnesses(report: &ModelReport, dir: &Path, staged: &mut moe_audit::files::Staged) -> Result<()> {
    moe_audit::files::create_dir(dir)?;
    for w in report.findings.iter().filter_map(|f| f.witness.as_ref()) {
        let path = dir.join(format!("{}-{:?}.json", moe_audit::names::file_stem(&w.model), w.probe));
        staged
            .write(&path, (serde_json::to_string_pretty(w).expect("a witness always serialises") + "\n").as_bytes())?;
    }
    Ok(())
}

/// Replays a model witness: exit 1 when the token still shows a verdict of `--fail-on`, 0 when not.
fn replay_witness(
    model: &dyn Model,
    path: &Path,
    budget: MemoryBudget,
    fail_on: FailOn,
    out: &mut dyn Write,
) -> Result<u8> {
    let text = moe_audit::files::read_text(path, budget.text(), "a witness")?;
    let w: TokenWitness = serde_json::from_str(&text).map_err(|e| Error::parse(path, "not a model witness", e))?;
    let verdict = replay(model, &w)?;
    let line = render_model_replay(&w, verdict);
    out.write_all(line.as_bytes()).map_err(io_error)?;
    Ok(exit::failed_if(fail_on.counts(verdict)))
}
