//! Router kinds: who chooses whom, each kind with its own settings and its own checks. The TOML
//! keeps every key in one flat table (`file.rs` maps it); in memory a kind's settings exist only
//! on that kind, so routing code never meets a `top_k` on an expert-choice router.
//!
//! A kind's routing and its state between training steps are `routing/kind.rs`'s
//! `KindRouting`.

use super::validate::{ensure, Check, MAX_CAPACITY_FACTOR};
use super::{Family, GroupLimit, RouterConfig, ScoreFn, Selection};
use crate::error::FieldError;
use serde::{Deserialize, Serialize};

/// Who chooses whom, with that kind's settings.
#[derive(Debug, Clone, PartialEq)]
pub enum RouterKind {
    /// Each token takes its k best experts.
    TokenChoice(TokenChoice),
    /// Each expert takes its C best tokens of the scope (Zhou et al. 2022).
    ExpertChoice(ExpertChoice),
    /// Each expert takes every token whose score is above its threshold, a state moved between
    /// steps toward the expert's top-(cf/E) score quantile (Sun et al. 2026, arXiv 2603.11535).
    ExpertThreshold(ThresholdConfig),
}

/// The settings of a token-choice router.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenChoice {
    /// Experts per token k.
    pub top_k: usize,
    /// Selection-only bias per expert (DeepSeek-V3): added to scores to choose, never to gates.
    pub expert_bias: Option<Vec<f32>>,
    /// Group-limited top-k (DeepSeek-V3).
    pub group_limit: Option<GroupLimit>,
    /// How a token's experts are selected: plain top-k, or top-k of a Sinkhorn-balanced score
    /// matrix over the routing group (training-time balancing; serve with `selection = "top-k"`).
    pub selection: Selection,
    /// Aux-loss-free balancing (DeepSeek-V3): between training steps the selection bias moves by
    /// `rate * sign(mean_load - load_e)` ([`RouterConfig::step`]); never inside a forward.
    pub bias_update_rate: Option<f32>,
    /// Null experts (dropless): the last `null_experts` of the `experts` ids are zero-compute
    /// slots. A token's top-k may land on them; those routes produce nothing and are left out of
    /// the record, so the number of real experts per token varies from 0 to k.
    pub null_experts: usize,
}

/// The settings of an expert-choice router: none beyond the shared ones (its capacity is
/// required, `[capacity]`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExpertChoice;

/// The state and update rule of expert-threshold routing (docs/ROUTING.md).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ThresholdConfig {
    /// Target load factor cf: a step moves expert e's threshold toward the score of its
    /// `c = max(1, round_half_even(cf*T/E))`-th best token of the batch (cf 1: the top-1/E quantile).
    pub factor: f64,
    /// EMA rate α in (0, 1]: `τ ← τ + α·(q − τ)` (f32) at every step.
    pub ema: f32,
    /// The thresholds in force, one per expert: the state a forward routes with (frozen within
    /// a forward; the first batch routes with the values as given).
    pub values: Vec<f32>,
}

/// A kind's name, as the `kind` key writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum KindName {
    /// `token-choice`.
    TokenChoice,
    /// `expert-choice`.
    ExpertChoice,
    /// `expert-threshold`.
    ExpertThreshold,
}

impl RouterKind {
    /// The kind's name (the `kind` key).
    pub fn name(&self) -> KindName {
        match self {
            RouterKind::TokenChoice(_) => KindName::TokenChoice,
            RouterKind::ExpertChoice(_) => KindName::ExpertChoice,
            RouterKind::ExpertThreshold(_) => KindName::ExpertThreshold,
        }
    }

    /// The kind's design family (the sweep chart's marker, the report's advice).
    pub(super) fn family(&self, config: &RouterConfig) -> Family {
        match self {
            RouterKind::TokenChoice(tc) => Family::of_token_choice(config, tc),
            RouterKind::ExpertChoice(_) => Family::ExpertChoice,
            RouterKind::ExpertThreshold(_) => Family::ExpertThreshold,
        }
    }

    /// The settings for `experts` experts that compute (a sweep cell): `top_k` and the load
    /// factor where the kind takes them, per-expert state resized.
    pub fn resize(&mut self, experts: usize, top_k: Option<usize>, factor: Option<f64>) {
        match self {
            RouterKind::TokenChoice(tc) => {
                tc.top_k = top_k.unwrap_or(tc.top_k);
                if let Some(bias) = tc.expert_bias.as_mut().filter(|b| b.len() != experts) {
                    *bias = vec![0.0; experts];
                }
            }
            RouterKind::ExpertChoice(_) => {}
            RouterKind::ExpertThreshold(t) => {
                t.factor = factor.unwrap_or(t.factor);
                if t.values.len() != experts {
                    // Every expert starts at the mean of the given thresholds.
                    let mean = t.values.iter().sum::<f32>() / t.values.len().max(1) as f32;
                    t.values = vec![mean; experts];
                }
            }
        }
    }

    /// The rules of the kind's own settings, and of the shared ones it constrains, in a fixed
    /// order (the first broken rule is the error).
    pub(super) fn validate(&self, config: &RouterConfig) -> Check {
        match self {
            RouterKind::TokenChoice(tc) => tc.validate(config),
            RouterKind::ExpertChoice(ec) => ec.validate(config),
            RouterKind::ExpertThreshold(t) => t.validate(config),
        }
    }
}

impl TokenChoice {
    /// Plain top-k: no bias, group limit, balancing or null experts.
    pub fn new(top_k: usize) -> TokenChoice {
        TokenChoice {
            top_k,
            expert_bias: None,
            group_limit: None,
            selection: Selection::TopK,
            bias_update_rate: None,
            null_experts: 0,
        }
    }

    /// `top_k` between 1 and E, then null experts, the selection bias, group limits and
    /// balancing.
    fn validate(&self, config: &RouterConfig) -> Check {
        let (k, e) = (self.top_k, config.experts);
        ensure(k >= 1, "top_k", || format!("must be at least 1, got {k}"))?;
        ensure(k <= e, "top_k", || format!("{k} exceeds experts = {e}"))?;
        self.check_null_experts(config)?;
        if let Some(bias) = &self.expert_bias {
            check_expert_bias(bias, e)?;
        }
        if let Some(g) = &self.group_limit {
            self.check_group_limit(g, e)?;
        }
        self.check_balancing()
    }

    /// Null experts: dropless, top-k, and at least one real expert left.
    fn check_null_experts(&self, config: &RouterConfig) -> Check {
        let (n, e) = (self.null_experts, config.experts);
        if n == 0 {
            return Ok(());
        }
        ensure(n < e, "null_experts", || format!("{n} leaves no real expert of experts = {e}"))?;
        ensure(config.capacity.is_none(), "null_experts", || {
            "need a dropless router (remove [capacity]): a null expert has no capacity to share".into()
        })?;
        ensure(self.selection == Selection::TopK, "null_experts", || "need selection = \"top-k\"".into())
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
        ensure(g.top_groups * per_group >= self.top_k, "group_limit.top_groups", || {
            format!("{} groups of {per_group} experts cannot hold top_k = {}", g.top_groups, self.top_k)
        })
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
}

impl ExpertChoice {
    /// Scores without a per-token top-k; a capacity, not padded.
    fn validate(&self, config: &RouterConfig) -> Check {
        ensure(config.score != ScoreFn::SoftmaxPost, "score", || {
            "softmax-post needs a per-token top-k; use softmax-pre or sigmoid for expert choice".into()
        })?;
        let cap = config
            .capacity
            .as_ref()
            .ok_or_else(|| FieldError::new("capacity", "is required for an expert-choice router"))?;
        ensure(!cap.pad && !cap.renormalize_after_drop, "capacity", || {
            "pad and renormalize_after_drop apply to token-choice routers only".into()
        })
    }
}

impl ThresholdConfig {
    /// Scores without a per-token top-k, no capacity; the thresholds well formed, one per expert.
    fn validate(&self, config: &RouterConfig) -> Check {
        let e = config.experts;
        ensure(config.score != ScoreFn::SoftmaxPost, "score", || {
            "softmax-post needs a per-token top-k; use softmax-pre or sigmoid for expert threshold".into()
        })?;
        ensure(config.capacity.is_none(), "capacity", || {
            "an expert-threshold router is dropless: its thresholds set the load".into()
        })?;
        let f = self.factor;
        ensure(f.is_finite() && f > 0.0 && f <= MAX_CAPACITY_FACTOR, "threshold.factor", || {
            format!("must be finite, > 0 and at most {MAX_CAPACITY_FACTOR:?}, got {f}")
        })?;
        ensure(self.ema.is_finite() && self.ema > 0.0 && self.ema <= 1.0, "threshold.ema", || {
            format!("must be in (0, 1], got {}", self.ema)
        })?;
        ensure(self.values.len() == e, "threshold.values", || {
            format!("has {} entries, expected one per expert ({e})", self.values.len())
        })?;
        if let Some((i, v)) = self.values.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(FieldError::new("threshold.values", format!("entry {i} is {v}, must be finite")));
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
