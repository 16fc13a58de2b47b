//! M, mode (T/I): the training configuration against the `[inference]` one on the same input.

use super::Modes;
use super::{run_repeat, Ctx, Rule, Sample};
use crate::analyze::case::{Call, Case};
use crate::analyze::witness::{Replayer, Witness};
use crate::analyze::{AuditOptions, Finding, Probe, Verdict};
use moe_audit_core::error::Result;
use moe_audit_core::routing::Routing;

/// Probe M.
pub(crate) struct Mode;

impl Rule for Mode {
    fn calls(&self, _: Option<&Witness>, _: &AuditOptions, modes: Modes) -> [String; 2] {
        match modes {
            Modes::Config => ["the training configuration".into(), "the [inference] configuration".into()],
            // An external router has modes, not an `[inference]` table; the mode audited comes
            // first (the witness's `before` is its routing).
            Modes::External(crate::mode::Mode::Inference) => ["inference mode".into(), "training mode".into()],
            Modes::External(crate::mode::Mode::Train) => ["training mode".into(), "inference mode".into()],
        }
    }

    fn cause(&self, _: &Finding) -> String {
        "the configuration: training and inference route differently".into()
    }

    fn fix(&self) -> Option<String> {
        Some("train and serve with one routing rule, or audit the serving rule as a router of its own".into())
    }

    fn run(&self, ctx: &Ctx, _sample: Option<&Sample>) -> Result<Finding> {
        let Some(inference) = ctx.router.inference()? else {
            let mut finding = Finding::empty(Probe::M);
            finding.verdict = Verdict::NotApplicable;
            finding.note = "no [inference] table: training and serving use one rule".into();
            return Ok(finding);
        };
        let case = Case::aligned(&ctx.base, Call::clone(&ctx.base));
        let served = ctx.base.routes(inference.as_ref())?;
        // An external router has no `[inference]` table: it is asked in its other mode.
        let note = match ctx.router.config() {
            Some(_) => "training versus [inference] configuration on the same input",
            None => "the router's two modes (`mode: train` and `mode: inference` requests) on the same input",
        };
        let modes = (crate::mode::Mode::Train, crate::mode::Mode::Inference);
        run_repeat(ctx, Probe::M, &case, (&ctx.base_routing, &served), modes, note)
    }

    fn changes_input(&self) -> bool {
        false
    }

    fn replay(
        &self,
        with: &dyn Replayer,
        a: &Call,
        _: &Call,
        _: (crate::mode::Mode, crate::mode::Mode),
    ) -> Result<(Routing, Routing)> {
        Ok((with.route(a, crate::mode::Mode::Train)?, with.route(a, crate::mode::Mode::Inference)?))
    }
}
