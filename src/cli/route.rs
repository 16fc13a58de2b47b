//! `moe-audit route`: one call through a router, shown as a table or the JSON record.

use super::common::{MemoryArgs, SHOWN_BATCH, SHOWN_SEQ_LEN};
use super::exit;
use super::io_error;
use candle_core::{DType, Device};
use clap::{Args, ValueEnum};
use moe_audit::config::RouterConfig;
use moe_audit::error::{ensure_positive, Result};
use moe_audit::layer::CallSizes;
use moe_audit::layer::{MoeLayer, Seeded};
use moe_audit::render::json;
use moe_audit::routing::{assign, render_table, Logits};
use moe_audit::settings::{BATCH, FFN, HIDDEN, SEQ_LEN};
use moe_audit::RunSizes;
use std::io::Write;
use std::path::PathBuf;

/// Arguments of `moe-audit route`.
#[derive(Debug, Args)]
pub(crate) struct RouteArgs {
    /// A preset name (see `moe-audit presets`) or a router TOML file.
    pub(crate) router: String,
    /// Sequences per call.
    #[arg(long, default_value_t = SHOWN_BATCH, help_heading = "Sizes")]
    pub(crate) batch: usize,
    /// Tokens per sequence (default 8; with --logits, derived from the file).
    #[arg(long, help_heading = "Sizes")]
    pub(crate) seq_len: Option<usize>,
    /// Hidden size of the seeded layer.
    #[arg(long, default_value_t = RunSizes::default().hidden, help_heading = "Sizes")]
    pub(crate) hidden: usize,
    /// Expert FFN size of the seeded layer.
    #[arg(long, default_value_t = RunSizes::default().ffn, help_heading = "Sizes")]
    pub(crate) ffn: usize,
    /// Seed of the layer weights and hidden states.
    #[arg(long, default_value_t = 0, help_heading = "Input")]
    pub(crate) seed: u64,
    /// Route these logits instead: a JSON array of batch*seq_len rows of `experts` numbers,
    /// flattened sequence-major; --batch splits the rows into sequences.
    #[arg(long, value_name = "FILE", help_heading = "Input")]
    pub(crate) logits: Option<PathBuf>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = RouteFormat::Text, help_heading = "Output")]
    pub(crate) format: RouteFormat,
    /// The memory limit.
    #[command(flatten)]
    pub(crate) memory: MemoryArgs,
}

/// Output formats of `route`.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum RouteFormat {
    /// The compact routing table with the load summary (`table` until 0.3.0, still taken).
    #[value(alias = "table")]
    Text,
    /// The routing record as JSON.
    Json,
}

/// A validated `route`: the router, its input, the output format.
#[derive(Debug)]
pub(crate) struct RouteOptions {
    config: RouterConfig,
    input: Input,
    format: RouteFormat,
}

/// What is routed.
#[derive(Debug)]
enum Input {
    /// Given logits, `[batch, seq_len, experts]`.
    Logits(Logits),
    /// Hidden states drawn from `seed` through a layer seeded alike.
    Seeded { sizes: CallSizes, seed: u64 },
}

impl RouteArgs {
    /// The router loaded, the logits file read, sizes checked and the call's memory estimate
    /// checked against the limit.
    pub(crate) fn validated(&self) -> Result<RouteOptions> {
        let config = RouterConfig::load(&self.router)?;
        let budget = self.memory.budget();
        let (input, sizes) = match &self.logits {
            Some(path) => {
                let expected = format!("the router has {} experts", config.experts);
                let logits =
                    moe_audit::files::read_rows(path, self.batch, self.seq_len, config.experts, &expected, budget)?;
                let (batch, seq_len, _) = logits.dim();
                let sizes =
                    CallSizes { batch, seq_len, experts: config.experts, routes: config.k(), hidden: 0, ffn: 0 };
                (Input::Logits(logits), sizes)
            }
            None => {
                let seq_len = self.seq_len.unwrap_or(SHOWN_SEQ_LEN);
                ensure_positive(&[(BATCH, self.batch), (SEQ_LEN, seq_len), (HIDDEN, self.hidden), (FFN, self.ffn)])?;
                let sizes = CallSizes {
                    batch: self.batch,
                    seq_len,
                    experts: config.experts,
                    routes: config.k(),
                    hidden: self.hidden,
                    ffn: self.ffn,
                };
                (Input::Seeded { sizes, seed: self.seed }, sizes)
            }
        };
        budget.ensure_fits("this call", sizes.estimate())?;
        Ok(RouteOptions { config, input, format: self.format })
    }
}

pub(super) fn run(r: RouteOptions, out: &mut dyn Write) -> Result<u8> {
    let routing = match r.input {
        Input::Logits(logits) => assign(&r.config, logits.view())?,
        Input::Seeded { sizes, seed } => {
            let device = Device::Cpu;
            let layer = MoeLayer::seeded(r.config, sizes.hidden, sizes.ffn, seed, DType::F32, &device)?;
            // Hidden states from a stream of their own, so changing the weights' seed and the
            // input's seed are independent choices.
            let x = Seeded::new(seed ^ moe_audit::seeds::INPUT)
                .normal(&[sizes.batch, sizes.seq_len, sizes.hidden], &device)?;
            layer.forward(&x)?.1
        }
    };
    let text = match r.format {
        RouteFormat::Text => render_table(&routing),
        RouteFormat::Json => json(&routing),
    };
    out.write_all(text.as_bytes()).map_err(io_error)?;
    Ok(exit::OK)
}
