//! Comparing two routing records token by token: the full record (ids, choice order, weights,
//! kept and padded flags, capacity in force, and the layer's output row when the router sends
//! one), never ids alone.
//!
//! A pure function of two records, with no knowledge of probes: the analyzer judges leaks by it
//! ([`TokenDiff::decision`]), and the sweep, the whole-model comparison and prefix stability's
//! tests compare routings with it too, so it sits with the record.

use crate::routing::{Routing, TokenRouting};
use serde::{Deserialize, Serialize};

/// Absolute tolerance on combine weights: weights of an unchanged token are computed from the
/// same logits by the same formula, so anything above float noise is a real change.
pub const WEIGHT_TOLERANCE: f32 = 1e-6;

/// The dtype a layer computes its output in (protocol field `output`); it sets how far two
/// outputs of one token may differ by float reduction order alone ([`OutputDtype::rtol`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OutputDtype {
    /// IEEE single precision.
    Float32,
    /// bfloat16 (8 significand bits).
    Bfloat16,
    /// IEEE half precision (11 significand bits).
    Float16,
}

impl OutputDtype {
    /// Relative tolerance on a token's output row (docs/PROTOCOL.md, "Output comparison"): the
    /// same token computed with other batch-mates differs only by the order of float reductions
    /// (measured <= 4e-8 on |y| ~ 1 in f32), while a route dropped or re-weighted moves the output
    /// by its gate times the expert's output (>= 1e-2 relative for a gate >= 0.01). Between the
    /// two, a few units in the last place of the dtype: f32 2^-13, f16 2^-8, bf16 2^-5.
    pub fn rtol(self) -> f32 {
        match self {
            OutputDtype::Float32 => 2f32.powi(-13),
            OutputDtype::Float16 => 2f32.powi(-8),
            OutputDtype::Bfloat16 => 2f32.powi(-5),
        }
    }

    /// Whether two output rows of one token differ: `max |a_i - b_i| > rtol * max(max |a_i|,
    /// max |b_i|, 1e-3)` (the floor keeps rows near zero from judging by noise alone).
    pub fn rows_differ(self, a: &[f32], b: &[f32]) -> bool {
        let largest = |r: &[f32]| r.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scale = largest(a).max(largest(b)).max(1e-3);
        let gap = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        a.len() != b.len() || gap > self.rtol() * scale
    }
}

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
    /// The layer's output row differs beyond its dtype's tolerance ([`OutputDtype::rtol`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub output: bool,
}

impl TokenDiff {
    /// The token's routing decision changed (experts, order, kept, padding, weights, or the
    /// layer's output): what a probe's rate counts. The capacity in force alone does not count
    /// here, though it is a leak ([`TokenDiff::any`]).
    pub fn decision(&self) -> bool {
        self.experts || self.kept || self.padded || self.weight || self.output
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
            (self.output, "output"),
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
        output: match (&a.output, &b.output) {
            (Some(oa), Some(ob)) => oa.dtype.rows_differ(oa.row(ba * a.seq_len + pa), ob.row(bb * b.seq_len + pb)),
            _ => false,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_tolerance_is_relative_to_the_larger_row_with_a_floor() {
        let f32_ = OutputDtype::Float32;
        // Reduction-order noise on |y| ~ 1 passes; a 1% move (a gate of 0.01) does not.
        assert!(!f32_.rows_differ(&[1.0, -0.5], &[1.0 + 4e-8, -0.5]));
        assert!(f32_.rows_differ(&[1.0, -0.5], &[1.01, -0.5]));
        // Near zero the floor 1e-3 sets the scale: 1e-8 apart is noise.
        assert!(!f32_.rows_differ(&[0.0], &[1e-8]));
        // bf16 tolerates what f32 does not.
        assert!(f32_.rows_differ(&[1.0], &[1.01]) && !OutputDtype::Bfloat16.rows_differ(&[1.0], &[1.01]));
        assert!(OutputDtype::Float16.rows_differ(&[1.0], &[1.01]));
    }
}
