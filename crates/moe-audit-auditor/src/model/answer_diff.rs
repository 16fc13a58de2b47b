//! Comparing two answers of a model token by token, at every routed layer and in the output
//! rows, and telling numerics from real differences.
//!
//! Two calls of a model that differ in shape (a prefix, a KV cache step) may give a token router
//! logits that differ in the last bits. A top-k choice that flips then is a near-tie, not a leak:
//! the flip is **numerics** when the token's logits differ by f32 noise only (`delta`, their
//! largest absolute difference, > 0 and within 1e-4 relative) and its top-k margin (the k-th
//! best logit less the (k+1)-th, the smaller of the two calls') is at most `2 delta`, or when
//! only its combine weights moved on such logits. Anything else (a drop, a change on identical logits, a flip by more than the
//! logits moved) is **real**. Later layers inherit a flip's consequences, so a case whose
//! earliest change is numerics is drift as a whole.

use super::{LayerOutput, ModelOutput};
use moe_audit_core::routing::{diff_token, TokenDiff};
use serde::{Deserialize, Serialize};

/// Relative tolerance on output rows and on logits for weight-only changes: matmuls of
/// different shapes block and sum differently (as the single-layer audit's layer sample).
pub const OUTPUT_TOLERANCE: f64 = 1e-4;

/// How one token's routing changed at one layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Change {
    /// What changed.
    pub diff: TokenDiff,
    /// Explained by rounding (a near-tie on logits that moved), or not.
    pub numerics: bool,
    /// The token's top-k margin (smaller of the two calls), when logits and k are known.
    pub margin: Option<f32>,
}

/// One compared token pair: its change at each routed layer (`None`: unchanged) and the
/// relative difference of its output rows.
pub(crate) struct PairResult {
    pub layers: Vec<Option<Change>>,
    /// Whether only the capacity in force changed, per layer.
    pub capacity: Vec<bool>,
    pub output: Option<f64>,
}

/// A case as a whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum CaseClass {
    /// Nothing changed beyond tolerance.
    Same,
    /// Only changes numerics explain (and what they carried to later layers).
    Drift,
    /// A real change of routing or of an output row.
    Leak,
    /// No decision or output changed beyond numerics, but the capacity in force did.
    Latent,
}

/// Compares token `ia` of `a` with token `ib` of `b` (flat, sequence-major indices).
pub(crate) fn compare_pair(a: &ModelOutput, ia: usize, b: &ModelOutput, ib: usize, width: usize) -> PairResult {
    let mut layers = Vec::with_capacity(a.layers.len());
    let mut capacity = Vec::with_capacity(a.layers.len());
    for (la, lb) in a.layers.iter().zip(&b.layers) {
        let (ra, rb) = (&la.routing, &lb.routing);
        let diff = diff_token(ra, (ia / ra.seq_len, ia % ra.seq_len), rb, (ib / rb.seq_len, ib % rb.seq_len));
        capacity.push(diff.capacity && !diff.decision());
        // A changed record is a change, the capacity in force included (`TokenDiff::any`).
        layers.push(diff.any().then(|| classify(diff, la, ia, lb, ib)));
    }
    let output = a.outputs.as_ref().zip(b.outputs.as_ref()).map(|(ya, yb)| {
        let (ra, rb) = (&ya[ia * width..(ia + 1) * width], &yb[ib * width..(ib + 1) * width]);
        relative_difference(ra, rb)
    });
    PairResult { layers, capacity, output }
}

/// `max |a - b| / max(1, max |a|)`.
fn relative_difference(a: &[f32], b: &[f32]) -> f64 {
    let norm = a.iter().fold(1.0f64, |m, v| m.max(f64::from(v.abs())));
    a.iter().zip(b).fold(0.0f64, |m, (x, y)| m.max(f64::from((x - y).abs()))) / norm
}

fn classify(diff: TokenDiff, la: &LayerOutput, ia: usize, lb: &LayerOutput, ib: usize) -> Change {
    let e = la.routing.experts;
    let rows =
        la.logits.as_ref().zip(lb.logits.as_ref()).map(|(x, y)| (&x[ia * e..(ia + 1) * e], &y[ib * e..(ib + 1) * e]));
    let Some((xa, xb)) = rows else {
        return Change { diff, numerics: false, margin: None };
    };
    let delta = xa.iter().zip(xb).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    let k = la.routing.top_k;
    let margin = k.and_then(|k| Some(top_k_margin(xa, k)?.min(top_k_margin(xb, k)?)));
    let scale = xa.iter().fold(1f32, |m, v| m.max(v.abs()));
    // Rounding moves logits by float noise only; a flip on logits that moved more was caused.
    let rounding = delta > 0.0 && f64::from(delta / scale) <= OUTPUT_TOLERANCE;
    // Rounding never changes a capacity in force (computed from token counts, not logits).
    let numerics = rounding
        && !diff.kept
        && !diff.padded
        && !diff.capacity
        && (!diff.experts || margin.is_some_and(|m| m <= 2.0 * delta));
    Change { diff, numerics, margin }
}

/// The k-th largest logit less the (k+1)-th; `None` when k is E (nothing to flip with).
pub(crate) fn top_k_margin(row: &[f32], k: usize) -> Option<f32> {
    if k == 0 || k >= row.len() {
        return None;
    }
    let mut sorted = row.to_vec();
    sorted.sort_unstable_by(|x, y| y.total_cmp(x));
    Some(sorted[k - 1] - sorted[k])
}

/// A case's class from its pairs: the earliest layer with a changed decision decides (numerics
/// there makes the whole case drift); an output beyond tolerance with no routing change is a
/// leak; a capacity in force that changed with neither is latent (a drift's too: a capacity
/// is computed from token counts, never rounded).
pub(crate) fn classify_case(pairs: &[PairResult]) -> CaseClass {
    let layers = pairs.first().map_or(0, |p| p.layers.len());
    let decided = (0..layers).find_map(|l| {
        let changes: Vec<&Change> =
            pairs.iter().filter_map(|p| p.layers[l].as_ref()).filter(|c| c.diff.decision()).collect();
        (!changes.is_empty()).then(|| changes.iter().any(|c| !c.numerics))
    });
    let output = || pairs.iter().any(|p| p.output.is_some_and(|d| d > OUTPUT_TOLERANCE));
    let capacity = || pairs.iter().any(|p| p.capacity.contains(&true));
    match decided {
        Some(true) => CaseClass::Leak,
        None if output() => CaseClass::Leak,
        _ if capacity() => CaseClass::Latent,
        Some(false) => CaseClass::Drift,
        None => CaseClass::Same,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn margins_are_between_the_kth_and_the_next() {
        assert_eq!(top_k_margin(&[0.25, 1.0, 0.75, 0.5], 2), Some(0.25));
        assert_eq!(top_k_margin(&[0.1, 0.9], 2), None);
    }
}
