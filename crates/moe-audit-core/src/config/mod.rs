//! Router configuration: the TOML schema, its validation, and the built-in presets.
//!
//! A config is the shared fields and a [`RouterKind`] carrying that kind's settings; it reads and
//! writes as one flat TOML table (`file.rs`), which is the file format, the CLI input and the
//! report header. Parsing and validation happen here, once, so the routing code can trust every
//! field it reads.

mod family;
mod file;
mod inference;
mod kind;
mod presets;
mod validate;

pub use family::Family;
pub use inference::{CapacityOverrides, GroupLimitOverrides, InferenceOverrides, ScopeOverrides};
// Every kind and its settings (a new kind is one variant and its settings in `kind.rs`).
pub use kind::*;
pub use presets::{preset, presets, Preset};
pub use validate::MAX_CAPACITY_FACTOR;

use crate::error::{Error, FieldError, Result};
use file::RouterFile;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::path::Path;

/// A router configuration: the shared fields, and the kind with its own settings.
///
/// Read and written as one flat TOML table (`file.rs`); reading checks which keys the kind may
/// have, [`RouterConfig::from_toml`] then checks the values.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "RouterFile", into = "RouterFile")]
pub struct RouterConfig {
    /// Name used in reports and records.
    pub name: String,
    /// One line saying what the router reproduces.
    pub description: String,
    /// Who chooses whom, with the kind's own settings (top-k, thresholds, ...).
    pub kind: RouterKind,
    /// Number of experts E.
    pub experts: usize,
    /// How logits become selection scores and gates.
    pub score: ScoreFn,
    /// Divide the k gates by their sum. Default: no for `softmax-pre`, yes for `sigmoid` with
    /// k > 1; `softmax-post` is normalised by construction.
    pub normalize: Option<bool>,
    /// Multiplier on every gate after normalisation (DeepSeek-V3's `routed_scaling_factor`).
    pub routed_scaling: f32,
    /// Capacity and token dropping; absent for a dropless router.
    pub capacity: Option<CapacityConfig>,
    /// Which tokens compete with each other.
    pub scope: ScopeConfig,
    /// How the router treats padding when given a padding mask; absent: it takes no mask.
    pub padding_mask: Option<PaddingMask>,
    /// Fields overridden when serving (`[inference]`); `dropless = true` removes the capacity.
    pub inference: Option<InferenceOverrides>,
}

/// What a router that accepts a padding mask does with padding tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PaddingMask {
    /// Padding gets no routes and does not count toward the capacity.
    Exclude,
    /// Padding is routed like any token and takes capacity (the bug of scenario 11).
    Compete,
}

/// How a token's logits become selection scores and gates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ScoreFn {
    /// Softmax over all experts, then top-k on the probabilities.
    SoftmaxPre,
    /// Top-k on the logits, then softmax over the k chosen.
    SoftmaxPost,
    /// Sigmoid per expert, then top-k.
    Sigmoid,
}

/// Expert selection rule of a token-choice router.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Selection {
    /// Each token's k best selection scores.
    #[default]
    TopK,
    /// The k best entries of each token's row of the Sinkhorn-balanced `exp(logits)` of the group
    /// (Megatron-LM `sinkhorn`): balanced across the group, so not causal.
    Sinkhorn,
}

impl Selection {
    fn is_top_k(&self) -> bool {
        *self == Selection::TopK
    }
}

/// Group-limited top-k: choose `top_groups` of `groups` expert groups first, then top-k inside them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupLimit {
    /// Number of equal expert groups (must divide `experts`).
    pub groups: usize,
    /// Groups a token may use.
    pub top_groups: usize,
    /// A group's score is the sum of its best `score_top` selection scores (DeepSeek-V3: 2).
    #[serde(default = "two")]
    pub score_top: usize,
}

fn two() -> usize {
    2
}

/// Capacity limits and the rule that decides which routes are dropped.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CapacityConfig {
    /// Capacity factor cf: capacity is derived from the scope's token count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub factor: Option<f64>,
    /// A constant capacity per scope, whatever its size (Switch Transformer's `expert_capacity`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fixed: Option<usize>,
    /// Which routes an over-full expert keeps.
    #[serde(default)]
    pub policy: DropPolicy,
    /// How the capacity is computed from the factor.
    #[serde(default)]
    pub arithmetic: Arithmetic,
    /// Lower bound on the capacity.
    #[serde(default)]
    pub min: usize,
    /// Pad every expert to exactly its capacity with gate-0 rows (Megatron `pad_to_capacity`).
    #[serde(default)]
    pub pad: bool,
    /// Renormalise each token's surviving gates to sum to 1 after dropping (DeepSpeed).
    #[serde(default)]
    pub renormalize_after_drop: bool,
}

/// Priority among the routes competing for one expert.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DropPolicy {
    /// Keep the routes with the largest gate; ties to the lower token index.
    #[default]
    Probs,
    /// Keep the first routes in token order; a token's 1st and 2nd choices rank alike.
    Position,
    /// Every 1st choice outranks every 2nd choice, then token order (DeepSpeed top-2).
    ChoiceRank,
    /// Batch-prioritised routing (V-MoE BPR): every 1st choice before every 2nd choice, and within
    /// a choice rank the tokens with the largest top gate (max routing probability) first.
    BatchPriority,
    /// Causal capacity: the token at position t keeps an expert iff fewer than `C(t)` earlier
    /// tokens of its sequence kept it, `C(t)` being the capacity formula for a group of t + 1
    /// tokens (`ceil(cf*(t+1)*k/E)` with Megatron arithmetic). Needs `scope.group = "sequence"`.
    Causal,
}

/// Capacity arithmetic, reproducing each framework's rounding.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Arithmetic {
    /// `max(ceil((T*k/E)*cf), min)` in float64 (Megatron-LM `get_capacity`).
    #[default]
    Megatron,
    /// `max(ceil(f32(T/E) * f32(cf*k)), min)` in float32 (DeepSpeed `_capacity`).
    Deepspeed,
    /// `max(round_half_even(cf*T/E), min)` in float64 (flaxformer expert choice).
    Flaxformer,
}

/// The set of tokens that compete for capacity, and their order.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScopeConfig {
    /// How the batch is split into routing groups.
    #[serde(default)]
    pub group: ScopeGroup,
    /// The order in which the batch is flattened; it decides who is "earlier".
    #[serde(default)]
    pub flatten: Flatten,
}

/// How the batch is split into independent routing groups.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum ScopeGroup {
    /// All tokens of the call together (Megatron, DeepSpeed: the micro-batch on a rank).
    #[default]
    Batch,
    /// Each sequence on its own (Switch Transformer).
    Sequence,
    /// Fixed-size groups of the flattened order; the last group may be shorter.
    Tokens(usize),
}

impl TryFrom<String> for ScopeGroup {
    type Error = String;
    fn try_from(s: String) -> std::result::Result<Self, String> {
        match s.as_str() {
            "batch" => Ok(ScopeGroup::Batch),
            "sequence" => Ok(ScopeGroup::Sequence),
            other => match other.strip_prefix("tokens:").map(str::parse::<usize>) {
                Some(Ok(n)) if n > 0 => Ok(ScopeGroup::Tokens(n)),
                _ => Err(format!(
                    "unknown scope group `{}`, expected `batch`, `sequence` or `tokens:N` with N > 0",
                    crate::error::excerpt(other)
                )),
            },
        }
    }
}

impl From<ScopeGroup> for String {
    fn from(g: ScopeGroup) -> String {
        g.to_string()
    }
}

impl fmt::Display for ScopeGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScopeGroup::Batch => f.write_str("batch"),
            ScopeGroup::Sequence => f.write_str("sequence"),
            ScopeGroup::Tokens(n) => write!(f, "tokens:{n}"),
        }
    }
}

/// Flattening order of a `[B, S]` batch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Flatten {
    /// `[S, B]`: all sequences' position 0, then position 1, ... (Megatron-LM).
    #[default]
    PositionMajor,
    /// `[B, S]`: sequence 0 entirely, then sequence 1, ... (HF and DeepSpeed callers).
    SequenceMajor,
}

impl fmt::Display for Flatten {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Flatten::PositionMajor => "position-major",
            Flatten::SequenceMajor => "sequence-major",
        })
    }
}

impl RouterConfig {
    /// Parses and validates a TOML document; `source_name` names it in errors.
    pub fn from_toml(text: &str, source_name: &str) -> Result<Self> {
        let file: RouterFile = parse_toml(text, source_name)?;
        let config = RouterConfig::try_from(file).map_err(|e| e.in_config(source_name))?;
        config.check(source_name)?;
        Ok(config)
    }

    /// Checks every rule on this configuration and on its `[inference]` one; errors name
    /// `source_name` and the field.
    pub fn check(&self, source_name: &str) -> Result<()> {
        self.validate().map_err(|e| e.in_config(source_name))?;
        self.inference_config_from(source_name)?;
        Ok(())
    }

    /// The configuration used when serving: this one with the `[inference]` overrides applied, or
    /// `None` when the router declares no `[inference]` table.
    pub fn inference_config(&self) -> Result<Option<RouterConfig>> {
        self.inference_config_from(&self.name)
    }

    fn inference_config_from(&self, source_name: &str) -> Result<Option<RouterConfig>> {
        let Some(overrides) = &self.inference else { return Ok(None) };
        let served = overrides
            .apply(self)
            .and_then(|c| c.validate().map(|()| c))
            .map_err(|e| e.within("inference").in_config(source_name))?;
        Ok(Some(served))
    }

    /// Reads, parses and validates a TOML file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = crate::files::read_text(path, crate::files::TEXT_LIMIT, "the most a router config may hold")?;
        Self::from_toml(&text, &path.display().to_string())
    }

    /// Resolves a preset name or a TOML file path.
    pub fn load(name_or_path: &str) -> Result<Self> {
        if let Some(p) = preset(name_or_path) {
            return p.config();
        }
        let path = Path::new(name_or_path);
        if path.is_file() {
            return Self::from_file(path);
        }
        Err(Error::UnknownRouter {
            name: name_or_path.to_string(),
            known: presets().iter().map(|p| p.name).collect::<Vec<_>>().join(", "),
        })
    }

    /// Experts per token for token choice; `None` when the experts choose.
    pub fn top_k(&self) -> Option<usize> {
        self.token_choice().map(|tc| tc.top_k)
    }

    /// k for token choice; 1 for the kinds where experts choose.
    pub fn k(&self) -> usize {
        self.top_k().unwrap_or(1)
    }

    /// The token-choice settings, when the router is one.
    pub fn token_choice(&self) -> Option<&TokenChoice> {
        match &self.kind {
            RouterKind::TokenChoice(tc) => Some(tc),
            _ => None,
        }
    }

    /// The token-choice settings to change, when the router is one.
    pub fn token_choice_mut(&mut self) -> Option<&mut TokenChoice> {
        match &mut self.kind {
            RouterKind::TokenChoice(tc) => Some(tc),
            _ => None,
        }
    }

    /// The thresholds, when the router is an expert-threshold one.
    pub fn threshold(&self) -> Option<&ThresholdConfig> {
        match &self.kind {
            RouterKind::ExpertThreshold(t) => Some(t),
            _ => None,
        }
    }

    /// Zero-compute expert slots (token choice only).
    pub fn null_experts(&self) -> usize {
        self.token_choice().map_or(0, |tc| tc.null_experts)
    }

    /// The experts that compute: `experts` less the null ones (the routing record's E).
    pub fn real_experts(&self) -> usize {
        self.experts - self.null_experts()
    }

    /// This configuration with a selection-only bias (e.g. read from weights), checked as if
    /// the file had said `expert_bias = [...]`.
    pub(crate) fn with_expert_bias(self, bias: Vec<f32>) -> std::result::Result<RouterConfig, FieldError> {
        let file = RouterFile { expert_bias: Some(bias), ..RouterFile::from(self) };
        let config = RouterConfig::try_from(file)?;
        config.validate()?;
        Ok(config)
    }

    /// Whether the k gates are divided by their sum (see [`RouterConfig::normalize`]).
    pub fn normalizes(&self) -> bool {
        match self.score {
            ScoreFn::SoftmaxPost => true,
            ScoreFn::SoftmaxPre => self.normalize.unwrap_or(false),
            ScoreFn::Sigmoid => self.normalize.unwrap_or(true) && self.k() > 1,
        }
    }
}

/// Deserialises a TOML document; errors name the source, the dotted field path, the value and
/// the line and column (one line each). Shared by every TOML input (routers, sweep grids).
pub fn parse_toml<T: serde::de::DeserializeOwned>(text: &str, source_name: &str) -> Result<T> {
    let de = toml::Deserializer::new(text);
    serde_path_to_error::deserialize(de).map_err(|e| {
        // The field path is made of the document's keys, and toml's message may quote a value.
        let path = crate::error::excerpt(&e.path().to_string());
        let inner = e.into_inner();
        // toml messages may span lines; a report line must not.
        let message = crate::error::excerpt_long(inner.message().split_whitespace().collect::<Vec<_>>().join(" "));
        let location = inner.span().map(|span| {
            let (line, col) = line_col(text, span.start);
            format!("line {line}, column {col}")
        });
        match (path.as_str(), location) {
            ("." | "", Some(at)) => Error::config(source_name, &at, message),
            ("." | "", None) => Error::config(source_name, "-", message),
            (field, Some(at)) => Error::config(source_name, field, format!("{message} ({at})")),
            (field, None) => Error::config(source_name, field, message),
        }
    })
}

fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
    (line, col)
}
