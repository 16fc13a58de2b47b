//! The calls every audit makes first, whatever its probes: the base call repeated, and
//! interleaved with another call and with calls of the other mode. D and S read their findings
//! from them, and the noise test ([`super::noise`]) reads D's rate.
//!
//! Training-mode calls come first and calls of the other mode last (after M), always in the
//! same order, so a stateful router's report does not depend on `--probes`: every training-mode
//! probe finds the router as it is before any inference call (HF's NLLB-MoE overwrites its
//! capacity in one) and routes its own base call fresh (see `audit`).

use super::case::{Call, Case};
use super::tally::Tally;
use crate::hints::HintsOf;
use crate::mode::Mode;
use moe_audit_core::error::Result;
use moe_audit_core::router::Router;
use moe_audit_core::routing::Routing;
use std::sync::Arc;

/// One comparison: the same call routed twice, with something (or nothing) in between.
pub(crate) struct Observed {
    /// What happened between the two routings, for the note (`after an inference call`).
    pub label: &'static str,
    /// `a`: the base call; `b`: the call made in between (a witness stores it), or the base.
    pub case: Case,
    /// The first routing.
    pub first: Routing,
    /// The second routing, which must equal the first.
    pub second: Routing,
    /// The modes of `case.a` (both routings) and `case.b` (the call in between).
    pub modes: (Mode, Mode),
}

impl Observed {
    /// The comparison's tally.
    pub(crate) fn tally(&self) -> Tally {
        Tally::of(&self.case.outcome(&self.first, &self.second))
    }
}

/// The repeats of an audit, in the order they were made.
pub(crate) struct Repeats {
    /// D: the base call twice in a row, after the state comparisons (a router that changes
    /// once, on its first call or its first inference call, is stateful, not random).
    pub repeat: Observed,
    /// S: the first call against its repeat, and the base call around another training call,
    /// around an inference call (train → inference → train) and, in inference mode, around a
    /// training call (inference → train → inference).
    pub state: Vec<Observed>,
    /// D in the other mode: the base call twice in a row there, the last calls of the audit
    /// (`None`: the router has one mode). A probe comparing calls of that mode (S's inference →
    /// train → inference, M) weighs its changes against it: a router random only in training
    /// (jitter, sampling) audited in inference mode is random in the calls S makes in training.
    pub other_repeat: Option<Observed>,
}

impl Repeats {
    /// The training-mode calls, first in every audit. `first` is the routing of the audit's
    /// first call of `base` (already made); `other` is a different call of the same sizes.
    pub(crate) fn train(router: &dyn Router, base: &Arc<Call>, first: &Routing, other: &Call) -> Result<Repeats> {
        let same = || Case::aligned(base, Call::clone(base));
        let again = base.routes(router)?;
        let twice = base.routes(router)?;
        other.routes(router)?;
        let after_other = base.routes(router)?;
        let train = (Mode::Train, Mode::Train);
        let around = Case { b: other.clone(), ..same() };
        let state = vec![
            observed("on the first call", same(), first.clone(), again.clone(), train),
            observed("after another call", around, twice.clone(), after_other, train),
        ];
        Ok(Repeats { repeat: observed("twice in a row", same(), again, twice, train), state, other_repeat: None })
    }

    /// The calls around the other mode, made after every training-mode probe and M (so that
    /// they run in the router's state before any inference call, whichever probes run):
    /// the base call in training mode against its routing before any inference call (S's
    /// `after another call`), around an inference call; then in inference mode around a
    /// training call.
    pub(crate) fn modes(&mut self, router: &dyn Router, base: &Arc<Call>, other: &Call) -> Result<()> {
        let Some(inference) = router.inference()? else { return Ok(()) };
        let same = || Case::aligned(base, Call::clone(base));
        let before = self.state.last().expect("made by train").second.clone();
        let served = base.routes(inference.as_ref())?;
        let after = base.routes(router)?;
        // The router audited in its serving mode (`check --mode inference`) has training as its
        // other mode: the labels name the modes the calls were really made in.
        let serving = router.serving();
        let label = if serving { "after a training call" } else { "after an inference call" };
        self.state.push(observed(label, same(), before, after, (Mode::Train, Mode::Inference)));
        other.routes(router)?;
        let served_again = base.routes(inference.as_ref())?;
        let label = if serving {
            "in training mode, after an inference call"
        } else {
            "in inference mode, after a training call"
        };
        let around = Case { b: other.clone(), ..same() };
        self.state.push(observed(label, around, served, served_again.clone(), (Mode::Inference, Mode::Train)));
        let twice = base.routes(inference.as_ref())?;
        let modes = (Mode::Inference, Mode::Inference);
        self.other_repeat = Some(observed("twice in a row in the other mode", same(), served_again, twice, modes));
        Ok(())
    }

    /// D's comparison in `mode` (`Train`: the audited mode), when the audit made it.
    pub(crate) fn repeat_in(&self, mode: Mode) -> Option<&Observed> {
        match mode {
            Mode::Train => Some(&self.repeat),
            Mode::Inference => self.other_repeat.as_ref(),
        }
    }
}

fn observed(label: &'static str, case: Case, first: Routing, second: Routing, modes: (Mode, Mode)) -> Observed {
    Observed { label, case, first, second, modes }
}
