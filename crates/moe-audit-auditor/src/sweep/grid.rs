//! The sweep grid: which routers, and which capacity factors, k, E, sequence lengths and batch
//! sizes to cross. A TOML file or the built-in default; validated like a router config.

use crate::exploit::ExploitOptions;
use moe_audit_core::config::{parse_toml, RouterConfig};
use moe_audit_core::error::{excerpt, Error, FieldError, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// A sweep grid (`SWEEP.toml`); every field has a default, so `moe-audit sweep` alone runs the
/// built-in grid.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Grid {
    /// Presets or router TOML files (relative to the grid file).
    #[serde(default = "default_routers")]
    pub routers: Vec<String>,
    /// Capacity factors, applied to routers whose capacity is derived from a factor.
    #[serde(default = "default_factors")]
    pub capacity_factor: Vec<f64>,
    /// Experts per token, applied to token-choice routers.
    #[serde(default = "default_top_k")]
    pub top_k: Vec<usize>,
    /// Numbers of experts.
    #[serde(default = "default_experts")]
    pub experts: Vec<usize>,
    /// Tokens per sequence.
    #[serde(default = "default_seq_len")]
    pub seq_len: Vec<usize>,
    /// Sequences per call.
    #[serde(default = "default_batch")]
    pub batch: Vec<usize>,
    /// Trials of the randomised probes.
    #[serde(default = "default_trials")]
    pub trials: usize,
    /// Seed of layers, inputs and probes.
    #[serde(default)]
    pub seed: u64,
    /// Hidden size of the seeded layers.
    #[serde(default = "default_size")]
    pub hidden: usize,
    /// Expert FFN size of the seeded layers.
    #[serde(default = "default_size")]
    pub ffn: usize,
    /// Balancing steps run before auditing a router with `bias_update_rate` (aux-loss-free).
    #[serde(default = "default_balance_steps")]
    pub balance_steps: usize,
    /// Run probe X (bf16/f16 routing flips) in every cell.
    #[serde(default = "yes")]
    pub numerics: bool,
    /// The router whose position × distance heatmap is drawn (one of `routers`).
    #[serde(default = "default_heatmap")]
    pub heatmap: String,
    /// `[exploit]`: also train a tiny decoder through every cell's router (`moe-audit exploit`
    /// with these sizes; an empty table: its defaults) and report how far below the causal floor
    /// its training-mode loss goes, the `exploit` column. Absent by default: it costs seconds
    /// per cell.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exploit: Option<ExploitOptions>,
}

fn default_routers() -> Vec<String> {
    [
        "mixtral",
        "aux-loss-free",
        "switch",
        "causal-capacity",
        "sinkhorn",
        "batch-prioritized",
        "megatron-probs",
        "megatron-position",
        "deepspeed-top2",
        "expert-choice",
        "expert-choice-tc-serve",
    ]
    .map(String::from)
    .to_vec()
}
fn default_factors() -> Vec<f64> {
    vec![1.0, 1.25, 2.0]
}
fn default_top_k() -> Vec<usize> {
    vec![1, 2]
}
fn default_experts() -> Vec<usize> {
    vec![8]
}
fn default_seq_len() -> Vec<usize> {
    vec![64]
}
fn default_batch() -> Vec<usize> {
    vec![4]
}
fn default_trials() -> usize {
    8
}
fn default_size() -> usize {
    32
}
fn default_balance_steps() -> usize {
    32
}
fn yes() -> bool {
    true
}
fn default_heatmap() -> String {
    "batch-prioritized".into()
}

impl Default for Grid {
    fn default() -> Self {
        parse_toml("", "<default grid>").expect("every field has a default")
    }
}

/// One configuration of the grid.
#[derive(Debug, Clone, PartialEq)]
pub struct Cell {
    /// The router with the cell's sizes applied (validated).
    pub config: RouterConfig,
    /// The capacity factor applied, if the router has one.
    pub capacity_factor: Option<f64>,
    /// k applied, for token choice.
    pub top_k: Option<usize>,
    /// E.
    pub experts: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Sequences per call.
    pub batch: usize,
}

/// A combination the router cannot take (k > E, a group limit that does not divide E, ...).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Skipped {
    /// The router.
    pub router: String,
    /// Why, as validation said it.
    pub reason: String,
}

impl Grid {
    /// Parses and validates a grid file; errors name the file, the field, the value and the line.
    pub fn from_toml(text: &str, source_name: &str) -> Result<Self> {
        let grid: Grid = parse_toml(text, source_name)?;
        grid.validate().map_err(|e| e.in_config(source_name))?;
        Ok(grid)
    }

    /// Reads a grid file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = moe_audit_core::files::read_text(
            path,
            moe_audit_core::files::TEXT_LIMIT,
            "the most a sweep grid may hold",
        )?;
        Self::from_toml(&text, &path.display().to_string())
    }

    fn validate(&self) -> std::result::Result<(), FieldError> {
        let lists: [(&str, &[usize]); 4] =
            [("top_k", &self.top_k), ("experts", &self.experts), ("seq_len", &self.seq_len), ("batch", &self.batch)];
        for (field, values) in lists {
            if values.is_empty() {
                return Err(FieldError::new(field, "must list at least one value"));
            }
            if let Some(i) = values.iter().position(|&v| v == 0) {
                return Err(FieldError::new(format!("{field}[{i}]"), "must be at least 1, got 0"));
            }
        }
        if self.routers.is_empty() {
            return Err(FieldError::new("routers", "must list at least one router"));
        }
        if self.capacity_factor.is_empty() {
            return Err(FieldError::new("capacity_factor", "must list at least one value"));
        }
        if let Some((i, f)) = self.capacity_factor.iter().enumerate().find(|(_, f)| !(f.is_finite() && **f > 0.0)) {
            return Err(FieldError::new(format!("capacity_factor[{i}]"), format!("must be finite and > 0, got {f}")));
        }
        // A factor no router config takes is bad input, not a skipped cell (checked before any cell runs).
        let max = moe_audit_core::config::MAX_CAPACITY_FACTOR;
        if let Some((i, f)) = self.capacity_factor.iter().enumerate().find(|(_, f)| **f > max) {
            return Err(FieldError::new(
                format!("capacity_factor[{i}]"),
                format!("{f:?} is over {max:?}: no token is dropped long before; use a smaller factor"),
            ));
        }
        for (field, v) in [("hidden", self.hidden), ("ffn", self.ffn), ("trials", self.trials)] {
            if v == 0 {
                return Err(FieldError::new(field, "must be at least 1, got 0"));
            }
        }
        if !self.routers.contains(&self.heatmap) {
            return Err(FieldError::new("heatmap", format!("`{}` is not one of `routers`", excerpt(&self.heatmap))));
        }
        match self.exploit.as_ref().map(ExploitOptions::validate) {
            Some(Err(Error::Setting { setting, message })) => {
                return Err(FieldError::new(format!("exploit.{}", setting.name()), message.to_string()))
            }
            Some(Err(e)) => return Err(FieldError::new("exploit", e.to_string())),
            _ => {}
        }
        Ok(())
    }

    /// Resolves the routers: presets by name, files inside `base` (the grid file's folder; no
    /// absolute path, `..` or symlink out of it: a grid is data, it points at no other file).
    pub(crate) fn load_routers(&self, source_name: &str, base: &Path) -> Result<Vec<RouterConfig>> {
        (self.routers.iter().enumerate())
            .map(|(i, name)| {
                if moe_audit_core::config::preset(name).is_some() {
                    return RouterConfig::load(name);
                }
                let path =
                    moe_audit_core::files::inside(base, Path::new(name), &format!("{source_name}: routers[{i}]"))?;
                if !path.is_file() {
                    let known = moe_audit_core::config::presets().iter().map(|p| p.name).collect::<Vec<_>>().join(", ");
                    let e = Error::UnknownRouter { name: name.clone(), known };
                    return Err(Error::config(source_name, &format!("routers[{i}]"), e.to_string()));
                }
                RouterConfig::from_file(&path)
            })
            .collect()
    }

    /// Every cell of the grid in a fixed order (router, E, k, capacity factor, seq len, batch), and
    /// the combinations a router cannot take. Axes a router has no use for collapse to one cell.
    pub fn cells(&self, routers: &[RouterConfig]) -> (Vec<Cell>, Vec<Skipped>) {
        let (mut cells, mut skipped) = (Vec::new(), Vec::new());
        for base in routers {
            for &experts in &self.experts {
                // The k axis applies where tokens choose.
                let ks: Vec<Option<usize>> = match base.top_k() {
                    Some(_) => self.top_k.iter().copied().map(Some).collect(),
                    None => vec![None],
                };
                // An expert-threshold router's target load factor is its capacity factor.
                let derived = base.capacity.as_ref().and_then(|c| c.factor).or(base.threshold().map(|t| t.factor));
                let factors: Vec<Option<f64>> = match derived {
                    Some(_) => self.capacity_factor.iter().copied().map(Some).collect(),
                    None => vec![None],
                };
                for &top_k in &ks {
                    for &capacity_factor in &factors {
                        let c = resized(base, experts, top_k, capacity_factor);
                        let what = format!(
                            "{} with experts = {experts}, top_k = {top_k:?}, capacity factor {capacity_factor:?}",
                            base.name
                        );
                        if let Err(e) = c.check(&what) {
                            skipped.push(Skipped { router: base.name.clone(), reason: e.to_string() });
                            continue;
                        }
                        for &seq_len in &self.seq_len {
                            for &batch in &self.batch {
                                cells.push(Cell { config: c.clone(), capacity_factor, top_k, experts, seq_len, batch });
                            }
                        }
                    }
                }
            }
        }
        (cells, skipped)
    }
}

/// `base` resized to a cell of the grid: `experts` that compute (null ones come on top), `top_k`
/// and the capacity factor when the cell sets them; a kind's per-expert settings follow E
/// (`RouterKind::resize`).
fn resized(base: &RouterConfig, experts: usize, top_k: Option<usize>, factor: Option<f64>) -> RouterConfig {
    let mut c = base.clone();
    c.experts = experts + c.null_experts();
    if let (Some(cap), Some(f)) = (c.capacity.as_mut(), factor) {
        cap.factor = Some(f);
    }
    c.kind.resize(experts, top_k, factor);
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_grid_resolves_and_collapses_unused_axes() {
        let grid = Grid::default();
        let routers = grid.load_routers("<default>", Path::new(".")).unwrap();
        let (cells, skipped) = grid.cells(&routers);
        assert!(skipped.is_empty(), "{skipped:?}");
        let count = |name: &str| cells.iter().filter(|c| c.config.name == name).count();
        assert_eq!(count("mixtral"), 2, "dropless: k only");
        assert_eq!(count("switch"), 2, "fixed capacity: k only");
        assert_eq!(count("expert-choice"), 3, "expert choice: capacity factor only");
        assert_eq!(count("megatron-probs"), 6);
    }

    #[test]
    fn k_above_e_is_skipped_with_the_validation_message() {
        let grid = Grid {
            routers: vec!["mixtral".into()],
            top_k: vec![4],
            experts: vec![2],
            heatmap: "mixtral".into(),
            ..Grid::default()
        };
        let routers = grid.load_routers("g", Path::new(".")).unwrap();
        let (cells, skipped) = grid.cells(&routers);
        assert!(cells.is_empty());
        assert!(skipped[0].reason.contains("top_k: 4 exceeds experts = 2"), "{skipped:?}");
    }
}
