//! Capacity arithmetic and token dropping, with each framework's exact rounding and priority.
//!
//! This is where routing stops being per token: which routes an over-full expert keeps depends
//! on the other tokens of the group. Ties always go to the lower token index of the group's
//! priority order (the flattening order).

use crate::config::{Arithmetic, CapacityConfig, DropPolicy};
use std::cmp::Ordering;

use super::scores::{desc, Choices};

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
    /// `kept[i * k + j]`: whether route j (choice order) of the group's token i survived.
    pub kept: Vec<bool>,
    /// Per expert, the group tokens added as gate-0 padding rows, in token order.
    pub padding: Vec<Vec<usize>>,
}

/// A route competing for a slot: its token (index in the group), choice rank, gate, and the
/// token's top gate.
#[derive(Debug, Clone, Copy, Default)]
struct Candidate {
    token: usize,
    rank: usize,
    gate: f32,
    top: f32,
}

/// Applies capacity `c` to the choices of one group (tokens in priority order).
///
/// Every policy's order is total (a token routes to an expert at most once, and the token
/// index breaks every tie), so which c routes an expert keeps is a selection, not a sort: the
/// c first of the order, found in linear time, and nothing to do for an expert with at most c
/// routes.
pub(crate) fn drop_routes(cap: &CapacityConfig, c: usize, choices: &Choices, experts: usize) -> Dropped {
    let k = choices.k();
    let tokens = choices.tokens();
    // Every route, grouped by expert in token order (a counting sort: one buffer for all).
    let mut start = vec![0usize; experts + 1];
    choices.iter().flat_map(|(es, _)| es).for_each(|&e| start[e + 1] += 1);
    for e in 0..experts {
        start[e + 1] += start[e];
    }
    let mut next = start.clone();
    let mut candidates = vec![Candidate::default(); tokens * k];
    for (i, (es, gates)) in choices.iter().enumerate() {
        for (rank, (&e, &gate)) in es.iter().zip(gates).enumerate() {
            candidates[next[e]] = Candidate { token: i, rank, gate, top: gates[0] };
            next[e] += 1;
        }
    }
    let order = |a: &Candidate, b: &Candidate| -> Ordering {
        match cap.policy {
            DropPolicy::Probs => desc(a.gate, b.gate).then(a.token.cmp(&b.token)),
            DropPolicy::BatchPriority => a.rank.cmp(&b.rank).then(desc(a.top, b.top)).then(a.token.cmp(&b.token)),
            DropPolicy::Position => a.token.cmp(&b.token),
            DropPolicy::ChoiceRank => a.rank.cmp(&b.rank).then(a.token.cmp(&b.token)),
            // Causal groups never reach here (see `drop_causal`); position order is its limit.
            DropPolicy::Causal => a.token.cmp(&b.token),
        }
    };
    let mut kept = vec![false; tokens * k];
    let mut padding = vec![Vec::new(); experts];
    let slots = c.min(tokens);
    for e in 0..experts {
        let routes = &mut candidates[start[e]..start[e + 1]];
        if routes.len() > c && c > 0 {
            // The c first routes of the order end up in front, in some order.
            routes.select_nth_unstable_by(c - 1, order);
        }
        for r in routes.iter().take(c) {
            kept[r.token * k + r.rank] = true;
        }
        if cap.pad && routes.len() < slots {
            let mut routed = vec![false; tokens];
            routes.iter().for_each(|r| routed[r.token] = true);
            padding[e] = (0..tokens).filter(|&i| !routed[i]).take(slots - routes.len()).collect();
        }
    }
    Dropped { kept, padding }
}

/// Causal capacity over one sequence (`choices` in position order): position t keeps a route to
/// expert e iff fewer than `C(t)` earlier positions kept e, `C(t)` = [`capacity`] of a group of
/// t + 1 tokens. Returns the outcome and the capacity in force at each position.
pub(crate) fn drop_causal(cap: &CapacityConfig, choices: &Choices, experts: usize) -> (Dropped, Vec<usize>) {
    let k = choices.k();
    let mut kept_so_far = vec![0usize; experts];
    let mut in_force = Vec::with_capacity(choices.tokens());
    let mut kept = Vec::with_capacity(choices.tokens() * k);
    for (t, (es, _)) in choices.iter().enumerate() {
        let c = capacity(cap, t + 1, k, experts);
        in_force.push(c);
        // A token's own routes go to distinct experts, so they never compete with each other.
        let from = kept.len();
        kept.extend(es.iter().map(|&e| kept_so_far[e] < c));
        es.iter().zip(&kept[from..]).filter(|(_, &k)| k).for_each(|(&e, _)| kept_so_far[e] += 1);
    }
    (Dropped { kept, padding: vec![Vec::new(); experts] }, in_force)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::collection::vec;
    use proptest::prelude::*;
    use proptest::test_runner::RngSeed;

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

    /// The dropping this module did before selection replaced sorting: each expert's routes
    /// sorted by the policy's order, the first c kept.
    fn drop_by_sorting(cap: &CapacityConfig, c: usize, choices: &Choices, experts: usize) -> Dropped {
        let mut candidates: Vec<Vec<(usize, usize, f32, f32)>> = vec![Vec::new(); experts];
        for (i, (es, gates)) in choices.iter().enumerate() {
            for (rank, (&e, &g)) in es.iter().zip(gates).enumerate() {
                candidates[e].push((i, rank, g, gates[0]));
            }
        }
        let order = |a: &(usize, usize, f32, f32), b: &(usize, usize, f32, f32)| -> Ordering {
            match cap.policy {
                DropPolicy::Probs => desc(a.2, b.2).then(a.0.cmp(&b.0)),
                DropPolicy::BatchPriority => a.1.cmp(&b.1).then(desc(a.3, b.3)).then(a.0.cmp(&b.0)),
                DropPolicy::Position | DropPolicy::Causal => a.0.cmp(&b.0),
                DropPolicy::ChoiceRank => a.1.cmp(&b.1).then(a.0.cmp(&b.0)),
            }
        };
        let (tokens, k) = (choices.tokens(), choices.k());
        let mut kept = vec![false; tokens * k];
        let mut padding = vec![Vec::new(); experts];
        let slots = c.min(tokens);
        for (e, routes) in candidates.iter_mut().enumerate() {
            routes.sort_by(order);
            for &(i, rank, ..) in routes.iter().take(c) {
                kept[i * k + rank] = true;
            }
            if cap.pad && routes.len() < slots {
                let mut routed = vec![false; tokens];
                routes.iter().for_each(|r| routed[r.0] = true);
                padding[e] = (0..tokens).filter(|&i| !routed[i]).take(slots - routes.len()).collect();
            }
        }
        Dropped { kept, padding }
    }

    /// A group's choices: per token, k distinct experts (a shuffled prefix) and gates drawn
    /// from a few values (exact ties, both zeros) or anywhere in [0, 1].
    fn group() -> impl Strategy<Value = (Choices, usize)> {
        (1usize..10, 1usize..60).prop_flat_map(|(experts, tokens)| {
            let gate = prop_oneof![Just(0.0f32), Just(-0.0), Just(0.25), Just(0.5), Just(1.0), 0.0f32..1.0];
            (1..=experts).prop_flat_map(move |k| {
                let token = (Just((0..experts).collect::<Vec<_>>()).prop_shuffle(), vec(gate.clone(), k));
                vec(token, tokens).prop_map(move |rows| {
                    let experts_of = rows.iter().flat_map(|(es, _)| es[..k].to_vec()).collect();
                    let gates = rows.into_iter().flat_map(|(_, g)| g).collect();
                    (Choices::from_parts(k, experts_of, gates), experts)
                })
            })
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 2000,
            rng_seed: RngSeed::Fixed(15),
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        #[test]
        fn selecting_keeps_exactly_what_sorting_kept(
            (choices, experts) in group(),
            policy in prop_oneof![
                Just(DropPolicy::Probs),
                Just(DropPolicy::BatchPriority),
                Just(DropPolicy::Position),
                Just(DropPolicy::ChoiceRank),
                Just(DropPolicy::Causal),
            ],
            c in 0usize..40,
            pad in any::<bool>(),
        ) {
            let cap = CapacityConfig { policy, pad, ..cap(Arithmetic::Megatron, 1.0, 0) };
            prop_assert_eq!(drop_routes(&cap, c, &choices, experts), drop_by_sorting(&cap, c, &choices, experts));
        }
    }
}
