//! `moe-audit check` (the CI gate) and `moe-audit zoo` (every preset at default sizes).

use super::io_error;
use crate::analyze::report::{render_markdown, render_text, render_zoo};
use crate::analyze::{audit, AuditOptions, Probe, Report, RouterReport, Subject, Verdict, Witness};
use crate::config::{presets, RouterConfig};
use crate::error::{Error, Result};
use crate::layer::MoeLayer;
use candle_core::{DType, Device};
use clap::{Args, ValueEnum};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Arguments of `moe-audit check`.
#[derive(Debug, Args)]
pub struct CheckArgs {
    /// Preset names or router TOML files.
    #[arg(required_unless_present = "replay", conflicts_with = "replay")]
    pub routers: Vec<String>,
    /// Replay a witness file: exit 1 if it still shows the leak, 0 if not.
    #[arg(long, value_name = "WITNESS.json")]
    pub replay: Option<PathBuf>,
    /// Probes to run, comma separated: P prefix, F future, N neighbour, R re-batch, D repeat,
    /// S replay, M mode; X numerics (bf16/f16 routing flips, accumulator swamping) is opt-in.
    #[arg(long, default_value = "P,F,N,R,D,S,M", help_heading = "Audit")]
    pub probes: String,
    /// Sequences per call.
    #[arg(long, default_value_t = 4, help_heading = "Audit")]
    pub batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 128, help_heading = "Audit")]
    pub seq_len: usize,
    /// Trials of the randomised probes.
    #[arg(long, default_value_t = 32, help_heading = "Audit")]
    pub trials: usize,
    /// Seed of the layer, the inputs and every random choice.
    #[arg(long, default_value_t = 0, help_heading = "Audit")]
    pub seed: u64,
    /// Hidden size of the seeded layer.
    #[arg(long, default_value_t = 64, help_heading = "Audit")]
    pub hidden: usize,
    /// Expert FFN size of the seeded layer.
    #[arg(long, default_value_t = 128, help_heading = "Audit")]
    pub ffn: usize,
    /// Report format.
    #[arg(long, value_enum, default_value_t = CheckFormat::Text, help_heading = "Output")]
    pub format: CheckFormat,
    /// Write the report here instead of stdout.
    #[arg(long, value_name = "FILE", help_heading = "Output")]
    pub output: Option<PathBuf>,
    /// Write one witness file per leak here (`<router>-<probe>.json`).
    #[arg(long, value_name = "DIR", help_heading = "Output")]
    pub witness_dir: Option<PathBuf>,
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
}

impl CheckArgs {
    fn options(&self) -> Result<AuditOptions> {
        for (flag, v) in [("--batch", self.batch), ("--seq-len", self.seq_len), ("--hidden", self.hidden), ("--ffn", self.ffn)] {
            if v == 0 {
                return Err(Error::Usage(format!("{flag} must be at least 1")));
            }
        }
        Ok(AuditOptions { probes: Probe::parse_list(&self.probes)?, batch: self.batch, seq_len: self.seq_len, trials: self.trials, seed: self.seed })
    }
}

/// Audits each config with a seeded layer, with a progress bar on a terminal.
pub(crate) fn audit_all(configs: Vec<RouterConfig>, options: &AuditOptions, hidden: usize, ffn: usize) -> Result<Report> {
    let bar = super::progress_bar((configs.len() * options.probes.len()) as u64);
    let mut routers = Vec::new();
    for config in configs {
        let layer = MoeLayer::seeded(config, hidden, ffn, options.seed, DType::F32, &Device::Cpu)?;
        let mut tick = |msg: &str| {
            bar.set_message(msg.to_string());
            bar.inc(1);
        };
        routers.push(audit(&Subject::layer(&layer), options, &mut tick)?);
    }
    bar.finish_and_clear();
    Ok(Report { options: options.clone(), routers })
}

fn witness_file(dir: &Path, router: &str, probe: Probe) -> PathBuf {
    let safe: String = router.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).collect();
    dir.join(format!("{safe}-{probe}.json"))
}

pub(super) fn run(args: &CheckArgs, out: &mut dyn Write) -> Result<u8> {
    if let Some(path) = &args.replay {
        return replay(path, out);
    }
    let options = args.options()?;
    let configs = args.routers.iter().map(|r| RouterConfig::load(r)).collect::<Result<Vec<_>>>()?;
    let report = audit_all(configs, &options, args.hidden, args.ffn)?;
    if let Some(dir) = &args.witness_dir {
        std::fs::create_dir_all(dir).map_err(|e| Error::input(dir, format!("cannot create: {e}")))?;
        for r in &report.routers {
            for f in r.findings.iter().filter(|f| f.witness.is_some()) {
                let path = witness_file(dir, &r.router, f.probe);
                let json = serde_json::to_string_pretty(&f.witness).expect("a witness always serialises");
                std::fs::write(&path, json + "\n").map_err(|e| Error::input(&path, format!("cannot write: {e}")))?;
            }
        }
    }
    let has_witness = |router: &str, probe: Probe| {
        report.routers.iter().find(|r| r.router == router).and_then(|r| r.finding(probe)).is_some_and(|f| f.witness.is_some())
    };
    let text = match args.format {
        CheckFormat::Text => render_text(&report, &|router, probe| {
            let dir = args.witness_dir.as_ref()?;
            has_witness(router, probe).then(|| witness_file(dir, router, probe).display().to_string())
        }),
        CheckFormat::Json => serde_json::to_string_pretty(&report).expect("a report always serialises") + "\n",
        CheckFormat::Markdown => render_markdown(&report),
    };
    match &args.output {
        Some(path) => std::fs::write(path, text).map_err(|e| Error::input(path, format!("cannot write: {e}")))?,
        None => out.write_all(text.as_bytes()).map_err(io_error)?,
    }
    Ok(u8::from(report.leaks()))
}

fn replay(path: &Path, out: &mut dyn Write) -> Result<u8> {
    let replay = Witness::read(path)?.replay(path)?;
    let w = &replay.witness;
    let token = format!("batch {}, position {}", w.token_a.batch, w.token_a.pos);
    let text = if replay.diff.any() {
        format!(
            "LEAK reproduced: router {}, probe {} ({}), property {}: token {token} routes differently ({})\n  before: {}\n  after:  {}\n",
            w.router.name,
            w.probe,
            w.probe.name(),
            w.property,
            replay.diff.describe(),
            serde_json::to_string(&replay.before.routes).expect("serialises"),
            serde_json::to_string(&replay.after.routes).expect("serialises"),
        )
    } else {
        format!("no leak: router {} now routes token {token} alike in both calls\n", w.router.name)
    };
    out.write_all(text.as_bytes()).map_err(io_error)?;
    Ok(u8::from(replay.diff.any()))
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
    let report = audit_all(configs, &options, 64, 128)?;
    let mut text = render_zoo(&report.routers, &options.probes);
    let leaking = report.routers.iter().filter(|r| r.findings.iter().any(|f| f.verdict == Verdict::Leak)).count();
    text.push_str(&format!(
        "\n{leaking} of {} presets leak. LEAK = the probe changed some token's routing; see `moe-audit check <preset>` for rates and witnesses.\n",
        report.routers.len()
    ));
    out.write_all(text.as_bytes()).map_err(io_error)?;
    Ok(0)
}

/// Verdicts of one audited router, for tests and tools.
pub fn verdicts(r: &RouterReport) -> Vec<(Probe, Verdict)> {
    r.findings.iter().map(|f| (f.probe, f.verdict)).collect()
}
