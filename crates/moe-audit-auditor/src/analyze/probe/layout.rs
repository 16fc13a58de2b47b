//! The layout probe (L): the same batch under 1 versus R expert-parallel ranks (each rank routes
//! its own block of sequences, as Megatron-LM and DeepSpeed do), and under [S,B] versus [B,S]
//! flattening. Capacity computed per rank makes a token's routing depend on which tokens share
//! its rank (docs/SCENARIOS.md, scenario 10). With a layer, the layer sample (one or more
//! sequences per rank) runs expert-parallel on R ranks and its outputs are checked against the
//! single-device layer's.

use super::Modes;
use super::{Ctx, Rule, Sample};
use crate::analyze::case::{CallMode, Case};
use crate::analyze::layer_check::ranks_split;
use crate::analyze::tally::{pick_witness_token, witness_hit, Tally};
use crate::analyze::{
    witness::{self, Witness},
    AuditOptions, Finding, Probe, Verdict,
};
use moe_audit_core::config::{Flatten, RouterConfig, ScopeGroup};
use moe_audit_core::error::Result;
use moe_audit_core::routing::assign_routes;
use moe_audit_parallel::RankTraffic;
use std::sync::Arc;

/// Probe L.
pub(crate) struct Layout;

impl Rule for Layout {
    fn calls(&self, _: Option<&Witness>, options: &AuditOptions, _: Modes) -> [String; 2] {
        ["1 rank".into(), format!("{} expert-parallel ranks (or the other flattening)", options.ranks)]
    }

    fn cause(&self, _: &Finding) -> String {
        "the parallel layout (ranks or flattening order)".into()
    }

    fn run(&self, ctx: &Ctx, sample: Option<&Sample>) -> Result<Finding> {
        probe(ctx, sample)
    }
}

/// Runs L: one case per rank (its sequences routed alone versus within the whole batch), one
/// case with the flattening order flipped, and the layer sample run expert-parallel. A batch
/// that does not split over the ranks is compared on its largest prefix of sequences that
/// does; one smaller than the ranks leaves the rank layouts uncompared, and the probe `n/a`
/// unless the flattening leaks (it never passes on a comparison it did not make).
fn probe(ctx: &Ctx, sample: Option<&Sample>) -> Result<Finding> {
    let mut finding = Finding::empty(Probe::L);
    let b = ctx.base.dims().0;
    let r = ctx.ranks;
    let split = ranks_split(b, r);
    // The sequences laid out over the ranks: the batch, or its largest prefix that splits.
    let used = if r >= 2 { b - b % r } else { 0 };
    let mut notes = Vec::new();
    let mut tally = Tally::default();
    let mut first_leak = None;
    let prefix;
    let (whole, reference) = if split {
        (&ctx.base, std::borrow::Cow::Borrowed(&ctx.base_routing))
    } else {
        prefix = Arc::new(ctx.base.select(&(0..used).collect::<Vec<_>>()));
        let routed = if used > 0 { Some(prefix.routes(ctx.router)?) } else { None };
        (&prefix, routed.map_or(std::borrow::Cow::Borrowed(&ctx.base_routing), std::borrow::Cow::Owned))
    };
    if used > 0 {
        let per = used / r;
        for rank in 0..r {
            let seqs: Vec<usize> = (rank * per..(rank + 1) * per).collect();
            // Sequences on other ranks have no counterpart: not compared.
            let seq_map = (0..used).map(|i| seqs.contains(&i).then(|| i - rank * per)).collect();
            let case = Case::whole(whole, whole.select(&seqs), seq_map);
            let routed = case.b.routes(ctx.router)?;
            let outcome = case.compare(&reference, &routed);
            tally.merge(&Tally::of(&outcome));
            let hit = pick_witness_token(&outcome).map(|hit| (case, hit, routed));
            first_leak = witness_hit(first_leak, hit, |(_, hit, _)| hit);
        }
        notes.push(format!("{r} ranks of {per} {}", if per == 1 { "sequence" } else { "sequences" }));
        if !split {
            notes.push(format!("on the first {used} of {b} sequences (a batch of {b} does not split over {r} ranks)"));
        }
    } else {
        notes.push(format!(
            "rank layouts not compared: needs a batch of at least {} sequences to split over {r} ranks, has {b}",
            r.max(2)
        ));
    }
    if let Some(flipped) = ctx.router.config().and_then(flipped_flatten) {
        let base = &ctx.base;
        let routing = assign_routes(&flipped, base.logits.view(), base.padding.as_ref().map(|m| m.view()))?;
        let same = Case::aligned(base, base.as_ref().clone());
        let outcome = same.compare(&ctx.base_routing, &routing);
        let affected = Tally::of(&outcome).affected;
        tally.merge(&Tally::of(&outcome));
        notes.push(format!("[S,B] vs [B,S] flattening: {affected} tokens differ"));
    }
    if used == 0 && tally.affected == 0 {
        finding.verdict = Verdict::NotApplicable;
        finding.note = notes.join("; ");
        return Ok(finding);
    }
    tally.finish(&mut finding);
    if let Some((case, hit, routed)) = first_leak {
        let (routed, modes) = (Some((reference.as_ref(), &routed)), (CallMode::Train, CallMode::Train));
        finding.witness = witness::build_routed(ctx.router, Probe::L, &case, (hit.batch, hit.pos), routed, modes)?;
    }
    if split && !ctx.router.experts().is_multiple_of(r) {
        notes.push(format!(
            "layer not run expert-parallel: {} experts do not split over {r} ranks",
            ctx.router.experts()
        ));
    } else if let (true, Some(sample)) = (split, sample) {
        if let Some(traffic) = sample.expert_parallel(r, &mut finding)? {
            notes.push(traffic_note(&traffic));
        }
    }
    finding.note = notes.join("; ");
    Ok(finding)
}

/// The router's config with the other flattening order, when the order can matter (a scope
/// per sequence flattens each sequence alike either way).
fn flipped_flatten(config: &RouterConfig) -> Option<RouterConfig> {
    if config.scope.group == ScopeGroup::Sequence {
        return None;
    }
    let mut flipped = config.clone();
    flipped.scope.flatten = match config.scope.flatten {
        Flatten::PositionMajor => Flatten::SequenceMajor,
        Flatten::SequenceMajor => Flatten::PositionMajor,
    };
    Some(flipped)
}

/// The dispatch traffic of the expert-parallel run against the uniform all-to-all formula of docs/ROUTING.md.
fn traffic_note(traffic: &[RankTraffic]) -> String {
    let sent: usize = traffic.iter().map(|t| t.dispatch.bytes_sent).sum();
    let payload: usize = traffic.iter().map(|t| t.payload_bytes).sum();
    let uniform: f64 = traffic.iter().map(|t| t.uniform_bytes_sent).sum();
    let n = traffic.len();
    format!(
        "expert-parallel layer on {n} ranks: dispatch sent {sent} of {payload} bytes off-rank ({:.1}%; uniform routing (N-1)/N = {:.1}%)",
        100.0 * sent as f64 / payload.max(1) as f64,
        100.0 * uniform / payload.max(1) as f64
    )
}
