//! `moe-audit collectives`: gradient-like payloads all-reduced with every algorithm × wire ×
//! accumulator over a range of rank counts, against the exact sum (the GPT-4 failure, README
//! §1). Exit 1 when a configuration's bias exceeds `--max-bias`.

use super::common::{CommKind, MemoryArgs};
use super::exit;
use super::io_error;
use clap::{Args, ValueEnum};
use moe_audit::error::{Error, Result};
use moe_audit::parallel::reduce::{Algorithm, Precision, ReducePlan};
use moe_audit::parallel::swamping::{audit_in_process, sort_figures, AuditPlan, Figures, Payload};
use moe_audit::render::{collectives_chart, collectives_config_name, json, render_collectives, CollectivesReport};
use std::io::Write;
use std::path::PathBuf;

/// Most in-process ranks (one thread each).
const MAX_RANKS: usize = 1024;

/// Arguments of `moe-audit collectives`.
#[derive(Debug, Args)]
pub struct CollectivesArgs {
    /// Rank counts to reduce over (in-process; with --comm mpi, the MPI world size only).
    #[arg(long, value_delimiter = ',', default_value = "4,8,16,32,64")]
    pub ranks: Vec<usize>,
    /// How the ranks communicate (mpi: run under `mpirun -np R`; rank 0 prints).
    #[arg(long, value_enum, default_value_t = CommKind::InProcess)]
    pub comm: CommKind,
    /// Elements per buffer [default: 4096, or every value of --gradients].
    #[arg(long)]
    pub elements: Option<usize>,
    /// Dynamic ranges of the seeded payload: outliers are this many times the typical value.
    #[arg(long, value_delimiter = ',', default_value = "10,100,1000,10000")]
    pub ranges: Vec<f64>,
    /// Probability that a rank's value of an element is an outlier (seeded payload).
    #[arg(long, default_value_t = 0.01)]
    pub outliers: f64,
    /// Seed of the payload.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Real gradients instead of the seeded payload: a safetensors file whose tensors all have
    /// the ranks as first dimension (row r of every tensor, in name order, is rank r's buffer).
    #[arg(long, value_name = "FILE")]
    pub gradients: Option<PathBuf>,
    /// Algorithms compared.
    #[arg(long, value_parser = super::one_of(Algorithm::ALL, Algorithm::name, Algorithm::about), value_delimiter = ',', default_value = "ring,halving,hierarchical,direct")]
    pub algorithms: Vec<Algorithm>,
    /// Wire precisions compared.
    #[arg(long, value_parser = super::precision(), value_delimiter = ',', default_value = "f32,bf16,f16")]
    pub wire: Vec<Precision>,
    /// Accumulator precisions compared.
    #[arg(long, value_parser = super::precision(), value_delimiter = ',', default_value = "f32,bf16,f16")]
    pub accumulate: Vec<Precision>,
    /// Ranks per domain of the hierarchical algorithm (must divide every rank count).
    #[arg(long, default_value_t = 4)]
    pub domain: usize,
    /// An element is swamped when its error exceeds this share of its exact sum.
    #[arg(long, default_value_t = 0.01)]
    pub tolerance: f64,
    /// Exit 1 when a configuration's |bias| (mean signed error over mean |exact|) exceeds this.
    #[arg(long)]
    pub max_bias: Option<f64>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = CollectivesFormat::Text)]
    pub format: CollectivesFormat,
    /// Also draw relative error against ranks, one line per configuration and one chart per
    /// range, into this directory (SVG and PNG).
    #[arg(long, value_name = "DIR")]
    pub chart: Option<PathBuf>,
    /// The memory limit.
    #[command(flatten)]
    pub memory: MemoryArgs,
}

/// Output formats of `collectives`.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum CollectivesFormat {
    /// One table per dynamic range.
    Text,
    /// Every figure.
    Json,
}

pub(super) fn run(args: &CollectivesArgs, out: &mut dyn Write) -> Result<u8> {
    let (payload, plan) = validate(args)?;
    let results = match args.comm {
        CommKind::InProcess => audit_in_process(&args.ranks, &payload, &plan)?,
        CommKind::Mpi => match on_mpi(args, &payload, &plan)? {
            Some(mut r) => {
                sort_figures(&plan, &mut r);
                r
            }
            None => return Ok(exit::OK),
        },
    };
    // A NaN bias (an overflowed sum) counts as over.
    let mut over: Vec<String> = Vec::new();
    if let Some(max) = args.max_bias {
        for f in results.iter().filter(|f| f.bias.is_nan() || f.bias.abs() > max) {
            let name = collectives_config_name(f);
            if !over.contains(&name) {
                over.push(name);
            }
        }
    }
    let report = CollectivesReport {
        payload: args.gradients.as_ref().map_or("seeded".into(), |p| p.display().to_string()),
        elements: plan.elements,
        tolerance: plan.tolerance,
        max_bias: args.max_bias,
        results,
        over_max_bias: over,
    };
    if let Some(dir) = &args.chart {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, "cannot create", e))?;
        for &range in &plan.ranges {
            collectives_chart(&report, &plan, range, dir)?;
        }
    }
    let text = match args.format {
        CollectivesFormat::Json => json(&report),
        CollectivesFormat::Text => render_collectives(&report, &plan, &args.ranks, args.gradients.is_none()),
    };
    out.write_all(text.as_bytes()).map_err(io_error)?;
    Ok(exit::failed_if(!report.over_max_bias.is_empty()))
}

#[cfg(feature = "mpi")]
fn on_mpi(args: &CollectivesArgs, payload: &Payload, plan: &AuditPlan) -> Result<Option<Vec<Figures>>> {
    use moe_audit::parallel::Communicator as _;
    let comm = moe_audit::parallel::mpi::MpiComm::init()?;
    let result = if args.ranks.len() != 1 || args.ranks[0] != comm.size() {
        Err(Error::usage(format!("--ranks must be the MPI world size {} under --comm mpi (mpirun -np)", comm.size())))
    } else {
        moe_audit::parallel::swamping::audit(&comm, payload, plan)
    };
    Ok(result.unwrap_or_else(|e| comm.abort(&e)))
}

#[cfg(not(feature = "mpi"))]
fn on_mpi(_: &CollectivesArgs, _: &Payload, _: &AuditPlan) -> Result<Option<Vec<Figures>>> {
    Err(super::common::no_mpi())
}

/// Every rule on the flags in one place; reads the gradients file.
fn validate(args: &CollectivesArgs) -> Result<(Payload, AuditPlan)> {
    let usage = |m: String| Err(Error::usage(m));
    if args.ranks.is_empty() {
        return usage("--ranks is empty".into());
    }
    if let Some(&r) = args.ranks.iter().find(|&&r| r == 0 || r > MAX_RANKS) {
        return usage(format!("--ranks must be between 1 and {MAX_RANKS}, got {r}"));
    }
    if args.algorithms.contains(&Algorithm::Hierarchical) {
        if args.domain == 0 {
            return usage("--domain must be at least 1".into());
        }
        if let Some(&r) = args.ranks.iter().find(|&&r| r % args.domain != 0) {
            return usage(format!("--domain {} does not divide {r} ranks (hierarchical reduction)", args.domain));
        }
    }
    if !(args.tolerance > 0.0 && args.tolerance.is_finite()) {
        return usage(format!("--tolerance must be a positive number, got {}", args.tolerance));
    }
    if let Some(m) = args.max_bias.filter(|m| !(*m >= 0.0 && m.is_finite())) {
        return usage(format!("--max-bias must be a number ≥ 0, got {m}"));
    }
    for (flag, empty) in [
        ("--algorithms", args.algorithms.is_empty()),
        ("--wire", args.wire.is_empty()),
        ("--accumulate", args.accumulate.is_empty()),
    ] {
        if empty {
            return usage(format!("{flag} is empty"));
        }
    }
    let max_ranks = *args.ranks.iter().max().expect("not empty");
    let budget = args.memory.budget();
    let (payload, elements, ranges) = match &args.gradients {
        Some(path) => {
            // The file's own size bounds what reading it allocates.
            let size = std::fs::metadata(path).map_err(|e| Error::io(path, "cannot read", e))?.len();
            budget.ensure_fits("reading the gradients", size.saturating_mul(3))?;
            let rows = moe_audit::parallel::swamping::read_gradients(path)?;
            if let Some(&r) = args.ranks.iter().find(|&&r| r > rows.len()) {
                return usage(format!("--ranks {r}: {} holds gradients of {} ranks", path.display(), rows.len()));
            }
            let n = rows[0].len();
            let elements = args.elements.unwrap_or(n);
            if elements > n {
                return usage(format!("--elements {elements}: {} holds {n} values per rank", path.display()));
            }
            (Payload::Rows(rows), elements, vec![1.0])
        }
        None => {
            if !(0.0..=1.0).contains(&args.outliers) {
                return usage(format!("--outliers must be a probability in [0, 1], got {}", args.outliers));
            }
            if let Some(r) = args.ranges.iter().find(|r| !(**r >= 1.0 && r.is_finite())) {
                return usage(format!("--ranges must be finite numbers ≥ 1, got {r}"));
            }
            if args.ranges.is_empty() {
                return usage("--ranges is empty".into());
            }
            let payload = Payload::Seeded { seed: args.seed, outliers: args.outliers };
            (payload, args.elements.unwrap_or(4096), args.ranges.clone())
        }
    };
    if elements == 0 {
        return usage("--elements must be at least 1".into());
    }
    // Per rank: its payload, the buffer, a rounded copy, the message and what arrives (5 × 4
    // bytes per element); rank 0 also holds every rank's payload and the exact sums.
    let per_element = (max_ranks as u64).saturating_mul(20 + 4).saturating_add(8);
    budget.ensure_fits("this reduction", (elements as u64).saturating_mul(per_element).saturating_add(32 << 20))?;
    let mut plans = Vec::new();
    for &algorithm in &args.algorithms {
        for &wire in &args.wire {
            for &accumulate in &args.accumulate {
                plans.push(ReducePlan { algorithm, wire, accumulate, domain: args.domain });
            }
        }
    }
    Ok((payload, AuditPlan { elements, ranges, plans, tolerance: args.tolerance }))
}
