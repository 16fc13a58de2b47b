//! Semantic checks on a parsed [`RouterConfig`]: every rule in one place, each error naming
//! the field and the value.

use super::{CapacityConfig, DropPolicy, GroupLimit, RouterConfig, RouterKind, ScopeGroup, ScoreFn, Selection};
use crate::error::FieldError;

type Check = Result<(), FieldError>;

/// The largest capacity factor accepted.
pub const MAX_CAPACITY_FACTOR: f64 = 1e6;

fn ensure(ok: bool, field: &'static str, message: impl FnOnce() -> String) -> Check {
    if ok {
        Ok(())
    } else {
        Err(FieldError::new(field, message()))
    }
}

impl RouterConfig {
    /// Checks the rules the schema cannot express, in a fixed order (the first broken rule is
    /// the error). Errors are `(field, message)`.
    pub fn validate(&self) -> Check {
        let e = self.experts;
        crate::names::check(&self.name).map_err(|m| FieldError::new("name", m))?;
        ensure(e > 0, "experts", || format!("must be at least 1, got {e}"))?;
        ensure(self.routed_scaling.is_finite() && self.routed_scaling > 0.0, "routed_scaling", || {
            format!("must be finite and > 0, got {}", self.routed_scaling)
        })?;
        match self.kind {
            RouterKind::TokenChoice => self.check_token_choice(e)?,
            RouterKind::ExpertThreshold => self.check_expert_threshold(e)?,
            RouterKind::ExpertChoice => self.check_expert_choice()?,
        }
        if self.kind != RouterKind::ExpertThreshold {
            ensure(self.threshold.is_none(), "threshold", || "applies to expert-threshold routers only".into())?;
        }
        if self.null_experts > 0 {
            self.check_null_experts(e)?;
        }
        if self.score == ScoreFn::SoftmaxPost {
            ensure(self.normalize != Some(false), "normalize", || {
                "softmax-post is normalised by construction; remove `normalize = false`".into()
            })?;
        }
        if let Some(bias) = &self.expert_bias {
            check_expert_bias(bias, e)?;
        }
        if let Some(g) = &self.group_limit {
            self.check_group_limit(g, e)?;
        }
        self.check_balancing()?;
        if let Some(cap) = &self.capacity {
            self.check_capacity(cap)?;
        }
        Ok(())
    }

    /// A token-choice router: `top_k` between 1 and E.
    fn check_token_choice(&self, e: usize) -> Check {
        let k = self.top_k.ok_or_else(|| FieldError::new("top_k", "is required for a token-choice router"))?;
        ensure(k >= 1, "top_k", || format!("must be at least 1, got {k}"))?;
        ensure(k <= e, "top_k", || format!("{k} exceeds experts = {e}"))?;
        Ok(())
    }

    /// An expert-threshold router: no top-k, capacity or token-choice options; its thresholds
    /// well formed, one per expert.
    fn check_expert_threshold(&self, e: usize) -> Check {
        ensure(self.top_k.is_none(), "top_k", || {
            "does not apply to an expert-threshold router (each expert takes the tokens above its threshold)".into()
        })?;
        ensure(self.score != ScoreFn::SoftmaxPost, "score", || {
            "softmax-post needs a per-token top-k; use softmax-pre or sigmoid for expert threshold".into()
        })?;
        ensure(
            self.expert_bias.is_none()
                && self.group_limit.is_none()
                && self.selection == Selection::TopK
                && self.bias_update_rate.is_none(),
            "kind",
            || "expert_bias, group_limit, selection and bias_update_rate apply to token-choice routers only".into(),
        )?;
        ensure(self.capacity.is_none(), "capacity", || {
            "an expert-threshold router is dropless: its thresholds set the load".into()
        })?;
        let t = self
            .threshold
            .as_ref()
            .ok_or_else(|| FieldError::new("threshold", "is required for an expert-threshold router"))?;
        ensure(t.factor.is_finite() && t.factor > 0.0 && t.factor <= MAX_CAPACITY_FACTOR, "threshold.factor", || {
            format!("must be finite, > 0 and at most {MAX_CAPACITY_FACTOR:?}, got {}", t.factor)
        })?;
        ensure(t.ema.is_finite() && t.ema > 0.0 && t.ema <= 1.0, "threshold.ema", || {
            format!("must be in (0, 1], got {}", t.ema)
        })?;
        ensure(t.values.len() == e, "threshold.values", || {
            format!("has {} entries, expected one per expert ({e})", t.values.len())
        })?;
        if let Some((i, v)) = t.values.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(FieldError::new("threshold.values", format!("entry {i} is {v}, must be finite")));
        }
        Ok(())
    }

    /// An expert-choice router: no top-k or token-choice options; a capacity, not padded.
    fn check_expert_choice(&self) -> Check {
        ensure(self.top_k.is_none(), "top_k", || {
            "does not apply to an expert-choice router (each expert picks tokens)".into()
        })?;
        ensure(self.score != ScoreFn::SoftmaxPost, "score", || {
            "softmax-post needs a per-token top-k; use softmax-pre or sigmoid for expert choice".into()
        })?;
        ensure(self.expert_bias.is_none(), "expert_bias", || "applies to token-choice routers only".into())?;
        ensure(self.group_limit.is_none(), "group_limit", || "applies to token-choice routers only".into())?;
        ensure(self.selection == Selection::TopK, "selection", || "applies to token-choice routers only".into())?;
        ensure(self.bias_update_rate.is_none(), "bias_update_rate", || "applies to token-choice routers only".into())?;
        let cap = self
            .capacity
            .as_ref()
            .ok_or_else(|| FieldError::new("capacity", "is required for an expert-choice router"))?;
        ensure(!cap.pad && !cap.renormalize_after_drop, "capacity", || {
            "pad and renormalize_after_drop apply to token-choice routers only".into()
        })?;
        Ok(())
    }

    /// Null experts: token choice, dropless, top-k, and at least one real expert left.
    fn check_null_experts(&self, e: usize) -> Check {
        let n = self.null_experts;
        ensure(self.kind == RouterKind::TokenChoice, "null_experts", || "apply to token-choice routers only".into())?;
        ensure(n < e, "null_experts", || format!("{n} leaves no real expert of experts = {e}"))?;
        ensure(self.capacity.is_none(), "null_experts", || {
            "need a dropless router (remove [capacity]): a null expert has no capacity to share".into()
        })?;
        ensure(self.selection == Selection::TopK, "null_experts", || "need selection = \"top-k\"".into())?;
        Ok(())
    }

    /// Group-limited top-k: groups divide E and hold `top_k`.
    fn check_group_limit(&self, g: &GroupLimit, e: usize) -> Check {
        ensure(g.groups > 0 && e.is_multiple_of(g.groups), "group_limit.groups", || {
            format!("{} does not divide experts = {e}", g.groups)
        })?;
        ensure(g.top_groups >= 1 && g.top_groups <= g.groups, "group_limit.top_groups", || {
            format!("{} must be between 1 and groups = {}", g.top_groups, g.groups)
        })?;
        let per_group = e / g.groups;
        ensure(g.score_top >= 1 && g.score_top <= per_group, "group_limit.score_top", || {
            format!("{} must be between 1 and experts per group = {per_group}", g.score_top)
        })?;
        ensure(g.top_groups * per_group >= self.k(), "group_limit.top_groups", || {
            format!("{} groups of {per_group} experts cannot hold top_k = {}", g.top_groups, self.k())
        })?;
        Ok(())
    }

    /// Balancing (Sinkhorn, a bias moved between steps): one mechanism at a time, a positive rate.
    fn check_balancing(&self) -> Check {
        if self.selection == Selection::Sinkhorn {
            ensure(
                self.expert_bias.is_none() && self.group_limit.is_none() && self.bias_update_rate.is_none(),
                "selection",
                || {
                    "sinkhorn balances the selection itself; remove expert_bias, group_limit and bias_update_rate"
                        .into()
                },
            )?;
        }
        if let Some(rate) = self.bias_update_rate {
            ensure(rate.is_finite() && rate > 0.0, "bias_update_rate", || {
                format!("must be finite and > 0, got {rate}")
            })?;
        }
        Ok(())
    }

    /// Capacity: either a factor (finite, in (0, MAX]) or a fixed size; causal only per sequence.
    fn check_capacity(&self, cap: &CapacityConfig) -> Check {
        if cap.policy == DropPolicy::Causal {
            ensure(self.scope.group == ScopeGroup::Sequence, "capacity.policy", || {
                format!(
                    "causal counts earlier tokens of the same sequence; needs scope.group = \"sequence\", got \"{}\"",
                    self.scope.group
                )
            })?;
            ensure(!cap.pad, "capacity.pad", || {
                "pad-to-capacity needs the final capacity, which a causal capacity never knows in advance".into()
            })?;
        }
        match (cap.factor, cap.fixed) {
            (Some(f), None) => {
                ensure(f.is_finite() && f > 0.0, "capacity.factor", || format!("must be finite and > 0, got {f}"))?;
                // Beyond this the capacity is past every route anyway; far beyond, past usize.
                ensure(f <= MAX_CAPACITY_FACTOR, "capacity.factor", || {
                    format!("{f:?} is over {MAX_CAPACITY_FACTOR:?}: no token is dropped long before; use a fixed capacity or a smaller factor")
                })?
            }
            (None, Some(_)) => {}
            (Some(_), Some(_)) => return Err(FieldError::new("capacity", "set either `factor` or `fixed`, not both")),
            (None, None) => {
                return Err(FieldError::new(
                    "capacity",
                    "needs `factor` (derived capacity) or `fixed` (constant capacity)",
                ))
            }
        }
        Ok(())
    }
}

/// A selection-only bias: one finite entry per expert.
fn check_expert_bias(bias: &[f32], e: usize) -> Check {
    ensure(bias.len() == e, "expert_bias", || format!("has {} entries, expected one per expert ({e})", bias.len()))?;
    if let Some((i, b)) = bias.iter().enumerate().find(|(_, b)| !b.is_finite()) {
        return Err(FieldError::new("expert_bias", format!("entry {i} is {b}, must be finite")));
    }
    Ok(())
}
