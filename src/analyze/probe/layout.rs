//! The layout probe (L): the same batch under 1 versus R expert-parallel ranks (each rank routes
//! its own block of sequences, as Megatron-LM and DeepSpeed do), and under [S,B] versus [B,S]
//! flattening. Capacity computed per rank makes a token's routing depend on which tokens share
//! its rank (docs/SCENARIOS.md, scenario 10). With a layer, the layer sample (one or more
//! sequences per rank) runs expert-parallel on R ranks and its outputs are checked against the
//! single-device layer's.

use super::{Ctx, Rule, Sample};
use crate::analyze::case::{CallMode, Case};
use crate::analyze::layer_check::ranks_split;
use crate::analyze::tally::{pick_witness_token, Tally};
use crate::analyze::{witness, Finding, Probe, Property, Verdict};
use crate::config::{Flatten, RouterConfig, ScopeGroup};
use crate::error::Result;
use crate::parallel::RankTraffic;
use crate::routing::assign_routes;

/// Probe L.
pub(crate) struct Layout;

impl Rule for Layout {
    fn name(&self) -> &'static str {
        "layout"
    }

    fn property(&self) -> Property {
        Property::L
    }

    fn run(&self, ctx: &Ctx, sample: Option<&Sample>) -> Result<Finding> {
        probe(ctx, sample)
    }
}

/// Runs L: one case per rank (its sequences routed alone versus within the whole batch), one
/// case with the flattening order flipped, and the layer sample run expert-parallel.
fn probe(ctx: &Ctx, sample: Option<&Sample>) -> Result<Finding> {
    let mut finding = Finding::empty(Probe::L);
    let b = ctx.base.dims().0;
    let r = ctx.ranks;
    let split = ranks_split(b, r);
    let mut notes = Vec::new();
    let mut tally = Tally::default();
    let mut first_leak = None;
    if split {
        let per = b / r;
        for rank in 0..r {
            let seqs: Vec<usize> = (rank * per..(rank + 1) * per).collect();
            // Sequences on other ranks have no counterpart: not compared.
            let seq_map = (0..b).map(|i| seqs.contains(&i).then(|| i - rank * per)).collect();
            let case = Case::whole(&ctx.base, ctx.base.select(&seqs), seq_map);
            let routed = case.b.routes(ctx.router)?;
            let outcome = case.compare(&ctx.base_routing, &routed);
            tally.merge(&Tally::of(&outcome));
            if first_leak.is_none() {
                first_leak = pick_witness_token(&outcome).map(|hit| (case, hit, routed));
            }
        }
        notes.push(format!("{r} ranks of {per} {}", if per == 1 { "sequence" } else { "sequences" }));
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
    if notes.is_empty() {
        finding.verdict = Verdict::NotApplicable;
        finding.note = format!(
            "needs a batch divisible by {r} ranks (2 or more), or a router config whose scope is not per sequence"
        );
        return Ok(finding);
    }
    tally.finish(&mut finding);
    if let Some((case, hit, routed)) = first_leak {
        let (routed, modes) = (Some((&ctx.base_routing, &routed)), (CallMode::Train, CallMode::Train));
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
