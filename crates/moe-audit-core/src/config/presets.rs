//! The built-in routers: each is a router TOML file in `presets/` beside this one, compiled into
//! the binary (TOML, so a preset reads like the file a user writes, comments included).

use super::RouterConfig;
use crate::error::Result;

/// A built-in router configuration.
#[derive(Debug, Clone, Copy)]
pub struct Preset {
    /// The name users type.
    pub name: &'static str,
    /// The TOML source.
    pub toml: &'static str,
}

macro_rules! presets {
    ($($name:literal),* $(,)?) => {
        &[$(Preset { name: $name, toml: include_str!(concat!("presets/", $name, ".toml")) }),*]
    };
}

const PRESETS: &[Preset] = presets![
    "mixtral",
    "deepseek-v3",
    "switch",
    "megatron-probs",
    "megatron-position",
    "megatron-probs-pad",
    "deepspeed-top1",
    "deepspeed-top2",
    "deepspeed-topk-probs",
    "expert-choice",
    "aux-loss-free",
    "causal-capacity",
    "sinkhorn",
    "batch-prioritized",
    "expert-choice-tc-serve",
    "expert-threshold",
    "null-experts",
];

/// All presets, in a fixed order.
pub fn presets() -> &'static [Preset] {
    PRESETS
}

/// The preset of that name, if any.
pub fn preset(name: &str) -> Option<&'static Preset> {
    PRESETS.iter().find(|p| p.name == name)
}

impl Preset {
    /// The parsed, validated configuration.
    pub fn config(&self) -> Result<RouterConfig> {
        RouterConfig::from_toml(self.toml, &format!("preset:{}", self.name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_preset_parses_and_is_named_after_its_file() {
        for p in presets() {
            let config = p.config().unwrap();
            assert_eq!(config.name, p.name);
            assert!(!config.description.is_empty(), "{} has no description", p.name);
        }
    }
}
