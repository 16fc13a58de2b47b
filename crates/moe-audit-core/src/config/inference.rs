//! `[inference]`: what a router changes when serving, as a typed overlay on its training
//! configuration. Parsed with the file (so a bad field is reported at its own line), applied
//! field by field: no TOML text is written and parsed again.

use super::file::RouterFile;
use super::{
    Arithmetic, CapacityConfig, DropPolicy, Flatten, GroupLimit, KindName, PaddingMask, RouterConfig, ScopeGroup,
    ScoreFn, Selection,
};
use crate::error::FieldError;
use serde::{Deserialize, Serialize};

/// The `[inference]` table: every field present replaces the training value, a nested table
/// (`capacity`, `scope`, `group_limit`) overrides only the fields it names, and `dropless = true`
/// removes the capacity first.
///
/// Fields are declared in alphabetical order, the order a TOML table serialises in, so the
/// router written into witness files keeps its bytes.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InferenceOverrides {
    /// Replaces the token-choice [`TokenChoice::bias_update_rate`](super::TokenChoice::bias_update_rate).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bias_update_rate: Option<f32>,
    /// Overrides fields of [`RouterConfig::capacity`] (a capacity of defaults when there is none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<CapacityOverrides>,
    /// Replaces [`RouterConfig::description`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// `true`: serve without a capacity (nothing is dropped).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dropless: Option<bool>,
    /// Replaces the token-choice [`TokenChoice::expert_bias`](super::TokenChoice::expert_bias).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_bias: Option<Vec<f32>>,
    /// Replaces [`RouterConfig::experts`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub experts: Option<usize>,
    /// Overrides fields of the token-choice [`TokenChoice::group_limit`](super::TokenChoice::group_limit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_limit: Option<GroupLimitOverrides>,
    /// Replaces the kind ([`RouterConfig::kind`]; the settings it needs come from the file).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<KindName>,
    /// Replaces [`RouterConfig::name`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Replaces [`RouterConfig::normalize`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub normalize: Option<bool>,
    /// Replaces [`RouterConfig::padding_mask`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub padding_mask: Option<PaddingMask>,
    /// Replaces [`RouterConfig::routed_scaling`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routed_scaling: Option<f32>,
    /// Overrides fields of [`RouterConfig::scope`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scope: Option<ScopeOverrides>,
    /// Replaces [`RouterConfig::score`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub score: Option<ScoreFn>,
    /// Replaces the token-choice [`TokenChoice::selection`](super::TokenChoice::selection).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selection: Option<Selection>,
    /// Replaces the token-choice [`TokenChoice::top_k`](super::TokenChoice::top_k).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<usize>,
}

/// Fields of [`CapacityConfig`] overridden when serving.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CapacityOverrides {
    /// Replaces [`CapacityConfig::arithmetic`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arithmetic: Option<Arithmetic>,
    /// Replaces [`CapacityConfig::factor`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub factor: Option<f64>,
    /// Replaces [`CapacityConfig::fixed`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fixed: Option<usize>,
    /// Replaces [`CapacityConfig::min`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min: Option<usize>,
    /// Replaces [`CapacityConfig::pad`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pad: Option<bool>,
    /// Replaces [`CapacityConfig::policy`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<DropPolicy>,
    /// Replaces [`CapacityConfig::renormalize_after_drop`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub renormalize_after_drop: Option<bool>,
}

/// Fields of [`GroupLimit`] overridden when serving.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupLimitOverrides {
    /// Replaces [`GroupLimit::groups`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub groups: Option<usize>,
    /// Replaces [`GroupLimit::score_top`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub score_top: Option<usize>,
    /// Replaces [`GroupLimit::top_groups`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_groups: Option<usize>,
}

/// Fields of [`super::ScopeConfig`] overridden when serving.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScopeOverrides {
    /// Replaces [`super::ScopeConfig::flatten`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flatten: Option<Flatten>,
    /// Replaces [`super::ScopeConfig::group`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<ScopeGroup>,
}

/// Replaces `*field` when `value` is present.
fn set<T: Clone>(field: &mut T, value: &Option<T>) {
    if let Some(v) = value {
        *field = v.clone();
    }
}

impl InferenceOverrides {
    /// `training` with these overrides applied, without its own `[inference]` table; not yet
    /// validated. Applied to the flat file, so serving may change the kind (expert choice
    /// trained, token choice served). Errors are `(field, message)`, as
    /// [`RouterConfig::validate`]'s.
    pub(super) fn apply(&self, training: &RouterConfig) -> Result<RouterConfig, FieldError> {
        let mut c = RouterFile { inference: None, ..RouterFile::from(training.clone()) };
        if self.dropless == Some(true) {
            c.capacity = None;
        }
        set(&mut c.bias_update_rate, &self.bias_update_rate.map(Some));
        if let Some(o) = &self.capacity {
            let cap = c.capacity.get_or_insert_with(CapacityConfig::default);
            set(&mut cap.arithmetic, &o.arithmetic);
            set(&mut cap.factor, &o.factor.map(Some));
            set(&mut cap.fixed, &o.fixed.map(Some));
            set(&mut cap.min, &o.min);
            set(&mut cap.pad, &o.pad);
            set(&mut cap.policy, &o.policy);
            set(&mut cap.renormalize_after_drop, &o.renormalize_after_drop);
        }
        set(&mut c.description, &self.description);
        set(&mut c.expert_bias, &self.expert_bias.clone().map(Some));
        set(&mut c.experts, &self.experts);
        if let Some(o) = &self.group_limit {
            let g = match (&c.group_limit, o.groups, o.top_groups) {
                (Some(g), _, _) => g.clone(),
                // A group limit new in serving names both sizes; `score_top` has its default.
                (None, Some(groups), Some(top_groups)) => GroupLimit { groups, top_groups, score_top: super::two() },
                (None, None, _) => return Err(FieldError::new("group_limit", "missing field `groups`")),
                (None, _, None) => return Err(FieldError::new("group_limit", "missing field `top_groups`")),
            };
            let g = c.group_limit.insert(g);
            set(&mut g.groups, &o.groups);
            set(&mut g.score_top, &o.score_top);
            set(&mut g.top_groups, &o.top_groups);
        }
        set(&mut c.kind, &self.kind);
        set(&mut c.name, &self.name);
        set(&mut c.normalize, &self.normalize.map(Some));
        set(&mut c.padding_mask, &self.padding_mask.map(Some));
        set(&mut c.routed_scaling, &self.routed_scaling);
        if let Some(o) = &self.scope {
            set(&mut c.scope.flatten, &o.flatten);
            set(&mut c.scope.group, &o.group);
        }
        set(&mut c.score, &self.score);
        set(&mut c.selection, &self.selection);
        set(&mut c.top_k, &self.top_k.map(Some));
        RouterConfig::try_from(c)
    }
}

#[cfg(test)]
mod tests {
    use crate::config::{DropPolicy, Flatten, RouterConfig};

    const BASE: &str = "name = \"r\"\nkind = \"token-choice\"\nexperts = 8\ntop_k = 2\nscore = \"softmax-pre\"\n\
                        [capacity]\nfactor = 1.0\npolicy = \"position\"\n";

    fn served(inference: &str) -> crate::error::Result<Option<RouterConfig>> {
        RouterConfig::from_toml(&format!("{BASE}[inference]\n{inference}"), "t.toml")?.inference_config()
    }

    #[test]
    fn nested_tables_override_only_the_fields_they_name() {
        let c = served("capacity = { factor = 4.0 }\nscope = { flatten = \"sequence-major\" }\nname = \"s\"\n")
            .unwrap()
            .unwrap();
        let cap = c.capacity.clone().unwrap();
        assert_eq!((cap.factor, cap.policy), (Some(4.0), DropPolicy::Position), "policy kept from training");
        assert_eq!((c.scope.flatten, c.name.as_str(), c.top_k()), (Flatten::SequenceMajor, "s", Some(2)));
        assert!(c.inference.is_none());
    }

    #[test]
    fn dropless_removes_the_capacity_before_a_new_one_is_built() {
        assert!(served("dropless = true\n").unwrap().unwrap().capacity.is_none());
        let fresh = served("dropless = true\ncapacity = { fixed = 3 }\n").unwrap().unwrap().capacity.unwrap();
        assert_eq!((fresh.factor, fresh.fixed, fresh.policy), (None, Some(3), DropPolicy::Probs));
        assert_eq!(served("dropless = false\n").unwrap().unwrap().capacity.unwrap().factor, Some(1.0));
    }

    #[test]
    fn errors_name_the_field_under_inference_and_the_line_of_the_file() {
        let err = |s: &str| served(s).unwrap_err().to_string();
        assert_eq!(err("top_k = 9\n"), "t.toml: inference.top_k: 9 exceeds experts = 8");
        assert_eq!(
            err("top_k = \"x\"\n"),
            "t.toml: inference.top_k: invalid type: string \"x\", expected usize (line 10, column 9)"
        );
        assert_eq!(err("group_limit = { top_groups = 1 }\n"), "t.toml: inference.group_limit: missing field `groups`");
        assert!(err("colour = 1\n").starts_with("t.toml: inference.colour: unknown field `colour`"));
    }

    #[test]
    fn the_overlay_serialises_in_table_order_and_round_trips() {
        let c =
            RouterConfig::from_toml(&format!("{BASE}[inference]\nname = \"s\"\ncapacity = {{ factor = 4.0 }}\n"), "t")
                .unwrap();
        let json = serde_json::to_string(&c.inference).unwrap();
        assert_eq!(json, r#"{"capacity":{"factor":4.0},"name":"s"}"#);
        let back: RouterConfig = crate::config::parse_toml(&toml::to_string(&c).unwrap(), "t").unwrap();
        assert_eq!(back, c);
    }
}
