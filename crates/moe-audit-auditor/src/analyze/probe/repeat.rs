//! D, repeat (determinism): the same call twice must route alike, bit for bit. The two calls
//! are the audit's repeat (`analyze/repeats.rs`), made before any probe; when they differ, the
//! router is random, and the noise test (`analyze/noise.rs`) weighs every other probe's leak
//! against D's rate.

use super::Modes;
use super::{run_repeat, Ctx, Rule, Sample};
use crate::analyze::case::Call;
use crate::analyze::layer_check::{SampleCase, SampleInput};
use crate::analyze::witness::{Replayer, Witness};
use crate::analyze::{AuditOptions, Finding, Probe};
use crate::mode::Mode;
use moe_audit_core::error::Result;
use moe_audit_core::routing::Routing;

/// Probe D.
pub(crate) struct Repeat;

impl Rule for Repeat {
    fn calls(&self, _: Option<&Witness>, _: &AuditOptions, _: Modes) -> [String; 2] {
        ["the call".into(), "the same call again".into()]
    }

    fn cause(&self, _: &Finding) -> String {
        "nothing: the same call routes differently".into()
    }

    fn fix(&self) -> Option<String> {
        // D runs in the audited mode: a router may be random in training only (jitter, sampling).
        // A report's words, the same for every front end: the mode in words, not a flag.
        Some("random only in training (jitter, sampling): seed every training call or audit in inference mode; random when serving: make it deterministic, no random selection or sampling at inference".into())
    }

    fn run(&self, ctx: &Ctx, _sample: Option<&Sample>) -> Result<Finding> {
        let o = &ctx.repeats().repeat;
        run_repeat(ctx, Probe::D, &o.case, (&o.first, &o.second), o.modes, "the same call twice")
    }

    /// The sample itself, run again: outputs must be equal bit for bit.
    fn sample(&self, input: &SampleInput) -> Result<Option<SampleCase>> {
        Ok(Some(input.again()?))
    }

    fn changes_input(&self) -> bool {
        false
    }

    fn replay(&self, with: &dyn Replayer, a: &Call, _: &Call, modes: (Mode, Mode)) -> Result<(Routing, Routing)> {
        Ok((with.route(a, modes.0)?, with.route(a, modes.0)?))
    }
}
