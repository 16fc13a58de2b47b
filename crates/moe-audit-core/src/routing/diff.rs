//! Comparing two routing records token by token: the full record (ids, choice order, weights,
//! kept and padded flags, capacity in force), never ids alone.
//!
//! A pure function of two records, with no knowledge of probes: the analyzer judges leaks by it
//! ([`TokenDiff::decision`]), and the sweep, the whole-model comparison and prefix stability's
//! tests compare routings with it too, so it sits with the record.

use crate::routing::{Routing, TokenRouting};
use serde::{Deserialize, Serialize};

/// Absolute tolerance on combine weights: weights of an unchanged token are computed from the
/// same logits by the same formula, so anything above float noise is a real change.
pub const WEIGHT_TOLERANCE: f32 = 1e-6;

/// What differs between two routings of one token.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenDiff {
    /// Expert ids or their choice order differ.
    pub experts: bool,
    /// A route was kept in one and dropped in the other.
    pub kept: bool,
    /// Padding slots differ.
    pub padded: bool,
    /// A combine weight differs beyond [`WEIGHT_TOLERANCE`].
    pub weight: bool,
    /// The capacity in force for the token's group differs.
    pub capacity: bool,
}

impl TokenDiff {
    /// The token's routing decision changed (experts, order, kept, padding, weights): what a
    /// probe's rate counts. The capacity in force alone does not count here, though it is a
    /// leak ([`TokenDiff::any`]).
    pub fn decision(&self) -> bool {
        self.experts || self.kept || self.padded || self.weight
    }

    /// The token's routing record changed, the capacity in force included: the one rule that
    /// judges a leak, for the audit, witness shrinking and witness replay alike. Routing is the
    /// full record (docs/PROPERTIES.md): a capacity that depends on what the token must not see
    /// is a leak before it changes a decision (a prefix's smaller capacity, scenario 2).
    pub fn any(&self) -> bool {
        self.decision() || self.capacity
    }

    /// Short words for reports, e.g. `kept, weight`.
    pub fn describe(&self) -> String {
        let parts: Vec<&str> = [
            (self.experts, "experts"),
            (self.kept, "kept"),
            (self.padded, "padding"),
            (self.weight, "weight"),
            (self.capacity, "capacity"),
        ]
        .iter()
        .filter(|(on, _)| *on)
        .map(|(_, name)| *name)
        .collect();
        parts.join(", ")
    }
}

/// The capacity in force for a token: its own (causal capacity), else its group's.
pub fn capacity_of(r: &Routing, t: &TokenRouting) -> Option<usize> {
    t.capacity.or_else(|| r.scope.groups.get(t.group).and_then(|g| g.capacity))
}

/// Compares token `(ba, pa)` of `a` with token `(bb, pb)` of `b`.
pub fn diff_token(a: &Routing, (ba, pa): (usize, usize), b: &Routing, (bb, pb): (usize, usize)) -> TokenDiff {
    let (ta, tb) = (a.token(ba, pa), b.token(bb, pb));
    fn experts_of(t: &TokenRouting, padded: bool) -> impl Iterator<Item = usize> + '_ {
        t.routes.iter().filter(move |r| r.padded == padded).map(|r| r.expert)
    }
    let experts = !experts_of(ta, false).eq(experts_of(tb, false));
    let (kept, weight) = if experts {
        (false, false)
    } else {
        let pairs = || ta.routes.iter().filter(|r| !r.padded).zip(tb.routes.iter().filter(|r| !r.padded));
        (pairs().any(|(x, y)| x.kept != y.kept), pairs().any(|(x, y)| (x.weight - y.weight).abs() > WEIGHT_TOLERANCE))
    };
    TokenDiff {
        experts,
        kept,
        padded: !experts_of(ta, true).eq(experts_of(tb, true)),
        weight,
        capacity: capacity_of(a, ta) != capacity_of(b, tb),
    }
}
