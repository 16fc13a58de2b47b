//! What a probe saw, summed over its cases, and the token its witness is built for.

use super::case::{Affected, Outcome};
use super::{Finding, InfluenceBucket, Verdict};

/// Prefers a token whose decision changed over one whose capacity alone changed.
pub(crate) fn pick_witness_token(outcome: &Outcome) -> Option<Affected> {
    outcome.affected.iter().find(|a| a.diff.decision()).or(outcome.affected.first()).copied()
}

/// The hit a probe builds its witness for, of those its cases found in order: the first, unless
/// it shows only a capacity change and a later one a changed decision (the witness must replay
/// with the probe's verdict, a leak when some decision changed). `hit` reads a hit's token.
pub(crate) fn witness_hit<T>(kept: Option<T>, next: Option<T>, hit: fn(&T) -> &Affected) -> Option<T> {
    let decides = |t: &Option<T>| t.as_ref().is_some_and(|t| hit(t).diff.decision());
    match kept {
        Some(_) if decides(&kept) || !decides(&next) => kept,
        _ => next.or(kept),
    }
}

/// What a probe saw, summed over its cases: O(1) per case whatever the number of affected tokens.
#[derive(Default)]
pub(crate) struct Tally {
    compared: usize,
    pub(crate) affected: usize,
    capacity_changed: bool,
    first_position: Option<usize>,
    /// Affected tokens by distance to the change, bucket i holding [2^i, 2^(i+1)) (the last
    /// bucket everything beyond).
    influence: [usize; 32],
}

impl Tally {
    /// `compared` tokens that all routed alike.
    pub(crate) fn unaffected(compared: usize) -> Tally {
        Tally { compared, ..Tally::default() }
    }

    pub(crate) fn of(outcome: &Outcome) -> Tally {
        let mut t = Tally { compared: outcome.compared, ..Tally::default() };
        for a in &outcome.affected {
            t.capacity_changed |= a.diff.capacity;
            if a.diff.decision() {
                t.affected += 1;
                if let Some(d) = a.distance {
                    t.influence[(d.max(1).ilog2() as usize).min(31)] += 1;
                }
            }
            t.first_position = Some(t.first_position.map_or(a.pos, |p| p.min(a.pos)));
        }
        t
    }

    /// Whether some token's routing or capacity differed.
    pub(crate) fn differs(&self) -> bool {
        self.affected > 0 || self.capacity_changed
    }

    /// Tokens compared.
    pub(crate) fn compared(&self) -> usize {
        self.compared
    }

    pub(crate) fn merge(&mut self, other: &Tally) {
        self.compared += other.compared;
        self.affected += other.affected;
        self.capacity_changed |= other.capacity_changed;
        self.first_position = self.first_position.into_iter().chain(other.first_position).min();
        self.influence.iter_mut().zip(other.influence).for_each(|(a, b)| *a += b);
    }

    /// The verdict of what was seen: a changed decision is a leak; a changed capacity in force
    /// alone is latent (the record changed, [`TokenDiff::any`], no decision did).
    ///
    /// [`TokenDiff::any`]: moe_audit_core::routing::TokenDiff::any
    pub(crate) fn verdict(&self) -> Verdict {
        if self.affected > 0 {
            Verdict::Leak
        } else if self.capacity_changed {
            Verdict::Latent
        } else {
            Verdict::Pass
        }
    }

    pub(crate) fn finish(&self, finding: &mut Finding) {
        finding.compared = self.compared;
        finding.affected = self.affected;
        finding.capacity_changed = self.capacity_changed;
        finding.first_position = self.first_position;
        finding.rate = if self.compared > 0 { self.affected as f64 / self.compared as f64 } else { 0.0 };
        finding.verdict = self.verdict();
        finding.influence = (self.influence.iter().enumerate())
            .filter(|(_, &count)| count > 0)
            .map(|(i, &count)| InfluenceBucket { from: 1 << i, to: (2 << i) - 1, count })
            .collect();
    }
}
