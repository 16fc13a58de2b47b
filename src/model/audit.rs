//! The whole-model audit: the probes P F N R D S M on token ids, and G (generation against
//! training), every routed layer compared with the full-record diff, outputs compared at the
//! positions that must not change.
//!
//! Each case is one model call (its reference is the base call, made once): cases are never
//! packed as sequences of one call, because whether sequences of a call interact is what N and
//! R test, and a model's scope is its own claim (docs/PROTOCOL.md, "Calls").

use super::compare::{classify_case, compare_pair, CaseClass, PairResult, OUTPUT_TOLERANCE};
use super::{Mode, Model, ModelInfo, ModelOutput, Path, TokenCall};
use crate::analyze::{Property, Verdict};
use crate::error::{Error, Result, Setting};
use crate::routing::Route;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// A probe on token ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum TokenProbe {
    /// Prefix: the sequences cut after position t; positions ≤ t compared.
    P,
    /// Future: tokens after t of one sequence replaced (random ids, or token t repeated so the
    /// later tokens want the same experts); positions ≤ t compared.
    F,
    /// Neighbour: another sequence of the batch replaced.
    N,
    /// Re-batch: sequences reversed, the batch halved, padding on the right and on the left.
    R,
    /// Repeat: the same call twice.
    D,
    /// Replay: the same call after another call.
    S,
    /// Mode: training against inference mode.
    M,
    /// Generation: the generation path (prefill, then one token at a time through the KV
    /// cache) against one full forward.
    G,
}

impl TokenProbe {
    /// Every probe, in report order.
    pub const ALL: &'static [TokenProbe] = &[
        TokenProbe::P,
        TokenProbe::F,
        TokenProbe::N,
        TokenProbe::R,
        TokenProbe::D,
        TokenProbe::S,
        TokenProbe::M,
        TokenProbe::G,
    ];

    /// The property the probe tests.
    pub fn property(self) -> Property {
        match self {
            TokenProbe::P => Property::CLength,
            TokenProbe::F => Property::CContent,
            TokenProbe::N | TokenProbe::R => Property::B,
            TokenProbe::D => Property::D,
            TokenProbe::S => Property::S,
            TokenProbe::M | TokenProbe::G => Property::TI,
        }
    }

    /// Its long name.
    pub fn name(self) -> &'static str {
        match self {
            TokenProbe::P => "prefix",
            TokenProbe::F => "future",
            TokenProbe::N => "neighbour",
            TokenProbe::R => "re-batch",
            TokenProbe::D => "repeat",
            TokenProbe::S => "replay",
            TokenProbe::M => "mode",
            TokenProbe::G => "generation",
        }
    }

    /// A comma-separated list of letters; L and X (layout, numerics of a router's rows) have
    /// no meaning for a model answering token ids and are refused.
    pub fn parse_list(list: &str) -> Result<Vec<TokenProbe>> {
        let mut out = Vec::new();
        for word in list.split(',').map(str::trim).filter(|w| !w.is_empty()) {
            let probe = TokenProbe::ALL.iter().copied().find(|p| format!("{p:?}").eq_ignore_ascii_case(word));
            match probe {
                Some(p) if !out.contains(&p) => out.push(p),
                Some(_) => {}
                None => {
                    return Err(Error::Usage(format!(
                        "{}: unknown probe `{word}` for a whole model: expected letters of P,F,N,R,D,S,M,G",
                        Setting::Probes
                    )))
                }
            }
        }
        if out.is_empty() {
            return Err(Error::Usage(format!("{} is empty: an audit that runs no probe cannot pass", Setting::Probes)));
        }
        out.sort();
        Ok(out)
    }
}

/// Sizes and knobs of a whole-model audit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelAuditOptions {
    /// Probes to run.
    pub probes: Vec<TokenProbe>,
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
    pub probe: TokenProbe,
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
    pub probe: TokenProbe,
    /// The property it tests.
    pub property: Property,
    /// Pass, leak, drift or not applicable.
    pub verdict: Verdict,
    /// Cases run (model calls, besides the base call; S makes two per case).
    pub cases: usize,
    /// Cases whose changes numerics explain.
    pub drift_cases: usize,
    /// Cases with a real change.
    pub leak_cases: usize,
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
    pub fn finding(&self, probe: TokenProbe) -> Option<&ModelFinding> {
        self.findings.iter().find(|f| f.probe == probe)
    }
}

/// Seed offset of the probes' random streams.
const PROBE_SALT: u64 = 0x746f_6b65_6e00;

/// One case: call `b` (after the calls `before`, whose answers are ignored) against the base
/// call, and the token pairs `(index in base, index in b)` that must not change.
struct Case {
    before: Vec<TokenCall>,
    b: TokenCall,
    pairs: Vec<(usize, usize)>,
}

/// Runs `options.probes` on `model`, in report order, one call at a time.
pub fn audit_model(model: &dyn Model, options: &ModelAuditOptions) -> Result<ModelReport> {
    let info = model.info();
    crate::error::ensure_positive(&[
        (Setting::Batch, options.batch),
        (Setting::SeqLen, options.seq_len),
        (Setting::Trials, options.trials),
    ])?;
    if options.prefill > options.seq_len {
        return Err(Error::Usage(format!(
            "prefill {} is over the sequence length {}",
            options.prefill, options.seq_len
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
        let (cases, note) = plan(probe, info, &base, options, &mut rng);
        findings.push(run_probe(model, probe, &base, &base_out, cases, note)?);
    }
    Ok(ModelReport { model: info.clone(), options: options.clone(), findings })
}

/// Every pair of a sequence map: token `p` of base sequence `i` against token `p + offset` of
/// sequence `j` of the other call, for positions `0..n`.
fn pairs_of(s: usize, other_len: usize, map: &[(usize, usize)], n: usize, offset: usize) -> Vec<(usize, usize)> {
    map.iter().flat_map(|&(i, j)| (0..n).map(move |p| (i * s + p, j * other_len + p + offset))).collect()
}

/// A call of sequences picked from the base (`rows[j]` = the base sequence of row j), each
/// padded with `left` and `right` padding tokens (id 0).
fn rebuilt(base: &TokenCall, rows: &[usize], (left, right): (usize, usize)) -> TokenCall {
    let s = base.seq_len;
    let len = left + s + right;
    let mut tokens = Vec::with_capacity(rows.len() * len);
    let mut mask = Vec::with_capacity(rows.len() * len);
    for &i in rows {
        tokens.extend(std::iter::repeat_n(0, left).chain(base.tokens[i * s..(i + 1) * s].iter().copied()));
        tokens.extend(std::iter::repeat_n(0, right));
        mask.extend((0..len).map(|p| p < left || p >= left + s));
    }
    let padding = (left + right > 0).then_some(mask);
    TokenCall { batch: rows.len(), seq_len: len, tokens, padding, ..base.clone() }
}

/// The cases of `probe` (none, with a note, when it does not apply).
fn plan(
    probe: TokenProbe,
    info: &ModelInfo,
    base: &TokenCall,
    options: &ModelAuditOptions,
    rng: &mut ChaCha8Rng,
) -> (Vec<Case>, String) {
    let (b, s) = (base.batch, base.seq_len);
    let all: Vec<(usize, usize)> = (0..b).map(|i| (i, i)).collect();
    let every = pairs_of(s, s, &all, s, 0);
    let vocab = info.vocab as u32;
    let one = |b: TokenCall, pairs: Vec<(usize, usize)>| Case { before: Vec::new(), b, pairs };
    match probe {
        TokenProbe::P => {
            // Prefix lengths 1, 2, 4, ... and s - 1: one call each (a shorter call cannot be
            // packed with others without padding, which is R's question).
            let mut lengths: Vec<usize> =
                std::iter::successors(Some(1usize), |n| Some(n * 2)).take_while(|&n| n < s).collect();
            if s > 1 && lengths.last() != Some(&(s - 1)) {
                lengths.push(s - 1);
            }
            let cases = lengths
                .iter()
                .map(|&n| {
                    let tokens = (0..b).flat_map(|i| base.tokens[i * s..i * s + n].iter().copied()).collect();
                    one(TokenCall { seq_len: n, tokens, ..base.clone() }, pairs_of(s, n, &all, n, 0))
                })
                .collect::<Vec<_>>();
            let note = format!("{} prefixes of every sequence, lengths {lengths:?}", cases.len());
            (cases, if s == 1 { "a sequence of one token has no prefix".into() } else { note })
        }
        TokenProbe::F if s > 1 => {
            let cases = (0..options.trials)
                .map(|trial| {
                    let (i, t) = (trial % b, rng.random_range(0..s - 1));
                    let mut call = base.clone();
                    let keep = base.tokens[i * s + t];
                    for p in t + 1..s {
                        // Odd trials are targeted: later tokens equal to token t want its experts.
                        call.tokens[i * s + p] = if trial % 2 == 1 { keep } else { rng.random_range(0..vocab) };
                    }
                    one(call, pairs_of(s, s, &[(i, i)], t + 1, 0))
                })
                .collect();
            (cases, format!("{} trials: later tokens of one sequence random, or repeating token t", options.trials))
        }
        TokenProbe::F => (Vec::new(), "a sequence of one token has no future".into()),
        TokenProbe::N if b > 1 => {
            let cases = (0..options.trials)
                .map(|trial| {
                    let i = trial % b;
                    let mut call = base.clone();
                    call.tokens[i * s..(i + 1) * s].iter_mut().for_each(|t| *t = rng.random_range(0..vocab));
                    let others: Vec<(usize, usize)> = all.iter().copied().filter(|&(j, _)| j != i).collect();
                    one(call, pairs_of(s, s, &others, s, 0))
                })
                .collect();
            (cases, format!("{} trials: one sequence of the batch replaced", options.trials))
        }
        TokenProbe::N => (Vec::new(), "a batch of one sequence has no neighbour".into()),
        TokenProbe::R => {
            let mut cases = Vec::new();
            let mut what = Vec::new();
            if b > 1 {
                let reversed: Vec<usize> = (0..b).rev().collect();
                let map: Vec<(usize, usize)> = reversed.iter().enumerate().map(|(j, &i)| (i, j)).collect();
                cases.push(one(rebuilt(base, &reversed, (0, 0)), pairs_of(s, s, &map, s, 0)));
                let half: Vec<usize> = (0..b.div_ceil(2)).collect();
                let map: Vec<(usize, usize)> = half.iter().map(|&i| (i, i)).collect();
                cases.push(one(rebuilt(base, &half, (0, 0)), pairs_of(s, s, &map, s, 0)));
                what.push("reversed, halved");
            }
            if info.padding_mask {
                let pad = (s / 4).max(1);
                let rows: Vec<usize> = (0..b).collect();
                cases.push(one(rebuilt(base, &rows, (0, pad)), pairs_of(s, s + pad, &all, s, 0)));
                cases.push(one(rebuilt(base, &rows, (pad, 0)), pairs_of(s, s + pad, &all, s, pad)));
                what.push("padded right and left");
            }
            let note = match what.is_empty() {
                true => "a batch of one sequence, and a model that takes no padding mask".to_string(),
                false => format!("the batch {}", what.join("; ")),
            };
            (cases, note)
        }
        TokenProbe::D => (vec![one(base.clone(), every)], "the base call twice".into()),
        TokenProbe::S => {
            let other: Vec<u32> = (0..b * s).map(|_| rng.random_range(0..vocab)).collect();
            let other = TokenCall { tokens: other, ..base.clone() };
            (
                vec![Case { before: vec![other], b: base.clone(), pairs: every }],
                "the base call after another call".into(),
            )
        }
        TokenProbe::M => (
            vec![one(TokenCall { mode: Mode::Inference, ..base.clone() }, every)],
            "inference mode against training mode".into(),
        ),
        TokenProbe::G if info.generate => {
            let call = TokenCall { path: Path::Generate { prefill: options.prefill }, ..base.clone() };
            let note = format!("prefill {} positions, then one token at a time through the KV cache", options.prefill);
            (vec![one(call, every)], note)
        }
        TokenProbe::G => (Vec::new(), "the model does not run the generation path".into()),
    }
}

/// Runs the cases of one probe and folds them into its finding.
fn run_probe(
    model: &dyn Model,
    probe: TokenProbe,
    base: &TokenCall,
    base_out: &ModelOutput,
    cases: Vec<Case>,
    note: String,
) -> Result<ModelFinding> {
    let info = model.info();
    let mut layers: Vec<LayerTally> = info
        .routed()
        .map(|l| LayerTally {
            layer: l.layer,
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
        })
        .collect();
    let mut finding = ModelFinding {
        probe,
        property: probe.property(),
        verdict: if cases.is_empty() { Verdict::NotApplicable } else { Verdict::Pass },
        cases: cases.len(),
        drift_cases: 0,
        leak_cases: 0,
        first_layer: None,
        layers: Vec::new(),
        outputs: OutputTally::default(),
        note,
        witness: None,
    };
    for case in &cases {
        for call in &case.before {
            model.call(call)?;
        }
        let out = model.call(&case.b)?;
        let results: Vec<PairResult> =
            case.pairs.iter().map(|&(ia, ib)| compare_pair(base_out, ia, &out, ib, info.outputs)).collect();
        let class = classify_case(&results);
        match class {
            CaseClass::Leak => finding.leak_cases += 1,
            CaseClass::Drift => finding.drift_cases += 1,
            CaseClass::Same => {}
        }
        for r in &results {
            let mut seen = false;
            for (l, (tally, change)) in layers.iter_mut().zip(&r.layers).enumerate() {
                tally.compared += 1;
                tally.capacity_only += usize::from(r.capacity[l]);
                // A capacity alone makes the case leak (`classify_case`); the counts are decisions.
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
            if let Some(d) = r.output {
                finding.outputs.compared += 1;
                if d > OUTPUT_TOLERANCE {
                    finding.outputs.changed += usize::from(class == CaseClass::Leak);
                } else if d > 0.0 {
                    finding.outputs.drift = Some(finding.outputs.drift.map_or(d, |x| x.max(d)));
                }
            }
        }
        if class == CaseClass::Leak && finding.witness.is_none() {
            finding.witness = Some(witness(info, probe, base, base_out, case, &out, &results));
        }
    }
    for t in &mut layers {
        t.rate = if t.compared == 0 { 0.0 } else { t.changed as f64 / t.compared as f64 };
    }
    finding.first_layer = layers.iter().find(|t| t.first > 0).map(|t| t.layer);
    finding.layers = layers;
    if finding.verdict == Verdict::Pass {
        finding.verdict = match (finding.leak_cases, finding.drift_cases) {
            (0, 0) => Verdict::Pass,
            (0, _) => Verdict::Drift,
            _ => Verdict::Leak,
        };
    }
    Ok(finding)
}

fn max_opt(a: Option<f32>, b: Option<f32>) -> Option<f32> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.max(y)),
        (x, y) => x.or(y),
    }
}

/// The leaking case's first token at its earliest changed layer (by layer, then token order),
/// or its first changed output row.
fn witness(
    info: &ModelInfo,
    probe: TokenProbe,
    base: &TokenCall,
    base_out: &ModelOutput,
    case: &Case,
    out: &ModelOutput,
    results: &[PairResult],
) -> TokenWitness {
    let layers = base_out.layers.len();
    let at_layer = (0..layers).find_map(|l| {
        let i = results.iter().position(|r| r.layers[l].is_some_and(|c| !c.numerics))?;
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

/// Replays a witness against `model`: both calls again, and whether the token still differs
/// at the witness's layer (or in its output row) beyond numerics.
pub fn replay(model: &dyn Model, w: &TokenWitness) -> Result<bool> {
    let info = model.info();
    if w.model != info.name {
        return Err(Error::Usage(format!("the witness is of model `{}`, not `{}`", w.model, info.name)));
    }
    let index = |call: &TokenCall, (s, p): (usize, usize)| -> Result<usize> {
        if s >= call.batch || p >= call.seq_len {
            return Err(Error::Usage(format!("the witness's token ({s}, {p}) is outside its call")));
        }
        Ok(s * call.seq_len + p)
    };
    let (ia, ib) = (index(&w.a, w.token_a)?, index(&w.b, w.token_b)?);
    let layer = match w.layer {
        Some(layer) => match info.routed().position(|l| l.layer == layer) {
            Some(i) => Some(i),
            None => {
                return Err(Error::Usage(format!("the witness's layer {layer} is not a routed layer of the model")))
            }
        },
        None => None,
    };
    let (a, b) = (model.call(&w.a)?, model.call(&w.b)?);
    let r = compare_pair(&a, ia, &b, ib, info.outputs);
    Ok(match layer {
        Some(l) => r.layers[l].is_some_and(|c| !c.numerics),
        None => r.output.is_some_and(|d| d > OUTPUT_TOLERANCE),
    })
}
