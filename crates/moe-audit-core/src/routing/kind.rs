//! What differs between router kinds, behind one trait: how a kind routes one group of the scope,
//! what it says about itself (prefix stability, routes per token), and the state it moves
//! between training steps. Each kind's settings (`config/kind.rs`) implement [`KindRouting`];
//! the generic routing, the layer, the sweep and the trainer call only the trait.

use super::scores::Row;
use super::{balance, expert_choice, threshold, token_choice, ExpertLoad, GroupRouting};
use crate::config::{ExpertChoice, RouterConfig, RouterKind, ThresholdConfig, TokenChoice};
use crate::error::Result;
use ndarray::ArrayView3;

/// One training step's batch, as a kind's state update reads it.
#[derive(Debug, Clone, Copy)]
pub struct StepBatch<'a> {
    /// `[batch, seq_len, experts]` the router logits of the step (what thresholds follow).
    pub logits: ArrayView3<'a, f32>,
    /// The step's expert loads, routes chosen before any dropping (what a balancing bias follows).
    pub loads: &'a [ExpertLoad],
}

/// A router kind's behaviour. `config` is the whole router (shared fields) the settings belong to.
pub(crate) trait KindRouting {
    /// Routes one group; `rows` are the group's tokens in priority order.
    fn route_group(&self, config: &RouterConfig, rows: &[Row]) -> GroupRouting;

    /// Routes per token on average (memory estimates): k, or the load factor the experts aim at.
    fn routes_per_token(&self, config: &RouterConfig) -> f64;

    /// Whether every prefix of a call of `batch` sequences routes as the whole call restricted
    /// to it (`routing/prefix.rs`).
    fn prefix_stable(&self, config: &RouterConfig, batch: usize) -> bool;

    /// Whether the kind carries state moved between training steps.
    fn has_state(&self) -> bool {
        false
    }

    /// The settings after one step between training batches (never inside a forward).
    fn step(&self, config: &RouterConfig, batch: &StepBatch) -> Result<RouterKind>;
}

impl KindRouting for TokenChoice {
    fn route_group(&self, config: &RouterConfig, rows: &[Row]) -> GroupRouting {
        token_choice::route_group(config, self, rows)
    }
    fn routes_per_token(&self, _: &RouterConfig) -> f64 {
        self.top_k as f64
    }
    fn prefix_stable(&self, config: &RouterConfig, batch: usize) -> bool {
        super::prefix::token_choice_prefix_stable(config, self, batch)
    }
    fn has_state(&self) -> bool {
        self.bias_update_rate.is_some()
    }
    fn step(&self, config: &RouterConfig, batch: &StepBatch) -> Result<RouterKind> {
        Ok(RouterKind::TokenChoice(balance::step(config, self, batch.loads)?))
    }
}

impl KindRouting for ExpertChoice {
    fn route_group(&self, config: &RouterConfig, rows: &[Row]) -> GroupRouting {
        expert_choice::route_group(config, rows)
    }
    fn routes_per_token(&self, config: &RouterConfig) -> f64 {
        let e = config.experts as f64;
        config.capacity.as_ref().and_then(|c| c.factor).unwrap_or(e).min(e)
    }
    fn prefix_stable(&self, _: &RouterConfig, _: usize) -> bool {
        // Each expert ranks the whole group: a later token may take an earlier one's slot.
        false
    }
    fn step(&self, _: &RouterConfig, _: &StepBatch) -> Result<RouterKind> {
        Ok(RouterKind::ExpertChoice(*self))
    }
}

impl KindRouting for ThresholdConfig {
    fn route_group(&self, config: &RouterConfig, rows: &[Row]) -> GroupRouting {
        threshold::route_group(config, self, rows)
    }
    fn routes_per_token(&self, config: &RouterConfig) -> f64 {
        // About cf experts per token once the thresholds track their quantiles.
        self.factor.min(config.experts as f64)
    }
    fn prefix_stable(&self, _: &RouterConfig, _: usize) -> bool {
        // Every token against fixed thresholds, nothing shared.
        true
    }
    fn has_state(&self) -> bool {
        true
    }
    fn step(&self, config: &RouterConfig, batch: &StepBatch) -> Result<RouterKind> {
        Ok(RouterKind::ExpertThreshold(threshold::step(config, self, batch.logits)?))
    }
}

impl RouterKind {
    /// The kind's behaviour.
    pub(crate) fn rule(&self) -> &dyn KindRouting {
        match self {
            RouterKind::TokenChoice(tc) => tc,
            RouterKind::ExpertChoice(ec) => ec,
            RouterKind::ExpertThreshold(t) => t,
        }
    }
}

impl RouterConfig {
    /// Whether the router carries state moved between training steps (a balancing bias,
    /// thresholds).
    pub fn has_state(&self) -> bool {
        self.kind.rule().has_state()
    }

    /// Routes per token on average (memory estimates).
    pub fn routes_per_token(&self) -> f64 {
        self.kind.rule().routes_per_token(self)
    }

    /// One step of the router's state between training batches: a balancing bias moves toward
    /// balance, thresholds toward their quantiles; a router without state stays as it is. Never
    /// called inside a forward, so a forward's routing is stateless.
    pub fn step(&mut self, batch: &StepBatch) -> Result<()> {
        self.kind = self.kind.rule().step(self, batch)?;
        Ok(())
    }
}
