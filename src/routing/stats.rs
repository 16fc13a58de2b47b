//! Load-balance figures of a routing: what users trade against causality.

use super::record::{ExpertLoad, LoadStats, TokenRouting};

/// Routes per expert before and after dropping.
pub(crate) fn loads(experts: usize, tokens: &[TokenRouting]) -> Vec<ExpertLoad> {
    let mut loads: Vec<ExpertLoad> =
        (0..experts).map(|expert| ExpertLoad { expert, routed: 0, kept: 0, padded: 0 }).collect();
    for r in tokens.iter().flat_map(|t| &t.routes) {
        let l = &mut loads[r.expert];
        if r.padded {
            l.padded += 1;
        } else {
            l.routed += 1;
            l.kept += usize::from(r.kept);
        }
    }
    loads
}

/// Balance of the routed load, drop rate and the Switch auxiliary loss on `probs`, the rows of
/// softmax probabilities (one per token; none: aux loss 0).
pub(crate) fn load_stats<'a>(loads: &[ExpertLoad], probs: impl Iterator<Item = &'a [f32]>) -> LoadStats {
    let e = loads.len() as f64;
    let routed: Vec<f64> = loads.iter().map(|l| l.routed as f64).collect();
    let total: f64 = routed.iter().sum();
    let kept: f64 = loads.iter().map(|l| l.kept as f64).sum();
    let mean = total / e;
    let (max_over_mean_load, load_cv) = if total > 0.0 {
        let max = routed.iter().copied().fold(0.0, f64::max);
        let var = routed.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / e;
        (max / mean, var.sqrt() / mean)
    } else {
        (0.0, 0.0)
    };
    let mut mean_prob = vec![0.0f64; loads.len()];
    let mut n = 0usize;
    for row in probs {
        n += 1;
        row.iter().zip(&mut mean_prob).for_each(|(p, m)| *m += f64::from(*p));
    }
    let aux_loss = if total > 0.0 && n > 0 {
        e * routed.iter().zip(&mean_prob).map(|(r, p)| (r / total) * (p / n as f64)).sum::<f64>()
    } else {
        0.0
    };
    LoadStats {
        max_over_mean_load,
        load_cv,
        drop_rate: if total > 0.0 { (total - kept) / total } else { 0.0 },
        aux_loss,
    }
}
