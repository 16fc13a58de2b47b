//! Which positions a router lets later tokens affect, and from how far ahead: for every position
//! u and every sequence, token u alone is replaced (pushed hard toward each expert in turn, and
//! once at random) and every earlier token t of that sequence is checked for a changed routing.

use super::grid::Cell;
use crate::analyze::TARGET_LOGIT;
use moe_audit_core::error::Result;
use moe_audit_core::router::Router;
use moe_audit_core::routing::diff_token;
use moe_audit_core::routing::Logits;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

/// The position × distance picture of one router configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Heatmap {
    /// Router name.
    pub router: String,
    /// Capacity factor, k, E of the cell drawn.
    pub capacity_factor: Option<f64>,
    /// k of the cell.
    pub top_k: Option<usize>,
    /// E of the cell.
    pub experts: usize,
    /// Sequences per call.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Changes tried per (position, distance): sequences × (E targeted + 1 random).
    pub trials: usize,
    /// `rate[d - 1][t]`: share of the changes at position t + d that changed t's routing
    /// (distances 1..seq_len, positions t < seq_len - d).
    pub rate: Vec<Vec<f64>>,
}

/// Computes the heatmap on the cell's base logits.
pub(super) fn heatmap(router: &dyn Router, logits: &Logits, cell: &Cell, seed: u64) -> Result<Heatmap> {
    let (b, s, e) = logits.dim();
    let base = router.assign(logits.view())?;
    // Per source position u: counts[t] of changes at u that changed t < u.
    let per_source: Vec<Vec<usize>> = (1..s)
        .into_par_iter()
        .map(|u| -> Result<Vec<usize>> {
            let mut rng = ChaCha8Rng::seed_from_u64(seed ^ (crate::seeds::HEATMAP + u as u64));
            let mut counts = vec![0usize; u];
            for bi in 0..b {
                for variant in 0..=e {
                    let mut changed = logits.clone();
                    for (j, v) in changed.slice_mut(ndarray::s![bi, u, ..]).iter_mut().enumerate() {
                        *v = if variant < e {
                            if j == variant {
                                TARGET_LOGIT
                            } else {
                                0.0
                            }
                        } else {
                            StandardNormal.sample(&mut rng)
                        };
                    }
                    let r = router.assign(changed.view())?;
                    for (t, c) in counts.iter_mut().enumerate() {
                        *c += usize::from(diff_token(&base, (bi, t), &r, (bi, t)).decision());
                    }
                }
            }
            Ok(counts)
        })
        .collect::<Result<_>>()?;
    let trials = b * (e + 1);
    let rate = (1..s).map(|d| (0..s - d).map(|t| per_source[t + d - 1][t] as f64 / trials as f64).collect()).collect();
    Ok(Heatmap {
        router: router.name().to_string(),
        capacity_factor: cell.capacity_factor,
        top_k: cell.top_k,
        experts: cell.experts,
        batch: b,
        seq_len: s,
        trials,
        rate,
    })
}
