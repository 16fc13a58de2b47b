//! Capacity arithmetic and token dropping, with each framework's exact rounding and priority.
//!
//! This is where routing stops being per token: which routes an over-full expert keeps depends
//! on the other tokens of the group. Ties always go to the lower token index of the group's
//! priority order (the flattening order).

use crate::config::{Arithmetic, CapacityConfig, DropPolicy};
use std::cmp::Ordering;

use super::scores::{desc, Choice};

/// The capacity of every expert in a group of `tokens` tokens, `k` routes per token.
pub fn capacity(cap: &CapacityConfig, tokens: usize, k: usize, experts: usize) -> usize {
    let Some(cf) = cap.factor else {
        return cap.fixed.unwrap_or(0).max(cap.min);
    };
    let derived = match cap.arithmetic {
        // Megatron-LM get_capacity(num_tokens = T*k): ceil((num_tokens / E) * cf), float64.
        Arithmetic::Megatron => (((tokens * k) as f64 / experts as f64) * cf).ceil(),
        // DeepSpeed _capacity: ceil((T / E) * tensor(cf*k)): a float32 product.
        Arithmetic::Deepspeed => {
            let per_expert = (tokens as f64 / experts as f64) as f32;
            let factor = (cf * k as f64) as f32;
            (per_expert * factor).ceil() as f64
        }
        // flaxformer: int(round(cf * T / E)), Python's round half to even.
        Arithmetic::Flaxformer => (cf * tokens as f64 / experts as f64).round_ties_even(),
    };
    (derived as usize).max(cap.min)
}

/// The outcome of dropping in one group.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Dropped {
    /// `kept[i][j]`: whether route j (choice order) of the group's token i survived.
    pub kept: Vec<Vec<bool>>,
    /// Per expert, the group tokens added as gate-0 padding rows, in token order.
    pub padding: Vec<Vec<usize>>,
}

/// Applies capacity `c` to the choices of one group (tokens in priority order).
pub(crate) fn drop_routes(cap: &CapacityConfig, c: usize, choices: &[Choice], experts: usize) -> Dropped {
    // (token, choice rank, gate, the token's top gate) of every route, per expert.
    let mut candidates: Vec<Vec<(usize, usize, f32, f32)>> = vec![Vec::new(); experts];
    for (i, choice) in choices.iter().enumerate() {
        for (rank, (&e, &g)) in choice.experts.iter().zip(&choice.gates).enumerate() {
            candidates[e].push((i, rank, g, choice.gates[0]));
        }
    }
    let order = |a: &(usize, usize, f32, f32), b: &(usize, usize, f32, f32)| -> Ordering {
        match cap.policy {
            DropPolicy::Probs => desc(a.2, b.2).then(a.0.cmp(&b.0)),
            DropPolicy::BatchPriority => a.1.cmp(&b.1).then(desc(a.3, b.3)).then(a.0.cmp(&b.0)),
            DropPolicy::Position => a.0.cmp(&b.0),
            DropPolicy::ChoiceRank => a.1.cmp(&b.1).then(a.0.cmp(&b.0)),
            // Causal groups never reach here (see `drop_causal`); position order is its limit.
            DropPolicy::Causal => a.0.cmp(&b.0),
        }
    };
    let mut kept: Vec<Vec<bool>> = choices.iter().map(|ch| vec![false; ch.experts.len()]).collect();
    let mut padding = vec![Vec::new(); experts];
    let slots = c.min(choices.len());
    for (e, routes) in candidates.iter_mut().enumerate() {
        routes.sort_by(order);
        for &(i, rank, ..) in routes.iter().take(c) {
            kept[i][rank] = true;
        }
        if cap.pad && routes.len() < slots {
            let mut routed = vec![false; choices.len()];
            routes.iter().for_each(|r| routed[r.0] = true);
            padding[e] = (0..choices.len()).filter(|&i| !routed[i]).take(slots - routes.len()).collect();
        }
    }
    Dropped { kept, padding }
}

/// Causal capacity over one sequence (`choices` in position order): position t keeps a route to
/// expert e iff fewer than `C(t)` earlier positions kept e, `C(t)` = [`capacity`] of a group of
/// t + 1 tokens. Returns the outcome and the capacity in force at each position.
pub(crate) fn drop_causal(cap: &CapacityConfig, choices: &[Choice], k: usize, experts: usize) -> (Dropped, Vec<usize>) {
    let mut kept_so_far = vec![0usize; experts];
    let mut in_force = Vec::with_capacity(choices.len());
    let kept = choices
        .iter()
        .enumerate()
        .map(|(t, choice)| {
            let c = capacity(cap, t + 1, k, experts);
            in_force.push(c);
            // A token's own routes go to distinct experts, so they never compete with each other.
            let kept: Vec<bool> = choice.experts.iter().map(|&e| kept_so_far[e] < c).collect();
            choice.experts.iter().zip(&kept).filter(|(_, &k)| k).for_each(|(&e, _)| kept_so_far[e] += 1);
            kept
        })
        .collect();
    (Dropped { kept, padding: vec![Vec::new(); experts] }, in_force)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cap(arithmetic: Arithmetic, factor: f64, min: usize) -> CapacityConfig {
        CapacityConfig {
            factor: Some(factor),
            fixed: None,
            policy: DropPolicy::Probs,
            arithmetic,
            min,
            pad: false,
            renormalize_after_drop: false,
        }
    }

    #[test]
    fn fifty_tokens_four_experts_cf_1_2_is_15_in_megatron_and_16_in_deepspeed() {
        assert_eq!(capacity(&cap(Arithmetic::Megatron, 1.2, 0), 50, 1, 4), 15);
        assert_eq!(capacity(&cap(Arithmetic::Deepspeed, 1.2, 0), 50, 1, 4), 16);
    }

    #[test]
    fn min_capacity_and_fixed_capacity() {
        assert_eq!(capacity(&cap(Arithmetic::Deepspeed, 1.0, 4), 8, 1, 8), 4);
        assert_eq!(capacity(&cap(Arithmetic::Megatron, 1.0, 0), 8, 1, 8), 1);
        let fixed = CapacityConfig { factor: None, fixed: Some(64), ..cap(Arithmetic::Megatron, 1.0, 0) };
        assert_eq!(capacity(&fixed, 3, 2, 8), 64);
    }

    #[test]
    fn flaxformer_rounds_half_to_even() {
        // 2.0 * 5 / 4 = 2.5 -> 2; 2.0 * 7 / 4 = 3.5 -> 4.
        assert_eq!(capacity(&cap(Arithmetic::Flaxformer, 2.0, 0), 5, 1, 4), 2);
        assert_eq!(capacity(&cap(Arithmetic::Flaxformer, 2.0, 0), 7, 1, 4), 4);
    }
}
