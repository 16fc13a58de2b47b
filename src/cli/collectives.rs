//! `moe-audit collectives`: gradient-like payloads all-reduced with every algorithm × wire ×
//! accumulator over a range of rank counts, against the exact sum (the GPT-4 failure, README
//! §1). Exit 1 when a configuration's bias exceeds `--max-bias`.

use super::common::{CommKind, MemoryArgs};
use super::exit;
use super::io_error;
use clap::{Args, ValueEnum};
use moe_audit::error::{Error, Result};
use moe_audit::parallel::reduce::{Algorithm, Precision, ReducePlan};
use moe_audit::parallel::swamping::{audit_in_process, sort_figures, AuditPlan, CollectivesReport, Figures, Payload};
use moe_audit::render::{collectives_chart, json, render_collectives};
use std::io::Write;
use std::path::PathBuf;

/// Most in-process ranks (one thread each).
const MAX_RANKS: usize = 1024;

/// Arguments of `moe-audit collectives`.
#[derive(Debug, Args)]
pub(crate) struct CollectivesArgs {
    /// Rank counts to reduce over (in-process; with --comm mpi, the MPI world size only).
    #[arg(long, value_delimiter = ',', default_value = "4,8,16,32,64")]
    pub(crate) ranks: Vec<usize>,
    /// How the ranks communicate (mpi: run under `mpirun -np R`; rank 0 prints).
    #[arg(long, value_enum, default_value_t = CommKind::InProcess)]
    pub(crate) comm: CommKind,
    /// Elements per buffer [default: 4096, or every value of --gradients].
    #[arg(long)]
    pub(crate) elements: Option<usize>,
    /// Dynamic ranges of the seeded payload: outliers are this many times the typical value.
    #[arg(long, value_delimiter = ',', default_value = "10,100,1000,10000")]
    pub(crate) ranges: Vec<f64>,
    /// Probability that a rank's value of an element is an outlier (seeded payload).
    #[arg(long, default_value_t = 0.01)]
    pub(crate) outliers: f64,
    /// Seed of the payload.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// Real gradients instead of the seeded payload: a safetensors file whose tensors all have
    /// the ranks as first dimension (row r of every tensor, in name order, is rank r's buffer).
    #[arg(long, value_name = "FILE")]
    pub(crate) gradients: Option<PathBuf>,
    /// Algorithms compared.
    #[arg(long, value_parser = super::one_of(Algorithm::ALL, Algorithm::name, Algorithm::about), value_delimiter = ',', default_value = "ring,halving,hierarchical,direct")]
    pub(crate) algorithms: Vec<Algorithm>,
    /// Wire precisions compared.
    #[arg(long, value_parser = super::precision(), value_delimiter = ',', default_value = "f32,bf16,f16")]
    pub(crate) wire: Vec<Precision>,
    /// Accumulator precisions compared.
    #[arg(long, value_parser = super::precision(), value_delimiter = ',', default_value = "f32,bf16,f16")]
    pub(crate) accumulate: Vec<Precision>,
    /// Ranks per domain of the hierarchical algorithm (must divide every rank count).
    #[arg(long, default_value_t = 4)]
    pub(crate) domain: usize,
    /// An element is swamped when its error exceeds this share of its exact sum.
    #[arg(long, default_value_t = 0.01)]
    pub(crate) tolerance: f64,
    /// Exit 1 when a configuration's |bias| (mean signed error over mean |exact|) exceeds this.
    #[arg(long)]
    pub(crate) max_bias: Option<f64>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = CollectivesFormat::Text)]
    pub(crate) format: CollectivesFormat,
    /// Also draw relative error against ranks, one line per configuration and one chart per
    /// range, into this directory (SVG and PNG).
    #[arg(long = "chart-dir", alias = "chart", value_name = "DIR")]
    pub(crate) chart: Option<PathBuf>,
    /// The memory limit.
    #[command(flatten)]
    pub(crate) memory: MemoryArgs,
}

/// Output formats of `collectives`.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum CollectivesFormat {
    /// One table per dynamic range.
    Text,
    /// Every figure.
    Json,
}

/// A validated `collectives`: the payload, the plan, and what to do with the figures.
#[derive(Debug)]
pub(crate) struct CollectivesOptions {
    /// Rank counts, each in 1..=MAX_RANKS.
    ranks: Vec<usize>,
    comm: CommKind,
    payload: Payload,
    /// How the report names the payload: `seeded` or the gradients file.
    payload_name: String,
    plan: AuditPlan,
    max_bias: Option<f64>,
    format: CollectivesFormat,
    chart: Option<PathBuf>,
}

impl CollectivesArgs {
    /// Every rule on the flags in one place, in named steps; reads the gradients file.
    pub(crate) fn validated(&self) -> Result<CollectivesOptions> {
        self.check_ranks()?;
        self.check_reductions()?;
        let budget = self.memory.budget();
        let (payload, elements, ranges) = self.payload(budget)?;
        if elements == 0 {
            return Err(Error::usage("--elements must be at least 1"));
        }
        let plan = AuditPlan { elements, ranges, plans: self.reduce_plans(), tolerance: self.tolerance };
        let max_ranks = *self.ranks.iter().max().expect("checked not empty");
        budget.ensure_fits("this reduction", plan.memory_estimate(max_ranks))?;
        Ok(CollectivesOptions {
            ranks: self.ranks.clone(),
            comm: self.comm,
            payload,
            payload_name: self.gradients.as_ref().map_or("seeded".into(), |p| p.display().to_string()),
            plan,
            max_bias: self.max_bias,
            format: self.format,
            chart: self.chart.clone(),
        })
    }

    /// `--ranks`: not empty, each from 1 to [`MAX_RANKS`].
    fn check_ranks(&self) -> Result<()> {
        if self.ranks.is_empty() {
            return Err(Error::usage("--ranks is empty"));
        }
        if let Some(&r) = self.ranks.iter().find(|&&r| r == 0 || r > MAX_RANKS) {
            return Err(Error::usage(format!("--ranks must be between 1 and {MAX_RANKS}, got {r}")));
        }
        Ok(())
    }

    /// `--domain`, `--tolerance`, `--max-bias` and the lists of algorithms and precisions.
    fn check_reductions(&self) -> Result<()> {
        let usage = |m: String| Err(Error::usage(m));
        if self.algorithms.contains(&Algorithm::Hierarchical) {
            if self.domain == 0 {
                return usage("--domain must be at least 1".into());
            }
            if let Some(&r) = self.ranks.iter().find(|&&r| r % self.domain != 0) {
                return usage(format!("--domain {} does not divide {r} ranks (hierarchical reduction)", self.domain));
            }
        }
        if !(self.tolerance > 0.0 && self.tolerance.is_finite()) {
            return usage(format!("--tolerance must be a positive number, got {}", self.tolerance));
        }
        if let Some(m) = self.max_bias.filter(|m| !(*m >= 0.0 && m.is_finite())) {
            return usage(format!("--max-bias must be a number ≥ 0, got {m}"));
        }
        for (flag, empty) in [
            ("--algorithms", self.algorithms.is_empty()),
            ("--wire", self.wire.is_empty()),
            ("--accumulate", self.accumulate.is_empty()),
        ] {
            if empty {
                return usage(format!("{flag} is empty"));
            }
        }
        Ok(())
    }

    /// The payload, its elements per buffer and its dynamic ranges: the gradients file's (read
    /// within `budget`), or the seeded one's.
    fn payload(&self, budget: moe_audit::MemoryBudget) -> Result<(Payload, usize, Vec<f64>)> {
        let usage = |m: String| Err(Error::usage(m));
        match &self.gradients {
            Some(path) => {
                let rows = moe_audit::parallel::swamping::read_gradients(path, budget)?;
                if let Some(&r) = self.ranks.iter().find(|&&r| r > rows.len()) {
                    return usage(format!("--ranks {r}: {} holds gradients of {} ranks", path.display(), rows.len()));
                }
                let n = rows[0].len();
                let elements = self.elements.unwrap_or(n);
                if elements > n {
                    return usage(format!("--elements {elements}: {} holds {n} values per rank", path.display()));
                }
                Ok((Payload::Rows(rows), elements, vec![1.0]))
            }
            None => {
                if !(0.0..=1.0).contains(&self.outliers) {
                    return usage(format!("--outliers must be a probability in [0, 1], got {}", self.outliers));
                }
                if let Some(r) = self.ranges.iter().find(|r| !(**r >= 1.0 && r.is_finite())) {
                    return usage(format!("--ranges must be finite numbers ≥ 1, got {r}"));
                }
                if self.ranges.is_empty() {
                    return usage("--ranges is empty".into());
                }
                let payload = Payload::Seeded { seed: self.seed, outliers: self.outliers };
                Ok((payload, self.elements.unwrap_or(4096), self.ranges.clone()))
            }
        }
    }

    /// Every algorithm × wire × accumulator, in that order.
    fn reduce_plans(&self) -> Vec<ReducePlan> {
        let mut plans = Vec::new();
        for &algorithm in &self.algorithms {
            for &wire in &self.wire {
                for &accumulate in &self.accumulate {
                    plans.push(ReducePlan { algorithm, wire, accumulate, domain: self.domain });
                }
            }
        }
        plans
    }
}

pub(super) fn run(c: CollectivesOptions, out: &mut dyn Write) -> Result<u8> {
    let results = match c.comm {
        CommKind::InProcess => audit_in_process(&c.ranks, &c.payload, &c.plan)?,
        CommKind::Mpi => match on_mpi(&c.ranks, &c.payload, &c.plan)? {
            Some(mut r) => {
                sort_figures(&c.plan, &mut r);
                r
            }
            None => return Ok(exit::OK),
        },
    };
    let seeded = matches!(c.payload, Payload::Seeded { .. });
    let report = CollectivesReport::new(c.payload_name, &c.plan, c.max_bias, results);
    if let Some(dir) = &c.chart {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, "cannot create", e))?;
        for &range in &c.plan.ranges {
            collectives_chart(&report, &c.plan, range, dir)?;
        }
    }
    let text = match c.format {
        CollectivesFormat::Json => json(&report),
        CollectivesFormat::Text => render_collectives(&report, &c.plan, &c.ranks, seeded),
    };
    out.write_all(text.as_bytes()).map_err(io_error)?;
    Ok(exit::failed_if(report.failed()))
}

#[cfg(feature = "mpi")]
fn on_mpi(ranks: &[usize], payload: &Payload, plan: &AuditPlan) -> Result<Option<Vec<Figures>>> {
    use moe_audit::parallel::Communicator as _;
    let comm = moe_audit::parallel::mpi::MpiComm::init()?;
    let result = if ranks.len() != 1 || ranks[0] != comm.size() {
        Err(Error::usage(format!("--ranks must be the MPI world size {} under --comm mpi (mpirun -np)", comm.size())))
    } else {
        moe_audit::parallel::swamping::audit(&comm, payload, plan)
    };
    Ok(result.unwrap_or_else(|e| comm.abort(&e)))
}

#[cfg(not(feature = "mpi"))]
fn on_mpi(_: &[usize], _: &Payload, _: &AuditPlan) -> Result<Option<Vec<Figures>>> {
    Err(super::common::no_mpi())
}
