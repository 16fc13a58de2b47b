//! `moe-audit snapshot`: `record` a router's decisions on fixed inputs to a `.snap` file,
//! `check` one or `update` it (made again from its header), and `plan` the inputs for a harness
//! that routes them itself (the Python helper).

use super::common::{utf8, InputArg, MemoryArgs, TimeoutArgs, SHOWN_BATCH, SHOWN_SEQ_LEN};
use super::exit;
use super::io_error;
use clap::{ArgGroup, Args, Subcommand};
use moe_audit::config::presets;
use moe_audit::error::{Error, Result};
use moe_audit::external::protocol::PROTOCOL;
use moe_audit::external::Handshake;
use moe_audit::files::write_atomic;
use moe_audit::snapshot::{check, make, remake, write_plan, Header, InputSpec, RouterSource, Rows, SnapshotFile};
use moe_audit::MemoryBudget;
use moe_audit::RunSizes;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Arguments of `moe-audit snapshot`.
#[derive(Debug, Args)]
pub(crate) struct SnapshotArgs {
    /// What to do with a snapshot.
    #[command(subcommand)]
    pub(crate) command: SnapshotCommand,
}

/// The `snapshot` subcommands.
#[derive(Debug, Subcommand)]
pub(crate) enum SnapshotCommand {
    /// Route fixed inputs (train and inference) through one router and write the snapshot.
    Record(RecordArgs),
    /// Make the snapshot FILE's header describes again and compare: exit 0 when unchanged, 1
    /// with a diff when the routing changed, 2 for a bad or edited file.
    Check(AgainArgs),
    /// Make the snapshot FILE's header describes again and rewrite FILE (also migrates the
    /// unsealed format).
    Update(AgainArgs),
    /// Write the inputs of a snapshot into DIR for a harness that routes them itself (the Python
    /// helper); `snapshot record --traces DIR` then makes the snapshot from its answers.
    Plan(PlanArgs),
}

/// The inputs of a snapshot: `record` and `plan`.
#[derive(Debug, Args)]
#[command(next_help_heading = "Input")]
pub(crate) struct InputArgs {
    /// Sequences [default: 2].
    #[arg(long)]
    pub(crate) batch: Option<usize>,
    /// Tokens per sequence [default: 8; with --logits or --hidden-states, from the file].
    #[arg(long)]
    pub(crate) seq_len: Option<usize>,
    /// Hidden size H: of a preset's or TOML router's seeded gate and hidden states [default:
    /// 64]; for `plan`, of a router with --input hidden.
    #[arg(long, alias = "hidden-size", value_name = "H")]
    pub(crate) hidden: Option<usize>,
    /// Seed of the inputs (standard normal rows) and of a preset's or TOML router's gate
    /// [default: 0].
    #[arg(long)]
    pub(crate) seed: Option<u64>,
    /// Route these logits: a JSON array of batch*seq_len rows of E numbers, sequence-major.
    #[arg(long, value_name = "FILE", conflicts_with = "hidden_states")]
    pub(crate) logits: Option<PathBuf>,
    /// Route these hidden states: a JSON array of batch*seq_len rows of H numbers.
    #[arg(long, value_name = "FILE")]
    pub(crate) hidden_states: Option<PathBuf>,
}

/// Arguments of `snapshot record`.
#[derive(Debug, Args)]
#[command(group(ArgGroup::new("source").args(["router", "router_cmd", "traces"]).required(true)))]
pub(crate) struct RecordArgs {
    /// A preset name or router TOML file (with a seeded gate, or the gate of --weights).
    pub(crate) router: Option<String>,
    /// Write the snapshot here (atomically: complete or untouched) instead of stdout.
    #[arg(long, value_name = "FILE.snap", help_heading = "Output")]
    pub(crate) output: Option<PathBuf>,
    /// A router run as a subprocess: a command speaking the moe-audit/1 or /2 protocol
    /// (docs/PROTOCOL.md), run with `sh -c` (its hidden size is its own).
    #[arg(long, value_name = "COMMAND", conflicts_with = "hidden", help_heading = "External routers")]
    pub(crate) router_cmd: Option<String>,
    /// How long the router command may take.
    #[command(flatten, next_help_heading = "External routers")]
    pub(crate) timeout: TimeoutArgs,
    /// A trace directory answered by a harness (`moe-audit plan`, or `snapshot plan`): the first
    /// call of each mode is snapshotted, on the plan's own inputs.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["batch", "seq_len", "seed", "hidden", "logits", "hidden_states"], help_heading = "External routers")]
    pub(crate) traces: Option<PathBuf>,
    /// A safetensors checkpoint holding the gate of ROUTER (whose hidden size is its own).
    #[arg(long, value_name = "FILE.safetensors", requires = "gate", conflicts_with_all = ["router_cmd", "traces", "hidden"], help_heading = "External routers")]
    pub(crate) weights: Option<PathBuf>,
    /// The gate matrix `[experts, hidden]` in --weights.
    #[arg(long, value_name = "TENSOR", requires = "weights", help_heading = "External routers")]
    pub(crate) gate: Option<String>,
    /// A selection-only expert bias `[experts]` in --weights.
    #[arg(long, value_name = "TENSOR", requires = "gate", help_heading = "External routers")]
    pub(crate) bias: Option<String>,
    /// The inputs.
    #[command(flatten)]
    pub(crate) input: InputArgs,
    /// The memory limit.
    #[command(flatten)]
    pub(crate) memory: MemoryArgs,
}

/// Arguments of `snapshot check` and `snapshot update`: the file's header says everything else.
#[derive(Debug, Args)]
pub(crate) struct AgainArgs {
    /// The snapshot.
    #[arg(value_name = "FILE.snap")]
    pub(crate) file: PathBuf,
    /// The router command, when the header's router is one (the header's is never run: it runs
    /// only when given here, and must be the header's).
    #[arg(long, value_name = "COMMAND")]
    pub(crate) router_cmd: Option<String>,
    /// Where a harness's answers are now (a snapshot made from traces or a plan).
    #[arg(long, value_name = "DIR")]
    pub(crate) traces: Option<PathBuf>,
    /// The memory limit.
    #[command(flatten)]
    pub(crate) memory: MemoryArgs,
}

/// Arguments of `snapshot plan`.
#[derive(Debug, Args)]
pub(crate) struct PlanArgs {
    /// Where to write the inputs.
    #[arg(value_name = "DIR")]
    pub(crate) dir: PathBuf,
    /// The router's name.
    #[arg(long, default_value = "router", help_heading = "Router")]
    pub(crate) name: String,
    /// Number of experts E.
    #[arg(long, help_heading = "Router")]
    pub(crate) experts: usize,
    /// Experts per token (omit for expert choice).
    #[arg(long, help_heading = "Router")]
    pub(crate) top_k: Option<usize>,
    /// What the router's rows hold.
    #[arg(long, value_enum, default_value_t = InputArg::Logits, help_heading = "Router")]
    pub(crate) input: InputArg,
    /// The inputs.
    #[command(flatten)]
    pub(crate) rows: InputArgs,
    /// The memory limit.
    #[command(flatten)]
    pub(crate) memory: MemoryArgs,
}

/// A validated `snapshot`.
#[derive(Debug)]
pub(crate) enum SnapshotOptions {
    /// Make a snapshot of one router.
    Record { source: RouterSource, input: InputSpec, output: Option<PathBuf>, budget: MemoryBudget },
    /// Make a stored snapshot again: compare (`check`) or rewrite it (`update`).
    Again { file: PathBuf, update: bool, router_cmd: Option<String>, traces: Option<PathBuf>, budget: MemoryBudget },
    /// Write the inputs for a harness.
    Plan { dir: PathBuf, router: Handshake, input: InputSpec, budget: MemoryBudget },
}

impl SnapshotArgs {
    /// The subcommand's flags checked, its router and inputs resolved.
    pub(crate) fn validated(&self) -> Result<SnapshotOptions> {
        if let SnapshotCommand::Plan(a) = &self.command {
            a.input.check_hidden(a.rows.hidden)?;
        }
        Ok(match &self.command {
            SnapshotCommand::Record(a) => SnapshotOptions::Record {
                source: a.source()?,
                input: a.input.spec()?,
                output: a.output.clone(),
                budget: a.memory.budget(),
            },
            SnapshotCommand::Check(a) | SnapshotCommand::Update(a) => SnapshotOptions::Again {
                file: a.file.clone(),
                update: matches!(self.command, SnapshotCommand::Update(_)),
                router_cmd: a.router_cmd.clone(),
                traces: a.traces.clone(),
                budget: a.memory.budget(),
            },
            SnapshotCommand::Plan(a) => SnapshotOptions::Plan {
                dir: a.dir.clone(),
                router: Handshake {
                    protocol: PROTOCOL.into(),
                    name: a.name.clone(),
                    experts: a.experts,
                    top_k: a.top_k,
                    input: a.input.into(),
                    hidden_size: a.rows.hidden,
                    responses: None,
                    padding_mask: false,
                    seed_calls: None,
                    ranks: None,
                    output: None,
                    weights: None,
                },
                input: a.rows.spec()?,
                budget: a.memory.budget(),
            },
        })
    }
}

impl InputArgs {
    fn spec(&self) -> Result<InputSpec> {
        let (rows, file) = match (&self.logits, &self.hidden_states) {
            (Some(f), _) => (Rows::Logits, Some(f)),
            (_, Some(f)) => (Rows::HiddenStates, Some(f)),
            _ => (Rows::Seeded, None),
        };
        let file = file.map(|f| utf8(f, "--logits/--hidden-states")).transpose()?;
        Ok(InputSpec {
            batch: self.batch.unwrap_or(SHOWN_BATCH),
            seq_len: self.seq_len.unwrap_or(SHOWN_SEQ_LEN),
            rows,
            seed: self.seed.unwrap_or(0),
            hidden: Some(self.hidden.unwrap_or(RunSizes::default().hidden)),
            file,
            sha256: String::new(),
        })
    }
}

impl RecordArgs {
    /// The one router to snapshot (clap has checked there is one).
    fn source(&self) -> Result<RouterSource> {
        if let Some(command) = &self.router_cmd {
            return Ok(RouterSource::Command { command: command.clone(), timeout: self.timeout.timeout });
        }
        if let Some(dir) = &self.traces {
            return Ok(RouterSource::Traces { dir: utf8(dir, "--traces")?, sha256: String::new() });
        }
        let router = self.router.clone().expect("clap requires one source");
        if let (Some(weights), Some(gate)) = (&self.weights, &self.gate) {
            return Ok(RouterSource::Gate {
                router,
                weights: utf8(weights, "--weights")?,
                gate: gate.clone(),
                bias: self.bias.clone(),
                sha256: String::new(),
            });
        }
        if presets().iter().any(|p| p.name == router) {
            Ok(RouterSource::Preset { name: router })
        } else if Path::new(&router).is_file() {
            Ok(RouterSource::Config { path: router, sha256: String::new() })
        } else {
            // The unknown-router error, listing the presets.
            moe_audit::config::RouterConfig::load(&router).map(|_| unreachable!("neither a preset nor a file"))
        }
    }
}

pub(super) fn run(snapshot: SnapshotOptions, out: &mut dyn Write) -> Result<u8> {
    match snapshot {
        SnapshotOptions::Record { source, input, output, budget } => record(&source, &input, output, budget, out),
        SnapshotOptions::Again { file, update, router_cmd, traces, budget } => {
            again(&file, update, router_cmd.as_deref(), traces.as_deref(), budget, out)
        }
        SnapshotOptions::Plan { dir, router, input, budget } => {
            write_plan(&dir, &router, &input, budget)?;
            writeln!(
                out,
                "wrote the inputs of a snapshot in {}: answer its 2 calls in decisions.jsonl, then run `moe-audit snapshot record --traces {}`",
                dir.display(),
                dir.display()
            )
            .map_err(io_error)?;
            Ok(exit::OK)
        }
    }
}

/// `snapshot check` and `snapshot update`.
fn again(
    path: &Path,
    update: bool,
    router_cmd: Option<&str>,
    traces: Option<&Path>,
    budget: MemoryBudget,
    out: &mut dyn Write,
) -> Result<u8> {
    // The file, its parsed copy and the fresh one stay in memory together; read bounded, as
    // a FIFO or `/dev/zero` has no size to check beforehand.
    if let Ok(meta) = std::fs::metadata(path) {
        budget.ensure_fits(&format!("reading {}", path.display()), meta.len().saturating_mul(4))?;
    }
    let text = moe_audit::files::read_text_within(path, budget)?;
    let stored = SnapshotFile::parse(&text, path);
    if update {
        // The header says how to remake it (the unsealed format too: this migrates it); the
        // sections may be anything.
        let end = text.find("\n=== ").map_or(text.len(), |i| i + 1);
        let header = Header::parse_unsealed(&text[..end], path)?;
        let fresh = remake(path, &header, router_cmd, traces, budget)?;
        let bytes = fresh.render();
        if text != bytes {
            write_atomic(path, bytes.as_bytes())?;
        }
        let what = match stored.ok().map(|s| check(path, &s, &fresh)) {
            Some(Ok(outcome)) if !outcome.changed => "unchanged".to_string(),
            Some(Ok(outcome)) => format!("updated\n{}", outcome.report),
            _ => "updated".to_string(),
        };
        writeln!(out, "{}: {what}", path.display()).map_err(io_error)?;
        return Ok(exit::OK);
    }
    let stored = stored?;
    let fresh = remake(path, &stored.header, router_cmd, traces, budget)?;
    let outcome = check(path, &stored, &fresh)?;
    let verdict = if outcome.changed { "routing changed" } else { "unchanged" };
    write!(out, "{}: {verdict}\n{}", path.display(), outcome.report).map_err(io_error)?;
    Ok(exit::failed_if(outcome.changed))
}

/// `snapshot record`.
fn record(
    source: &RouterSource,
    input: &InputSpec,
    output: Option<PathBuf>,
    budget: MemoryBudget,
    out: &mut dyn Write,
) -> Result<u8> {
    let made = make(source, input, None, budget)?;
    let bytes = made.render();
    match &output {
        Some(path) => {
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, "cannot create", e))?;
            }
            write_atomic(path, bytes.as_bytes())?;
            let tokens = made.header.input.batch * made.header.input.seq_len;
            writeln!(out, "wrote {} ({} modes x {tokens} tokens)", path.display(), made.sections.len())
                .map_err(io_error)?;
        }
        None => out.write_all(bytes.as_bytes()).map_err(io_error)?,
    }
    Ok(exit::OK)
}
