//! A probe case: two calls whose aligned tokens must route alike, and the machinery to run
//! and compare them.

use crate::hints::HintsOf;
use moe_audit_core::error::Result;
use moe_audit_core::router::Router;
use moe_audit_core::routing::{diff_token, TokenDiff};
use moe_audit_core::routing::{Logits, Routing};
use ndarray::{s, Array2, Axis};
use std::sync::Arc;

/// One call to a router: logits and, for routers that take one, a padding mask and a
/// placement of its sequences over ranks.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    /// `[batch, seq_len, experts]`.
    pub logits: Logits,
    /// `[batch, seq_len]`, `true` = padding.
    pub padding: Option<Array2<bool>>,
    /// `[batch]`: the rank of each sequence, for a layer that places them (L's cases);
    /// `None`: the layer's default placement.
    pub placement: Option<Vec<usize>>,
}

impl Call {
    /// A call without padding.
    pub fn new(logits: Logits) -> Self {
        Call { logits, padding: None, placement: None }
    }

    /// `(batch, seq_len)`.
    pub fn dims(&self) -> (usize, usize) {
        let (b, s, _) = self.logits.dim();
        (b, s)
    }

    /// Routes the call.
    pub fn route(&self, router: &dyn Router) -> Result<Routing> {
        match &self.padding {
            Some(mask) => router.assign_masked(self.logits.view(), mask.view()),
            None => router.assign(self.logits.view()),
        }
    }

    /// Routes the call for a comparison of routes ([`Router::assign_routes`]: load statistics
    /// may be left out), under its placement when it has one.
    pub fn routes(&self, router: &dyn Router) -> Result<Routing> {
        let padding = self.padding.as_ref().map(|m| m.view());
        match &self.placement {
            Some(p) => router.assign_placed(self.logits.view(), padding, p),
            None => router.assign_routes(self.logits.view(), padding),
        }
    }

    /// Keeps positions `< len` of every sequence (on the same ranks).
    pub fn truncate(&self, len: usize) -> Call {
        Call {
            logits: self.logits.slice(s![.., ..len, ..]).to_owned(),
            padding: self.padding.as_ref().map(|m| m.slice(s![.., ..len]).to_owned()),
            placement: self.placement.clone(),
        }
    }

    /// The sequences at `order` (indices into this call), in that order, in the default
    /// placement.
    pub fn select(&self, order: &[usize]) -> Call {
        Call {
            logits: self.logits.select(Axis(0), order),
            padding: self.padding.as_ref().map(|m| m.select(Axis(0), order)),
            placement: None,
        }
    }
}

/// Two calls and how their tokens align: sequence `i` of `a` is sequence `seq_map[i]` of `b`,
/// and position `p` of `a` is position `p + offset` of `b`.
#[derive(Debug, Clone)]
pub struct Case {
    /// The reference call (shared: most cases of a probe compare against the same base call).
    pub a: Arc<Call>,
    /// The changed call.
    pub b: Call,
    /// For each sequence of `a`, its index in `b`, if present.
    pub seq_map: Vec<Option<usize>>,
    /// Position shift from `a` to `b` (left padding).
    pub offset: usize,
    /// For each sequence of `a`: compare its positions `< compare[i]` (0: not compared).
    pub compare: Vec<usize>,
    /// For influence: the first position (in `a`) of the sequence's own change, if the change is
    /// in the same sequence.
    pub change_from: Vec<Option<usize>>,
}

/// An affected token of a case.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Affected {
    /// Sequence in `a`.
    pub batch: usize,
    /// Position in `a`.
    pub pos: usize,
    /// What changed.
    pub diff: TokenDiff,
    /// How far after the token the nearest same-sequence change was.
    pub distance: Option<usize>,
}

/// The outcome of one case.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// Tokens compared.
    pub compared: usize,
    /// Tokens whose routing changed in any way (capacity included).
    pub affected: Vec<Affected>,
}

impl Case {
    /// `b` against the reference `a`, sequence `i` of `a` being `seq_map[i]` of `b`: every
    /// position of every mapped sequence compared, no change to measure influence from.
    pub fn whole(a: &Arc<Call>, b: Call, seq_map: Vec<Option<usize>>) -> Case {
        let (n, s) = a.dims();
        Case { a: Arc::clone(a), b, seq_map, offset: 0, compare: vec![s; n], change_from: vec![None; n] }
    }

    /// [`Case::whole`] with every sequence at its own index in `b`.
    pub fn aligned(a: &Arc<Call>, b: Call) -> Case {
        let n = a.dims().0;
        Case::whole(a, b, (0..n).map(Some).collect())
    }

    /// [`Case::outcome`] under its name before 0.3.0.
    #[deprecated(since = "0.3.0", note = "renamed `outcome` (`compare` is `routes compare`'s)")]
    pub fn compare(&self, ra: &Routing, rb: &Routing) -> Outcome {
        self.outcome(ra, rb)
    }

    /// The outcome of this case: aligned tokens of two routings compared.
    pub fn outcome(&self, ra: &Routing, rb: &Routing) -> Outcome {
        let mut out = Outcome::default();
        for (i, (&n, map)) in self.compare.iter().zip(&self.seq_map).enumerate() {
            let Some(j) = *map else { continue };
            for p in 0..n {
                out.compared += 1;
                let diff = diff_token(ra, (i, p), rb, (j, p + self.offset));
                if diff.any() {
                    let distance = self.change_from[i].filter(|&c| c > p).map(|c| c - p);
                    out.affected.push(Affected { batch: i, pos: p, diff, distance });
                }
            }
        }
        out
    }
}
