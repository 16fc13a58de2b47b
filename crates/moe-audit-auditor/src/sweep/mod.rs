//! `moe-audit sweep`: load balance against causality over a grid of routers and sizes.
//!
//! Each cell builds a seeded layer (running aux-loss-free balancing steps first where the router
//! has them), audits it with the analyzer ([`crate::analyze::audit`]) and adds what the audit
//! does not give: the compute imbalance after dropping and the output change leaks cause. Then
//! one router's position × distance heatmap. Everything is seeded: the same grid gives the same
//! bytes.

mod grid;
mod heatmap;

pub use grid::{Cell, Grid, Skipped};
pub use heatmap::Heatmap;
pub use moe_audit_core::config::Family;

use crate::analyze::numerics::{swamping, Swamping};
use crate::analyze::{audit, AuditOptions, Probe, RouterReport, Subject, Verdict};
use crate::exploit::{ExploitOptions, RouterExploit};
use crate::progress::Silent;
use candle_core::{DType, Device, Tensor};
use moe_audit_core::error::Result;
use moe_audit_core::layer::{MoeLayer, Seeded};
use moe_audit_core::router::{logits_to_host, Router};
use moe_audit_core::routing::Routing;
use moe_audit_core::routing::{diff_token, StepBatch};
use moe_audit_core::MemoryBudget;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The result of a sweep (`sweep.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SweepReport {
    /// The grid that ran.
    pub grid: Grid,
    /// One row per configuration.
    pub cells: Vec<CellResult>,
    /// Combinations a router could not take.
    pub skipped: Vec<Skipped>,
    /// The heatmap router's position × distance picture.
    pub heatmap: Heatmap,
    /// Accumulator swamping (probe X), router-independent; `None` without `numerics`.
    pub swamping: Option<Vec<Swamping>>,
}

/// Load balance and leaks of one configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CellResult {
    /// Router name.
    pub router: String,
    /// Capacity factor applied (`None`: dropless or fixed capacity).
    pub capacity_factor: Option<f64>,
    /// k applied (`None`: expert choice).
    pub top_k: Option<usize>,
    /// E.
    pub experts: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Sequences per call.
    pub batch: usize,
    /// Aux-loss-free balancing steps run before the audit.
    pub balance_steps: usize,
    /// Routed load (before dropping): max over mean.
    pub max_over_mean_load: f64,
    /// Routed load: coefficient of variation.
    pub load_cv: f64,
    /// Dropped routes over routed routes.
    pub drop_rate: f64,
    /// Switch auxiliary loss.
    pub aux_loss: f64,
    /// Kept load (what experts compute): max over mean. The imbalance the chart plots.
    pub max_over_mean_kept: f64,
    /// Leak rate (affected / compared tokens) of every probe the cell ran but those with columns
    /// of their own (M, X), in report order; `None` where the probe does not apply (P, F: one
    /// token; N: one sequence; L: an odd batch and a scope per sequence). Written as `leak_p`,
    /// `leak_f`, … fields ([`leak_column`]): a probe added to the registry gets its column with
    /// no edit to the sweep.
    #[serde(flatten, with = "leak_columns")]
    pub leaks: BTreeMap<Probe, Option<f64>>,
    /// The largest of P, F, N, R: the chart's leak rate.
    pub leak_rate: f64,
    /// Probes with a leak verdict, e.g. `P F N R`.
    pub leaking: String,
    /// Probes with a latent verdict (only the capacity in force changed), e.g. `R L`.
    #[serde(default)]
    pub latent: String,
    /// M: share of tokens routed differently by the `[inference]` rule (`None`: no such table).
    pub mismatch: Option<f64>,
    /// Mean relative output change (L2, relative to the larger of the two outputs) of the first
    /// half of every sequence when the second half is replaced: what leaks do to outputs (0 for
    /// a causal router).
    pub output_change: Option<f64>,
    /// The same, over the tokens whose routing changed only.
    pub output_change_affected: Option<f64>,
    /// X: share of tokens routed differently in bf16 than in f32.
    pub flips_bf16: Option<f64>,
    /// X: the same in f16.
    pub flips_f16: Option<f64>,
    /// Bits per token a tiny decoder trained through this router goes below the causal floor
    /// (`moe-audit exploit` with the grid's `[exploit]` sizes; its best seed, 99% interval
    /// Bonferroni over the seeds); `None` without `[exploit]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exploit: Option<crate::exploit::Interval>,
    /// Whether that is below the floor by more than its interval (the exploit verdict).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exploited: Option<bool>,
    /// The router's design family (the chart's marker shape; not written to JSON or CSV).
    #[serde(skip)]
    pub family: Family,
}

/// Probes with columns of their own, left out of [`CellResult::leaks`]: M's `mismatch`, X's
/// `flips_bf16` and `flips_f16`.
const OWN_COLUMNS: [Probe; 2] = [Probe::M, Probe::X];

/// The sweep's column (JSON field, CSV header) of a probe's leak rate: `leak_p` for P.
pub fn leak_column(probe: Probe) -> String {
    format!("leak_{}", probe.to_string().to_lowercase())
}

impl CellResult {
    /// A probe's leak rate; `None` where it does not apply or the cell has no such column.
    pub fn leak(&self, probe: Probe) -> Option<f64> {
        self.leaks.get(&probe).copied().flatten()
    }
}

/// [`CellResult::leaks`] as flattened `leak_<letter>` fields, in the map's (report) order.
mod leak_columns {
    use super::{leak_column, Probe};
    use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};
    use serde::Serializer;
    use std::collections::BTreeMap;

    type Leaks = BTreeMap<Probe, Option<f64>>;

    pub fn serialize<S: Serializer>(leaks: &Leaks, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(leaks.iter().map(|(p, rate)| (leak_column(*p), rate)))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Leaks, D::Error> {
        struct Columns;
        impl<'de> Visitor<'de> for Columns {
            type Value = Leaks;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("leak_<probe> fields")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Leaks, A::Error> {
                let mut leaks = Leaks::new();
                while let Some(key) = map.next_key::<String>()? {
                    match Probe::KNOWN.iter().find(|p| leak_column(**p) == key) {
                        Some(p) => {
                            leaks.insert(*p, map.next_value()?);
                        }
                        // Not a probe's column: the cell's struct does not know it either.
                        None => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(leaks)
            }
        }
        d.deserialize_map(Columns)
    }
}

/// Runs every cell (calling `tick` after each) and the heatmap; fails before running any when
/// a cell's audit is estimated to need more than `budget` bytes.
pub fn run(
    grid: &Grid,
    source_name: &str,
    base: &std::path::Path,
    budget: MemoryBudget,
    tick: &mut dyn FnMut(&str),
) -> Result<SweepReport> {
    let routers = grid.load_routers(source_name, base)?;
    moe_audit_core::names::check_unique(routers.iter().map(|r| r.name.as_str()))
        .map_err(|e| moe_audit_core::Error::config(source_name, "routers", e.to_string()))?;
    // `heatmap` names an entry of `routers` (a preset or a file); its cells carry the config's
    // name. Checked here, before any cell runs.
    let heat_name = grid.routers.iter().position(|r| *r == grid.heatmap).map(|i| routers[i].name.clone());
    let (cells, skipped) = grid.cells(&routers);
    if !cells.iter().any(|c| Some(&c.config.name) == heat_name.as_ref()) {
        return Err(moe_audit_core::Error::config(
            source_name,
            "heatmap",
            format!("router `{}` has no runnable cell", grid.heatmap),
        ));
    }
    for cell in &cells {
        let options =
            AuditOptions { batch: cell.batch, seq_len: cell.seq_len, trials: grid.trials, ..AuditOptions::default() };
        let what = format!(
            "{source_name}: the cell {} (batch {} x seq_len {}, {} experts)",
            cell.config.name, cell.batch, cell.seq_len, cell.experts
        );
        let mut need = options.memory_estimate(cell.experts, cell.config.k(), grid.hidden, grid.ffn);
        if let Some(exploit) = &grid.exploit {
            need = need.max(exploit.memory_estimate(&cell.config));
        }
        budget.ensure_fits(&what, need)?;
    }
    let mut results = Vec::with_capacity(cells.len());
    let mut heat = None;
    for cell in &cells {
        tick(&cell.config.name);
        let layer = trained_layer(grid, cell)?;
        results.push(run_cell(grid, cell, &layer, budget)?);
        if heat.is_none() && Some(&cell.config.name) == heat_name.as_ref() {
            heat = Some(heatmap::heatmap(layer.router(), &base_call(grid, cell, &layer)?.0, cell, grid.seed)?);
        }
    }
    let heatmap = heat.ok_or_else(|| {
        moe_audit_core::Error::config(source_name, "heatmap", format!("router `{}` has no runnable cell", grid.heatmap))
    })?;
    Ok(SweepReport {
        grid: grid.clone(),
        cells: results,
        skipped,
        heatmap,
        swamping: grid.numerics.then(|| swamping(grid.seed)),
    })
}

/// Number of cells the grid runs (for a progress bar).
pub fn cell_count(grid: &Grid, source_name: &str, base: &std::path::Path) -> Result<usize> {
    Ok(grid.cells(&grid.load_routers(source_name, base)?).0.len())
}

/// The cell's seeded layer, after its balancing steps (on batches of the cell's size).
fn trained_layer(grid: &Grid, cell: &Cell) -> Result<MoeLayer> {
    let mut layer = MoeLayer::seeded(cell.config.clone(), grid.hidden, grid.ffn, grid.seed, DType::F32, &Device::Cpu)?;
    if cell.config.has_state() {
        for step in 0..grid.balance_steps as u64 {
            let x = Seeded::new(grid.seed ^ (crate::seeds::BALANCE_STEP + step))
                .normal(&[cell.batch, cell.seq_len, grid.hidden], &Device::Cpu)?;
            let logits = moe_audit_core::router::logits_to_host(&layer.router().scores(&x)?)?;
            // What the layer's forward routes, without the experts' compute.
            let routing = layer.router().assign(logits.view())?;
            layer.step(&StepBatch { logits: logits.view(), loads: &routing.experts_load })?;
        }
    }
    Ok(layer)
}

fn balance_steps(grid: &Grid, cell: &Cell) -> usize {
    if cell.config.has_state() {
        grid.balance_steps
    } else {
        0
    }
}

/// The audit's base call: the same seeded hidden states the analyzer draws, their logits.
fn base_call(grid: &Grid, cell: &Cell, layer: &MoeLayer) -> Result<(moe_audit_core::routing::Logits, Tensor)> {
    let x = Seeded::new(grid.seed).normal(&[cell.batch, cell.seq_len, grid.hidden], &Device::Cpu)?;
    Ok((logits_to_host(&layer.router().scores(&x)?)?, x))
}

fn run_cell(grid: &Grid, cell: &Cell, layer: &MoeLayer, budget: MemoryBudget) -> Result<CellResult> {
    let mut probes = Probe::DEFAULT.to_vec();
    if grid.numerics {
        probes.push(Probe::X);
    }
    let options = AuditOptions {
        probes,
        batch: cell.batch,
        seq_len: cell.seq_len,
        trials: grid.trials,
        seed: grid.seed,
        // The sweep compares leak rates: P's must cover every prefix, not the searched ones.
        exhaustive: true,
        ..AuditOptions::default()
    };
    let report = audit(&Subject::layer(layer), &options, &Silent)?;
    let rate = |p: Probe| report.finding(p).filter(|f| f.verdict != Verdict::NotApplicable).map(|f| f.rate);
    let (_, x) = base_call(grid, cell, layer)?;
    let (y, routing) = layer.forward(&x)?;
    let (output_change, output_change_affected) = output_change(grid, layer, &x, &y, &routing)?;
    let flips = |i: usize| report.finding(Probe::X).and_then(|f| f.numerics.as_ref()).map(|n| n.flips[i].rate);
    // Every probe the audit ran gets a column: the registry (`analyze/probe/mod.rs`) is the list,
    // and `Probe`'s order (the map's) is its report order.
    let leaks: BTreeMap<Probe, Option<f64>> =
        report.findings.iter().filter(|f| !OWN_COLUMNS.contains(&f.probe)).map(|f| (f.probe, rate(f.probe))).collect();
    let leak_rate = [Probe::P, Probe::F, Probe::N, Probe::R].into_iter().filter_map(rate).fold(0.0, f64::max);
    let exploit = grid.exploit.as_ref().map(|o| exploit_cell(cell, o, budget)).transpose()?;
    let exploit = exploit.as_ref();
    Ok(CellResult {
        router: cell.config.name.clone(),
        capacity_factor: cell.capacity_factor,
        top_k: cell.top_k,
        experts: cell.experts,
        seq_len: cell.seq_len,
        batch: cell.batch,
        balance_steps: balance_steps(grid, cell),
        max_over_mean_load: report.load.max_over_mean_load,
        load_cv: report.load.load_cv,
        drop_rate: report.load.drop_rate,
        aux_loss: report.load.aux_loss,
        max_over_mean_kept: kept_imbalance(&routing),
        leaks,
        leak_rate,
        leaking: with_verdict(&report, Verdict::Leak),
        latent: with_verdict(&report, Verdict::Latent),
        mismatch: rate(Probe::M),
        output_change,
        output_change_affected,
        flips_bf16: flips(0),
        flips_f16: flips(1),
        exploit: exploit
            .map(|r| r.seeds.iter().find(|s| s.seed == r.best_seed).expect("the best seed").below_floor_bits),
        exploited: exploit.map(|r| r.verdict == crate::exploit::Verdict::Exploited),
        family: Family::of(&cell.config),
    })
}

/// `moe-audit exploit` on the cell's router.
fn exploit_cell(cell: &Cell, options: &ExploitOptions, budget: MemoryBudget) -> Result<RouterExploit> {
    let mut report = crate::exploit::run(std::slice::from_ref(&cell.config), options, budget, &|_| {})?;
    Ok(report.routers.remove(0))
}

/// The probes of verdict `v`, e.g. `P F N R`.
fn with_verdict(report: &RouterReport, v: Verdict) -> String {
    let probes: Vec<String> = report.findings.iter().filter(|f| f.verdict == v).map(|f| f.probe.to_string()).collect();
    probes.join(" ")
}

/// Max over mean of the kept rows per expert (padding included: experts compute it).
fn kept_imbalance(r: &Routing) -> f64 {
    let rows: Vec<f64> = r.experts_load.iter().map(|l| (l.kept + l.padded) as f64).collect();
    let mean = rows.iter().sum::<f64>() / rows.len() as f64;
    if mean > 0.0 {
        rows.iter().copied().fold(0.0, f64::max) / mean
    } else {
        0.0
    }
}

/// Replaces the second half of every sequence and measures the first half's outputs: mean
/// relative L2 change over all those tokens, and over those whose routing changed.
fn output_change(
    grid: &Grid,
    layer: &MoeLayer,
    x: &Tensor,
    y: &Tensor,
    routing: &Routing,
) -> Result<(Option<f64>, Option<f64>)> {
    let (b, s, h) = x.dims3()?;
    let half = s / 2;
    if half == 0 {
        return Ok((None, None));
    }
    let later = Seeded::new(grid.seed ^ crate::seeds::SWEEP_LATER_HALF).normal(&[b, s - half, h], &Device::Cpu)?;
    let changed = Tensor::cat(&[&x.narrow(1, 0, half)?, &later], 1)?;
    let (y2, r2) = layer.forward(&changed)?;
    let (ya, yb) = (y.to_vec3::<f32>()?, y2.to_vec3::<f32>()?);
    let (mut all, mut affected, mut n_affected) = (0.0, 0.0, 0usize);
    for bi in 0..b {
        for p in 0..half {
            let (a, c) = (&ya[bi][p], &yb[bi][p]);
            // Relative to the larger output: expert choice may leave a token with no expert (0).
            let norm = |v: &[f32]| v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
            let scale = norm(a).max(norm(c));
            let diff = if scale > 0.0 {
                a.iter().zip(c).map(|(u, v)| f64::from(u - v).powi(2)).sum::<f64>().sqrt() / scale
            } else {
                0.0
            };
            all += diff;
            if diff_token(routing, (bi, p), &r2, (bi, p)).decision() {
                affected += diff;
                n_affected += 1;
            }
        }
    }
    Ok((Some(all / (b * half) as f64), (n_affected > 0).then(|| affected / n_affected as f64)))
}
