//! The whole-model audit: the probes P F N R D S M on token ids, and G (generation against
//! training), every routed layer compared with the full-record diff, outputs compared at the
//! positions that must not change.
//!
//! Each case is one model call (its reference is the base call, made once): cases are never
//! packed as sequences of one call, because whether sequences of a call interact is what N and
//! R test, and a model's scope is its own claim (docs/PROTOCOL.md, "Calls").

mod plan;

use super::answer_diff::{classify_case, compare_pair, CaseClass, Change, PairResult, OUTPUT_TOLERANCE};
use super::{Model, ModelInfo, ModelOutput, TokenCall};
use crate::analyze::{Probe, Property, Verdict};
use moe_audit_core::error::{Error, Result};
use moe_audit_core::routing::Route;
use moe_audit_core::text;
use plan::{Case, Plan};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// Sizes and knobs of a whole-model audit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelAuditOptions {
    /// Probes to run.
    pub probes: Vec<Probe>,
    /// Sequences per call.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Cases of F and N.
    pub trials: usize,
    /// Seed of the token ids and every random choice.
    pub seed: u64,
    /// Positions G prefills before generating one at a time (default half the sequence).
    pub prefill: usize,
}

/// The largest call an audit of `batch` sequences of `seq_len` tokens makes, `(batch, seq_len)`:
/// R pads up to a quarter of the sequence on (at least one token). A model's memory is checked
/// at this call before the audit starts.
pub fn largest_call(batch: usize, seq_len: usize) -> (usize, usize) {
    (batch, seq_len + seq_len / 4 + 1)
}

/// One routed layer's figures in a probe.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerTally {
    /// Global layer number.
    pub layer: usize,
    /// Tokens compared at this layer over all cases.
    pub compared: usize,
    /// Tokens whose routing decision changed in leaking cases.
    pub changed: usize,
    /// `changed / compared`.
    pub rate: f64,
    /// Of `changed`, tokens whose earliest changed layer is this one.
    pub first: usize,
    /// Of `changed`, tokens that had already changed at an earlier layer.
    pub inherited: usize,
    /// Tokens whose routing changed in drift cases (numerics, and what it carried along).
    pub drift: usize,
    /// Tokens whose capacity in force changed while their routes did not.
    pub capacity_only: usize,
    /// Changed tokens (any case) a near-tie explains: the flip is within the logits' change.
    pub near_ties: usize,
    /// Largest top-k margin of a near-tie flip.
    pub max_tie_margin: Option<f32>,
    /// Smallest top-k margin of a real change of experts.
    pub min_real_margin: Option<f32>,
}

/// The output rows' figures in a probe.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct OutputTally {
    /// Output rows compared.
    pub compared: usize,
    /// Rows beyond the f32 tolerance in leaking cases.
    pub changed: usize,
    /// Largest relative difference of a row within the tolerance (drift).
    pub drift: Option<f64>,
}

/// A leak as two calls and one token: replayable against the live model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenWitness {
    /// The model's name.
    pub model: String,
    /// The probe that found it.
    pub probe: Probe,
    /// The routed layer where the token changed first; `None`: only its output row changed.
    pub layer: Option<usize>,
    /// The reference call.
    pub a: TokenCall,
    /// The changed call.
    pub b: TokenCall,
    /// The token `(sequence, position)` in `a`.
    pub token_a: (usize, usize),
    /// The same token in `b`.
    pub token_b: (usize, usize),
    /// What changed (`experts, kept, weight, ...` or `output`).
    pub changed: String,
    /// Its routes at `layer` in `a`.
    pub routes_a: Vec<Route>,
    /// Its routes at `layer` in `b`.
    pub routes_b: Vec<Route>,
}

/// The result of one probe on a model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelFinding {
    /// The probe.
    pub probe: Probe,
    /// The property it tests.
    pub property: Property,
    /// Pass, leak, latent, drift or not applicable.
    pub verdict: Verdict,
    /// Cases run (model calls, besides the base call; S makes two per case).
    pub cases: usize,
    /// Cases whose changes numerics explain.
    pub drift_cases: usize,
    /// Cases with a real change.
    pub leak_cases: usize,
    /// Cases where only the capacity in force changed (no decision, no output).
    #[serde(default)]
    pub latent_cases: usize,
    /// The earliest routed layer where some token's routing changed in a leaking case.
    pub first_layer: Option<usize>,
    /// Per routed layer.
    pub layers: Vec<LayerTally>,
    /// The output rows, when the model returns them.
    pub outputs: OutputTally,
    /// One line on what was done or why the probe does not apply.
    pub note: String,
    /// The first leaking token, with both calls.
    pub witness: Option<TokenWitness>,
    /// The same counts by position, for the HTML report's heatmaps; not in the JSON, whose
    /// figures are per layer.
    #[serde(skip)]
    pub positions: PositionTally,
}

/// Where on the sequence a probe changed routing: per routed layer (report order) and position
/// of the reference call, tokens changed first there and tokens carried from an earlier layer
/// in leaking cases; per position, the largest relative difference of an output row.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PositionTally {
    /// `[layer][position]`: tokens whose earliest changed layer is this one.
    pub first: Vec<Vec<usize>>,
    /// `[layer][position]`: tokens that had already changed at an earlier layer.
    pub carried: Vec<Vec<usize>>,
    /// `[position]`: the largest relative difference of an output row (any case).
    pub output: Vec<Option<f64>>,
}

impl PositionTally {
    fn new(layers: usize, seq_len: usize) -> PositionTally {
        PositionTally {
            first: vec![vec![0; seq_len]; layers],
            carried: vec![vec![0; seq_len]; layers],
            output: vec![None; seq_len],
        }
    }

    /// Counts one token pair at position `pos`, as [`tally_layers`] counts it per layer.
    fn add(&mut self, pos: usize, r: &PairResult, class: CaseClass) {
        if let Some(d) = r.output {
            self.output[pos] = Some(self.output[pos].map_or(d, |x| x.max(d)));
        }
        if class != CaseClass::Leak {
            return;
        }
        let changed = r.layers.iter().map(|c| c.is_some_and(|c| c.diff.decision()));
        let mut seen = false;
        for (l, _) in changed.enumerate().filter(|(_, c)| *c) {
            let counts = if seen { &mut self.carried } else { &mut self.first };
            counts[l][pos] += 1;
            seen = true;
        }
    }
}

/// A whole-model audit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelReport {
    /// The model as it introduced itself.
    pub model: ModelInfo,
    /// The options the audit ran with.
    pub options: ModelAuditOptions,
    /// One finding per probe run.
    pub findings: Vec<ModelFinding>,
}

impl ModelReport {
    /// Whether a probe found a real leak.
    pub fn leaks(&self) -> bool {
        self.findings.iter().any(|f| f.verdict == Verdict::Leak)
    }

    /// Whether a probe found only numerics.
    pub fn drifts(&self) -> bool {
        self.findings.iter().any(|f| f.verdict == Verdict::Drift)
    }

    /// The finding of `probe`, if it ran.
    pub fn finding(&self, probe: Probe) -> Option<&ModelFinding> {
        self.findings.iter().find(|f| f.probe == probe)
    }
}

/// Seed offset of the probes' random streams.
const PROBE_SALT: u64 = 0x746f_6b65_6e00;

/// Runs `options.probes` on `model`, in report order, one call at a time.
pub fn audit_model(model: &dyn Model, options: &ModelAuditOptions) -> Result<ModelReport> {
    let info = model.info();
    moe_audit_core::error::ensure_positive(&[
        (moe_audit_core::settings::BATCH, options.batch),
        (moe_audit_core::settings::SEQ_LEN, options.seq_len),
        (crate::settings::TRIALS, options.trials),
    ])?;
    if options.prefill > options.seq_len {
        return Err(Error::usage(format!(
            "prefill {} is over the sequence length {}",
            options.prefill, options.seq_len
        )));
    }
    if let Some(p) = options.probes.iter().find(|p| !Probe::MODEL.contains(p)) {
        let letters = Probe::MODEL.iter().map(Probe::to_string).collect::<Vec<_>>().join(",");
        return Err(Error::usage(text!(
            crate::settings::PROBES,
            format!(": probe {p} does not audit whole models: expected letters of {letters}")
        )));
    }
    let mut rng = ChaCha8Rng::seed_from_u64(options.seed);
    let (b, s) = (options.batch, options.seq_len);
    let tokens: Vec<u32> = (0..b * s).map(|_| rng.random_range(0..info.vocab as u32)).collect();
    let base = TokenCall::forward(b, s, options.seed, tokens);
    let base_out = model.call(&base)?;
    let mut findings = Vec::new();
    for &probe in &options.probes {
        // One stream per probe, whichever others run.
        let mut rng = ChaCha8Rng::seed_from_u64(options.seed ^ (PROBE_SALT + probe as u64));
        let plan = Plan::of(probe, info, &base, options, &mut rng);
        findings.push(run_probe(model, probe, &base, &base_out, plan)?);
    }
    Ok(ModelReport { model: info.clone(), options: options.clone(), findings })
}

/// Runs the cases of one probe and folds them into its finding.
fn run_probe(
    model: &dyn Model,
    probe: Probe,
    base: &TokenCall,
    base_out: &ModelOutput,
    plan: Plan,
) -> Result<ModelFinding> {
    let info = model.info();
    let mut layers: Vec<LayerTally> = info.routed().map(|l| LayerTally::new(l.layer)).collect();
    let mut finding = ModelFinding::new(probe, plan.cases.len(), plan.note);
    finding.positions = PositionTally::new(layers.len(), base.seq_len);
    let mut witnessed = None;
    for case in &plan.cases {
        for call in &case.before {
            model.call(call)?;
        }
        let out = model.call(&case.b)?;
        let results: Vec<PairResult> =
            case.pairs.iter().map(|&(ia, ib)| compare_pair(base_out, ia, &out, ib, info.outputs)).collect();
        let class = classify_case(&results);
        match class {
            CaseClass::Leak => finding.leak_cases += 1,
            CaseClass::Latent => finding.latent_cases += 1,
            CaseClass::Drift => finding.drift_cases += 1,
            CaseClass::Same => {}
        }
        for (r, &(ia, _)) in results.iter().zip(&case.pairs) {
            tally_layers(&mut layers, r, class);
            finding.positions.add(ia % base.seq_len, r, class);
            finding.outputs.add(r.output, class);
        }
        // The witness replays with the finding's verdict: the first leaking case's, else the
        // first latent one's.
        let wanted =
            matches!((class, witnessed), (CaseClass::Leak, None | Some(CaseClass::Latent)) | (CaseClass::Latent, None));
        if wanted {
            finding.witness = Some(witness(info, probe, base, base_out, (case, class), &out, &results));
            witnessed = Some(class);
        }
    }
    finding.finish(layers);
    Ok(finding)
}

/// Counts one token pair of a case at every routed layer: decisions changed (first at this
/// layer or inherited from an earlier one; drift in a drift case), capacities changed alone,
/// and the top-k margins of near-ties and of real changes.
fn tally_layers(layers: &mut [LayerTally], r: &PairResult, class: CaseClass) {
    let mut seen = false;
    for (l, (tally, change)) in layers.iter_mut().zip(&r.layers).enumerate() {
        tally.compared += 1;
        tally.capacity_only += usize::from(r.capacity[l]);
        // A capacity alone makes the case latent (`classify_case`); the counts are decisions.
        let Some(c) = change.filter(|c| c.diff.decision()) else { continue };
        if c.numerics {
            tally.near_ties += 1;
            tally.max_tie_margin = max_opt(tally.max_tie_margin, c.margin);
        } else if c.diff.experts {
            tally.min_real_margin = c.margin.map(|m| tally.min_real_margin.map_or(m, |x: f32| x.min(m)));
        }
        match class {
            CaseClass::Leak => {
                tally.changed += 1;
                if seen {
                    tally.inherited += 1;
                } else {
                    tally.first += 1;
                }
            }
            _ => tally.drift += 1,
        }
        seen = true;
    }
}

impl LayerTally {
    fn new(layer: usize) -> LayerTally {
        LayerTally {
            layer,
            compared: 0,
            changed: 0,
            rate: 0.0,
            first: 0,
            inherited: 0,
            drift: 0,
            capacity_only: 0,
            near_ties: 0,
            max_tie_margin: None,
            min_real_margin: None,
        }
    }
}

impl OutputTally {
    /// Counts one output row's relative difference (`None`: the model returns no outputs).
    fn add(&mut self, difference: Option<f64>, class: CaseClass) {
        let Some(d) = difference else { return };
        self.compared += 1;
        if d > OUTPUT_TOLERANCE {
            self.changed += usize::from(class == CaseClass::Leak);
        } else if d > 0.0 {
            self.drift = Some(self.drift.map_or(d, |x| x.max(d)));
        }
    }
}

impl ModelFinding {
    /// A finding before its cases run: not applicable without cases, else passing so far.
    fn new(probe: Probe, cases: usize, note: String) -> ModelFinding {
        ModelFinding {
            probe,
            property: probe.property(),
            verdict: if cases == 0 { Verdict::NotApplicable } else { Verdict::Pass },
            cases,
            drift_cases: 0,
            leak_cases: 0,
            latent_cases: 0,
            first_layer: None,
            layers: Vec::new(),
            outputs: OutputTally::default(),
            note,
            witness: None,
            positions: PositionTally::default(),
        }
    }

    /// The layers' rates, the first changed layer and the verdict from the cases counted.
    fn finish(&mut self, mut layers: Vec<LayerTally>) {
        for t in &mut layers {
            t.rate = if t.compared == 0 { 0.0 } else { t.changed as f64 / t.compared as f64 };
        }
        self.first_layer = layers.iter().find(|t| t.first > 0).map(|t| t.layer);
        self.layers = layers;
        if self.verdict == Verdict::Pass {
            self.verdict = match (self.leak_cases, self.latent_cases, self.drift_cases) {
                (0, 0, 0) => Verdict::Pass,
                (0, 0, _) => Verdict::Drift,
                (0, _, _) => Verdict::Latent,
                _ => Verdict::Leak,
            };
        }
    }
}

fn max_opt(a: Option<f32>, b: Option<f32>) -> Option<f32> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.max(y)),
        (x, y) => x.or(y),
    }
}

/// The leaking case's first token at its earliest layer with a real decision change (by layer,
/// then token order), or its first changed output row; a latent case's first token whose
/// capacity in force changed.
fn witness(
    info: &ModelInfo,
    probe: Probe,
    base: &TokenCall,
    base_out: &ModelOutput,
    (case, class): (&Case, CaseClass),
    out: &ModelOutput,
    results: &[PairResult],
) -> TokenWitness {
    let layers = base_out.layers.len();
    let shows = |c: Change| !c.numerics && (c.diff.decision() || class == CaseClass::Latent);
    let at_layer = (0..layers).find_map(|l| {
        let i = results.iter().position(|r| r.layers[l].is_some_and(shows))?;
        Some((Some(l), i, results[i].layers[l].expect("found").diff.describe()))
    });
    let (layer, i, changed) = at_layer.unwrap_or_else(|| {
        let i = results.iter().position(|r| r.output.is_some_and(|d| d > OUTPUT_TOLERANCE)).unwrap_or(0);
        (None, i, "output".to_string())
    });
    let (ia, ib) = case.pairs[i];
    let token_a = (ia / base.seq_len, ia % base.seq_len);
    let token_b = (ib / case.b.seq_len, ib % case.b.seq_len);
    let routes = |o: &ModelOutput, (s, p): (usize, usize)| {
        layer.map_or(Vec::new(), |l| o.layers[l].routing.token(s, p).routes.clone())
    };
    TokenWitness {
        model: info.name.clone(),
        probe,
        layer: layer.map(|l| base_out.layers[l].layer),
        a: base.clone(),
        b: case.b.clone(),
        token_a,
        token_b,
        changed,
        routes_a: routes(base_out, token_a),
        routes_b: routes(out, token_b),
    }
}

/// Replays a witness against `model`: both calls again, and how the token differs now at the
/// witness's layer (or in its output row) beyond numerics: a changed decision or output row is
/// a leak, the capacity in force alone latent, nothing a pass.
pub fn replay(model: &dyn Model, w: &TokenWitness) -> Result<Verdict> {
    let info = model.info();
    if w.model != info.name {
        let model = moe_audit_core::error::excerpt(&w.model);
        return Err(Error::invalid(format!("the witness is of model `{model}`, not `{}`", info.name)));
    }
    let index = |call: &TokenCall, (s, p): (usize, usize)| -> Result<usize> {
        if s >= call.batch || p >= call.seq_len {
            return Err(Error::invalid(format!("the witness's token ({s}, {p}) is outside its call")));
        }
        Ok(s * call.seq_len + p)
    };
    let (ia, ib) = (index(&w.a, w.token_a)?, index(&w.b, w.token_b)?);
    let layer = match w.layer {
        Some(layer) => match info.routed().position(|l| l.layer == layer) {
            Some(i) => Some(i),
            None => {
                return Err(Error::invalid(format!("the witness's layer {layer} is not a routed layer of the model")))
            }
        },
        None => None,
    };
    let (a, b) = (model.call(&w.a)?, model.call(&w.b)?);
    let r = compare_pair(&a, ia, &b, ib, info.outputs);
    Ok(match layer {
        Some(l) => match r.layers[l].filter(|c| !c.numerics) {
            Some(c) if c.diff.decision() => Verdict::Leak,
            Some(_) => Verdict::Latent,
            None => Verdict::Pass,
        },
        None if r.output.is_some_and(|d| d > OUTPUT_TOLERANCE) => Verdict::Leak,
        None => Verdict::Pass,
    })
}
