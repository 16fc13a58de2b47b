//! `moe-audit snapshot`: a router's decisions on fixed inputs to a `.snap` file, `--check` and
//! `--update` of one, and `--plan` (inputs for a harness such as the Python helper).

use super::exit;
use super::external::{InputArg, RouterCmdArgs};
use super::{io_error, MemoryArgs};
use clap::Args;
use moe_audit::config::presets;
use moe_audit::error::{Error, Result};
use moe_audit::external::protocol::PROTOCOL;
use moe_audit::external::{Handshake, InputKind};
use moe_audit::snapshot::{
    check, make, remake, write_atomic, write_plan, Header, InputSpec, RouterSource, Rows, SnapshotFile,
};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Arguments of `moe-audit snapshot`.
#[derive(Debug, Args)]
pub struct SnapshotArgs {
    /// A preset name or router TOML file (with a seeded gate, or the gate of --weights).
    pub router: Option<String>,
    /// Write the snapshot here (atomically: complete or untouched) instead of stdout.
    #[arg(long, value_name = "FILE.snap", help_heading = "Output")]
    pub output: Option<PathBuf>,
    /// Make the snapshot FILE's header describes again and compare: exit 0 when unchanged, 1
    /// with a diff when the routing changed, 2 for a bad or edited file. A router command runs
    /// only when given here with --router-cmd (the header's is never run).
    #[arg(long, value_name = "FILE.snap", conflicts_with = "update", help_heading = "Output")]
    pub check: Option<PathBuf>,
    /// Make the snapshot FILE's header describes again and rewrite FILE.
    #[arg(long, value_name = "FILE.snap", help_heading = "Output")]
    pub update: Option<PathBuf>,
    /// A router run as a subprocess (one).
    #[command(flatten)]
    pub cmd: RouterCmdArgs,
    /// A trace directory answered by a harness (`moe-audit plan`, or `snapshot --plan`): the
    /// first call of each mode is snapshotted. With --check/--update: where the answers are now.
    #[arg(long, value_name = "DIR", help_heading = "External routers")]
    pub traces: Option<PathBuf>,
    /// A safetensors checkpoint holding the gate of ROUTER.
    #[arg(long, value_name = "FILE.safetensors", requires = "gate", help_heading = "External routers")]
    pub weights: Option<PathBuf>,
    /// The gate matrix `[experts, hidden]` in --weights.
    #[arg(long, value_name = "TENSOR", requires = "weights", help_heading = "External routers")]
    pub gate: Option<String>,
    /// A selection-only expert bias `[experts]` in --weights.
    #[arg(long, value_name = "TENSOR", requires = "gate", help_heading = "External routers")]
    pub bias: Option<String>,
    /// Sequences [default: 2].
    #[arg(long, help_heading = "Input")]
    pub batch: Option<usize>,
    /// Tokens per sequence [default: 8; with --logits or --hidden-states, from the file].
    #[arg(long, help_heading = "Input")]
    pub seq_len: Option<usize>,
    /// Hidden size of a preset's or TOML router's seeded gate and hidden states [default: 64].
    #[arg(long, help_heading = "Input")]
    pub hidden: Option<usize>,
    /// Seed of the inputs (standard normal rows) and of a preset's or TOML router's gate
    /// [default: 0].
    #[arg(long, help_heading = "Input")]
    pub seed: Option<u64>,
    /// Route these logits: a JSON array of batch*seq_len rows of E numbers, sequence-major.
    #[arg(long, value_name = "FILE", conflicts_with = "hidden_states", help_heading = "Input")]
    pub logits: Option<PathBuf>,
    /// Route these hidden states: a JSON array of batch*seq_len rows of H numbers.
    #[arg(long, value_name = "FILE", help_heading = "Input")]
    pub hidden_states: Option<PathBuf>,
    /// Write the inputs of a snapshot into DIR for a harness that routes them itself (the Python
    /// helper); `snapshot --traces DIR` then makes the snapshot from its answers.
    #[arg(long, value_name = "DIR", requires = "experts", help_heading = "Harness")]
    pub plan: Option<PathBuf>,
    /// The router's name (with --plan).
    #[arg(long, requires = "plan", default_value = "router", help_heading = "Harness")]
    pub name: String,
    /// Number of experts E (with --plan).
    #[arg(long, requires = "plan", help_heading = "Harness")]
    pub experts: Option<usize>,
    /// Experts per token (with --plan; omit for expert choice).
    #[arg(long, requires = "plan", help_heading = "Harness")]
    pub top_k: Option<usize>,
    /// What the router's rows hold (with --plan).
    #[arg(long, value_enum, requires = "plan", help_heading = "Harness")]
    pub input: Option<InputArg>,
    /// Hidden size H (with --plan --input hidden).
    #[arg(long, requires = "plan", help_heading = "Harness")]
    pub hidden_size: Option<usize>,
    /// The memory limit.
    #[command(flatten)]
    pub memory: MemoryArgs,
}

impl SnapshotArgs {
    /// Flags that describe a snapshot to make (not allowed with --check/--update).
    fn making_flags(&self) -> Vec<&'static str> {
        let given = [
            ("ROUTER", self.router.is_some()),
            ("--output", self.output.is_some()),
            ("--weights", self.weights.is_some()),
            ("--batch", self.batch.is_some()),
            ("--seq-len", self.seq_len.is_some()),
            ("--hidden", self.hidden.is_some()),
            ("--seed", self.seed.is_some()),
            ("--logits", self.logits.is_some()),
            ("--hidden-states", self.hidden_states.is_some()),
            ("--plan", self.plan.is_some()),
        ];
        given.iter().filter(|(_, g)| *g).map(|(f, _)| *f).collect()
    }

    /// The `--router-cmd` a `--check`/`--update` may run: at most one.
    fn one_router_cmd(&self) -> Result<Option<&str>> {
        match self.cmd.router_cmd.as_slice() {
            [] => Ok(None),
            [one] => Ok(Some(one)),
            _ => Err(Error::Usage("a snapshot holds one router: give --router-cmd once".into())),
        }
    }

    fn input(&self) -> Result<InputSpec> {
        let (rows, file) = match (&self.logits, &self.hidden_states) {
            (Some(f), _) => (Rows::Logits, Some(f)),
            (_, Some(f)) => (Rows::HiddenStates, Some(f)),
            _ => (Rows::Seeded, None),
        };
        let file = file.map(|f| utf8(f, "--logits/--hidden-states")).transpose()?;
        Ok(InputSpec {
            batch: self.batch.unwrap_or(2),
            seq_len: self.seq_len.unwrap_or(8),
            rows,
            seed: self.seed.unwrap_or(0),
            hidden: Some(self.hidden.unwrap_or(64)),
            file,
            sha256: String::new(),
        })
    }

    /// The one router to snapshot.
    fn source(&self) -> Result<RouterSource> {
        let sources =
            usize::from(self.router.is_some()) + self.cmd.router_cmd.len() + usize::from(self.traces.is_some());
        if sources != 1 {
            return Err(Error::Usage(
                "snapshot one router: a preset or TOML file (with --weights, on that gate), --router-cmd, or --traces"
                    .into(),
            ));
        }
        let unused = match () {
            _ if self.traces.is_some() => [
                ("--batch", self.batch.is_some()),
                ("--seq-len", self.seq_len.is_some()),
                ("--seed", self.seed.is_some()),
                ("--hidden", self.hidden.is_some()),
                ("--logits", self.logits.is_some()),
                ("--hidden-states", self.hidden_states.is_some()),
            ]
            .iter()
            .find(|(_, given)| *given)
            .map(|(flag, _)| (*flag, "--traces snapshots the plan's own inputs")),
            _ if self.hidden.is_some() && (!self.cmd.router_cmd.is_empty() || self.weights.is_some()) => {
                Some(("--hidden", "the router's hidden size is its own"))
            }
            _ => None,
        };
        if let Some((flag, why)) = unused {
            return Err(Error::Usage(format!("{why}: drop {flag}")));
        }
        if let Some(command) = self.cmd.router_cmd.first() {
            return Ok(RouterSource::Command { command: command.clone(), timeout: self.cmd.timeout });
        }
        if let Some(dir) = &self.traces {
            return Ok(RouterSource::Traces { dir: utf8(dir, "--traces")?, sha256: String::new() });
        }
        let router = self.router.clone().expect("one source");
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

fn utf8(path: &Path, flag: &str) -> Result<String> {
    path.to_str().map(str::to_string).ok_or_else(|| Error::Usage(format!("{flag}: the path is not UTF-8")))
}

pub(super) fn run(args: &SnapshotArgs, out: &mut dyn Write) -> Result<u8> {
    let budget = args.memory.budget();
    let again = args.check.as_ref().or(args.update.as_ref());
    if let Some(path) = again {
        let flag = if args.check.is_some() { "--check" } else { "--update" };
        if let Some(f) = args.making_flags().first() {
            return Err(Error::Usage(format!(
                "{flag} makes the snapshot its header describes: drop {f} (only --router-cmd, --traces DIR and --max-memory go with it)"
            )));
        }
        // The file, its parsed copy and the fresh one stay in memory together; read bounded, as
        // a FIFO or `/dev/zero` has no size to check beforehand.
        if let Ok(meta) = std::fs::metadata(path) {
            budget.ensure_fits(&format!("reading {}", path.display()), meta.len().saturating_mul(4))?;
        }
        let text = moe_audit::files::read_text_within(path, budget)?;
        let stored = SnapshotFile::parse(&text, path);
        if args.update.is_some() {
            // The header says how to remake it (the unsealed format too: this migrates it); the
            // sections may be anything.
            let end = text.find("\n=== ").map_or(text.len(), |i| i + 1);
            let header = Header::parse_unsealed(&text[..end], path)?;
            let fresh = remake(path, &header, args.one_router_cmd()?, args.traces.as_deref(), budget)?;
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
        let fresh = remake(path, &stored.header, args.one_router_cmd()?, args.traces.as_deref(), budget)?;
        let outcome = check(path, &stored, &fresh)?;
        let verdict = if outcome.changed { "routing changed" } else { "unchanged" };
        write!(out, "{}: {verdict}\n{}", path.display(), outcome.report).map_err(io_error)?;
        return Ok(exit::failed_if(outcome.changed));
    }
    if let Some(dir) = &args.plan {
        if args.router.is_some() || !args.cmd.router_cmd.is_empty() || args.traces.is_some() || args.weights.is_some() {
            return Err(Error::Usage(
                "--plan writes inputs for a router outside moe-audit: describe it with --name, --experts, --top-k, --input, --hidden-size".into(),
            ));
        }
        let hs = Handshake {
            protocol: PROTOCOL.into(),
            name: args.name.clone(),
            experts: args.experts.expect("clap requires --experts"),
            top_k: args.top_k,
            input: match args.input {
                Some(InputArg::Hidden) => InputKind::Hidden,
                _ => InputKind::Logits,
            },
            hidden_size: args.hidden_size,
            responses: None,
            padding_mask: false,
            seed_calls: None,
        };
        write_plan(dir, &hs, &args.input()?, budget)?;
        writeln!(
            out,
            "wrote the inputs of a snapshot in {}: answer its 2 calls in decisions.jsonl, then run `moe-audit snapshot --traces {}`",
            dir.display(),
            dir.display()
        )
        .map_err(io_error)?;
        return Ok(exit::OK);
    }
    let made = make(&args.source()?, &args.input()?, None, budget)?;
    let bytes = made.render();
    match &args.output {
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
