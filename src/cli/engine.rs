//! `moe-audit engine URL`: a running vLLM or SGLang server audited for routing that depends on
//! batch-mates, the prefix cache, decoding, continuation length, a second server's settings and
//! repetition (exit 1 when an axis of `--must-hold` changed).

use super::common::{MemoryArgs, ReportArgs, TimeoutArgs};
use super::{exit, io_error, one_of};
use clap::{Args, ValueEnum};
use moe_audit::engine::{audit, Axis, Connect, Engine, Run, Server, Settings, Witness};
use moe_audit::error::{Error, Result};
use moe_audit::files::Staged;
use moe_audit::records::Layout;
use moe_audit::render::{engine_html, engine_text, json};
use moe_audit::MemoryBudget;
use std::io::Write;
use std::path::PathBuf;

/// Arguments of `moe-audit engine`.
#[derive(Debug, Args)]
pub(crate) struct EngineArgs {
    /// The server: `http://host:port` of a vLLM or SGLang server started with
    /// `--enable-return-routed-experts`. Nobody else should use it during the audit.
    #[arg(value_name = "URL")]
    pub(crate) url: String,
    /// A second server that differs in one setting (prefill chunk budget, TP/EP degree,
    /// batch-invariant or deterministic mode): the same requests compared across the two.
    #[arg(long, value_name = "URL")]
    pub(crate) against: Option<String>,
    /// Refuse a server of another engine [default: told by its endpoints].
    #[arg(long, value_parser = one_of(Engine::ALL, Engine::name, Engine::about))]
    pub(crate) engine: Option<Engine>,
    /// The model's config.json (Hugging Face): SGLang returns routes without their shape.
    #[arg(long, value_name = "FILE")]
    pub(crate) config: Option<PathBuf>,
    /// Axes compared [default: every axis; `against` only with --against].
    #[arg(long, value_delimiter = ',', value_parser = one_of(Axis::ALL, Axis::name, Axis::about))]
    pub(crate) axes: Vec<Axis>,
    /// Axes that must hold: exit 1 when one changes.
    #[arg(long, value_delimiter = ',', default_value = "repeat,stale", value_parser = one_of(Axis::ALL, Axis::name, Axis::about))]
    pub(crate) must_hold: Vec<Axis>,
    /// Seed of the prompts.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// Probe prompts.
    #[arg(long, default_value_t = Settings::default().prompts)]
    pub(crate) prompts: usize,
    /// Shortest and longest probe prompt, in tokens.
    #[arg(long, value_name = "MIN..MAX", default_value = "32..96", value_parser = parse_range)]
    pub(crate) prompt_len: (usize, usize),
    /// Tokens generated per probe (greedy, end of sequence ignored).
    #[arg(long, default_value_t = Settings::default().generate)]
    pub(crate) generate: usize,
    /// Batch-mates sent with each probe.
    #[arg(long, default_value_t = Settings::default().mates)]
    pub(crate) mates: usize,
    /// Token ids are drawn from [0, VOCAB); at most the model's vocabulary (checked against
    /// --config): vLLM started with --skip-tokenizer-init does not check ids, and one past the
    /// vocabulary kills its engine.
    #[arg(long, default_value_t = Settings::default().vocab)]
    pub(crate) vocab: u32,
    /// Length of the prompt that fills the prefix cache (cache and stale axes): whole blocks of
    /// the engine (vLLM's CPU build caches blocks of 128 tokens, its GPU build 16).
    #[arg(long, default_value_t = Settings::default().cache_len)]
    pub(crate) cache_len: usize,
    /// Tokens appended to the cached prompt.
    #[arg(long, default_value_t = Settings::default().extension)]
    pub(crate) extension: usize,
    /// Long prompts sent to both servers (with --against: the prefill chunking).
    #[arg(long, default_value_t = Settings::default().long_prompts)]
    pub(crate) long_prompts: usize,
    /// Length of a long prompt.
    #[arg(long, default_value_t = Settings::default().long_len)]
    pub(crate) long_len: usize,
    /// The most requests in flight at once (the batch axis sends the probe and its mates
    /// together; every other request is sent alone).
    #[arg(long, default_value_t = Settings::default().concurrency)]
    pub(crate) concurrency: usize,
    /// Each request's timeout.
    #[command(flatten)]
    pub(crate) timeout: TimeoutArgs,
    /// Prefix of the requests' cache salts [default: from the clock, so no run reads another's
    /// cache entries].
    #[arg(long, value_name = "ID")]
    pub(crate) run_id: Option<String>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = EngineFormat::Text)]
    pub(crate) format: EngineFormat,
    /// Where the report and its witnesses go (`engine-AXIS.json`, one per changed axis).
    #[command(flatten)]
    pub(crate) report: ReportArgs,
    /// The memory limit.
    #[command(flatten)]
    pub(crate) memory: MemoryArgs,
}

/// Output formats of `engine`.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum EngineFormat {
    /// One row per axis, then the changes.
    Text,
    /// Every figure.
    Json,
    /// One self-contained page.
    Html,
}

/// The model's config.json: its layout and the document.
fn read_config(path: &std::path::Path, budget: MemoryBudget) -> Result<(Layout, serde_json::Value)> {
    let text = moe_audit::files::read_text_within(path, budget)?;
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| Error::parse(path, "not a JSON config", e))?;
    let layout = Layout::from_json(&value).map_err(|m| Error::input(path, m))?;
    Ok((layout, value))
}

fn parse_range(s: &str) -> std::result::Result<(usize, usize), String> {
    let (lo, hi) = s.split_once("..").ok_or_else(|| format!("`{s}` is not MIN..MAX"))?;
    let n = |x: &str| x.trim().parse::<usize>().map_err(|_| format!("`{x}` is not a whole number"));
    Ok((n(lo)?, n(hi)?))
}

/// A validated `engine`.
#[derive(Debug)]
pub(crate) struct EngineOptions {
    /// The model's config.json, kept in witnesses (SGLang's replay needs its shape).
    config: Option<serde_json::Value>,
    url: String,
    against: Option<String>,
    connect: Connect,
    settings: Settings,
    must_hold: Vec<Axis>,
    run_id: String,
    format: EngineFormat,
    output: Option<PathBuf>,
    witness_dir: Option<PathBuf>,
    budget: MemoryBudget,
}

impl EngineArgs {
    /// The flags checked and the config read.
    pub(crate) fn validated(&self) -> Result<EngineOptions> {
        let axes = if self.axes.is_empty() {
            Axis::ALL.into_iter().filter(|&a| a != Axis::Against || self.against.is_some()).collect()
        } else {
            self.axes.clone()
        };
        let settings = Settings {
            seed: self.seed,
            prompts: self.prompts,
            prompt_len: self.prompt_len,
            generate: self.generate,
            mates: self.mates,
            vocab: self.vocab,
            cache_len: self.cache_len,
            extension: self.extension,
            long_prompts: self.long_prompts,
            long_len: self.long_len,
            concurrency: self.concurrency,
            axes,
        };
        settings.check(self.against.is_some())?;
        let budget = self.memory.budget();
        let config = self.config.as_deref().map(|p| read_config(p, budget)).transpose()?;
        if let Some(size) = config.as_ref().and_then(|c| c.1["vocab_size"].as_u64()) {
            if u64::from(self.vocab) > size {
                return Err(Error::usage(format!(
                    "--vocab {} is over the model's vocab_size {size} (--config): an id past the vocabulary \
                     is refused by the engine, or kills it",
                    self.vocab
                )));
            }
        }
        let (layout, config) = config.map(|(l, v)| (Some(l), Some(v))).unwrap_or_default();
        let connect = Connect { timeout: self.timeout.validated()?, engine: self.engine, layout, memory: budget };
        let run_id = self.run_id.clone().unwrap_or_else(|| {
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            format!("{:x}", now.as_millis())
        });
        Ok(EngineOptions {
            config,
            url: self.url.clone(),
            against: self.against.clone(),
            connect,
            settings,
            must_hold: self.must_hold.clone(),
            run_id,
            format: self.format,
            output: self.report.output.clone(),
            witness_dir: self.report.witness_dir.clone(),
            budget,
        })
    }
}

/// Runs the audit: exit 1 when an axis of `--must-hold` changed.
pub(super) fn run(o: EngineOptions, out: &mut dyn Write) -> Result<u8> {
    let main = Server::connect(&o.url, &o.connect)?;
    let against = o.against.as_deref().map(|u| Server::connect(u, &o.connect)).transpose()?;
    let servers: Vec<&Server> = std::iter::once(&main).chain(against.as_ref()).collect();
    let run = Run { servers, run_id: o.run_id, must_hold: o.must_hold, memory: o.budget };
    let report = audit(&run, &o.settings, &|_, _| {})?;
    let text = match o.format {
        EngineFormat::Text => engine_text(&report),
        EngineFormat::Json => json(&report),
        EngineFormat::Html => engine_html(&report),
    };
    let mut staged = Staged::new();
    if let Some(dir) = &o.witness_dir {
        moe_audit::files::create_dir(dir)?;
        let infos: Vec<_> = run.servers.iter().map(|s| s.info.clone()).collect();
        for a in &report.axes {
            if let Some(w) = Witness::of(a, &infos, o.config.clone()) {
                staged.write(&dir.join(format!("engine-{}.json", a.axis.name())), json(&w).as_bytes())?;
            }
        }
    }
    if let Some(path) = &o.output {
        staged.write(path, text.as_bytes())?;
    }
    staged.commit()?;
    if o.output.is_none() {
        out.write_all(text.as_bytes()).map_err(io_error)?;
    }
    Ok(exit::failed_if(report.failed))
}
