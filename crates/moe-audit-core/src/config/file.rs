//! The router TOML as users write it: one flat table, a kind's own keys beside the shared ones.
//! [`RouterConfig`] reads and writes through it (`serde(try_from, into)`), so the file format,
//! the report header and the snapshot metadata keep their keys and their order while the config
//! in memory is a [`RouterKind`] with its settings.

use super::kind::{ExpertChoice, KindName, RouterKind, ThresholdConfig, TokenChoice};
use super::{
    CapacityConfig, GroupLimit, InferenceOverrides, PaddingMask, RouterConfig, ScopeConfig, ScoreFn, Selection,
};
use crate::error::FieldError;
use serde::{Deserialize, Serialize};

/// A router configuration, as written in a TOML file (field order is the written order).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RouterFile {
    pub name: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub description: String,
    pub kind: KindName,
    pub experts: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<usize>,
    pub score: ScoreFn,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub normalize: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_bias: Option<Vec<f32>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_limit: Option<GroupLimit>,
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub routed_scaling: f32,
    #[serde(default, skip_serializing_if = "Selection::is_top_k")]
    pub selection: Selection,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bias_update_rate: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<CapacityConfig>,
    #[serde(default)]
    pub scope: ScopeConfig,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub padding_mask: Option<PaddingMask>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub threshold: Option<ThresholdConfig>,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub null_experts: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inference: Option<InferenceOverrides>,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

fn one() -> f32 {
    1.0
}

fn is_one(x: &f32) -> bool {
    *x == 1.0
}

/// A key another kind owns: `Ok` when absent.
fn foreign(present: bool, field: &'static str, message: &str) -> Result<(), FieldError> {
    if present {
        Err(FieldError::new(field, message))
    } else {
        Ok(())
    }
}

impl RouterFile {
    /// The token-choice settings: `top_k` required, no thresholds.
    fn token_choice(&mut self) -> Result<TokenChoice, FieldError> {
        let top_k = self.top_k.ok_or_else(|| FieldError::new("top_k", "is required for a token-choice router"))?;
        foreign(self.threshold.is_some(), "threshold", "applies to expert-threshold routers only")?;
        Ok(TokenChoice {
            top_k,
            expert_bias: self.expert_bias.take(),
            group_limit: self.group_limit.take(),
            selection: self.selection,
            bias_update_rate: self.bias_update_rate,
            null_experts: self.null_experts,
        })
    }

    /// No token-choice key and no thresholds.
    fn expert_choice(&self) -> Result<ExpertChoice, FieldError> {
        let only = "applies to token-choice routers only";
        foreign(self.top_k.is_some(), "top_k", "does not apply to an expert-choice router (each expert picks tokens)")?;
        foreign(self.expert_bias.is_some(), "expert_bias", only)?;
        foreign(self.group_limit.is_some(), "group_limit", only)?;
        foreign(self.selection != Selection::TopK, "selection", only)?;
        foreign(self.bias_update_rate.is_some(), "bias_update_rate", only)?;
        foreign(self.threshold.is_some(), "threshold", "applies to expert-threshold routers only")?;
        foreign(self.null_experts > 0, "null_experts", "apply to token-choice routers only")?;
        Ok(ExpertChoice)
    }

    /// The thresholds required, no token-choice key.
    fn expert_threshold(&mut self) -> Result<ThresholdConfig, FieldError> {
        foreign(
            self.top_k.is_some(),
            "top_k",
            "does not apply to an expert-threshold router (each expert takes the tokens above its threshold)",
        )?;
        foreign(
            self.expert_bias.is_some()
                || self.group_limit.is_some()
                || self.selection != Selection::TopK
                || self.bias_update_rate.is_some(),
            "kind",
            "expert_bias, group_limit, selection and bias_update_rate apply to token-choice routers only",
        )?;
        let threshold = self
            .threshold
            .take()
            .ok_or_else(|| FieldError::new("threshold", "is required for an expert-threshold router"))?;
        foreign(self.null_experts > 0, "null_experts", "apply to token-choice routers only")?;
        Ok(threshold)
    }
}

impl TryFrom<RouterFile> for RouterConfig {
    type Error = FieldError;

    /// Gives each key to the kind that owns it; a key of another kind is the error. The values
    /// are checked later ([`RouterConfig::validate`]).
    fn try_from(mut f: RouterFile) -> Result<Self, FieldError> {
        let kind = match f.kind {
            KindName::TokenChoice => RouterKind::TokenChoice(f.token_choice()?),
            KindName::ExpertChoice => RouterKind::ExpertChoice(f.expert_choice()?),
            KindName::ExpertThreshold => RouterKind::ExpertThreshold(f.expert_threshold()?),
        };
        Ok(RouterConfig {
            name: f.name,
            description: f.description,
            kind,
            experts: f.experts,
            score: f.score,
            normalize: f.normalize,
            routed_scaling: f.routed_scaling,
            capacity: f.capacity,
            scope: f.scope,
            padding_mask: f.padding_mask,
            inference: f.inference,
        })
    }
}

impl From<RouterConfig> for RouterFile {
    fn from(c: RouterConfig) -> Self {
        let mut f = RouterFile {
            name: c.name,
            description: c.description,
            kind: c.kind.name(),
            experts: c.experts,
            top_k: None,
            score: c.score,
            normalize: c.normalize,
            expert_bias: None,
            group_limit: None,
            routed_scaling: c.routed_scaling,
            selection: Selection::TopK,
            bias_update_rate: None,
            capacity: c.capacity,
            scope: c.scope,
            padding_mask: c.padding_mask,
            threshold: None,
            null_experts: 0,
            inference: c.inference,
        };
        match c.kind {
            RouterKind::TokenChoice(tc) => {
                f.top_k = Some(tc.top_k);
                f.expert_bias = tc.expert_bias;
                f.group_limit = tc.group_limit;
                f.selection = tc.selection;
                f.bias_update_rate = tc.bias_update_rate;
                f.null_experts = tc.null_experts;
            }
            RouterKind::ExpertChoice(ExpertChoice) => {}
            RouterKind::ExpertThreshold(t) => f.threshold = Some(t),
        }
        f
    }
}
