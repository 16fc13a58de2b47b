//! The layer half of the audit: the score stage must be per token (checked once), and on one
//! sample case per probe the whole layer runs, so an output that changes while the routing does
//! not (a layer bug) is caught. Output differences within f32 summation noise are drift.

use super::{Finding, Layer, Probe, Verdict};
use candle_core::{Device, Tensor};
use moe_audit_core::error::Result;
use moe_audit_core::layer::Seeded;
use moe_audit_core::router::{logits_to_host, Router};
use moe_audit_core::routing::diff_token;
use moe_audit_core::routing::{Logits, Routing};
use moe_audit_parallel::RankTraffic;

/// Relative output tolerance: matmuls of different row counts may block and sum differently.
const OUTPUT_TOLERANCE: f64 = 1e-4;
/// Tolerance on recomputed logits (same reason).
const SCORE_TOLERANCE: f32 = 1e-4;

/// Scores of a truncated and of a re-ordered batch must equal the full batch's scores.
pub(super) fn scores_per_token(router: &dyn Router, x: &Tensor, logits: &Logits) -> Result<Vec<String>> {
    let (b, s, _) = x.dims3()?;
    let mut out = Vec::new();
    let half = s.div_ceil(2);
    let prefix = logits_to_host(&router.scores(&x.narrow(1, 0, half)?)?)?;
    let reversed = logits_to_host(&router.scores(&x.flip(&[0])?.contiguous()?)?)?;
    for bi in 0..b {
        for p in 0..s {
            for e in 0..logits.dim().2 {
                let want = logits[[bi, p, e]];
                let tol = SCORE_TOLERANCE * (1.0 + want.abs());
                if p < half && (prefix[[bi, p, e]] - want).abs() > tol {
                    out.push(format!(
                        "scores are not per token: truncating the batch changes batch {bi}, position {p}"
                    ));
                    return Ok(out);
                }
                if (reversed[[b - 1 - bi, p, e]] - want).abs() > tol {
                    out.push(format!(
                        "scores are not per token: re-ordering the batch changes batch {bi}, position {p}"
                    ));
                    return Ok(out);
                }
            }
        }
    }
    Ok(out)
}

/// The layer sample: the first (up to) [`SAMPLE_SEQS`] sequences, or one per expert-parallel rank
/// when there are more ranks, × [`SAMPLE_LEN`] positions of the audit's hidden states, and the
/// layer's output on them, computed once. Each probe then runs the whole layer on one changed
/// version of the sample (L: the sample itself, expert-parallel): a small fixed cost per probe, so
/// the audit stays a few forward passes however long the input (routing is probed at full size
/// anyway).
pub(crate) struct Sample<'a> {
    layer: &'a dyn Layer,
    x: Tensor,
    y: Tensor,
    routing: Routing,
    seed: u64,
}

/// Sequences in the layer sample (two, so the neighbour and re-batch probes apply).
const SAMPLE_SEQS: usize = 2;
/// Positions per sequence in the layer sample.
const SAMPLE_LEN: usize = 16;

impl<'a> Sample<'a> {
    /// The sample of `x`, with a sequence for each of `ranks` when they split the batch.
    pub(super) fn new(layer: &'a dyn Layer, x: &Tensor, seed: u64, ranks: usize) -> Result<Self> {
        let (b, s, _) = x.dims3()?;
        let seqs = if ranks_split(b, ranks) { SAMPLE_SEQS.max(ranks) } else { b.min(SAMPLE_SEQS) };
        let x = x.narrow(0, 0, seqs)?.narrow(1, 0, s.min(SAMPLE_LEN))?.contiguous()?;
        let (y, routing) = layer.forward(&x)?;
        Ok(Sample { layer, x, y, routing, seed })
    }

    /// Runs the layer on the sample changed as `probe` prescribes (its rule's
    /// [`sample`](super::probe::Rule::sample)) and folds the result into `finding`.
    pub(super) fn check(&self, probe: Probe, finding: &mut Finding) -> Result<()> {
        if finding.verdict == Verdict::NotApplicable {
            return Ok(());
        }
        let input = SampleInput { layer: self.layer, x: &self.x, seed: self.seed };
        let Some(change) = probe.rule().sample(&input)? else { return Ok(()) };
        let (yb, rb) = self.layer.forward(&change.x.contiguous()?)?;
        let compared =
            compare_outputs(&self.y, &self.routing, &yb, &rb, &change.seq_map, &change.compare, change.exact)?;
        fold(compared, finding);
        Ok(())
    }

    /// Runs the sample expert-parallel on `ranks` ranks (they split its sequences) and folds the
    /// comparison with the single-device output into `finding`: the ranks' traffic, or `None` for
    /// a layer that cannot run expert-parallel.
    pub(super) fn expert_parallel(&self, ranks: usize, finding: &mut Finding) -> Result<Option<Vec<RankTraffic>>> {
        let Some(ep) = self.layer.forward_parallel(&self.x, ranks)? else { return Ok(None) };
        let (b, s, _) = self.x.dims3()?;
        let all: Vec<_> = (0..b).map(Some).collect();
        fold(compare_outputs(&self.y, &self.routing, &ep.y, &ep.routing, &all, &vec![s; b], false)?, finding);
        Ok(Some(ep.traffic))
    }
}

/// Whether `ranks` expert-parallel ranks split a batch of `batch` sequences, so L compares them
/// with one device.
pub(super) fn ranks_split(batch: usize, ranks: usize) -> bool {
    ranks >= 2 && batch.is_multiple_of(ranks)
}

/// Folds a layer comparison's (leaking tokens, drift) into `finding`.
fn fold((leaks, drift): (usize, Option<f64>), finding: &mut Finding) {
    finding.output_leaks += leaks;
    finding.output_drift = drift;
    if leaks > 0 {
        finding.verdict = Verdict::Leak;
    }
}

/// What a probe changes the layer sample from.
pub(crate) struct SampleInput<'a> {
    /// The layer (a probe may run it first, as S does).
    pub layer: &'a dyn Layer,
    /// The sample's hidden states `[b, s, h]`.
    pub x: &'a Tensor,
    /// The audit's seed.
    pub seed: u64,
}

impl SampleInput<'_> {
    /// `n` fresh hidden rows `[1, n, h]` from the audit's seed and `salt`.
    pub fn fresh(&self, n: usize, salt: u64) -> Result<Tensor> {
        let h = self.x.dims3()?.2;
        Seeded::new(self.seed ^ salt).normal(&[1, n, h], &Device::Cpu)
    }

    /// Every sequence at its own index.
    pub fn all(&self) -> Vec<Option<usize>> {
        (0..self.x.dims3().map_or(0, |d| d.0)).map(Some).collect()
    }

    /// The sample itself again, every token compared bit for bit (D, S).
    pub fn again(&self) -> Result<SampleCase> {
        let (b, s, _) = self.x.dims3()?;
        Ok(SampleCase { x: self.x.clone(), seq_map: self.all(), compare: vec![s; b], exact: true })
    }
}

/// The layer sample as a probe changed it.
pub(crate) struct SampleCase {
    /// The changed input.
    pub x: Tensor,
    /// For each sequence of the sample, its index in `x`.
    pub seq_map: Vec<Option<usize>>,
    /// Positions compared per sequence.
    pub compare: Vec<usize>,
    /// Outputs must be equal bit for bit (else within the f32 tolerance).
    pub exact: bool,
}

/// Tokens with identical routing must have equal outputs: bit for bit when `exact`, else within
/// the f32 tolerance. Returns (tokens over tolerance, largest relative difference within it).
pub(crate) fn compare_outputs(
    ya: &Tensor,
    ra: &Routing,
    yb: &Tensor,
    rb: &Routing,
    seq_map: &[Option<usize>],
    compare: &[usize],
    exact: bool,
) -> Result<(usize, Option<f64>)> {
    let scale = |y: &Tensor| -> Result<Vec<Vec<Vec<f32>>>> { Ok(y.to_dtype(candle_core::DType::F32)?.to_vec3()?) };
    let (va, vb) = (scale(ya)?, scale(yb)?);
    let (mut leaks, mut drift) = (0usize, None::<f64>);
    for (i, (&n, map)) in compare.iter().zip(seq_map).enumerate() {
        let Some(j) = *map else { continue };
        for p in 0..n {
            if diff_token(ra, (i, p), rb, (j, p)).any() {
                continue;
            }
            let (a, b) = (&va[i][p], &vb[j][p]);
            let norm = a.iter().fold(1.0f64, |m, v| m.max(f64::from(v.abs())));
            let diff = a.iter().zip(b).fold(0.0f64, |m, (x, y)| m.max(f64::from((x - y).abs()))) / norm;
            if (exact && diff > 0.0) || diff > OUTPUT_TOLERANCE {
                leaks += 1;
            } else if diff > 0.0 {
                drift = Some(drift.map_or(diff, |d| d.max(diff)));
            }
        }
    }
    Ok((leaks, drift))
}
