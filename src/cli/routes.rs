//! `moe-audit routes`: rollout against trainer routing records (`compare`, the gate) and one
//! record summarised (`show`).

use super::{exit, io_error};
use clap::{Args, Subcommand, ValueEnum};
use moe_audit::error::{Error, Result};
use moe_audit::files::Staged;
use moe_audit::records::{self, Budget, CompareOptions, Layout, Sides, Source};
use moe_audit::render::{json, routes_chart, routes_github, routes_junit, routes_markdown, routes_text, show_text};
use moe_audit::MemoryBudget;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Arguments of `moe-audit routes`.
#[derive(Debug, Args)]
pub(crate) struct RoutesArgs {
    /// What to do with routing records.
    #[command(subcommand)]
    pub(crate) command: RoutesCommand,
}

/// The `routes` subcommands.
#[derive(Debug, Subcommand)]
pub(crate) enum RoutesCommand {
    /// Align a rollout record against a trainer record, diagnose the alignment, measure their
    /// disagreement (exit 0 ok, 1 a defect or over --max-disagreement, 2 bad input).
    Compare(CompareArgs),
    /// Summarise one record: what was inferred (writer, dtype, layer numbering, padding,
    /// missing routes), then load per layer and expert.
    Show(ShowArgs),
}

/// Arguments of `routes compare`.
#[derive(Debug, Args)]
pub(crate) struct CompareArgs {
    /// The engine's record: an SGLang response (JSON), a vLLM `.npy` or HTTP response, a
    /// Megatron-Core inference response, or any trainer format.
    pub(crate) rollout: PathBuf,
    /// The trainer's record: the generic format (`moe_audit.routes.record`), Megatron-Core
    /// `router_trace_rank{r}.jsonl` (or a folder of them), verl, slime, SkyRL or NeMo-RL arrays
    /// (`.npz`/safetensors), or any rollout format. docs/ROUTES.md lists every layout.
    pub(crate) trainer: PathBuf,
    /// The model's Hugging Face config.json: which layers are MoE, dense or MTP, experts, top-k.
    #[arg(long, value_name = "config.json")]
    pub(crate) config: Option<PathBuf>,
    /// Fail when more than this share (0..1) of router decisions differ; 0 checks a replay.
    #[arg(long, value_name = "R")]
    pub(crate) max_disagreement: Option<f64>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = CompareFormat::Text)]
    pub(crate) format: CompareFormat,
    /// Also draw the disagreement per layer (`.png` or `.svg`).
    #[arg(long, value_name = "FILE")]
    pub(crate) chart: Option<PathBuf>,
    /// Write the report here instead of stdout.
    #[arg(long, value_name = "FILE")]
    pub(crate) output: Option<PathBuf>,
    /// `--max-memory`.
    #[command(flatten)]
    pub(crate) memory: super::common::MemoryArgs,
}

/// Output formats of `routes compare`.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum CompareFormat {
    /// Diagnoses, headline numbers, the per-layer table.
    Text,
    /// The whole comparison as JSON.
    Json,
    /// A markdown report.
    Markdown,
    /// JUnit XML (one test case per check).
    Junit,
    /// GitHub Actions annotations.
    Github,
    /// One self-contained HTML page (with --output FILE): diagnoses, layers, flips per token.
    Html,
}

/// Arguments of `routes show`.
#[derive(Debug, Args)]
pub(crate) struct ShowArgs {
    /// The record.
    pub(crate) file: PathBuf,
    /// The model's config.json (layer numbers, expert count, top-k; needed for SGLang JSON).
    #[arg(long, value_name = "config.json")]
    pub(crate) config: Option<PathBuf>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = ShowFormat::Text)]
    pub(crate) format: ShowFormat,
    /// `--max-memory`.
    #[command(flatten)]
    pub(crate) memory: super::common::MemoryArgs,
}

/// Output formats of `routes show`.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum ShowFormat {
    /// One line per layer.
    Text,
    /// The summary as JSON.
    Json,
}

/// A validated `routes` subcommand.
#[derive(Debug)]
pub(crate) enum RoutesOptions {
    /// `routes compare`.
    Compare(Compare),
    /// `routes show`.
    Show { file: PathBuf, config: Option<PathBuf>, format: ShowFormat, budget: MemoryBudget },
}

/// A validated `routes compare`.
#[derive(Debug)]
pub(crate) struct Compare {
    rollout: PathBuf,
    trainer: PathBuf,
    config: Option<PathBuf>,
    options: CompareOptions,
    format: CompareFormat,
    chart: Option<PathBuf>,
    output: Option<PathBuf>,
    budget: MemoryBudget,
}

impl RoutesArgs {
    /// The subcommand's flags checked.
    pub(crate) fn validated(&self) -> Result<RoutesOptions> {
        Ok(match &self.command {
            RoutesCommand::Compare(a) => RoutesOptions::Compare(a.validated()?),
            RoutesCommand::Show(a) => RoutesOptions::Show {
                file: a.file.clone(),
                config: a.config.clone(),
                format: a.format,
                budget: a.memory.budget(),
            },
        })
    }
}

impl CompareArgs {
    fn validated(&self) -> Result<Compare> {
        let options = CompareOptions::new(self.max_disagreement)?;
        if let Some(chart) = &self.chart {
            let ext = chart.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase);
            if !matches!(ext.as_deref(), Some("png" | "svg")) {
                return Err(Error::input(chart, "--chart takes a .png or .svg file"));
            }
        }
        Ok(Compare {
            rollout: self.rollout.clone(),
            trainer: self.trainer.clone(),
            config: self.config.clone(),
            options,
            format: self.format,
            chart: self.chart.clone(),
            output: self.output.clone(),
            budget: self.memory.budget(),
        })
    }
}

pub(super) fn run(routes: RoutesOptions, out: &mut dyn Write) -> Result<u8> {
    match routes {
        RoutesOptions::Compare(c) => compare(&c, out),
        RoutesOptions::Show { file, config, format, budget } => show(&file, &config, format, budget, out),
    }
}

fn layout(config: &Option<PathBuf>) -> Result<Option<Layout>> {
    config.as_deref().map(Layout::load).transpose()
}

fn compare(args: &Compare, out: &mut dyn Write) -> Result<u8> {
    let layout = layout(&args.config)?;
    let sources = Sides::new(Source::File(&args.rollout), Source::File(&args.trainer));
    let c = records::compare_sources(sources, layout.as_ref(), &args.options, args.budget)?;
    let text = match args.format {
        CompareFormat::Text => routes_text(&c),
        CompareFormat::Json => json(&c),
        CompareFormat::Markdown => routes_markdown(&c),
        CompareFormat::Junit => routes_junit(&c),
        CompareFormat::Github => routes_github(&c),
        CompareFormat::Html => moe_audit::render::routes_html(&c),
    };
    let mut staged = Staged::new();
    if let Some(chart) = &args.chart {
        routes_chart(&c, chart, &mut staged)?;
    }
    if let Some(path) = &args.output {
        staged.write(path, text.as_bytes())?;
    }
    staged.commit()?;
    if args.output.is_none() {
        out.write_all(text.as_bytes()).map_err(io_error)?;
    }
    Ok(exit::failed_if(c.failed))
}

fn show(
    file: &Path,
    config: &Option<PathBuf>,
    format: ShowFormat,
    budget: MemoryBudget,
    out: &mut dyn Write,
) -> Result<u8> {
    let layout = layout(config)?;
    let mut budget = Budget::new(budget);
    let record = records::load(file, layout.as_ref(), None, &mut budget)?;
    let summary = records::show(&record, layout.as_ref().map(|l| l.experts));
    let text = match format {
        ShowFormat::Text => show_text(&summary),
        ShowFormat::Json => json(&summary),
    };
    out.write_all(text.as_bytes()).map_err(io_error)?;
    Ok(exit::OK)
}
