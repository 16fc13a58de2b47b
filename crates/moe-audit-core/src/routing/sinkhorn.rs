//! Sinkhorn balanced assignment (Megatron-LM `sinkhorn`, BASE-style balancing): scale
//! `exp(logits)` of the whole group until every token row and every expert column carries
//! equal mass, then let each token take its best entries. Balanced across the group, hence not
//! causal: training-time only, and serving usually switches back to plain top-k (the M probe).

/// Iterations stop once the mean relative change of the column scaling is below this
/// (Megatron-LM: `tol = 1e-4` on the absolute change, which depends on the logits' scale).
const TOLERANCE: f64 = 1e-4;
/// A bound that keeps every call finite and deterministic; balanced rows converge in tens.
const MAX_ITERATIONS: usize = 200;
/// Megatron-LM's guard against an empty row or column.
const EPS: f64 = 1e-8;

/// The balanced matrix of one group, row by row (`rows` in priority order), in `f32` for
/// selection. Computed in `f64` from `exp(logit - max)`: the scaling is invariant to the shift.
pub(crate) fn sinkhorn(rows: &[&[f32]]) -> Vec<Vec<f32>> {
    let (t, e) = (rows.len(), rows.first().map_or(0, |r| r.len()));
    let max = rows.iter().flat_map(|r| r.iter()).fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let cost: Vec<Vec<f64>> =
        rows.iter().map(|r| r.iter().map(|&v| (f64::from(v) - f64::from(max)).exp()).collect()).collect();
    let mut d0 = vec![1.0f64; t];
    let mut d1 = vec![1.0f64; e];
    for _ in 0..MAX_ITERATIONS {
        for (d, row) in d0.iter_mut().zip(&cost) {
            *d = 1.0 / (t as f64 * (row.iter().zip(&d1).map(|(c, b)| c * b).sum::<f64>() + EPS));
        }
        let mut change = 0.0;
        for (j, b) in d1.iter_mut().enumerate() {
            let next = 1.0 / (e as f64 * (cost.iter().zip(&d0).map(|(row, a)| row[j] * a).sum::<f64>() + EPS));
            change += (next - *b).abs() / next.abs().max(EPS);
            *b = next;
        }
        if change / (e as f64) < TOLERANCE {
            break;
        }
    }
    cost.iter().zip(&d0).map(|(row, a)| row.iter().zip(&d1).map(|(c, b)| (c * a * b) as f32).collect()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_end_up_balanced_even_when_every_token_prefers_expert_0() {
        let rows: Vec<Vec<f32>> = (0..8).map(|i| vec![3.0, 1.0 + i as f32 * 0.1, 0.5, 0.0]).collect();
        let refs: Vec<&[f32]> = rows.iter().map(Vec::as_slice).collect();
        let p = sinkhorn(&refs);
        for j in 0..4 {
            let col: f32 = p.iter().map(|r| r[j]).sum();
            assert!((col - 0.25).abs() < 1e-3, "column {j} carries {col}");
        }
        // Plain top-1 sends all 8 tokens to expert 0; balanced, only some still go there.
        let to_0 = p.iter().filter(|r| crate::routing::scores::top_k(r, 1) == [0]).count();
        assert!(to_0 < 8, "{p:?}");
    }
}
