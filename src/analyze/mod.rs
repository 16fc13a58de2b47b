//! The causality analyzer: probes perturb, truncate and re-batch a router's input, compare full
//! routing records token by token, and report every leak with a minimal, replayable witness.
//!
//! Probes run the assignment stage on logits (cheap, exact); the score stage is checked once to
//! be per token, and the MoE layer is run on a sample of each probe so layer bugs (outputs that
//! change while routing does not) are caught too.

mod budget;
mod case;
pub mod compare;
mod layer_check;
mod layout;
pub mod numerics;
mod prefix;
mod probes;
pub mod witness;

pub use case::{Call, Case};
pub use witness::Witness;

use crate::error::{Error, Result};
use crate::layer::{MoeLayer, Seeded};
use crate::router::{logits_to_host, Router};
use crate::routing::{LoadStats, Routing};
use candle_core::{Device, Tensor};
use case::Outcome;
use probes::Ctx;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::sync::Arc;

/// A probe: one way of changing the input that must not change a token's routing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Probe {
    /// Prefix: truncate after t.
    P,
    /// Future: change tokens after t.
    F,
    /// Neighbour: change another sequence.
    N,
    /// Re-batch: permute, resize, pad.
    R,
    /// Repeat: the same call twice.
    D,
    /// Replay: the same call after a different call.
    S,
    /// Mode: training versus inference configuration.
    M,
    /// Layout: 1 versus R expert-parallel ranks, [S,B] versus [B,S] flattening.
    L,
    /// Numerics: routing in bf16/f16 versus f32, and low-precision accumulation (off by default).
    X,
}

impl Probe {
    /// The default probes, in report order (X, numerics, is opt-in).
    pub const ALL: [Probe; 8] = [Probe::P, Probe::F, Probe::N, Probe::R, Probe::D, Probe::S, Probe::M, Probe::L];

    /// The property the probe tests.
    pub fn property(self) -> Property {
        match self {
            Probe::P => Property::CLength,
            Probe::F => Property::CContent,
            Probe::N | Probe::R => Property::B,
            Probe::D => Property::D,
            Probe::S => Property::S,
            Probe::M | Probe::X => Property::TI,
            Probe::L => Property::L,
        }
    }

    /// Its long name.
    pub fn name(self) -> &'static str {
        match self {
            Probe::P => "prefix",
            Probe::F => "future",
            Probe::N => "neighbour",
            Probe::R => "re-batch",
            Probe::D => "repeat",
            Probe::S => "replay",
            Probe::M => "mode",
            Probe::L => "layout",
            Probe::X => "numerics",
        }
    }

    /// Parses a comma-separated list such as `P,F,N`.
    pub fn parse_list(list: &str) -> Result<Vec<Probe>> {
        let mut probes = Vec::new();
        for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let probe = match item.to_ascii_uppercase().as_str() {
                "P" => Probe::P,
                "F" => Probe::F,
                "N" => Probe::N,
                "R" => Probe::R,
                "D" => Probe::D,
                "S" => Probe::S,
                "M" => Probe::M,
                "L" => Probe::L,
                "X" => Probe::X,
                _ => {
                    return Err(Error::Usage(format!(
                        "--probes: unknown probe `{item}`, expected some of P,F,N,R,D,S,M,L,X"
                    )))
                }
            };
            if !probes.contains(&probe) {
                probes.push(probe);
            }
        }
        if probes.is_empty() {
            return Err(Error::Usage("--probes: no probe given".into()));
        }
        probes.sort();
        Ok(probes)
    }
}

impl fmt::Display for Probe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self:?}")
    }
}

/// The properties of docs/PROPERTIES.md.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Property {
    /// Causal in content.
    #[serde(rename = "C-content")]
    CContent,
    /// Causal in length.
    #[serde(rename = "C-length")]
    CLength,
    /// Batch-invariant.
    B,
    /// Deterministic.
    D,
    /// Stateless.
    S,
    /// Train = inference.
    #[serde(rename = "T/I")]
    TI,
    /// Layout-invariant.
    L,
}

impl fmt::Display for Property {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Property::CContent => "C-content",
            Property::CLength => "C-length",
            Property::B => "B",
            Property::D => "D",
            Property::S => "S",
            Property::TI => "T/I",
            Property::L => "L",
        })
    }
}

/// A probe's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Verdict {
    /// No token's routing or output changed.
    Pass,
    /// Some token's routing or output changed.
    Leak,
    /// The probe cannot apply (batch of 1, no `[inference]` table, ...).
    NotApplicable,
}

/// Audit sizes and knobs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AuditOptions {
    /// Probes to run.
    pub probes: Vec<Probe>,
    /// Sequences per call.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Trials of the randomised probes (F, N, R).
    pub trials: usize,
    /// Seed of every random choice.
    pub seed: u64,
    /// Expert-parallel ranks the layout probe (L) compares with one.
    #[serde(default = "default_ranks")]
    pub ranks: usize,
    /// Route every prefix in P (quadratic in `seq_len`) instead of searching them (see README,
    /// "What is searched").
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub exhaustive: bool,
}

fn default_ranks() -> usize {
    2
}

impl Default for AuditOptions {
    fn default() -> Self {
        AuditOptions {
            probes: Probe::ALL.to_vec(),
            batch: 4,
            seq_len: 128,
            trials: 32,
            seed: 0,
            ranks: default_ranks(),
            exhaustive: false,
        }
    }
}

impl AuditOptions {
    /// Checks options read from a file (a trace manifest): an audit that runs no probe, or on
    /// no token, must not pass. The error names the field.
    pub fn check(&self) -> std::result::Result<(), (String, String)> {
        if self.probes.is_empty() {
            return Err(("probes".into(), "is empty: an audit that runs no probe cannot pass".into()));
        }
        for (field, v) in
            [("batch", self.batch), ("seq_len", self.seq_len), ("trials", self.trials), ("ranks", self.ranks)]
        {
            if v == 0 {
                return Err((field.into(), "must be at least 1, got 0".into()));
            }
        }
        Ok(())
    }
}

/// Counts of how far after a token the change that affected it was: bucket `[from, to]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct InfluenceBucket {
    /// Smallest distance in the bucket.
    pub from: usize,
    /// Largest distance in the bucket.
    pub to: usize,
    /// Affected tokens.
    pub count: usize,
}

/// The result of one probe on one router.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Finding {
    /// The probe.
    pub probe: Probe,
    /// Pass, leak or not applicable.
    pub verdict: Verdict,
    /// The property the probe tests.
    pub property: Property,
    /// Tokens compared over all cases.
    pub compared: usize,
    /// Tokens whose routing decision changed (ids, order, kept, padding, weights).
    pub affected: usize,
    /// `affected / compared`.
    pub rate: f64,
    /// Whether the capacity in force changed for some token.
    pub capacity_changed: bool,
    /// Smallest position of an affected token.
    pub first_position: Option<usize>,
    /// How far after t the change that affected t was (same-sequence changes only).
    pub influence: Vec<InfluenceBucket>,
    /// Layer sample: tokens whose output changed although their routing did not.
    pub output_leaks: usize,
    /// Layer sample: largest relative output difference among tokens with identical routing
    /// that stayed within the f32 tolerance (numeric drift, never a leak).
    pub output_drift: Option<f64>,
    /// One line on what was done or why the probe does not apply.
    pub note: String,
    /// A minimal pair of inputs that reproduces the leak.
    pub witness: Option<Witness>,
    /// Probe X only: precision flips and accumulator swamping.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numerics: Option<numerics::Numerics>,
}

impl Finding {
    /// A passing finding of `probe` with nothing compared yet.
    fn empty(probe: Probe) -> Finding {
        Finding {
            probe,
            verdict: Verdict::Pass,
            property: probe.property(),
            compared: 0,
            affected: 0,
            rate: 0.0,
            capacity_changed: false,
            first_position: None,
            influence: Vec::new(),
            output_leaks: 0,
            output_drift: None,
            note: String::new(),
            witness: None,
            numerics: None,
        }
    }
}

/// Everything found about one router.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RouterReport {
    /// The router's name.
    pub router: String,
    /// Load balance of the base call.
    pub load: LoadStats,
    /// Invariant violations (capacity exceeded, capacity not the declared formula, scores not
    /// per token); empty when all hold.
    pub invariants: Vec<String>,
    /// One finding per probe run.
    pub findings: Vec<Finding>,
}

impl RouterReport {
    /// Whether any probe found a leak or any invariant failed.
    pub fn leaks(&self) -> bool {
        !self.invariants.is_empty() || self.findings.iter().any(|f| f.verdict == Verdict::Leak)
    }

    /// The finding of `probe`, if it ran.
    pub fn finding(&self, probe: Probe) -> Option<&Finding> {
        self.findings.iter().find(|f| f.probe == probe)
    }
}

/// A whole audit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// The options the audit ran with.
    pub options: AuditOptions,
    /// One report per router.
    pub routers: Vec<RouterReport>,
}

impl Report {
    /// Whether any router leaks.
    pub fn leaks(&self) -> bool {
        self.routers.iter().any(RouterReport::leaks)
    }
}

/// A layer the analyzer can run: hidden states in, outputs and routing out.
pub trait Layer {
    /// # Shapes
    /// `x`: `[batch, seq_len, hidden]` → `[batch, seq_len, hidden]`.
    fn forward(&self, x: &Tensor) -> Result<(Tensor, Routing)>;

    /// The layer expert-parallel on `ranks` ranks, each routing its own block of sequences,
    /// gathered; `None` for a layer that cannot run expert-parallel.
    ///
    /// # Shapes
    /// `x`: `[batch, seq_len, hidden]`, `batch` divisible by `ranks`.
    fn forward_parallel(&self, x: &Tensor, ranks: usize) -> Result<Option<crate::parallel::Gathered>> {
        let _ = (x, ranks);
        Ok(None)
    }
}

impl Layer for MoeLayer {
    fn forward(&self, x: &Tensor) -> Result<(Tensor, Routing)> {
        MoeLayer::forward(self, x)
    }

    fn forward_parallel(&self, x: &Tensor, ranks: usize) -> Result<Option<crate::parallel::Gathered>> {
        crate::parallel::forward_in_process(self, x, ranks).map(Some)
    }
}

/// What is audited: a router, and optionally the layer around it (outputs are then checked too).
pub struct Subject<'a> {
    /// The router.
    pub router: &'a dyn Router,
    /// The layer whose outputs are sampled; it must route with `router`.
    pub layer: Option<&'a dyn Layer>,
}

impl<'a> Subject<'a> {
    /// A layer and its router.
    pub fn layer(layer: &'a MoeLayer) -> Self {
        Subject { router: layer.router(), layer: Some(layer) }
    }
}

/// Audits one subject; `tick` is called once per probe (progress).
pub fn audit(subject: &Subject, options: &AuditOptions, tick: &mut dyn FnMut(&str)) -> Result<RouterReport> {
    let (b, s) = (options.batch, options.seq_len);
    if b == 0 || s == 0 {
        return Err(Error::Usage(format!("--batch and --seq-len must be at least 1, got {b} and {s}")));
    }
    let router = subject.router;
    let hidden = match router.hidden_size() {
        Some(h) => Some(probes::hidden_states(router, (b, s), h, options.seed)?),
        None => None,
    };
    let logits = match &hidden {
        Some(x) => logits_to_host(&router.scores(x)?)?,
        None => {
            let t = Seeded::new(options.seed).normal(&[b, s, router.row_width()], &Device::Cpu)?;
            crate::routing::Logits::from_shape_vec((b, s, router.row_width()), t.flatten_all()?.to_vec1()?)
                .expect("shape")
        }
    };
    let base = Arc::new(Call::new(logits));
    let base_routing = base.route(router)?;
    let mut invariants = invariant_violations(router, &base_routing);
    if let Some(x) = &hidden {
        invariants.extend(layer_check::scores_per_token(router, x, &base.logits)?);
    }
    let pure = router.concurrent() && looks_pure(router, &base, &base_routing)?;
    let layout = layout::Plan { ranks: options.ranks, layer: subject.layer.zip(hidden.as_ref()) };
    let ctx =
        Ctx { router, base, base_routing, trials: options.trials, seed: options.seed, pure, hidden: hidden.clone() };
    let sample = match (subject.layer, &hidden) {
        (Some(layer), Some(x)) => Some(layer_check::Sample::new(layer, x, options.seed)?),
        _ => None,
    };
    let mut findings = Vec::new();
    for &probe in &options.probes {
        tick(&format!("{} {}", router.name(), probe.name()));
        let mut finding =
            if probe == Probe::L { layout::probe(&ctx, &layout)? } else { run_probe(&ctx, probe, options.exhaustive)? };
        if let Some(sample) = &sample {
            sample.check(probe, &mut finding)?;
        }
        findings.push(finding);
    }
    Ok(RouterReport { router: router.name().to_string(), load: ctx.base_routing.stats, invariants, findings })
}

fn run_probe(ctx: &Ctx, probe: Probe, exhaustive: bool) -> Result<Finding> {
    let mut finding = Finding::empty(probe);
    let cases = match probe {
        Probe::P => probes::Cases::Prefix(ctx),
        Probe::F => probes::Cases::Built(probes::future(ctx)?),
        Probe::N => probes::Cases::Built(probes::neighbour(ctx)?),
        Probe::R => probes::Cases::Built(probes::rebatch(ctx)?),
        Probe::D | Probe::S | Probe::M => return repeat_probe(ctx, probe, finding),
        Probe::X => return numerics::probe(ctx, finding),
        Probe::L => unreachable!("the layout probe runs in layout.rs"),
    };
    let count = cases.len();
    if count == 0 {
        finding.verdict = Verdict::NotApplicable;
        finding.note = match probe {
            Probe::N => "needs a batch of 2 or more".into(),
            _ => "needs a sequence of 2 or more tokens".into(),
        };
        return Ok(finding);
    }
    if probe == Probe::P && ctx.pure && !exhaustive {
        return prefix::probe(ctx, finding);
    }
    let run = |i: usize| -> Result<(Tally, Option<case::Affected>)> {
        let case = cases.get(i);
        let outcome = case.compare(&ctx.base_routing, &case.b.routes(ctx.router)?);
        Ok((Tally::of(&outcome), pick_witness_token(&outcome)))
    };
    // Cases are independent, so they run in parallel for a router that looks pure; a stateful
    // one sees its calls in case order, so the audit stays deterministic either way.
    let results: Vec<_> =
        if ctx.pure { (0..count).into_par_iter().map(run).collect() } else { (0..count).map(run).collect() };
    let mut tally = Tally::default();
    let mut first_leak = None;
    for (i, result) in results.into_iter().enumerate() {
        let (t, hit) = result?;
        tally.merge(&t);
        if first_leak.is_none() {
            first_leak = hit.map(|hit| (i, hit));
        }
    }
    finding.note = format!("{count} cases");
    tally.finish(&mut finding);
    if let Some((i, hit)) = first_leak {
        finding.witness = witness::build(ctx.router, probe, &cases.get(i), (hit.batch, hit.pos))?;
    }
    Ok(finding)
}

/// Prefers a token whose decision changed over one whose capacity alone changed.
fn pick_witness_token(outcome: &Outcome) -> Option<case::Affected> {
    outcome.affected.iter().find(|a| a.diff.decision()).or(outcome.affected.first()).copied()
}

/// What a probe saw, summed over its cases: O(1) per case whatever the number of affected tokens.
#[derive(Default)]
struct Tally {
    compared: usize,
    affected: usize,
    capacity_changed: bool,
    first_position: Option<usize>,
    /// Affected tokens by distance to the change, bucket i holding [2^i, 2^(i+1)) (the last
    /// bucket everything beyond).
    influence: [usize; 32],
}

impl Tally {
    fn of(outcome: &Outcome) -> Tally {
        let mut t = Tally { compared: outcome.compared, ..Tally::default() };
        for a in &outcome.affected {
            t.capacity_changed |= a.diff.capacity;
            if a.diff.decision() {
                t.affected += 1;
                if let Some(d) = a.distance {
                    t.influence[(d.max(1).ilog2() as usize).min(31)] += 1;
                }
            }
            t.first_position = Some(t.first_position.map_or(a.pos, |p| p.min(a.pos)));
        }
        t
    }

    fn merge(&mut self, other: &Tally) {
        self.compared += other.compared;
        self.affected += other.affected;
        self.capacity_changed |= other.capacity_changed;
        self.first_position = self.first_position.into_iter().chain(other.first_position).min();
        self.influence.iter_mut().zip(other.influence).for_each(|(a, b)| *a += b);
    }

    fn finish(&self, finding: &mut Finding) {
        finding.compared = self.compared;
        finding.affected = self.affected;
        finding.capacity_changed = self.capacity_changed;
        finding.first_position = self.first_position;
        finding.rate = if self.compared > 0 { self.affected as f64 / self.compared as f64 } else { 0.0 };
        if self.affected > 0 || self.capacity_changed {
            finding.verdict = Verdict::Leak;
        }
        finding.influence = (self.influence.iter().enumerate())
            .filter(|(_, &count)| count > 0)
            .map(|(i, &count)| InfluenceBucket { from: 1 << i, to: (2 << i) - 1, count })
            .collect();
    }
}

/// D (the same call twice), S (the same call after another) and M (train vs inference config).
fn repeat_probe(ctx: &Ctx, probe: Probe, mut finding: Finding) -> Result<Finding> {
    let (b, s) = ctx.base.dims();
    let same = Case::aligned(&ctx.base, Call::clone(&ctx.base));
    let (reference, again, case) = match probe {
        Probe::D => (ctx.base_routing.clone(), ctx.base.routes(ctx.router)?, same),
        Probe::S => {
            let mut rng = rand::SeedableRng::seed_from_u64(ctx.seed ^ 0x5);
            let other = Call::new(
                ctx.fresh(s.max(2) * b, &mut rng)?
                    .into_shape_with_order((b, s.max(2), ctx.router.row_width()))
                    .expect("shape"),
            );
            let first = ctx.base.routes(ctx.router)?;
            other.routes(ctx.router)?;
            let after = ctx.base.routes(ctx.router)?;
            (first, after, Case { b: other, ..same })
        }
        _ => match ctx.router.inference()? {
            None => {
                finding.verdict = Verdict::NotApplicable;
                finding.note = "no [inference] table: training and serving use one rule".into();
                return Ok(finding);
            }
            Some(inference) => (ctx.base_routing.clone(), ctx.base.routes(inference.as_ref())?, same),
        },
    };
    let outcome = case.compare(&reference, &again);
    Tally::of(&outcome).finish(&mut finding);
    finding.note = match probe {
        Probe::D => "the same call twice".into(),
        Probe::S => "the same call before and after another call".into(),
        _ => "training versus [inference] configuration on the same input".into(),
    };
    if let Some(hit) = pick_witness_token(&outcome) {
        finding.witness = witness::build(ctx.router, probe, &case, (hit.batch, hit.pos))?;
    }
    Ok(finding)
}

/// Whether the router routes the base call alike twice in a row and after another call: then
/// probe cases may run in parallel without changing what the router returns.
fn looks_pure(router: &dyn Router, base: &Call, base_routing: &Routing) -> Result<bool> {
    let again = base.route(router)?;
    base.truncate(base.dims().1.div_ceil(2)).route(router)?;
    Ok(again == *base_routing && base.route(router)? == *base_routing)
}

/// Capacity respected and equal to the declared formula, in every group.
fn invariant_violations(router: &dyn Router, r: &Routing) -> Vec<String> {
    let mut out = Vec::new();
    let config = router.config();
    for (g, group) in r.scope.groups.iter().enumerate() {
        let Some(c) = group.capacity else { continue };
        let mut kept = vec![0usize; r.experts];
        for t in r.tokens.iter().filter(|t| t.group == g) {
            t.routes.iter().filter(|x| x.kept).for_each(|x| kept[x.expert] += 1);
        }
        if let Some((e, k)) = kept.iter().enumerate().find(|(_, &k)| k > c) {
            out.push(format!("group {g}: expert {e} kept {k} routes over its capacity {c}"));
        }
        if let Some(declared) = config.and_then(|cfg| {
            cfg.capacity.as_ref().map(|cap| {
                let k = r.top_k.unwrap_or(1);
                crate::routing::capacity::capacity(cap, group.tokens, k, r.experts)
            })
        }) {
            if declared != c {
                out.push(format!("group {g}: capacity {c} is not the declared formula's {declared}"));
            }
        }
    }
    out
}
