//! `check --model` and `check --model-cmd`: whole-model audits on token ids (the built-in
//! decoder, or a model over `moe-audit/3`), and the replay of their witnesses.

use super::check::{CheckArgs, CheckFormat};
use super::exit;
use super::io_error;
use clap::Args;
use moe_audit::analyze::Probe;
use moe_audit::config::RouterConfig;
use moe_audit::error::{Error, Result};
use moe_audit::model::audit::{replay, TokenWitness};
use moe_audit::model::{
    audit_model, Builtin, BuiltinSpec, Model, ModelAuditOptions, ModelProcess, ModelReport, TokenProbe,
};
use moe_audit::render::render_model_text;
use moe_audit::MemoryBudget;
use std::io::Write;
use std::path::Path;

/// Whole models: token ids in, every MoE layer compared.
#[derive(Debug, Args)]
pub struct ModelArgs {
    /// Audit the built-in decoder (token embeddings, --layers × (causal attention + FFN), layer
    /// 0 dense and the others MoE with this router: a preset name or a router TOML file).
    #[arg(long, value_name = "ROUTER", conflicts_with = "model_cmd", help_heading = "Whole models")]
    pub model: Option<String>,
    /// Audit a model in a command speaking moe-audit/3 on stdin/stdout (docs/PROTOCOL.md), run
    /// with `sh -c`.
    #[arg(long, value_name = "COMMAND", help_heading = "Whole models")]
    pub model_cmd: Option<String>,
    /// Decoder layers of the built-in model (layer 0 dense).
    #[arg(long, default_value_t = 4, requires = "model", help_heading = "Whole models")]
    pub layers: usize,
    /// Vocabulary of the built-in model.
    #[arg(long, default_value_t = 256, requires = "model", help_heading = "Whole models")]
    pub vocab: usize,
    /// A layer of the built-in model whose attention sees later tokens (a deliberate bug the
    /// audit must catch).
    #[arg(long, value_name = "LAYER", requires = "model", help_heading = "Whole models")]
    pub non_causal: Option<usize>,
    /// Positions the generation probe (G) prefills before feeding one token at a time
    /// [default: half of --seq-len].
    #[arg(long, help_heading = "Whole models")]
    pub prefill: Option<usize>,
}

impl ModelArgs {
    fn selected(&self) -> bool {
        self.model.is_some() || self.model_cmd.is_some()
    }
}

/// Runs `check` on a model when `--model` or `--model-cmd` selects one; `None` otherwise.
pub(super) fn run(args: &CheckArgs, out: &mut dyn Write) -> Result<Option<u8>> {
    let m = &args.model;
    if !m.selected() {
        return Ok(None);
    }
    if !args.routers.is_empty() || !args.external.cmd.router_cmd.is_empty() || args.external.traces.is_some() {
        return Err(Error::Usage("--model and --model-cmd audit one model: name no router beside it".into()));
    }
    let router_only = [
        ("--exhaustive", args.exhaustive),
        ("--ranks", args.ranks.is_some()),
        ("--comm", args.comm != super::check::CommKind::InProcess),
        ("--github", args.github),
        ("--mode", args.external.mode != super::external::ModeArg::Train),
        ("--weights", args.external.weights.is_some()),
    ];
    if let Some((flag, _)) = router_only.iter().find(|(_, set)| *set) {
        return Err(Error::Usage(format!("{flag} applies to routers, not to --model or --model-cmd")));
    }
    let budget = args.memory.budget();
    let model = open(args, budget)?;
    if let Some(path) = &args.replay {
        return replay_witness(model.as_ref(), path, budget, args, out).map(Some);
    }
    // The single-layer default list names L, which has no meaning here: the default is every
    // token probe.
    let probes = match args.probes == Probe::default_list() {
        true => TokenProbe::ALL.to_vec(),
        false => TokenProbe::parse_list(&args.probes)?,
    };
    let options = ModelAuditOptions {
        probes,
        batch: args.sizes.batch,
        seq_len: args.sizes.seq_len,
        trials: args.trials,
        seed: args.seed,
        prefill: m.prefill.unwrap_or(args.sizes.seq_len / 2),
    };
    let report = audit_model(model.as_ref(), &options)?;
    let text = match args.format {
        CheckFormat::Text => render_model_text(&report),
        CheckFormat::Json => serde_json::to_string_pretty(&report).expect("a report always serialises") + "\n",
        CheckFormat::Html => moe_audit::render::model_html(&report),
        other => {
            let name = format!("{other:?}").to_lowercase();
            return Err(Error::Usage(format!("--format {name} is not written for whole models: text, json or html")));
        }
    };
    let mut staged = moe_audit::files::Staged::new();
    if let Some(dir) = &args.witness_dir {
        write_witnesses(&report, dir, &mut staged)?;
    }
    match &args.output {
        Some(path) => staged.write(path, text.as_bytes())?,
        None => out.write_all(text.as_bytes()).map_err(io_error)?,
    }
    staged.commit()?;
    let fails = (args.fail_on.leak && report.leaks()) || (args.fail_on.drift && report.drifts());
    Ok(Some(exit::failed_if(fails)))
}

/// The model the flags name, checked to fit in memory at the audit's sizes.
fn open(args: &CheckArgs, budget: MemoryBudget) -> Result<Box<dyn Model>> {
    let m = &args.model;
    if let Some(command) = &m.model_cmd {
        let timeout = moe_audit::external::process::timeout(args.external.cmd.timeout)?;
        return Ok(Box::new(ModelProcess::spawn(command, timeout, budget)?));
    }
    let router = RouterConfig::load(m.model.as_deref().expect("selected"))?;
    let spec = BuiltinSpec {
        router,
        layers: m.layers,
        vocab: m.vocab,
        hidden: args.sizes.hidden,
        ffn: args.sizes.ffn,
        seed: args.seed,
        non_causal: m.non_causal,
    };
    let model = Builtin::new(spec)?;
    // R pads a quarter of the sequence on.
    let estimate = model.call_bytes(args.sizes.batch, args.sizes.seq_len + args.sizes.seq_len / 4 + 1);
    budget.ensure_fits(&format!("the audit of model `{}`", model.info().name), estimate)?;
    Ok(Box::new(model))
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

/// Replays a model witness: exit 1 when the token still changes, 0 when not.
fn replay_witness(
    model: &dyn Model,
    path: &Path,
    budget: MemoryBudget,
    args: &CheckArgs,
    out: &mut dyn Write,
) -> Result<u8> {
    let text = moe_audit::files::read_text(path, budget.text(), "a witness")?;
    let w: TokenWitness = serde_json::from_str(&text).map_err(|e| Error::parse(path, "not a model witness", e))?;
    let still = replay(model, &w)?;
    let at = w.layer.map_or("its output row".to_string(), |l| format!("layer {l}"));
    let verdict = if still { "LEAK reproduced" } else { "no longer leaks" };
    let line = format!(
        "{} {:?} {}: sequence {}, position {} at {at}: {verdict}\n",
        w.model,
        w.probe,
        w.probe.name(),
        w.token_a.0,
        w.token_a.1
    );
    out.write_all(line.as_bytes()).map_err(io_error)?;
    Ok(exit::failed_if(still && args.fail_on.leak))
}
