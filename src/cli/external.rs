//! The flags of `check`'s routers that live outside moe-audit (subprocesses, trace files, a real
//! gate), turned into [`Target`]s, and `moe-audit plan`, which writes the inputs of an audit for a harness to answer.

use super::common::{mode_parser, InputArg, MemoryArgs, TimeoutArgs};
use super::exit;
use clap::Args;
use moe_audit::analyze::{AuditOptions, Probe};
use moe_audit::check::{CheckpointGate, RouterCommand, Target};
use moe_audit::config::RouterConfig;
use moe_audit::error::{ensure_positive, Error, Result};
use moe_audit::external::{plan, Handshake, InputKind, Mode};
use moe_audit::settings::{BATCH, SEQ_LEN, TRIALS};
use moe_audit::MemoryBudget;
use moe_audit::RunSizes;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The `check` flags of routers outside moe-audit.
#[derive(Debug, Args)]
#[command(next_help_heading = "External routers")]
pub(crate) struct ExternalArgs {
    /// A command speaking the moe-audit/1 or /2 protocol on stdin/stdout (docs/PROTOCOL.md), run
    /// with `sh -c`; repeat it for several routers.
    #[arg(long, value_name = "COMMAND")]
    pub(crate) router_cmd: Vec<String>,
    /// Another launch of the --router-cmd layer at another expert-parallel size (the same
    /// script at `--nproc_per_node 1` or 4), spawned like it; the layout probe (L) compares its
    /// answer to the base call token by token. Repeat it for several sizes.
    #[arg(long, value_name = "COMMAND", requires = "router_cmd")]
    pub(crate) layout_cmd: Vec<String>,
    /// How long a router command may take.
    #[command(flatten)]
    pub(crate) timeout: TimeoutArgs,
    /// The mode --router-cmd routers are audited in: every probe's requests carry it (M compares
    /// it with the other mode); `inference` audits the serving path.
    #[arg(long, value_parser = mode_parser(), default_value = "train", requires = "router_cmd")]
    pub(crate) mode: Mode,
    /// A trace directory (`moe-audit plan`, answered by your harness); the audit runs with the
    /// plan's probes and sizes.
    #[arg(long, value_name = "DIR", conflicts_with = "router_cmd")]
    pub(crate) traces: Option<PathBuf>,
    /// A safetensors checkpoint holding the gate of the routers named on the command line.
    #[arg(long, value_name = "FILE.safetensors", requires_all = ["gate", "routers"])]
    pub(crate) weights: Option<PathBuf>,
    /// The gate matrix `[experts, hidden]` in --weights.
    #[arg(long, value_name = "TENSOR", requires = "weights")]
    pub(crate) gate: Option<String>,
    /// A selection-only expert bias `[experts]` in --weights (DeepSeek-V3
    /// `e_score_correction_bias`); replaces the config's `expert_bias`.
    #[arg(long, value_name = "TENSOR", requires = "gate")]
    pub(crate) bias: Option<String>,
    /// Real hidden states `[..., hidden]` to sample the audit's tokens from, with --weights
    /// (`FILE.safetensors` holding one tensor, or `FILE.safetensors:TENSOR`); default: seeded
    /// standard normal.
    #[arg(long, value_name = "FILE[:TENSOR]", requires = "gate")]
    pub(crate) hidden_states: Option<String>,
}

impl ExternalArgs {
    /// These flags checked (clap has checked which go together) and turned into targets, after
    /// the `routers` named on the command line, loaded (on the gate of --weights when given, else
    /// on a seeded layer of `layer`); `probes` are the audit's.
    pub(crate) fn targets(&self, routers: &[String], layer: (usize, usize), probes: &[Probe]) -> Result<Vec<Target>> {
        let timeout = self.timeout.validated()?;
        if !self.layout_cmd.is_empty() {
            if self.router_cmd.len() != 1 {
                return Err(Error::usage(format!(
                    "--layout-cmd launches the layer of one --router-cmd again, got {} --router-cmd",
                    self.router_cmd.len()
                )));
            }
            if !probes.contains(&Probe::L) {
                return Err(Error::usage("--layout-cmd feeds the layout probe L, which --probes leaves out"));
            }
        }
        let configs = routers.iter().map(|r| RouterConfig::load(r)).collect::<Result<Vec<_>>>()?;
        let mut targets = Vec::new();
        match (&self.weights, &self.gate) {
            (Some(weights), Some(gate)) => targets.push(Target::Gate {
                configs,
                gate: CheckpointGate {
                    weights: weights.clone(),
                    gate: gate.clone(),
                    bias: self.bias.clone(),
                    // `FILE:TENSOR`, unless the whole spec names a file.
                    hidden_states: self.hidden_states.as_deref().map(|spec| match spec.rsplit_once(':') {
                        Some((file, tensor)) if !Path::new(spec).is_file() => (file.into(), Some(tensor.to_string())),
                        _ => (spec.into(), None),
                    }),
                },
            }),
            _ if !configs.is_empty() => targets.push(Target::Configs { configs, hidden: layer.0, ffn: layer.1 }),
            _ => {}
        }
        for command in &self.router_cmd {
            targets.push(Target::Command(RouterCommand {
                command: command.clone(),
                layouts: self.layout_cmd.clone(),
                timeout,
                mode: self.mode,
            }));
        }
        targets.extend(self.traces.clone().map(Target::Traces));
        Ok(targets)
    }
}

/// Arguments of `moe-audit plan`.
#[derive(Debug, Args)]
pub(crate) struct PlanArgs {
    /// Where to write `manifest.json` and `inputs.safetensors`.
    #[arg(long = "output-dir", alias = "output", value_name = "DIR")]
    pub(crate) output: PathBuf,
    /// The router's name in the report.
    #[arg(long, default_value = "traced")]
    pub(crate) name: String,
    /// Number of experts E.
    #[arg(long)]
    pub(crate) experts: usize,
    /// Experts per token (omit for expert choice).
    #[arg(long)]
    pub(crate) top_k: Option<usize>,
    /// What the harness feeds its router: E logits or H hidden values per token.
    #[arg(long, value_enum, default_value_t = InputArg::Logits)]
    pub(crate) input: InputArg,
    /// Hidden size H (with --input hidden).
    #[arg(long = "hidden", alias = "hidden-size", value_name = "H")]
    pub(crate) hidden_size: Option<usize>,
    /// Probes to plan, comma separated.
    #[arg(long, default_value_t = Probe::default_list())]
    pub(crate) probes: String,
    /// Sequences per call.
    #[arg(long, default_value_t = RunSizes::default().batch)]
    pub(crate) batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = RunSizes::default().seq_len)]
    pub(crate) seq_len: usize,
    /// Trials of the randomised probes.
    #[arg(long, default_value_t = RunSizes::default().trials)]
    pub(crate) trials: usize,
    /// Seed of the inputs and every random choice.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// The memory limit.
    #[command(flatten)]
    pub(crate) memory: MemoryArgs,
}

/// A validated `plan`: the handshake of the router to plan for and the audit's options.
#[derive(Debug)]
pub(crate) struct PlanOptions {
    router: Handshake,
    options: AuditOptions,
    output: PathBuf,
    budget: MemoryBudget,
}

impl PlanArgs {
    /// Every rule on the flags in one place.
    pub(crate) fn validated(&self) -> Result<PlanOptions> {
        let input: InputKind = self.input.into();
        let router = Handshake {
            protocol: moe_audit::external::protocol::PROTOCOL.into(),
            name: self.name.clone(),
            experts: self.experts,
            top_k: self.top_k,
            input,
            hidden_size: self.hidden_size,
            responses: None,
            padding_mask: false,
            seed_calls: None,
            ranks: None,
            output: None,
            weights: None,
        };
        // Each flag named in its own words (the handshake's checks would blame the handshake).
        ensure_positive(&[(BATCH, self.batch), (SEQ_LEN, self.seq_len), (TRIALS, self.trials)])?;
        let max = moe_audit::external::protocol::MAX_SIZE;
        if !(1..=max).contains(&self.experts) {
            return Err(Error::usage(format!("--experts must be from 1 to {max}, got {}", self.experts)));
        }
        if let Some(k) = self.top_k.filter(|&k| k == 0 || k > self.experts) {
            return Err(Error::usage(format!("--top-k must be from 1 to {} (--experts), got {k}", self.experts)));
        }
        self.input.check_hidden(self.hidden_size)?;
        if input == InputKind::Hidden && !(1..=max).contains(&self.hidden_size.unwrap_or(0)) {
            return Err(Error::usage(format!("--input hidden needs --hidden from 1 to {max}")));
        }
        moe_audit::names::check(&self.name).map_err(|m| Error::usage(format!("--name {m}")))?;
        let options = AuditOptions {
            probes: Probe::parse_list(&self.probes)?,
            batch: self.batch,
            seq_len: self.seq_len,
            trials: self.trials,
            seed: self.seed,
            ..AuditOptions::default()
        };
        Ok(PlanOptions { router, options, output: self.output.clone(), budget: self.memory.budget() })
    }
}

pub(super) fn run_plan(planned: &PlanOptions, out: &mut dyn Write) -> Result<u8> {
    let calls = plan(&planned.router, &planned.options, &planned.output, planned.budget)?;
    writeln!(
        out,
        "planned {calls} calls in {}: answer each call of manifest.json, in order, with one response line in decisions.jsonl, then run `moe-audit check --traces {}`",
        planned.output.display(),
        planned.output.display()
    )
    .map_err(super::io_error)?;
    Ok(exit::OK)
}
