//! Which family of router design a configuration belongs to (the sweep's chart markers, the
//! report's advice on how to fix a leak).

use super::{DropPolicy, RouterConfig, ScopeGroup, Selection, TokenChoice};

/// A router's design family (the sweep chart gives each its own marker shape).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub enum Family {
    /// Token choice, nothing dropped.
    #[default]
    Dropless,
    /// Capacity per sequence, kept by position (Switch, causal capacity).
    SequenceCapacity,
    /// Capacity over the batch or a rank (Megatron, DeepSpeed, BPR).
    BatchCapacity,
    /// Balanced assignment over the batch (Sinkhorn).
    Balanced,
    /// Experts choose their tokens.
    ExpertChoice,
    /// Experts take every token above a threshold learned from past batches (causal).
    ExpertThreshold,
}

impl Family {
    /// The family of a router configuration.
    pub fn of(config: &RouterConfig) -> Family {
        config.kind.family(config)
    }

    /// A token-choice router's family: how it balances or drops.
    pub(super) fn of_token_choice(config: &RouterConfig, tc: &TokenChoice) -> Family {
        match &config.capacity {
            _ if tc.selection == Selection::Sinkhorn => Family::Balanced,
            None => Family::Dropless,
            Some(c) if c.policy == DropPolicy::Causal || config.scope.group == ScopeGroup::Sequence => {
                Family::SequenceCapacity
            }
            Some(_) => Family::BatchCapacity,
        }
    }

    /// How the chart's legend names it.
    pub fn label(self) -> &'static str {
        match self {
            Family::Dropless => "dropless token choice",
            Family::SequenceCapacity => "capacity per sequence",
            Family::BatchCapacity => "capacity over the batch",
            Family::Balanced => "balanced assignment",
            Family::ExpertChoice => "expert choice",
            Family::ExpertThreshold => "expert threshold",
        }
    }
}
