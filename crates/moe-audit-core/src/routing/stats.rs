//! Load-balance figures of a routing: what users trade against causality.

use serde::{Deserialize, Serialize};

/// Load of one expert.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertLoad {
    /// Expert id.
    pub expert: usize,
    /// Routes chosen before capacity.
    pub routed: usize,
    /// Routes kept after capacity.
    pub kept: usize,
    /// Padding slots added (pad-to-capacity).
    pub padded: usize,
}

/// Load-balance figures of one call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct LoadStats {
    /// max over experts of routes before dropping, over their mean.
    pub max_over_mean_load: f64,
    /// Coefficient of variation (population std / mean) of routes before dropping.
    pub load_cv: f64,
    /// Dropped routes over routed routes.
    pub drop_rate: f64,
    /// Switch/GShard auxiliary loss `E * sum_e f_e * P_e` (f: share of routes, P: mean softmax).
    pub aux_loss: f64,
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
