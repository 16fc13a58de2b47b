//! `moe-audit ep`: one expert-parallel forward of a seeded layer, with each rank's traffic
//! beside the all-to-all formula of docs/ROUTING.md and the output checked against the single-device layer.

use super::check::CommKind;
use super::io_error;
use crate::config::RouterConfig;
use crate::error::{ensure_positive, Result, Setting};
use crate::layer::{MoeLayer, Seeded};
use crate::memory::{self, CallSizes};
use crate::parallel::reduce::Precision;
use crate::parallel::swamping::compare;
use crate::parallel::{split_batch, Communicator, ExpertParallel, Gathered};
use crate::render::{json, render_ep, CombineFigures, EpReport};
use crate::router::Router;
use bytesize::ByteSize;
use candle_core::{DType, Device, Tensor};
use clap::{Args, ValueEnum};
use std::io::Write;
use std::path::PathBuf;

/// Arguments of `moe-audit ep`.
#[derive(Debug, Args)]
pub struct EpArgs {
    /// Preset name or router TOML file.
    pub router: String,
    /// Ranks (in-process; with --comm mpi, the MPI world size) [default: 2].
    #[arg(long)]
    pub ranks: Option<usize>,
    /// How the ranks communicate (mpi: run under `mpirun -np R`; rank 0 prints).
    #[arg(long, value_enum, default_value_t = CommKind::InProcess)]
    pub comm: CommKind,
    /// Sequences (split evenly over the ranks).
    #[arg(long, default_value_t = 4)]
    pub batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 128)]
    pub seq_len: usize,
    /// Hidden size of the seeded layer.
    #[arg(long, default_value_t = 64)]
    pub hidden: usize,
    /// Expert FFN size of the seeded layer.
    #[arg(long, default_value_t = 128)]
    pub ffn: usize,
    /// Seed of the layer and the input.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Hidden states instead of seeded ones: a JSON array of batch*seq_len rows of `hidden`
    /// numbers, sequence-major (--batch splits them into sequences).
    #[arg(long, value_name = "FILE")]
    pub input: Option<PathBuf>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = EpFormat::Text)]
    pub format: EpFormat,
    /// Refuse to start a forward estimated to need more memory (e.g. `4GiB`; default: half of
    /// physical memory).
    #[arg(long, value_name = "SIZE", value_parser = crate::memory::parse_size, allow_hyphen_values = true)]
    pub max_memory: Option<ByteSize>,
    /// Precision of the expert outputs on their way back (the combine's wire); with a
    /// low-precision combine the report compares the output with the f32 combine's.
    #[arg(long, value_enum, default_value_t = Precision::F32)]
    pub combine_wire: Precision,
    /// Precision of the combine's sum of each token's weighted expert outputs.
    #[arg(long, value_enum, default_value_t = Precision::F32)]
    pub combine_accumulate: Precision,
}

/// Output formats of `ep`.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum EpFormat {
    /// A table per rank.
    Text,
    /// The whole result.
    Json,
}

pub(super) fn run(args: &EpArgs, out: &mut dyn Write) -> Result<u8> {
    ensure_positive(&[
        (Setting::Batch, args.batch),
        (Setting::SeqLen, args.seq_len),
        (Setting::Hidden, args.hidden),
        (Setting::Ffn, args.ffn),
    ])?;
    let config = RouterConfig::load(&args.router)?;
    let sizes = CallSizes {
        batch: args.batch,
        seq_len: args.seq_len,
        experts: config.experts,
        routes: config.k(),
        hidden: args.hidden,
        ffn: args.ffn,
    };
    let max_memory = memory::limit(args.max_memory);
    // The input's real sizes (a file's, not --seq-len) decide the estimate.
    let input = match &args.input {
        Some(path) => {
            let expected = format!("--hidden is {}", args.hidden);
            Some(crate::files::read_rows(path, args.batch, None, args.hidden, &expected, max_memory)?)
        }
        None => None,
    };
    let sizes = CallSizes { seq_len: input.as_ref().map_or(sizes.seq_len, |rows| rows.dim().1), ..sizes };
    // The expert-parallel forward, its gathered outputs and the single-device forward.
    memory::ensure_fits("this forward", sizes.estimate().saturating_mul(3), max_memory)?;
    let layer = MoeLayer::seeded(config, args.hidden, args.ffn, args.seed, DType::F32, &Device::Cpu)?;
    let x = match input {
        Some(rows) => {
            let dims = rows.dim();
            Tensor::from_vec(rows.into_raw_vec_and_offset().0, dims, &Device::Cpu)?
        }
        None => Seeded::new(args.seed ^ 0xe9).normal(&[args.batch, args.seq_len, args.hidden], &Device::Cpu)?,
    };
    let seq_len = x.dims3()?.1;
    let ep = ExpertParallel::new(&layer).with_combine(args.combine_wire, args.combine_accumulate);
    let report = |g: Gathered, ranks: usize| -> Result<EpReport> {
        let (_, whole) = layer.forward(&x)?;
        let low = (args.combine_wire, args.combine_accumulate) != (Precision::F32, Precision::F32);
        let low_precision_combine = if low {
            let reference: Vec<f64> =
                layer.apply(&x, &g.routing)?.flatten_all()?.to_vec1::<f32>()?.into_iter().map(f64::from).collect();
            let f = compare(&g.y.flatten_all()?.to_vec1::<f32>()?, &reference, 0.01);
            Some(CombineFigures {
                wire: args.combine_wire,
                accumulate: args.combine_accumulate,
                relative_error: f.relative_error,
                swamped_share: f.swamped_share,
                bias: f.bias,
            })
        } else {
            None
        };
        let differ = (whole.tokens.iter().zip(&g.routing.tokens)).filter(|(a, b)| a.routes != b.routes).count();
        Ok(EpReport {
            router: layer.router().name().to_string(),
            ranks,
            batch: args.batch,
            seq_len,
            hidden: args.hidden,
            experts: layer.dims().experts,
            output_checksum: format!("{:016x}", checksum(&g.y)?),
            equals_single_device: checksum(&g.y)? == checksum(&layer.apply(&x, &g.routing)?)?,
            tokens_routed_differently: differ,
            traffic: g.traffic,
            low_precision_combine,
        })
    };
    let report = match args.comm {
        // Threads of this process: every rank's result comes back as a value, reported once.
        CommKind::InProcess => {
            let ranks = args.ranks.unwrap_or(2);
            ensure_positive(&[(Setting::Ranks, ranks)])?;
            split_batch(args.batch, ranks)?;
            ep.local_experts(ranks)?;
            report(ep.forward_in_process(&x, ranks)?, ranks)?
        }
        CommKind::Mpi => {
            let work = |comm: &dyn Communicator| -> Result<EpReport> {
                split_batch(args.batch, comm.size())?;
                ep.local_experts(comm.size())?;
                report(ep.forward_gathered(comm, &x)?, comm.size())
            };
            let Some(report) = on_mpi(args.ranks, work)? else { return Ok(0) };
            report
        }
    };
    let text = match args.format {
        EpFormat::Json => json(&report),
        EpFormat::Text => render_ep(&report),
    };
    out.write_all(text.as_bytes()).map_err(io_error)?;
    Ok(0)
}

/// Runs `work` on every MPI rank; returns rank 0's result (`None` on the other ranks).
#[cfg(feature = "mpi")]
fn on_mpi<T>(ranks: Option<usize>, work: impl Fn(&dyn Communicator) -> Result<T>) -> Result<Option<T>> {
    let comm = crate::parallel::mpi::MpiComm::init()?;
    let result = match ranks {
        Some(r) if r != comm.size() => Err(crate::Error::Usage(format!(
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
    Err(super::check::no_mpi())
}

fn checksum(y: &Tensor) -> Result<u64> {
    let bits = y.flatten_all()?.to_vec1::<f32>()?;
    Ok(bits
        .iter()
        .flat_map(|v| v.to_bits().to_le_bytes())
        .fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)))
}
