//! The `check` flags for routers outside moe-audit (a subprocess, trace files, a real gate),
//! and `moe-audit plan`.

use super::bars::AuditBar;
use super::exit;
use super::MemoryArgs;
use clap::Args;
use moe_audit::analyze::{audit, AuditOptions, Probe, RouterReport, Subject};
use moe_audit::config::RouterConfig;
use moe_audit::error::{ensure_positive, Error, Result, Setting};
use moe_audit::external::{plan, planned_options, ExternalRouter, Handshake, InputKind, Mode, TraceRouter};
use moe_audit::layer::gate::GateSource;
use moe_audit::router::Router;
use moe_audit::MemoryBudget;
use std::io::Write;
use std::path::{Path, PathBuf};

/// `--router-cmd` and `--timeout`: routers run as subprocesses, declared once for `check` and
/// `snapshot`.
#[derive(Debug, Args)]
#[command(next_help_heading = "External routers")]
pub struct RouterCmdArgs {
    /// A command speaking the moe-audit/1 or /2 protocol on stdin/stdout (docs/PROTOCOL.md), run
    /// with `sh -c`; `check` takes it repeated, for several routers.
    #[arg(long, value_name = "COMMAND")]
    pub router_cmd: Vec<String>,
    /// Seconds to wait for a router's handshake and for each answer.
    #[arg(long, default_value_t = 60.0, value_name = "SECS", allow_hyphen_values = true)]
    pub timeout: f64,
}

impl RouterCmdArgs {
    /// The timeout as a duration, checked.
    pub fn timeout(&self) -> Result<std::time::Duration> {
        moe_audit::external::process::timeout(self.timeout)
    }
}

/// Routers that live outside moe-audit.
#[derive(Debug, Args)]
pub struct ExternalArgs {
    /// A router run as a subprocess.
    #[command(flatten)]
    pub cmd: RouterCmdArgs,
    /// The mode --router-cmd routers are audited in: every probe's requests carry it (M compares
    /// it with the other mode); `inference` audits the serving path.
    #[arg(long, value_enum, default_value_t = ModeArg::Train, help_heading = "External routers")]
    pub mode: ModeArg,
    /// A trace directory (`moe-audit plan`, answered by your harness); the audit runs with the
    /// plan's probes and sizes.
    #[arg(long, value_name = "DIR", help_heading = "External routers")]
    pub traces: Option<PathBuf>,
    /// A safetensors checkpoint holding the gate of the routers named on the command line.
    #[arg(long, value_name = "FILE.safetensors", requires = "gate", help_heading = "External routers")]
    pub weights: Option<PathBuf>,
    /// The gate matrix `[experts, hidden]` in --weights.
    #[arg(long, value_name = "TENSOR", requires = "weights", help_heading = "External routers")]
    pub gate: Option<String>,
    /// A selection-only expert bias `[experts]` in --weights (DeepSeek-V3
    /// `e_score_correction_bias`); replaces the config's `expert_bias`.
    #[arg(long, value_name = "TENSOR", requires = "gate", help_heading = "External routers")]
    pub bias: Option<String>,
    /// Real hidden states `[..., hidden]` to sample the audit's tokens from, with --weights
    /// (`FILE.safetensors` holding one tensor, or `FILE.safetensors:TENSOR`); default: seeded
    /// standard normal.
    #[arg(long, value_name = "FILE[:TENSOR]", requires = "gate", help_heading = "External routers")]
    pub hidden_states: Option<String>,
}

impl ExternalArgs {
    /// Whether the configs named on the command line take their gate from --weights.
    pub(super) fn real_gate(&self) -> bool {
        self.weights.is_some()
    }

    /// The audit options: the plan's when auditing traces (from its manifest; the traces
    /// themselves are read once, by the audit).
    pub(super) fn options(&self, options: AuditOptions, budget: MemoryBudget) -> Result<AuditOptions> {
        self.cmd.timeout()?;
        if self.mode != ModeArg::Train && self.cmd.router_cmd.is_empty() {
            return Err(Error::Usage(
                "--mode sets the mode of --router-cmd routers; built-in routers and traces have their own".into(),
            ));
        }
        if self.traces.is_some() && !self.cmd.router_cmd.is_empty() {
            return Err(Error::Usage(
                "--traces replays one planned audit; audit --router-cmd routers in another run".into(),
            ));
        }
        match &self.traces {
            Some(dir) => planned_options(dir, budget),
            None => Ok(options),
        }
    }

    /// Audits the configs on a real gate, the router commands and the traces.
    pub(super) fn audit(
        &self,
        configs: Vec<RouterConfig>,
        options: &AuditOptions,
        budget: MemoryBudget,
    ) -> Result<Vec<RouterReport>> {
        let mut reports = Vec::new();
        // Routers without a layer; their routes per token are unknown before they answer, so
        // the estimate counts one.
        let audit_router = |router: &dyn Router| -> Result<RouterReport> {
            let estimate = options.memory_estimate(router.row_width(), 1, 0, 0);
            budget.ensure_fits(&format!("the audit of `{}`", router.name()), estimate)?;
            let bar = AuditBar::stderr(options.probes.len());
            let report = audit(&Subject { router, layer: None }, options, &bar);
            bar.finish();
            report
        };
        if self.weights.is_some() && configs.is_empty() {
            return Err(Error::Usage(
                "--weights: name the routers (presets or TOML files) to audit on the gate".into(),
            ));
        }
        if let (Some(weights), Some(gate)) = (&self.weights, &self.gate) {
            let hidden_states = self.hidden_states.as_deref().map(|spec| match spec.rsplit_once(':') {
                Some((file, tensor)) if !Path::new(spec).is_file() => (Path::new(file), Some(tensor)),
                _ => (Path::new(spec), None),
            });
            let source = GateSource { weights, gate, bias: self.bias.as_deref(), hidden_states, budget };
            for config in configs {
                let router = source.router(config)?;
                reports.push(audit_router(&router)?);
            }
        }
        for command in &self.cmd.router_cmd {
            let timeout = self.cmd.timeout()?;
            let router = ExternalRouter::spawn(command, timeout, options.seed, self.mode.into(), budget)?;
            reports.push(audit_router(&router)?);
        }
        if let Some(dir) = &self.traces {
            let router = TraceRouter::open(dir, budget)?;
            reports.push(audit_router(&router)?);
        }
        Ok(reports)
    }
}

/// `--mode` of `check`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ModeArg {
    /// Training mode (the default).
    Train,
    /// Serving mode.
    Inference,
}

impl From<ModeArg> for Mode {
    fn from(m: ModeArg) -> Mode {
        match m {
            ModeArg::Train => Mode::Train,
            ModeArg::Inference => Mode::Inference,
        }
    }
}

/// Arguments of `moe-audit plan`.
#[derive(Debug, Args)]
pub struct PlanArgs {
    /// Where to write `manifest.json` and `inputs.safetensors`.
    #[arg(long, value_name = "DIR")]
    pub output: PathBuf,
    /// The router's name in the report.
    #[arg(long, default_value = "traced")]
    pub name: String,
    /// Number of experts E.
    #[arg(long)]
    pub experts: usize,
    /// Experts per token (omit for expert choice).
    #[arg(long)]
    pub top_k: Option<usize>,
    /// What the harness feeds its router: E logits or H hidden values per token.
    #[arg(long, value_enum, default_value_t = InputArg::Logits)]
    pub input: InputArg,
    /// Hidden size H (with --input hidden).
    #[arg(long)]
    pub hidden_size: Option<usize>,
    /// Probes to plan, comma separated.
    #[arg(long, default_value_t = Probe::default_list())]
    pub probes: String,
    /// Sequences per call.
    #[arg(long, default_value_t = 4)]
    pub batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 128)]
    pub seq_len: usize,
    /// Trials of the randomised probes.
    #[arg(long, default_value_t = 32)]
    pub trials: usize,
    /// Seed of the inputs and every random choice.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// The memory limit.
    #[command(flatten)]
    pub memory: MemoryArgs,
}

/// `--input` of `plan`.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum InputArg {
    /// E gate logits per token.
    Logits,
    /// H hidden values per token.
    Hidden,
}

pub(super) fn run_plan(args: &PlanArgs, out: &mut dyn Write) -> Result<u8> {
    let input = match args.input {
        InputArg::Logits => InputKind::Logits,
        InputArg::Hidden => InputKind::Hidden,
    };
    let router = Handshake {
        protocol: moe_audit::external::protocol::PROTOCOL.into(),
        name: args.name.clone(),
        experts: args.experts,
        top_k: args.top_k,
        input,
        hidden_size: args.hidden_size,
        responses: None,
        padding_mask: false,
        seed_calls: None,
    };
    // Each flag named in its own words (the handshake's checks would blame the handshake).
    ensure_positive(&[(Setting::Batch, args.batch), (Setting::SeqLen, args.seq_len), (Setting::Trials, args.trials)])?;
    let max = moe_audit::external::protocol::MAX_SIZE;
    if !(1..=max).contains(&args.experts) {
        return Err(Error::Usage(format!("--experts must be from 1 to {max}, got {}", args.experts)));
    }
    if let Some(k) = args.top_k.filter(|&k| k == 0 || k > args.experts) {
        return Err(Error::Usage(format!("--top-k must be from 1 to {} (--experts), got {k}", args.experts)));
    }
    match (input, args.hidden_size) {
        (InputKind::Hidden, h) if !(1..=max).contains(&h.unwrap_or(0)) => {
            return Err(Error::Usage(format!("--input hidden needs --hidden-size from 1 to {max}")));
        }
        _ => {}
    }
    moe_audit::names::check(&args.name).map_err(|m| Error::Usage(format!("--name {m}")))?;
    let options = AuditOptions {
        probes: Probe::parse_list(&args.probes)?,
        batch: args.batch,
        seq_len: args.seq_len,
        trials: args.trials,
        seed: args.seed,
        ..AuditOptions::default()
    };
    let calls = plan(&router, &options, &args.output, args.memory.budget())?;
    writeln!(
        out,
        "planned {calls} calls in {}: answer each call of manifest.json, in order, with one response line in decisions.jsonl, then run `moe-audit check --traces {}`",
        args.output.display(),
        args.output.display()
    )
    .map_err(super::io_error)?;
    Ok(exit::OK)
}
