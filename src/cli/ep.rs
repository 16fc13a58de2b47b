//! `moe-audit ep`: one expert-parallel forward of a seeded layer, with each rank's traffic
//! beside the all-to-all formula of docs/ROUTING.md and the output checked against the single-device layer.

use super::common::{CommKind, MemoryArgs, SizeArgs};
use super::exit;
use super::io_error;
use candle_core::{DType, Device, Tensor};
use clap::{Args, ValueEnum};
use moe_audit::config::RouterConfig;
use moe_audit::error::Result;
use moe_audit::layer::CallSizes;
use moe_audit::layer::{MoeLayer, Seeded};
use moe_audit::parallel::reduce::Precision;
use moe_audit::parallel::{split_batch, Communicator, ExpertParallel};
use moe_audit::render::{json, render_ep, EpReport};
use moe_audit::RunSizes;
use std::io::Write;
use std::path::PathBuf;

/// Arguments of `moe-audit ep`.
#[derive(Debug, Args)]
pub(crate) struct EpArgs {
    /// Preset name or router TOML file.
    pub(crate) router: String,
    /// Ranks (in-process; with --comm mpi, the MPI world size) [default: 2].
    #[arg(long)]
    pub(crate) ranks: Option<usize>,
    /// How the ranks communicate (mpi: run under `mpirun -np R`; rank 0 prints).
    #[arg(long, value_enum, default_value_t = CommKind::InProcess)]
    pub(crate) comm: CommKind,
    /// Sizes of the seeded layer's call.
    #[command(flatten)]
    pub(crate) sizes: SizeArgs,
    /// Seed of the layer and the input.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// Hidden states instead of seeded ones: a JSON array of batch*seq_len rows of `hidden`
    /// numbers, sequence-major (--batch splits them into sequences).
    #[arg(long = "hidden-states", alias = "input", value_name = "FILE")]
    pub(crate) input: Option<PathBuf>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = EpFormat::Text)]
    pub(crate) format: EpFormat,
    /// The memory limit.
    #[command(flatten)]
    pub(crate) memory: MemoryArgs,
    /// Precision of the expert outputs on their way back (the combine's wire); with a
    /// low-precision combine the report compares the output with the f32 combine's.
    #[arg(long, value_parser = super::precision(), default_value = "f32")]
    pub(crate) combine_wire: Precision,
    /// Precision of the combine's sum of each token's weighted expert outputs.
    #[arg(long, value_parser = super::precision(), default_value = "f32")]
    pub(crate) combine_accumulate: Precision,
}

/// Output formats of `ep`.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum EpFormat {
    /// A table per rank.
    Text,
    /// The whole result.
    Json,
}

/// A validated `ep`: the seeded layer's router and sizes, its input, how it runs.
#[derive(Debug)]
pub(crate) struct EpOptions {
    config: RouterConfig,
    run: RunSizes,
    /// `--ranks` as given (MPI checks it against the world size).
    ranks_given: Option<usize>,
    comm: CommKind,
    seed: u64,
    /// Given hidden states, `[batch, seq_len, hidden]`; seeded ones when `None`.
    input: Option<Tensor>,
    combine: (Precision, Precision),
    format: EpFormat,
}

impl EpArgs {
    /// Sizes checked, the router loaded, the input file read, and the forward's memory estimate
    /// (at the input's real sizes: a file's, not --seq-len) checked against the limit.
    pub(crate) fn validated(&self) -> Result<EpOptions> {
        let ranks = self.ranks.unwrap_or(RunSizes::default().ranks);
        let run = self.sizes.validated(RunSizes::default().trials, ranks)?;
        let config = RouterConfig::load(&self.router)?;
        let budget = self.memory.budget();
        let rows = match &self.input {
            Some(path) => {
                let expected = format!("--hidden is {}", run.hidden);
                Some(moe_audit::files::read_rows(path, run.batch, None, run.hidden, &expected, budget)?)
            }
            None => None,
        };
        let sizes = CallSizes {
            batch: run.batch,
            seq_len: rows.as_ref().map_or(run.seq_len, |rows| rows.dim().1),
            experts: config.experts,
            routes: config.k(),
            hidden: run.hidden,
            ffn: run.ffn,
        };
        budget.ensure_fits("this forward", ExpertParallel::memory_estimate(&sizes))?;
        let input = rows
            .map(|rows| {
                let dims = rows.dim();
                Tensor::from_vec(rows.into_raw_vec_and_offset().0, dims, &Device::Cpu)
            })
            .transpose()?;
        Ok(EpOptions {
            config,
            run,
            ranks_given: self.ranks,
            comm: self.comm,
            seed: self.seed,
            input,
            combine: (self.combine_wire, self.combine_accumulate),
            format: self.format,
        })
    }
}

pub(super) fn run(e: EpOptions, out: &mut dyn Write) -> Result<u8> {
    let run = e.run;
    let layer = MoeLayer::seeded(e.config, run.hidden, run.ffn, e.seed, DType::F32, &Device::Cpu)?;
    let x = match e.input {
        Some(x) => x,
        None => Seeded::new(e.seed ^ moe_audit::seeds::EP_INPUT)
            .normal(&[run.batch, run.seq_len, run.hidden], &Device::Cpu)?,
    };
    let ep = ExpertParallel::new(&layer).with_combine(e.combine.0, e.combine.1);
    let report = match e.comm {
        // Threads of this process: every rank's result comes back as a value, reported once.
        CommKind::InProcess => {
            split_batch(run.batch, run.ranks)?;
            ep.local_experts(run.ranks)?;
            ep.report(&x, ep.forward_in_process(&x, run.ranks)?, run.ranks)?
        }
        CommKind::Mpi => {
            let work = |comm: &dyn Communicator| -> Result<EpReport> {
                split_batch(run.batch, comm.size())?;
                ep.local_experts(comm.size())?;
                ep.report(&x, ep.forward_gathered(comm, &x)?, comm.size())
            };
            let Some(report) = on_mpi(e.ranks_given, work)? else { return Ok(exit::OK) };
            report
        }
    };
    let text = match e.format {
        EpFormat::Json => json(&report),
        EpFormat::Text => render_ep(&report),
    };
    out.write_all(text.as_bytes()).map_err(io_error)?;
    Ok(exit::OK)
}

/// Runs `work` on every MPI rank; returns rank 0's result (`None` on the other ranks).
#[cfg(feature = "mpi")]
fn on_mpi<T>(ranks: Option<usize>, work: impl Fn(&dyn Communicator) -> Result<T>) -> Result<Option<T>> {
    let comm = moe_audit::parallel::mpi::MpiComm::init()?;
    let result = match ranks {
        Some(r) if r != comm.size() => Err(moe_audit::Error::usage(format!(
            "--ranks {r} differs from the MPI world size {} (mpirun -np)",
            comm.size()
        ))),
        _ => work(&comm),
    };
    let value = result.unwrap_or_else(|e| comm.abort(&e));
    Ok((comm.rank() == 0).then_some(value))
}

#[cfg(not(feature = "mpi"))]
fn on_mpi<T>(_: Option<usize>, _: impl Fn(&dyn Communicator) -> Result<T>) -> Result<Option<T>> {
    Err(super::common::no_mpi())
}
