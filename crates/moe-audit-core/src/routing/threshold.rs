//! Expert-threshold routing (Sun et al. 2026, arXiv 2603.11535): expert e takes every token
//! whose score is strictly above its threshold `τ_e`, whatever the other tokens are, so the
//! routing is per token (causal and batch-invariant by construction) and a token gets 0..E
//! experts. The thresholds are state, moved between training steps by
//! [`RouterConfig::step`](crate::RouterConfig::step) toward each expert's score quantile over
//! the step's batch; a forward only reads them (docs/ROUTING.md, "Expert threshold").

use super::scores::{affinities, desc, softmax_rows, Row};
use super::GroupRouting;
use crate::config::{RouterConfig, ThresholdConfig};
use crate::error::{Error, Result};
use crate::routing::Route;
use ndarray::ArrayView3;

/// Routes one group (any scope: no token sees another).
pub(crate) fn route_group(config: &RouterConfig, threshold: &ThresholdConfig, rows: &[Row]) -> GroupRouting {
    let tau = &threshold.values;
    let routes = rows
        .iter()
        .map(|&row| {
            let scores = affinities(config.score, row);
            let mut routes: Vec<Route> = (0..config.experts)
                .filter(|&e| scores[e] > tau[e])
                .map(|e| Route { expert: e, weight: scores[e] * config.routed_scaling, kept: true, padded: false })
                .collect();
            // Choice order: the strongest score first, ties to the lower id (as expert choice).
            routes.sort_by(|a, b| desc(a.weight, b.weight).then(a.expert.cmp(&b.expert)));
            routes
        })
        .collect();
    GroupRouting { routes, capacity: None, in_force: None }
}

/// The number of tokens of a batch of `tokens` whose score sets an expert's quantile:
/// `max(1, round_half_even(cf·T/E))`, at most T (flaxformer's expert-choice capacity, at least
/// one token so the quantile always exists).
pub fn quantile_rank(factor: f64, tokens: usize, experts: usize) -> usize {
    let c = (factor * tokens as f64 / experts as f64).round_ties_even();
    (c as usize).clamp(1, tokens.max(1))
}

/// Every expert's quantile over a batch: the score of its `c`-th best token
/// ([`quantile_rank`]), ties counted (the c-th entry of the scores sorted in descending order).
/// Routing that batch with these thresholds takes exactly the tokens strictly above its c-th
/// score: expert choice's c picks less those tied with the c-th.
///
/// # Shapes
/// `logits`: `[batch, seq_len, experts]`, finite.
pub fn quantiles(config: &RouterConfig, logits: ArrayView3<f32>) -> Result<Vec<f32>> {
    let t = config.threshold().ok_or_else(|| not_threshold(config))?;
    let (b, s, e) = logits.dim();
    if e != config.experts || b * s == 0 {
        return Err(Error::shape(
            &format!("router `{}`", config.name),
            format!("threshold step on logits [{b}, {s}, {e}] for {} experts", config.experts),
        ));
    }
    super::scores::check_finite(&logits)?;
    let logits = logits.as_standard_layout();
    let flat = logits.as_slice().expect("standard layout is contiguous");
    let softmax = softmax_rows(flat, e);
    let scores: Vec<Vec<f32>> = (0..b * s)
        .map(|i| {
            let row = Row { logits: &flat[i * e..(i + 1) * e], softmax: &softmax[i * e..(i + 1) * e] };
            affinities(config.score, row).into_owned()
        })
        .collect();
    let c = quantile_rank(t.factor, b * s, e);
    let mut column = Vec::with_capacity(b * s);
    Ok((0..e)
        .map(|expert| {
            column.clear();
            column.extend(scores.iter().map(|row| row[expert]));
            // The c-th largest value; which of equal values is "the" c-th does not matter.
            *column.select_nth_unstable_by(c - 1, |a, b| desc(*a, *b)).1
        })
        .collect())
}

/// The EMA update of one threshold in f32: `τ + α·(q − τ)`.
pub fn ema(tau: f32, q: f32, rate: f32) -> f32 {
    tau + rate * (q - tau)
}

fn not_threshold(config: &RouterConfig) -> Error {
    Error::config(&config.name, "threshold", "is not set: the router is not an expert-threshold router")
}

/// One threshold step between training batches: every expert's threshold moves toward its
/// [`quantiles`] over `logits` (the step's whole batch, whatever the routing scope) at the EMA
/// rate. Never called inside a forward, so a forward's routing is stateless.
///
/// # Shapes
/// `logits`: `[batch, seq_len, experts]`, finite.
pub(crate) fn step(config: &RouterConfig, t: &ThresholdConfig, logits: ArrayView3<f32>) -> Result<ThresholdConfig> {
    let q = quantiles(config, logits)?;
    let values = t.values.iter().zip(q).map(|(&tau, q)| ema(tau, q, t.ema)).collect();
    Ok(ThresholdConfig { values, ..t.clone() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_quantile_rank_rounds_half_to_even_and_stays_in_one_to_t() {
        assert_eq!(quantile_rank(1.0, 8, 4), 2);
        assert_eq!(quantile_rank(1.0, 10, 4), 2); // 2.5 → 2
        assert_eq!(quantile_rank(1.0, 14, 4), 4); // 3.5 → 4
        assert_eq!(quantile_rank(0.1, 4, 8), 1); // 0.05 → 0 → at least 1
        assert_eq!(quantile_rank(100.0, 4, 2), 4); // 200 → at most T
    }

    #[test]
    fn the_ema_moves_by_its_rate() {
        assert_eq!(ema(0.5, 0.25, 0.5), 0.375);
        assert_eq!(ema(0.5, 0.25, 1.0), 0.25);
    }
}
