//! The layout probe (L): the same batch under 1 versus R expert-parallel ranks (each rank routes
//! its own block of sequences, as Megatron-LM and DeepSpeed do), and under [S,B] versus [B,S]
//! flattening. Capacity computed per rank makes a token's routing depend on which tokens share
//! its rank (docs/SCENARIOS.md, scenario 10). With a layer, the layer sample (one or more
//! sequences per rank) runs expert-parallel on R ranks and its outputs are checked against the
//! single-device layer's.
//!
//! A layer that runs expert-parallel itself (a router behind the protocol with `ranks`) is
//! audited as its users run it instead: the base call in the layer's default placement against
//! the same call with its sequences placed otherwise over the same ranks (a data loader's
//! contiguous slices, a `DistributedSampler`'s strides, ...). Megatron-Core and DeepSpeed count
//! capacity per source rank over its local tokens, so who shares a rank decides who is dropped.
//!
//! The same layer launched at other expert-parallel sizes (`check --layout-cmd`: EP 1, 2 and 4
//! are separate launches) routes the base call too, in its own default placement, and every
//! token is compared with the audited router's answer: a per-rank capacity counts different
//! tokens at each size.

use super::Modes;
use super::{Ctx, Rule, Sample};
use crate::analyze::case::{Affected, Call, Case};
use crate::analyze::explain::plural;
use crate::analyze::layer_check::ranks_split;
use crate::analyze::tally::{pick_witness_token, witness_hit, Tally};
use crate::analyze::{
    witness::{self, Witness},
    AuditOptions, Finding, Launch, Probe, Verdict,
};
use crate::hints::HintsOf;
use crate::mode::Mode;
use moe_audit_core::config::{Flatten, RouterConfig, ScopeGroup};
use moe_audit_core::error::excerpt;
use moe_audit_core::error::Result;
use moe_audit_core::routing::{assign_routes, Routing};
use moe_audit_parallel::RankTraffic;
use std::sync::Arc;

/// Probe L.
pub(crate) struct Layout;

impl Rule for Layout {
    fn calls(&self, w: Option<&Witness>, options: &AuditOptions, _: Modes) -> [String; 2] {
        if let Some((w, launch)) = w.and_then(|w| w.layout.as_ref().map(|l| (w, l))) {
            let ep = |h: Option<&serde_json::Value>| h.and_then(|h| h.get("ranks")?.as_u64()).unwrap_or(1);
            return [
                format!("the batch at EP {} (the audited launch)", ep(w.handshake.as_ref())),
                format!("the batch at EP {} (`{}`)", ep(Some(&launch.handshake)), excerpt(&launch.command)),
            ];
        }
        if let Some((a, b)) = w.and_then(|w| w.a.placement.as_ref().zip(w.b.placement.as_ref())) {
            return [format!("the batch on ranks {a:?}"), format!("the batch on ranks {b:?}")];
        }
        ["1 rank".into(), format!("{} expert-parallel ranks (or the other flattening)", options.ranks)]
    }

    fn cause(&self, f: &Finding) -> String {
        match f.witness.as_ref() {
            Some(w) if w.layout.is_some() => "the expert-parallel size the layer was launched at".into(),
            Some(w) if w.b.placement.is_some() => "the placement of the sequences over the ranks".into(),
            _ => "the parallel layout (ranks or flattening order)".into(),
        }
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
    if let Some(n) = ctx.router.ranks() {
        return placed(ctx, n);
    }
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
            let outcome = case.outcome(&reference, &routed);
            tally.merge(&Tally::of(&outcome));
            let hit = pick_witness_token(&outcome).map(|hit| (case, hit, routed, None));
            first_leak = witness_hit(first_leak, hit, |(_, hit, _, _)| hit);
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
        let outcome = same.outcome(&ctx.base_routing, &routing);
        let affected = Tally::of(&outcome).affected;
        tally.merge(&Tally::of(&outcome));
        notes.push(format!("[S,B] vs [B,S] flattening: {affected} tokens differ"));
    }
    across_launches(ctx, &mut tally, &mut first_leak, &mut notes)?;
    if used == 0 && tally.affected == 0 && ctx.layouts.is_empty() {
        finding.verdict = Verdict::NotApplicable;
        finding.note = notes.join("; ");
        return Ok(finding);
    }
    tally.finish(&mut finding);
    if let Some(leak) = first_leak {
        let reference = if leak.3.is_some() { &ctx.base_routing } else { reference.as_ref() };
        finding.witness = leak_witness(ctx, reference, leak, &mut notes)?;
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

/// Balanced placements of `b` sequences over `n` ranks (`n` divides `b`), named, distinct, in
/// a fixed order: contiguous slices (sequence i on rank i / (b/n)), strides (i % n, as
/// torch's `DistributedSampler`), the slices in reverse rank order, and a seeded shuffle.
fn placements(b: usize, n: usize, rng: &mut impl rand::Rng) -> Vec<(&'static str, Vec<usize>)> {
    let per = b / n;
    let contiguous: Vec<usize> = (0..b).map(|i| i / per).collect();
    let mut shuffled = contiguous.clone();
    for i in (1..b).rev() {
        shuffled.swap(i, rng.random_range(0..=i));
    }
    let all = [
        ("contiguous", contiguous),
        ("strided", (0..b).map(|i| i % n).collect()),
        ("reversed", (0..b).map(|i| n - 1 - i / per).collect()),
        ("shuffled", shuffled),
    ];
    let mut out: Vec<(&'static str, Vec<usize>)> = Vec::new();
    for (name, p) in all {
        if !out.iter().any(|(_, q)| *q == p) {
            out.push((name, p));
        }
    }
    out
}

/// L for a layer over `n` ranks: the base call in the layer's default placement against the
/// same call in every other placement of [`placements`]; a differing token's note names its
/// rank and the sequences sharing it in both.
fn placed(ctx: &Ctx, n: usize) -> Result<Finding> {
    let mut finding = Finding::empty(Probe::L);
    let b = ctx.base.dims().0;
    let mut named = placements(b, n, &mut ctx.rng(Probe::L));
    let default = match &ctx.base_routing.placement {
        Some(p) => p.clone(),
        None => named[0].1.clone(),
    };
    let default_name = named.iter().find(|(_, p)| *p == default).map_or("default", |(name, _)| name);
    let reference = Arc::new(Call { placement: Some(default.clone()), ..Call::clone(&ctx.base) });
    let mut notes = vec![format!("{n} ranks of {}, default placement {default_name}", plural(b / n, "sequence"))];
    named.retain(|(_, p)| *p != default);
    if named.is_empty() {
        notes.push(format!("no other placement of {} over {n} ranks", plural(b, "sequence")));
    }
    let mut tally = Tally::default();
    let mut first_leak = None;
    for (name, p) in &named {
        let case = Case::aligned(&reference, Call { placement: Some(p.clone()), ..Call::clone(&ctx.base) });
        let routed = case.b.routes(ctx.router)?;
        let outcome = case.outcome(&ctx.base_routing, &routed);
        let affected = Tally::of(&outcome).affected;
        tally.merge(&Tally::of(&outcome));
        notes.push(format!("{name}: {affected} tokens differ"));
        let hit = pick_witness_token(&outcome).map(|hit| (case, hit, routed, None));
        first_leak = witness_hit(first_leak, hit, |(_, hit, _, _)| hit);
    }
    across_launches(ctx, &mut tally, &mut first_leak, &mut notes)?;
    if named.is_empty() && ctx.layouts.is_empty() {
        finding.verdict = Verdict::NotApplicable;
        finding.note = notes.join("; ");
        return Ok(finding);
    }
    tally.finish(&mut finding);
    if let Some(leak) = first_leak {
        if leak.3.is_none() {
            let (hit, placement) = (&leak.1, leak.0.b.placement.as_deref().unwrap_or_default());
            notes.push(format!(
                "sequence {} position {} ({}): {} vs {}",
                hit.batch,
                hit.pos,
                hit.diff.describe(),
                on_rank(&default, hit.batch),
                on_rank(placement, hit.batch)
            ));
        }
        finding.witness = leak_witness(ctx, &ctx.base_routing, leak, &mut notes)?;
    }
    finding.note = notes.join("; ");
    Ok(finding)
}

/// The first leaking token of L's cases: the case, the token, call `b`'s routing, and the
/// other launch that routed `b` (`None`: the audited router did).
type Leak<'a> = (Case, Affected, Routing, Option<&'a Launch<'a>>);

/// L across launches: the base call through every other launch of the layer (in that launch's
/// default placement) against the audited router's answer to it, token by token, each launch's
/// differing tokens counted with L's other cases.
fn across_launches<'a>(
    ctx: &Ctx<'a>,
    tally: &mut Tally,
    first_leak: &mut Option<Leak<'a>>,
    notes: &mut Vec<String>,
) -> Result<()> {
    let ep = ctx.router.ranks().unwrap_or(1);
    for launch in ctx.layouts {
        let case = Case::aligned(&ctx.base, Call::clone(&ctx.base));
        let routed = case.b.routes(launch.router)?;
        let outcome = case.outcome(&ctx.base_routing, &routed);
        let seen = Tally::of(&outcome);
        notes.push(format!(
            "EP {} (`{}`) vs EP {ep}: {} tokens differ",
            launch.ep(),
            excerpt(launch.command),
            seen.affected
        ));
        tally.merge(&seen);
        let hit = pick_witness_token(&outcome).map(|hit| (case, hit, routed, Some(launch)));
        *first_leak = witness_hit(first_leak.take(), hit, |(_, hit, _, _)| hit);
    }
    Ok(())
}

/// The witness of L's first leak, its call `a` routed as `reference`; a leak across launches
/// records the launch that routed call `b` (a replay spawns both: `replay W --router-cmd CMD
/// --layout-cmd CMD2`), and its token goes in the note.
fn leak_witness(
    ctx: &Ctx,
    reference: &Routing,
    (case, hit, routed, launch): Leak,
    notes: &mut Vec<String>,
) -> Result<Option<Witness>> {
    let (routed_pair, modes) = (Some((reference, &routed)), (Mode::Train, Mode::Train));
    let witness = witness::build_routed(ctx.router, Probe::L, &case, (hit.batch, hit.pos), routed_pair, modes)?;
    let Some(launch) = launch else { return Ok(witness) };
    let ep = ctx.router.ranks().unwrap_or(1);
    notes.push(format!(
        "sequence {} position {} ({}): EP {ep} vs EP {}",
        hit.batch,
        hit.pos,
        hit.diff.describe(),
        launch.ep()
    ));
    witness.map(|w| w.across(launch)).transpose()
}

/// Where `placement` puts sequence `seq`, in words: its rank and the sequences it shares it with.
fn on_rank(placement: &[usize], seq: usize) -> String {
    let r = placement[seq];
    let with: Vec<String> = (0..placement.len()).filter(|&i| placement[i] == r).map(|i| i.to_string()).collect();
    format!("rank {r} with sequences {}", with.join(","))
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
