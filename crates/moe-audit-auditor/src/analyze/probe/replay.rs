//! S, replay (statelessness): the same call must route alike on the first call ever and after
//! it, before and after another call, around a call of the other mode (train → inference →
//! train; inference → train → inference). The calls are the audit's first
//! (`analyze/repeats.rs`), so a router that mutates itself in an inference call (HF's NLLB-MoE
//! overwrites its capacity) leaks here, whichever probes run.

use super::Modes;
use super::{Ctx, Rule, Sample};
use crate::analyze::case::Call;
use crate::analyze::layer_check::{SampleCase, SampleInput};
use crate::analyze::noise::Noise;
use crate::analyze::tally::{pick_witness_token, witness_hit, Tally};
use crate::analyze::witness::{self, Replayer, Witness};
use crate::analyze::{AuditOptions, Finding, Probe, Verdict};
use crate::mode::Mode;
use candle_core::Tensor;
use moe_audit_core::error::Result;
use moe_audit_core::routing::Routing;

/// Probe S.
pub(crate) struct Replay;

impl Rule for Replay {
    fn calls(&self, _: Option<&Witness>, _: &AuditOptions, _: Modes) -> [String; 2] {
        ["the call alone".into(), "the same call after another call".into()]
    }

    fn cause(&self, _: &Finding) -> String {
        "an earlier call (state kept between calls)".into()
    }

    fn fix(&self) -> Option<String> {
        Some(
            "keep forward stateless: update capacity or expert bias in an explicit training step, not in forward"
                .into(),
        )
    }

    /// Each comparison is judged against the randomness of the mode its two routings were made
    /// in (D in that mode): audited in inference mode, a router random only in training routes
    /// the training calls around an inference call differently, and that is noise, not state.
    fn run(&self, ctx: &Ctx, _sample: Option<&Sample>) -> Result<Finding> {
        let mut finding = Finding::empty(Probe::S);
        let noise = Noise::of(ctx.repeats(), Mode::audited(ctx.router));
        let (mut all, mut standing) = (Tally::default(), Tally::default());
        let (mut differs, mut explained) = (Vec::new(), Vec::new());
        let mut hit = None;
        for o in &ctx.repeats().state {
            let outcome = o.case.outcome(&o.first, &o.second);
            let t = Tally::of(&outcome);
            all.merge(&t);
            // Randomness explains changed decisions, never a capacity in force alone (latent).
            if let Some(why) = noise.explains(&[o.modes.0], t.affected, t.compared()).filter(|_| t.affected > 0) {
                explained.push((o.label, why));
                continue;
            }
            // The routing record includes the capacity in force: a capacity alone routes differently.
            if t.differs() {
                differs.push(o.label);
            }
            hit = witness_hit(hit, pick_witness_token(&outcome).map(|h| (o, h)), |(_, h)| h);
            standing.merge(&t);
        }
        if let Some((o, h)) = hit {
            let routed = Some((&o.first, &o.second));
            finding.witness = witness::build_routed(ctx.router, Probe::S, &o.case, (h.batch, h.pos), routed, o.modes)?;
        }
        all.finish(&mut finding);
        finding.verdict = match standing.verdict() {
            Verdict::Pass if !explained.is_empty() => Verdict::Inconclusive,
            v => v,
        };
        let modes = if ctx.repeats().state.len() > 2 { ", and around a call of the other mode" } else { "" };
        let random = explained.iter().map(|(label, _)| *label).collect::<Vec<_>>().join(", ");
        finding.note = match (differs.is_empty(), explained.first()) {
            (true, None) => format!("the same call first and again, before and after another call{modes}"),
            (true, Some((_, why))) => format!("{why}: the same call routes differently {random}"),
            (false, None) => format!("the same call routes differently {}", differs.join(", ")),
            (false, Some(_)) => format!(
                "the same call routes differently {} (and {random}, within that mode's randomness)",
                differs.join(", ")
            ),
        };
        Ok(finding)
    }

    /// The sample again after the layer ran on other input: outputs must be equal bit for bit.
    fn sample(&self, input: &SampleInput) -> Result<Option<SampleCase>> {
        let (b, s, h) = input.x.dims3()?;
        let other: Tensor = input.fresh(s, crate::seeds::REPLAY_OTHER_CALL)?.broadcast_as((b, s, h))?.contiguous()?;
        input.layer.forward(&other)?;
        Ok(Some(input.again()?))
    }

    fn changes_input(&self) -> bool {
        false
    }

    /// `a` in its mode, `b` in its own, then `a` again.
    fn replay(&self, with: &dyn Replayer, a: &Call, b: &Call, modes: (Mode, Mode)) -> Result<(Routing, Routing)> {
        let first = with.route(a, modes.0)?;
        with.route(b, modes.1)?;
        Ok((first, with.route(a, modes.0)?))
    }
}
