//! The causality analyzer: probes perturb, truncate and re-batch a router's input, compare full
//! routing records token by token, and report every leak with a minimal, replayable witness.
//!
//! Probes run the assignment stage on logits (cheap, exact); the score stage is checked once to
//! be per token, and the MoE layer is run on a sample of each probe so layer bugs (outputs that
//! change while routing does not) are caught too.

mod case;
mod estimate;
pub mod explain;
mod layer_check;
mod noise;
mod probe;
mod repeats;
mod tally;
pub mod witness;

pub use case::{Call, Case};
pub use explain::Explanation;
pub use moe_audit_parallel::Layer;
pub use noise::fix as random_router_fix;
pub(crate) use probe::TARGET_LOGIT;
pub use probe::{numerics, Audit, Probe};
pub use witness::Witness;

use crate::hints::HintsOf;
use crate::mode::Mode;
use crate::progress::Progress;
use crate::sizes::RunSizes;
use candle_core::{Device, Tensor};
use moe_audit_core::error::{Error, FieldError, Result};
use moe_audit_core::layer::{MoeLayer, Seeded};
use moe_audit_core::router::{logits_to_host, Router};
use moe_audit_core::routing::{LoadStats, Logits, Routing};
use moe_audit_core::text;
use moe_audit_core::MemoryBudget;
use probe::Ctx;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::sync::Arc;

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
    /// Some token's routing decision or output changed.
    Leak,
    /// Only the capacity in force changed: the rule depends on what it must not see, but no
    /// decision changed on these inputs (one does where the capacity binds). Counted by
    /// `--fail-on latent`, part of the default gate.
    Latent,
    /// The probe cannot apply (batch of 1, no `[inference]` table, ...).
    NotApplicable,
    /// Some token changed, but no more than the router's own randomness explains (D fails):
    /// the probe cannot tell a leak from noise.
    Inconclusive,
    /// Probe X only: routing in bf16 or f16 differs from f32 for some token. Precision drift
    /// between engines, not causality: it fails a check only with `--fail-on drift`.
    Drift,
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
    RunSizes::default().ranks
}

/// The sizes are [`RunSizes`]'s defaults, the command line's too.
impl Default for AuditOptions {
    fn default() -> Self {
        let RunSizes { batch, seq_len, trials, ranks, .. } = RunSizes::default();
        AuditOptions { probes: Probe::DEFAULT.to_vec(), batch, seq_len, trials, seed: 0, ranks, exhaustive: false }
    }
}

impl AuditOptions {
    /// Checks options read from a file (a trace manifest): an audit that runs no probe, or on
    /// no token, must not pass. The error names the field.
    pub fn check(&self) -> std::result::Result<(), FieldError> {
        if self.probes.is_empty() {
            return Err(FieldError::new("probes", "is empty: an audit that runs no probe cannot pass"));
        }
        for (field, v) in
            [("batch", self.batch), ("seq_len", self.seq_len), ("trials", self.trials), ("ranks", self.ranks)]
        {
            if v == 0 {
                return Err(FieldError::new(field, "must be at least 1, got 0"));
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
    /// Pass, leak, latent, ... ([`Verdict`]).
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
    /// Probe P only: some prefixes were searched, not routed ([`AuditOptions::exhaustive`]
    /// routes them all). Not serialised: a front end says in the note how to ask for it.
    #[serde(skip)]
    pub searched: bool,
    /// A leak in words: the two calls, what changed, the cause, how to fix.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub explain: Option<Explanation>,
}

impl Finding {
    /// A passing finding of `probe` with nothing compared yet.
    pub fn empty(probe: Probe) -> Finding {
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
            searched: false,
            explain: None,
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

    /// Whether some probe found a latent dependence ([`Verdict::Latent`]).
    pub fn latent(&self) -> bool {
        self.findings.iter().any(|f| f.verdict == Verdict::Latent)
    }

    /// Whether some probe could not tell a leak from the router's randomness.
    pub fn inconclusive(&self) -> bool {
        self.findings.iter().any(|f| f.verdict == Verdict::Inconclusive)
    }

    /// Whether some probe found precision drift.
    pub fn drifts(&self) -> bool {
        self.findings.iter().any(|f| f.verdict == Verdict::Drift)
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

/// What is audited: a router, optionally the layer around it (outputs are then checked too),
/// and other launches of the same layer that the layout probe compares it with.
pub struct Subject<'a> {
    /// The router.
    pub router: &'a dyn Router,
    /// The layer whose outputs are sampled; it must route with `router`.
    pub layer: Option<&'a dyn Layer>,
    /// The same layer launched at other expert-parallel sizes (`check --layout-cmd`).
    pub layouts: &'a [Launch<'a>],
}

impl<'a> Subject<'a> {
    /// A layer and its router.
    pub fn layer(layer: &'a MoeLayer) -> Self {
        Subject { router: layer.router(), layer: Some(layer), layouts: &[] }
    }

    /// A router alone.
    pub fn router(router: &'a dyn Router) -> Self {
        Subject { router, layer: None, layouts: &[] }
    }
}

/// Another launch of the audited layer (the same layer at another expert-parallel size, e.g. the
/// same script under `torch.distributed.run --nproc_per_node 1`): L routes the base call through
/// it and compares every token with the audited router's answer.
#[derive(Clone, Copy)]
pub struct Launch<'a> {
    /// The command that started it, as notes and witnesses name it.
    pub command: &'a str,
    /// The launch, answering like the audited router (its expert-parallel size from
    /// [`moe_audit_core::router::Hints::ranks`], 1 when it declares none).
    pub router: &'a dyn Router,
}

impl Launch<'_> {
    /// Its expert-parallel size.
    pub fn ep(&self) -> usize {
        self.router.ranks().unwrap_or(1)
    }
}

/// Audits each config with a seeded layer of `hidden` × `ffn`, telling `progress` each probe;
/// fails before allocating anything when an audit is estimated to need more than `budget`
/// bytes. With `comm`, the layout probe runs the layer expert-parallel over it (every rank audits
/// alike).
pub(crate) fn audit_configs(
    configs: Vec<moe_audit_core::RouterConfig>,
    options: &AuditOptions,
    (hidden, ffn): (usize, usize),
    budget: MemoryBudget,
    comm: Option<&dyn moe_audit_parallel::Communicator>,
    progress: &dyn Progress,
) -> Result<Report> {
    for config in &configs {
        let estimate = options.memory_estimate(config.experts, config.k(), hidden, ffn);
        budget.ensure_fits(&format!("the audit of `{}`", config.name), estimate)?;
    }
    let mut routers = Vec::new();
    for config in configs {
        let layer = MoeLayer::seeded(config, hidden, ffn, options.seed, candle_core::DType::F32, &Device::Cpu)?;
        let report = match comm {
            Some(comm) => {
                let on_comm = moe_audit_parallel::OnComm::new(&layer, comm);
                audit(&Subject { router: layer.router(), layer: Some(&on_comm), layouts: &[] }, options, progress)?
            }
            None => audit(&Subject::layer(&layer), options, progress)?,
        };
        routers.push(report);
    }
    Ok(Report { options: options.clone(), routers })
}

/// Verdicts of one audited router, for tests and tools.
pub fn verdicts(r: &RouterReport) -> Vec<(Probe, Verdict)> {
    r.findings.iter().map(|f| (f.probe, f.verdict)).collect()
}

/// Audits one subject, telling `progress` each probe and its cases as they run.
pub fn audit(subject: &Subject, options: &AuditOptions, progress: &dyn Progress) -> Result<RouterReport> {
    check_sizes(subject, options)?;
    let router = subject.router;
    let (hidden, logits) = base_input(router, options)?;
    let base = Arc::new(Call::new(logits));
    let base_routing = base.route(router)?;
    let mut invariants = invariant_violations(router, &base_routing);
    if let Some(x) = &hidden {
        invariants.extend(layer_check::scores_per_token(router, x, &base.logits)?);
    }
    let pure = router.concurrent() && looks_pure(router, &base, &base_routing)?;
    let mut ctx = Ctx {
        router,
        base,
        base_routing,
        trials: options.trials,
        seed: options.seed,
        pure,
        hidden: hidden.clone(),
        ranks: options.ranks,
        layouts: subject.layouts,
        exhaustive: options.exhaustive,
        repeats: None,
        progress,
    };
    let other = probe::other_call(&ctx)?;
    ctx.repeats = Some(repeats::Repeats::train(router, &ctx.base, &ctx.base_routing, &other)?);
    let sample = match (subject.layer, &hidden) {
        (Some(layer), Some(x)) => Some(layer_check::Sample::new(layer, x, options.seed, options.ranks)?),
        _ => None,
    };
    let load = ctx.base_routing.stats;
    let mut findings = run_probes(&mut ctx, &options.probes, &other, sample.as_ref())?;
    explain_findings(&mut findings, &ctx, options);
    Ok(RouterReport { router: router.name().to_string(), load, invariants, findings })
}

/// The sizes and probes `options` ask of `subject`: each call splits evenly over the ranks of
/// the router and of every layout launch, and every probe applies to a router.
fn check_sizes(subject: &Subject, options: &AuditOptions) -> Result<()> {
    let (b, s) = (options.batch, options.seq_len);
    if b == 0 || s == 0 {
        return Err(Error::usage(text!(
            moe_audit_core::settings::BATCH,
            " and ",
            moe_audit_core::settings::SEQ_LEN,
            format!(" must be at least 1, got {b} and {s}")
        )));
    }
    if let Some(e) = options.probes.iter().find_map(|p| p.check_router().err()) {
        return Err(Error::usage(e));
    }
    let router = subject.router;
    if let Some(n) = router.ranks().filter(|&n| !b.is_multiple_of(n)) {
        return Err(Error::usage(text!(
            moe_audit_core::settings::BATCH,
            format!(
                " {b} is not a multiple of the {n} ranks router `{}` runs over (each rank takes batch/ranks sequences)",
                router.name()
            )
        )));
    }
    if let Some(l) = subject.layouts.iter().find(|l| !b.is_multiple_of(l.ep())) {
        return Err(Error::usage(text!(moe_audit_core::settings::BATCH, format!(" {b} is not a multiple of the {} ranks layout launch `{}` (`{}`) runs over, to compare with router `{}`", l.ep(), l.router.name(), moe_audit_core::error::excerpt(l.command), router.name()))));
    }
    Ok(())
}

/// The base call's input: hidden states through the score stage for a router that takes them
/// (the hidden states kept for the layer sample), else seeded rows as wide as the router takes.
fn base_input(router: &dyn Router, options: &AuditOptions) -> Result<(Option<Tensor>, Logits)> {
    let (b, s) = (options.batch, options.seq_len);
    let hidden = match router.hidden_size() {
        Some(h) => Some(probe::hidden_states(router, (b, s), h, options.seed)?),
        None => None,
    };
    let logits = match &hidden {
        Some(x) => logits_to_host(&router.scores(x)?)?,
        None => {
            let t = Seeded::new(options.seed).normal(&[b, s, router.row_width()], &Device::Cpu)?;
            Logits::from_shape_vec((b, s, router.row_width()), t.flatten_all()?.to_vec1()?).expect("shape")
        }
    };
    Ok((hidden, logits))
}

/// Every probe asked, in the order a stateful router needs: training-mode probes first, then M
/// (inference calls), then the calls around the other mode (always made), then S, which reads
/// them. A router that an inference call changes is so audited in training mode as it was
/// before, whichever probes run (see `repeats`). Findings come back in the order asked.
fn run_probes(
    ctx: &mut Ctx,
    probes: &[Probe],
    other: &Call,
    sample: Option<&layer_check::Sample>,
) -> Result<Vec<Finding>> {
    let later = |p: &Probe| matches!(p, Probe::M | Probe::S);
    let mut findings = Vec::new();
    for &probe in probes.iter().filter(|p| !later(p)) {
        findings.push(run_probe(ctx, probe, sample)?);
    }
    if probes.contains(&Probe::M) {
        findings.push(run_probe(ctx, Probe::M, sample)?);
    }
    let (router, base) = (ctx.router, Arc::clone(&ctx.base));
    ctx.repeats.as_mut().expect("made by audit").modes(router, &base, other)?;
    if probes.contains(&Probe::S) {
        findings.push(run_probe(ctx, Probe::S, sample)?);
    }
    findings.sort_by_key(|f| probes.iter().position(|&p| p == f.probe));
    Ok(findings)
}

/// Each finding's explanation; a D that leaks for randomness gets the fix naming the mode and
/// what the router's adapter offers.
fn explain_findings(findings: &mut [Finding], ctx: &Ctx, options: &AuditOptions) {
    let router = ctx.router;
    let audited_in = Mode::audited(router);
    let noise = noise::Noise::of(ctx.repeats(), audited_in);
    let random_fix = noise::separate(findings, &noise, router.seed_calls());
    for finding in findings.iter_mut() {
        finding.explain = explain::explain(finding, options, router.config(), audited_in);
        if let (Probe::D, Some(e), Some(fix)) = (finding.probe, &mut finding.explain, &random_fix) {
            e.fix = fix.clone();
        }
    }
}

/// Runs one probe with its reference routed fresh (a router whose calls may change it: its
/// verdict must not depend on the calls before it), and checks its layer sample.
fn run_probe(ctx: &mut Ctx, probe: Probe, sample: Option<&layer_check::Sample>) -> Result<Finding> {
    ctx.progress.probe(&format!("{} {}", ctx.router.name(), probe.name()));
    if !ctx.pure {
        ctx.base_routing = ctx.base.routes(ctx.router)?;
    }
    let mut finding = probe.rule().run(ctx, sample)?;
    if let Some(sample) = sample {
        sample.check(probe, &mut finding)?;
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
    // A layer over ranks states one group per rank: the capacity is each rank's.
    let unit = if r.scope.group == moe_audit_core::routing::GroupRule::Rank { "rank" } else { "group" };
    for (g, group) in r.scope.groups.iter().enumerate() {
        let Some(c) = group.capacity else { continue };
        let mut kept = vec![0usize; r.experts];
        for t in r.tokens.iter().filter(|t| t.group == g) {
            t.routes.iter().filter(|x| x.kept).for_each(|x| kept[x.expert] += 1);
        }
        if let Some((e, k)) = kept.iter().enumerate().find(|(_, &k)| k > c) {
            out.push(format!("{unit} {g}: expert {e} kept {k} routes over its capacity {c}"));
        }
        if let Some(declared) = config.and_then(|cfg| {
            cfg.capacity.as_ref().map(|cap| {
                let k = r.top_k.unwrap_or(1);
                moe_audit_core::routing::capacity::capacity(cap, group.tokens, k, r.experts)
            })
        }) {
            if declared != c {
                out.push(format!("group {g}: capacity {c} is not the declared formula's {declared}"));
            }
        }
    }
    out
}
