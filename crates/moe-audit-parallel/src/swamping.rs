//! The collectives audit: gradient-like payloads reduced with every algorithm × wire precision ×
//! accumulator, each result compared with the exact sum (README: the GPT-4 failure).
//!
//! Every rank runs the same sequence of all-reduces on its own payload; rank 0 regenerates (or
//! holds) every rank's payload, so it computes the exact sums without any extra communication.

use super::comm::Communicator;
use super::reduce::{all_reduce, Algorithm, Precision, ReducePlan};
use moe_audit_core::error::{Error, Result};
use moe_audit_core::MemoryBudget;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};
use serde::Serialize;

/// Where each rank's values come from.
#[derive(Debug, Clone)]
pub enum Payload {
    /// Seeded gradient-like values: element i has a scale `s_i` log-uniform in [1e-3, 1e-1]
    /// (parameters' gradients differ in size), and rank r's value is `s_i · (0.5 + z)` with z
    /// standard normal (a direction every rank agrees on, plus noise), except that with
    /// probability `outliers` it is an outlier `± s_i · range · (1 + u)`, u uniform in [0, 1).
    Seeded {
        /// Seed of every value.
        seed: u64,
        /// Probability that a rank's value of an element is an outlier.
        outliers: f64,
    },
    /// Given values: row r is rank r's buffer (real gradients, from safetensors).
    Rows(Vec<Vec<f32>>),
}

impl Payload {
    /// Rank `rank`'s `n` values at dynamic range `range` (ignored for given rows).
    pub fn values(&self, rank: usize, n: usize, range: f64) -> Result<Vec<f32>> {
        match self {
            Payload::Seeded { seed, outliers } => {
                let mut scales = ChaCha8Rng::seed_from_u64(*seed);
                let mut rng = ChaCha8Rng::seed_from_u64(
                    seed.wrapping_add(0x9e37_79b9_7f4a_7c15u64.wrapping_mul(rank as u64 + 1)),
                );
                Ok((0..n)
                    .map(|_| {
                        let s = 10f64.powf(scales.random_range(-3.0..-1.0));
                        let z: f64 = StandardNormal.sample(&mut rng);
                        let v = if rng.random_bool(*outliers) {
                            let sign = if rng.random_bool(0.5) { 1.0 } else { -1.0 };
                            sign * s * range * (1.0 + rng.random::<f64>())
                        } else {
                            s * (0.5 + z)
                        };
                        v as f32
                    })
                    .collect())
            }
            Payload::Rows(rows) => {
                let row = rows.get(rank).ok_or_else(|| {
                    Error::usage(format!("rank {rank} asked for, the gradients hold {} ranks", rows.len()))
                })?;
                Ok(row[..n.min(row.len())].to_vec())
            }
        }
    }
}

/// What the audit runs: the grid and the figures' tolerance.
#[derive(Debug, Clone, Serialize)]
pub struct AuditPlan {
    /// Elements per buffer.
    pub elements: usize,
    /// Dynamic ranges (outlier over typical size) of the seeded payload; one entry (1) for given rows.
    pub ranges: Vec<f64>,
    /// The reductions compared.
    pub plans: Vec<ReducePlan>,
    /// An element is swamped when its error exceeds this share of its exact sum.
    pub tolerance: f64,
}

impl AuditPlan {
    /// Bytes the audit needs at most at `max_ranks` ranks: per rank its payload, the buffer, a
    /// rounded copy, the message and what arrives (5 × 4 bytes per element); rank 0 also holds
    /// every rank's payload and the exact sums; 32 MiB for the rest.
    pub fn memory_estimate(&self, max_ranks: usize) -> u64 {
        let per_element = (max_ranks as u64).saturating_mul(20 + 4).saturating_add(8);
        (self.elements as u64).saturating_mul(per_element).saturating_add(32 << 20)
    }
}

/// What the collectives audit reports (`moe-audit collectives --format json`).
#[derive(Debug, Serialize)]
pub struct CollectivesReport {
    /// `seeded` or the gradients file.
    pub payload: String,
    /// Elements per buffer.
    pub elements: usize,
    /// An element is swamped when its error exceeds this share of its exact sum.
    pub tolerance: f64,
    /// The largest |bias| a configuration may show, if any.
    pub max_bias: Option<f64>,
    /// One entry per range × rank count × configuration.
    pub results: Vec<Figures>,
    /// Configurations whose |bias| exceeds `max_bias` (at any rank count or range), each once,
    /// in the order of `results`.
    pub over_max_bias: Vec<String>,
}

impl CollectivesReport {
    /// The report of `results` of `plan` on `payload`, with the verdict against `max_bias`: a
    /// configuration fails when its |bias| exceeds it at any rank count or range, or when its
    /// bias is NaN (an overflowed sum).
    pub fn new(payload: String, plan: &AuditPlan, max_bias: Option<f64>, results: Vec<Figures>) -> Self {
        let mut over: Vec<String> = Vec::new();
        if let Some(max) = max_bias {
            for f in results.iter().filter(|f| f.bias.is_nan() || f.bias.abs() > max) {
                let name = f.config_name();
                if !over.contains(&name) {
                    over.push(name);
                }
            }
        }
        CollectivesReport {
            payload,
            elements: plan.elements,
            tolerance: plan.tolerance,
            max_bias,
            results,
            over_max_bias: over,
        }
    }

    /// Whether some configuration's bias exceeds the maximum.
    pub fn failed(&self) -> bool {
        !self.over_max_bias.is_empty()
    }
}

/// One reduction of one payload, against the exact sum.
#[derive(Debug, Clone, Serialize)]
pub struct Figures {
    /// The algorithm.
    pub algorithm: Algorithm,
    /// The wire precision.
    pub wire: Precision,
    /// The accumulator.
    pub accumulate: Precision,
    /// Ranks.
    pub ranks: usize,
    /// Dynamic range of the payload.
    pub range: f64,
    /// ‖result − exact‖₂ / ‖exact‖₂ over the finite results.
    pub relative_error: f64,
    /// Share of elements with |result − exact| > tolerance · |exact| (non-finite results included).
    pub swamped_share: f64,
    /// Mean signed error over mean |exact|: the part that does not average out.
    pub bias: f64,
    /// Elements whose result is not finite (overflow).
    pub non_finite: usize,
    /// Bytes the busiest rank sent.
    pub max_bytes_sent: u64,
    /// The all-reduce formula `2·B·(R−1)/R`, B the buffer's bytes on the wire.
    pub formula_bytes: f64,
    /// FNV-1a 64 of the result's f32 bits (equal results, equal checksums).
    pub checksum: String,
}

impl Figures {
    /// Its configuration as reports name it: `ring wire f16 accumulate f32`.
    pub(crate) fn config_name(&self) -> String {
        format!("{} wire {} accumulate {}", self.algorithm.name(), self.wire.name(), self.accumulate.name())
    }
}

/// Runs every all-reduce of `plan` on this rank. On rank 0 returns the figures, in the order
/// range × reduction plan; `None` on the other ranks.
pub fn audit(comm: &dyn Communicator, payload: &Payload, plan: &AuditPlan) -> Result<Option<Vec<Figures>>> {
    let (rank, ranks, n) = (comm.rank(), comm.size(), plan.elements);
    for p in &plan.plans {
        p.check(ranks)?;
    }
    let mut figures = Vec::new();
    for &range in &plan.ranges {
        let mine = payload.values(rank, n, range)?;
        // Rank 0 holds everyone's payload (regenerated) for the exact sums.
        let all = if rank == 0 {
            (0..ranks).map(|r| payload.values(r, n, range)).collect::<Result<Vec<_>>>()?
        } else {
            Vec::new()
        };
        for &p in &plan.plans {
            let reduced = all_reduce(comm, &mine, p)?;
            let sent = comm.all_gather_bytes(reduced.bytes_sent.to_le_bytes().to_vec())?;
            if rank != 0 {
                continue;
            }
            let max_bytes_sent =
                sent.iter().map(|b| u64::from_le_bytes(b[..8].try_into().expect("8 bytes"))).max().unwrap_or(0);
            let exact = exact_sums(&all, p.wire, n);
            let bytes = (n * p.wire.bytes()) as f64;
            figures.push(Figures {
                algorithm: p.algorithm,
                wire: p.wire,
                accumulate: p.accumulate,
                ranks,
                range,
                max_bytes_sent,
                formula_bytes: 2.0 * bytes * (ranks as f64 - 1.0) / ranks as f64,
                checksum: format!("{:016x}", checksum(&reduced.values)),
                ..error_figures(&reduced.values, &exact, plan.tolerance)
            });
        }
    }
    Ok((rank == 0).then_some(figures))
}

/// The exact sum of each element of the inputs as the collective sees them (rounded to the
/// wire), in f64 with Neumaier compensation.
pub(crate) fn exact_sums(rows: &[Vec<f32>], wire: Precision, n: usize) -> Vec<f64> {
    (0..n)
        .map(|i| {
            let (mut sum, mut comp) = (0.0f64, 0.0f64);
            for row in rows {
                let x = f64::from(wire.round(row[i]));
                let t = sum + x;
                comp += if sum.abs() >= x.abs() { (sum - t) + x } else { (x - t) + sum };
                sum = t;
            }
            sum + comp
        })
        .collect()
}

/// [`error_figures`] under its name before 0.3.0.
#[deprecated(since = "0.3.0", note = "renamed `error_figures` (`compare` is `routes compare`'s)")]
pub fn compare(result: &[f32], exact: &[f64], tolerance: f64) -> Figures {
    error_figures(result, exact, tolerance)
}

/// The error figures of `result` against `exact` (the other fields left at their defaults).
pub fn error_figures(result: &[f32], exact: &[f64], tolerance: f64) -> Figures {
    let (mut err2, mut ref2, mut signed, mut abs, mut swamped, mut non_finite) = (0.0, 0.0, 0.0, 0.0, 0, 0);
    for (&r, &e) in result.iter().zip(exact) {
        if !r.is_finite() {
            non_finite += 1;
            swamped += 1;
            continue;
        }
        let d = f64::from(r) - e;
        err2 += d * d;
        ref2 += e * e;
        signed += d;
        abs += e.abs();
        if d.abs() > tolerance * e.abs() {
            swamped += 1;
        }
    }
    let ratio = |a: f64, b: f64| {
        if b > 0.0 {
            a / b
        } else if a == 0.0 {
            0.0
        } else {
            f64::INFINITY
        }
    };
    Figures {
        algorithm: Algorithm::Ring,
        wire: Precision::F32,
        accumulate: Precision::F32,
        ranks: 0,
        range: 0.0,
        relative_error: ratio(err2.sqrt(), ref2.sqrt()),
        swamped_share: swamped as f64 / result.len().max(1) as f64,
        bias: ratio(signed, abs),
        non_finite,
        max_bytes_sent: 0,
        formula_bytes: 0.0,
        checksum: String::new(),
    }
}

fn checksum(values: &[f32]) -> u64 {
    values
        .iter()
        .flat_map(|v| v.to_bits().to_le_bytes())
        .fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

/// [`audit`] over in-process ranks, once per rank count, the figures in the order the tables
/// and charts read them: range, then configuration (the plan's order), then ranks.
pub fn audit_in_process(ranks: &[usize], payload: &Payload, plan: &AuditPlan) -> Result<Vec<Figures>> {
    let mut results = Vec::new();
    for &r in ranks {
        let got = super::run_ranks(r, |comm| audit(comm, payload, plan))?;
        results.extend(got.into_iter().next().flatten().unwrap_or_default());
    }
    sort_figures(plan, &mut results);
    Ok(results)
}

/// Sorts figures by range, then configuration (the plan's order), then ranks.
pub fn sort_figures(plan: &AuditPlan, results: &mut [Figures]) {
    let config = |f: &Figures| {
        plan.plans
            .iter()
            .position(|p| (p.algorithm, p.wire, p.accumulate) == (f.algorithm, f.wire, f.accumulate))
            .unwrap_or(usize::MAX)
    };
    results.sort_by_key(|f| (plan.ranges.iter().position(|&r| r == f.range), config(f), f.ranks));
}

/// Row r of every tensor of a safetensors file, in name order, concatenated: rank r's gradients.
/// Fails before reading when the file's size says reading it would exceed `budget`.
pub fn read_gradients(path: &std::path::Path, budget: MemoryBudget) -> Result<Vec<Vec<f32>>> {
    // The file's own size bounds what reading it allocates: the file, the tensors, the rows.
    let size = std::fs::metadata(path).map_err(|e| Error::io(path, "cannot read", e))?.len();
    budget.ensure_fits("reading the gradients", size.saturating_mul(3))?;
    let bad = |m: String| Error::input(path, m);
    let tensors = candle_core::safetensors::load(path, &candle_core::Device::Cpu)
        .map_err(|e| bad(format!("not a safetensors file: {e}")))?;
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    let Some(first) = names.first() else { return Err(bad("holds no tensors".into())) };
    let ranks = tensors[*first].dims().first().copied().unwrap_or(0);
    if ranks == 0 {
        return Err(bad(format!("tensor `{first}` has no rank dimension (shape {:?})", tensors[*first].dims())));
    }
    let mut rows = vec![Vec::new(); ranks];
    for name in names {
        let t = &tensors[name];
        if t.dims().first() != Some(&ranks) {
            return Err(bad(format!(
                "tensor `{name}` has shape {:?}, expected {ranks} ranks as its first dimension",
                t.dims()
            )));
        }
        let values = t.to_dtype(candle_core::DType::F32).and_then(|t| t.reshape((ranks, ())))?.to_vec2::<f32>()?;
        for (r, v) in values.into_iter().enumerate() {
            if let Some(i) = v.iter().position(|x| !x.is_finite()) {
                return Err(bad(format!("tensor `{name}` holds a non-finite value at rank {r}, element {i}")));
            }
            rows[r].extend(v);
        }
    }
    if rows[0].is_empty() {
        return Err(bad("holds no values".into()));
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn figures(algorithm: Algorithm, wire: Precision, ranks: usize, bias: f64) -> Figures {
        Figures {
            algorithm,
            wire,
            accumulate: Precision::F32,
            ranks,
            range: 10.0,
            relative_error: 0.0,
            swamped_share: 0.0,
            bias,
            non_finite: 0,
            max_bytes_sent: 0,
            formula_bytes: 0.0,
            checksum: String::new(),
        }
    }

    fn plan() -> AuditPlan {
        AuditPlan { elements: 4096, ranges: vec![10.0], plans: Vec::new(), tolerance: 0.01 }
    }

    /// A configuration over the maximum at any rank count is named once, in the figures' order;
    /// a NaN bias (an overflowed sum) is over; a bias at the maximum is not.
    #[test]
    fn configurations_over_the_maximum_bias_fail_once_each() {
        let results = vec![
            figures(Algorithm::Ring, Precision::F32, 4, 0.001),
            figures(Algorithm::Direct, Precision::Bf16, 4, f64::NAN),
            figures(Algorithm::Ring, Precision::F32, 8, -0.5),
            figures(Algorithm::Halving, Precision::F16, 8, 0.01),
            figures(Algorithm::Ring, Precision::F32, 16, 0.7),
        ];
        let report = CollectivesReport::new("seeded".into(), &plan(), Some(0.01), results.clone());
        assert_eq!(report.over_max_bias, ["direct wire bf16 accumulate f32", "ring wire f32 accumulate f32"]);
        assert!(report.failed());
        assert_eq!((report.elements, report.tolerance, report.max_bias), (4096, 0.01, Some(0.01)));
        let unchecked = CollectivesReport::new("seeded".into(), &plan(), None, results);
        assert!(unchecked.over_max_bias.is_empty() && !unchecked.failed());
    }

    /// 4096 elements at 64 ranks: 4096 × (64 × 24 + 8) bytes and 32 MiB.
    #[test]
    fn the_estimate_grows_with_elements_and_ranks() {
        assert_eq!(plan().memory_estimate(64), 4096 * (64 * 24 + 8) + (32 << 20));
        assert_eq!(plan().memory_estimate(1), 4096 * 32 + (32 << 20));
    }
}
