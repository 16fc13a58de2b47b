//! Prefix stability: when routing the first `t + 1` positions of every sequence gives exactly
//! the routing of the whole call restricted to them, so the prefix probe (P) need not route
//! every prefix from scratch to know it passes.
//!
//! The argument, from the assignment code ([`super::assign`]):
//! - with top-k selection a token's choice (experts, gates) is a function of its own row;
//!   Sinkhorn balances over the group, expert choice ranks tokens group-wide, so neither is;
//! - without capacity nothing else happens: every route is kept with its gate;
//! - with capacity, dropping looks at the whole group. Truncating every sequence after t keeps,
//!   of each group, a prefix of its priority order when the order is position by position
//!   (groups per sequence, position-major flattening, or a single sequence); with sequence-major
//!   flattening of several sequences, a truncated sequence 0 changes who comes "before" the
//!   tokens of sequence 1. Over a prefix of the order, a route survives in both calls when its
//!   fate depends only on earlier routes and on a capacity that does not depend on the group's
//!   size: `position` dropping under a fixed capacity (first come, first kept), and `causal`
//!   capacity (`C(t)` from the token's own position). Padding to capacity adds slots that
//!   depend on how many routes came: not stable.
//!
//! Everything else may differ between a prefix and the whole call, and is routed.

use crate::config::{DropPolicy, Flatten, RouterConfig, ScopeGroup, Selection, TokenChoice};

/// Whether `config` routes every prefix of a call of `batch` sequences (no padding mask) as the
/// whole call's routing restricted to it, token for token (routes and capacity in force).
pub fn prefix_stable(config: &RouterConfig, batch: usize) -> bool {
    config.kind.rule().prefix_stable(config, batch)
}

/// [`prefix_stable`] for a token-choice router: top-k (not balanced over the group), and a
/// capacity that neither later tokens nor the call's size can change.
pub(super) fn token_choice_prefix_stable(config: &RouterConfig, tc: &TokenChoice, batch: usize) -> bool {
    if tc.selection != Selection::TopK {
        return false;
    }
    let Some(cap) = &config.capacity else { return true };
    let order_kept =
        batch == 1 || config.scope.group == ScopeGroup::Sequence || config.scope.flatten == Flatten::PositionMajor;
    let size_free = match cap.policy {
        DropPolicy::Causal => true,
        DropPolicy::Position => cap.factor.is_none(),
        DropPolicy::Probs | DropPolicy::ChoiceRank | DropPolicy::BatchPriority => false,
    };
    order_kept && size_free && !cap.pad
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{preset, presets};
    use crate::routing::assign_routes;
    use crate::routing::diff_token;
    use ndarray::{s, Array3};
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// Logits with few distinct values, so capacity binds and ties happen.
    fn logits(rng: &mut ChaCha8Rng, (b, s, e): (usize, usize, usize)) -> Array3<f32> {
        Array3::from_shape_fn((b, s, e), |_| rng.random_range(0..6) as f32 * 0.75)
    }

    /// Whether every prefix of `x` routes as `x` restricted to it.
    fn every_prefix_alike(config: &RouterConfig, x: &Array3<f32>) -> bool {
        let (b, s, _) = x.dim();
        let whole = assign_routes(config, x.view(), None).unwrap();
        (1..s).all(|len| {
            let part = assign_routes(config, x.slice(s![.., ..len, ..]), None).unwrap();
            (0..b).all(|i| (0..len).all(|p| !diff_token(&whole, (i, p), &part, (i, p)).any()))
        })
    }

    #[test]
    fn the_claim_holds_on_every_preset_and_variant_where_it_is_made() {
        let mut rng = ChaCha8Rng::seed_from_u64(15);
        let mut stable = 0;
        let mut variants = Vec::new();
        for preset in presets() {
            let config = preset.config().unwrap();
            variants.push(config.clone());
            for flatten in [Flatten::PositionMajor, Flatten::SequenceMajor] {
                for group in [ScopeGroup::Batch, ScopeGroup::Sequence, ScopeGroup::Tokens(5)] {
                    let mut c = config.clone();
                    c.scope.flatten = flatten;
                    c.scope.group = group;
                    let token_choice = c.token_choice().is_some();
                    if let Some(cap) = &mut c.capacity {
                        if cap.policy == DropPolicy::Position && token_choice {
                            cap.factor = None;
                            cap.fixed = Some(2);
                        }
                    }
                    variants.push(c);
                }
            }
        }
        for config in &variants {
            for batch in [1, 3] {
                let claimed = prefix_stable(config, batch);
                stable += usize::from(claimed);
                for _ in 0..4 {
                    let x = logits(&mut rng, (batch, 12, config.experts));
                    if claimed {
                        assert!(every_prefix_alike(config, &x), "{} claimed stable, batch {batch}", config.name);
                    }
                }
            }
        }
        assert!(stable > 20, "the claim is made for dropless, causal and fixed first-come routers");
    }

    #[test]
    fn routers_that_leak_in_length_are_never_claimed() {
        for name in ["megatron-probs", "deepspeed-top2", "expert-choice", "sinkhorn", "batch-prioritized"] {
            let config = preset(name).unwrap().config().unwrap();
            assert!(!prefix_stable(&config, 1) && !prefix_stable(&config, 4), "{name}");
        }
        for name in ["mixtral", "deepseek-v3", "causal-capacity", "switch"] {
            let config = preset(name).unwrap().config().unwrap();
            assert!(prefix_stable(&config, 4), "{name}");
        }
    }
}
