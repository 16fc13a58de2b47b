//! Probe X, numerics (docs/PROPERTIES.md, third failure mode; scenario 15): the same router in bf16 or
//! f16 against f32, and sums of many small terms in low-precision accumulators.
//!
//! **Precision flips.** A low-precision engine feeds the gate bf16/f16 activations and gets
//! bf16/f16 logits back (tensor cores accumulate in f32 in between); routers then upcast. We do
//! the same: round the hidden states, run the score stage, round the logits, route. A token
//! flips when its full routing record differs from f32's; flips sit at near-ties, so we report
//! the f32 top-k margin (smallest gap between adjacent logits among the k + 1 best) at every flip.
//!
//! **Accumulator swamping.** Once a running sum is large, each small term is below half an ulp
//! and rounds away (f16: 1024 + 1 = 1024 needs spacing 2, reached at 2048; 2048 + 1 = 2048).
//! We sum the same seeded terms (about 1 each, exactly representable in f16) sequentially in f16,
//! bf16 and f32 and pairwise in f16 and bf16, against the exact sum (f64 is exact here), for a
//! growing number of terms: the combine of many experts, a reduction across many ranks.

use super::Modes;
use super::{Ctx, Rule, Sample};
use crate::analyze::case::{Call, Case};
use crate::analyze::{
    witness::{self, Witness},
    AuditOptions, Finding, Probe, Verdict,
};
use candle_core::{DType, Tensor};
use half::{bf16, f16};
use moe_audit_core::error::Result;
use moe_audit_core::router::logits_to_host;
use moe_audit_core::routing::diff_token;
use moe_audit_core::routing::{Logits, Routing};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// Everything probe X measured on one router.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Numerics {
    /// Routing in each low precision against f32.
    pub flips: Vec<PrecisionFlips>,
    /// Relative error of low-precision sums, by number of terms.
    pub swamping: Vec<Swamping>,
}

/// Routing flips of one low precision.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PrecisionFlips {
    /// `bf16` or `f16`.
    pub dtype: String,
    /// Tokens compared.
    pub tokens: usize,
    /// Tokens whose experts, their order, or kept/padding flags differ from f32's (gates always
    /// move by a few ulps and are not counted).
    pub flipped: usize,
    /// `flipped / tokens`.
    pub rate: f64,
    /// Median f32 top-k margin (smallest adjacent logit gap among the k + 1 best) over all tokens.
    pub median_margin: Option<f64>,
    /// Median margin at the flipped tokens (near-ties: far below `median_margin`).
    pub median_margin_at_flips: Option<f64>,
    /// Flipped tokens by margin, in buckets with upper bounds 1e-4, 1e-3, 1e-2, 1e-1, none.
    pub margins_at_flips: Vec<MarginBucket>,
}

/// Flipped tokens whose margin is below `below` (and not below the previous bucket's bound).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MarginBucket {
    /// Upper bound of the margin; `None` for the last, unbounded bucket.
    pub below: Option<f64>,
    /// Flipped tokens in the bucket.
    pub count: usize,
}

/// One row of the swamping experiment: relative error `|sum - exact| / exact` per accumulator.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Swamping {
    /// Number of terms summed.
    pub terms: usize,
    /// Sequential f16 accumulator.
    pub f16: f64,
    /// Sequential bf16 accumulator.
    pub bf16: f64,
    /// Sequential f32 accumulator.
    pub f32: f64,
    /// Pairwise (tree) summation in f16.
    pub f16_pairwise: f64,
    /// Pairwise (tree) summation in bf16.
    pub bf16_pairwise: f64,
}

/// Margin bucket upper bounds.
const MARGIN_BOUNDS: [f64; 5] = [1e-4, 1e-3, 1e-2, 1e-1, f64::INFINITY];
/// Term counts of the swamping experiment.
/// (The sum stays below f16's largest finite value, 65504.)
pub const SWAMPING_TERMS: [usize; 7] = [16, 128, 1024, 2048, 4096, 8192, 32_768];

/// Probe X.
pub(crate) struct NumericsProbe;

impl Rule for NumericsProbe {
    fn calls(&self, _: Option<&Witness>, _: &AuditOptions, _: Modes) -> [String; 2] {
        ["f32 routing".into(), "bf16 or f16 routing".into()]
    }

    fn cause(&self, _: &Finding) -> String {
        "the precision of the router's arithmetic".into()
    }

    fn fix(&self) -> Option<String> {
        Some("compute the router's scores and top-k in f32 (the gate may stay in low precision)".into())
    }

    fn run(&self, ctx: &Ctx, _sample: Option<&Sample>) -> Result<Finding> {
        probe(ctx, Finding::empty(Probe::X))
    }
}

/// Runs probe X: flips in bf16 and f16, then swamping; the first flip gets a witness.
fn probe(ctx: &Ctx, mut finding: Finding) -> Result<Finding> {
    let mut flips = Vec::new();
    let mut first = None;
    for dtype in [DType::BF16, DType::F16] {
        let low = Call::new(low_precision_logits(ctx, dtype)?);
        overflow(&ctx.base.logits, &low.logits, dtype)?;
        let routing = low.routes(ctx.router)?;
        let (f, token) = compare(&ctx.base.logits, &ctx.base_routing, &routing, dtype);
        if first.is_none() {
            first = token.map(|t| (low, t));
        }
        flips.push(f);
    }
    // The worse precision's counts, never an average of two engines (each dtype's are in
    // `numerics.flips`); drift is its own verdict, not a causality leak.
    let worst = flips.iter().max_by(|a, b| a.rate.total_cmp(&b.rate).then(b.dtype.cmp(&a.dtype))).expect("two dtypes");
    (finding.compared, finding.affected, finding.rate) = (worst.tokens, worst.flipped, worst.rate);
    if flips.iter().any(|f| f.flipped > 0) {
        finding.verdict = Verdict::Drift;
    }
    let swamping = swamping(ctx.seed);
    let most = swamping.last().expect("measured");
    finding.note = format!(
        "routing flips: bf16 {:.2}%, f16 {:.2}% of tokens; sum of {} terms ~1: f16 off by {:.0}%, bf16 by {:.0}%, f32 by {:.1e}, pairwise f16 by {:.1e}",
        flips[0].rate * 100.0,
        flips[1].rate * 100.0,
        most.terms,
        most.f16 * 100.0,
        most.bf16 * 100.0,
        most.f32,
        most.f16_pairwise
    );
    if let Some((low, token)) = first {
        let case = Case::aligned(&ctx.base, low);
        finding.witness = witness::build(ctx.router, Probe::X, &case, token)?;
    }
    finding.numerics = Some(Numerics { flips, swamping });
    Ok(finding)
}

/// The base call as a `dtype` engine computes it: rounded hidden states through the score stage,
/// logits rounded; a logits-only router gets its logits rounded.
fn low_precision_logits(ctx: &Ctx, dtype: DType) -> Result<Logits> {
    let round = |t: &Tensor| -> Result<Tensor> { Ok(t.to_dtype(dtype)?.to_dtype(DType::F32)?) };
    match &ctx.hidden {
        Some(x) => logits_to_host(&round(&ctx.router.scores(&round(x)?)?)?),
        None => {
            let (b, s, e) = ctx.base.logits.dim();
            let flat = Tensor::from_slice(
                ctx.base.logits.as_standard_layout().as_slice().expect("contiguous"),
                (b, s, e),
                &candle_core::Device::Cpu,
            )?;
            logits_to_host(&round(&flat)?)
        }
    }
}

/// Fails naming the first logit that is finite in f32 but not once computed in `dtype` (a gate
/// whose logits or hidden states exceed f16's 65504): routing could only call it non-finite.
fn overflow(base: &Logits, low: &Logits, dtype: DType) -> Result<()> {
    let at = ndarray::Zip::indexed(base).and(low).fold(None, |found, (b, p, e), &x, &y| {
        found.or_else(|| (x.is_finite() && !y.is_finite()).then_some((b, p, e, x, y)))
    });
    match at {
        None => Ok(()),
        Some((b, p, e, x, y)) => {
            let (name, max) = if dtype == DType::F16 { ("f16", "65504") } else { ("bf16", "3.39e38") };
            Err(moe_audit_core::Error::usage(format!(
                "probe X: {name} overflows at batch {b}, position {p}, expert {e}: the logit {x} (f32) becomes {y} \
                 in {name} (largest finite {max}); scale the gate down or leave X out"
            )))
        }
    }
}

/// Flipped tokens and their margins; also the first flipped token.
fn compare(logits: &Logits, base: &Routing, low: &Routing, dtype: DType) -> (PrecisionFlips, Option<(usize, usize)>) {
    let k = base.top_k.unwrap_or(1);
    let (b, s, _) = logits.dim();
    let mut all = Vec::with_capacity(b * s);
    let mut at_flips = Vec::new();
    let mut first = None;
    for bi in 0..b {
        for p in 0..s {
            let margin = top_k_margin(logits.slice(ndarray::s![bi, p, ..]).iter().copied(), k);
            if let Some(m) = margin {
                all.push(m);
            }
            // Gates always move by a few low-precision ulps; a flip is a changed decision.
            let d = diff_token(base, (bi, p), low, (bi, p));
            if d.experts || d.kept || d.padded {
                first.get_or_insert((bi, p));
                at_flips.push(margin.unwrap_or(f64::INFINITY));
            }
        }
    }
    let mut buckets: Vec<MarginBucket> =
        MARGIN_BOUNDS.iter().map(|&b| MarginBucket { below: b.is_finite().then_some(b), count: 0 }).collect();
    for &m in &at_flips {
        buckets
            .iter_mut()
            .find(|bucket| bucket.below.is_none_or(|b| m < b))
            .expect("the last bucket is unbounded")
            .count += 1;
    }
    let flipped = at_flips.len();
    let flips = PrecisionFlips {
        dtype: format!("{dtype:?}").to_lowercase(),
        tokens: b * s,
        flipped,
        rate: flipped as f64 / (b * s).max(1) as f64,
        median_margin: median(all),
        median_margin_at_flips: median(at_flips),
        margins_at_flips: buckets,
    };
    (flips, first)
}

/// The smallest gap between adjacent logits among the k + 1 largest: a perturbation of that
/// size swaps two choices or the k-th expert. `None` with a single expert.
fn top_k_margin(row: impl Iterator<Item = f32>, k: usize) -> Option<f64> {
    let mut v: Vec<f32> = row.collect();
    v.sort_by(|a, b| b.total_cmp(a));
    v.windows(2).take(k).map(|w| f64::from(w[0]) - f64::from(w[1])).reduce(f64::min)
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

/// The swamping experiment for every count in [`SWAMPING_TERMS`], on seeded terms in [0.5, 1.5)
/// rounded to f16 (so every accumulator sums the same values and f64 sums them exactly).
pub fn swamping(seed: u64) -> Vec<Swamping> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ crate::seeds::NUMERICS);
    let max = *SWAMPING_TERMS.last().expect("not empty");
    let terms: Vec<f16> = (0..max).map(|_| f16::from_f32(rng.random_range(0.5f32..1.5))).collect();
    SWAMPING_TERMS
        .iter()
        .map(|&n| {
            let t = &terms[..n];
            let exact: f64 = t.iter().map(|x| f64::from(x.to_f32())).sum();
            let err = |sum: f64| (sum - exact).abs() / exact;
            let bf: Vec<bf16> = t.iter().map(|x| bf16::from_f32(x.to_f32())).collect();
            Swamping {
                terms: n,
                f16: err(f64::from(t.iter().fold(f16::ZERO, |acc, &x| acc + x).to_f32())),
                bf16: err(f64::from(bf.iter().fold(bf16::ZERO, |acc, &x| acc + x).to_f32())),
                f32: err(f64::from(t.iter().fold(0.0f32, |acc, x| acc + x.to_f32()))),
                f16_pairwise: err(f64::from(pairwise(t).to_f32())),
                bf16_pairwise: err(f64::from(pairwise(&bf).to_f32())),
            }
        })
        .collect()
}

/// Tree summation: error grows with log n instead of n. The sum of nothing is zero.
pub fn pairwise<T: Copy + Default + std::ops::Add<Output = T>>(v: &[T]) -> T {
    match v {
        [] => T::default(),
        [x] => *x,
        _ => {
            let (a, b) = v.split_at(v.len() / 2);
            pairwise(a) + pairwise(b)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starting_at_1024_small_terms_vanish() {
        // f16 has 10 fraction bits: from 1024 the spacing is 1, so + 0.5 (half an ulp, ties to
        // even) leaves 1024 and + 1 does not; from 2048 (spacing 2) + 1 leaves 2048. bf16 has 7
        // fraction bits: spacing 8 at 1024, so 1024 + 1 leaves 1024.
        let (one, half) = (f16::from_f32(1.0), f16::from_f32(0.5));
        assert_eq!(f16::from_f32(1024.0) + half, f16::from_f32(1024.0));
        assert_eq!(f16::from_f32(1024.0) + one, f16::from_f32(1025.0));
        assert_eq!(f16::from_f32(2048.0) + one, f16::from_f32(2048.0));
        assert_eq!(bf16::from_f32(1024.0) + bf16::ONE, bf16::from_f32(1024.0));
        // Counting to 4096 by ones in f16 stalls at 2048.
        let ones = vec![one; 4096];
        assert_eq!(ones.iter().fold(f16::ZERO, |a, &x| a + x).to_f32(), 2048.0);
        assert_eq!(pairwise(&ones).to_f32(), 4096.0, "pairwise sums of powers of two stay exact");
    }

    #[test]
    fn pairwise_sums_of_nothing_and_of_odd_lengths() {
        // An empty slice used to split into two empty halves forever.
        assert_eq!(pairwise::<f32>(&[]), 0.0);
        assert_eq!(pairwise(&[f16::ZERO; 0]).to_f32(), 0.0);
        assert_eq!(pairwise(&[1.0f32, 2.0, 3.0]), 6.0);
    }

    #[test]
    fn swamping_grows_with_terms_in_low_precision_and_not_in_f32_or_pairwise() {
        let rows = swamping(0);
        let last = rows.last().unwrap();
        assert!(rows[0].f16 < 1e-2, "16 terms: f16 is fine, {}", rows[0].f16);
        assert!(last.f16 > 0.5 && last.bf16 > 0.9, "32768 terms stall far below the sum: {last:?}");
        assert!(last.f32 < 1e-3 && last.f16_pairwise < 1e-2, "{last:?}");
        assert!(rows.windows(2).all(|w| w[1].f16 >= w[0].f16 * 0.5), "f16 error grows: {rows:?}");
        assert_eq!(swamping(0), rows, "seeded");
    }
}
