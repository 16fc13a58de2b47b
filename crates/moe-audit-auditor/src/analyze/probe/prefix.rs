//! P, prefix (C-length): every sequence truncated after t, positions ≤ t compared. One case per
//! position, made on demand so memory stays O(T·E).
//!
//! Searched instead of exhausted by default: routing all S - 1 prefixes of up to S
//! tokens is quadratic in the sequence length, minutes at production shapes.
//!
//! What is routed: every prefix of the first [`DENSE`] lengths, then [`PER_OCTAVE`] lengths per
//! doubling, and the longest. Then, by what they showed:
//! - no leak, and the router declares itself prefix-stable ([`Router::prefix_stable`]): the
//!   other prefixes route alike by construction; they are counted as compared and unaffected,
//!   which is exactly what routing them gives (the routed ones check the claim);
//! - a leak, and the router is not prefix-stable: every prefix shorter than the first leak is
//!   routed too, so the first leaking prefix (whose token becomes the witness) is the one the
//!   exhaustive probe finds; the counts cover the routed prefixes;
//! - otherwise (no leak in a router not known stable, or a stable router that leaked anyway)
//!   every prefix is routed, as `--exhaustive` does.
//!
//! So the verdict and witness are always those of the exhaustive probe: a leak at any prefix
//! length is found. A router whose calls must stay in order (`Ctx::pure` false) is always routed
//! exhaustively: which prefixes the search routes depends on what it sees.
//!
//! [`Router::prefix_stable`]: moe_audit_core::router::Router::prefix_stable

use super::Modes;
use super::{run_cases, Cases, Ctx, Rule, Sample};
use crate::analyze::case::{Affected, Call, Case};
use crate::analyze::explain::{plural, positions_later};
use crate::analyze::layer_check::{SampleCase, SampleInput};
use crate::analyze::tally::{pick_witness_token, witness_hit, Tally};
use crate::analyze::witness;
use crate::analyze::witness::Witness;
use crate::analyze::{AuditOptions, Finding, Probe};
use moe_audit_core::error::Result;
use rayon::prelude::*;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Probe P.
pub(crate) struct Prefix;

impl Rule for Prefix {
    fn calls(&self, w: Option<&Witness>, _: &AuditOptions, _: Modes) -> [String; 2] {
        [
            w.map_or("the full sequence".into(), |w| format!("the sequence of {}", plural(w.a.seq_len, "token"))),
            w.map_or("a prefix of it".into(), |w| format!("its prefix of {}", plural(w.b.seq_len, "token"))),
        ]
    }

    fn cause(&self, f: &Finding) -> String {
        positions_later(f).map_or("later tokens removed".into(), |d| format!("the nearest removed token, {d}"))
    }

    fn run(&self, ctx: &Ctx, _sample: Option<&Sample>) -> Result<Finding> {
        let (base, count) = (&ctx.base, ctx.base.dims().1.saturating_sub(1));
        let cases = Cases::OnDemand(count, &|t| Ok(case(base, t)));
        if count > 0 && ctx.pure && !ctx.exhaustive {
            return search(ctx, &cases);
        }
        run_cases(ctx, Probe::P, cases, "needs a sequence of 2 or more tokens")
    }

    /// The sample's first half.
    fn sample(&self, input: &SampleInput) -> Result<Option<SampleCase>> {
        let (b, s, _) = input.x.dims3()?;
        Ok(Some(SampleCase {
            x: input.x.narrow(1, 0, s.div_ceil(2))?,
            seq_map: input.all(),
            compare: vec![s.div_ceil(2); b],
            exact: false,
        }))
    }
}

/// Every prefix of up to this many tokens is routed.
const DENSE: usize = 32;
/// Beyond [`DENSE`], routed prefix lengths per doubling.
const PER_OCTAVE: i32 = 4;
/// Prefixes routed per step while looking for the first leak below one already found.
const SCAN_CHUNK: usize = 64;

/// What routing one prefix case showed.
type Seen = (Tally, Option<Affected>);

/// The prefix cases (t = prefix length - 1) routed first, ascending: all t < [`DENSE`], then
/// lengths `DENSE * 2^(j / PER_OCTAVE)`, then the longest.
fn planned(count: usize) -> Vec<usize> {
    let mut t: Vec<usize> = (0..count.min(DENSE)).collect();
    for j in 1.. {
        let len = (DENSE as f64 * 2f64.powi(j).powf(1.0 / PER_OCTAVE as f64)).round() as usize;
        if len > count {
            break;
        }
        t.push(len - 1);
    }
    t.push(count.saturating_sub(1));
    t.dedup();
    t
}

/// P on `ctx` (with at least one case) searched as the module says: its tallied finding, with
/// its note and witness.
fn search(ctx: &Ctx, cases: &Cases) -> Result<Finding> {
    let mut finding = Finding::empty(Probe::P);
    let count = cases.len();
    let mut seen = route(ctx, cases, &planned(count))?;
    // A leak is a changed routing record (the capacity in force included): the scan looks for
    // the first.
    let leaks = |hit: &Option<Affected>| hit.is_some_and(|h| h.diff.any());
    let first_leak = |seen: &BTreeMap<usize, Seen>| seen.iter().find(|(_, (_, hit))| leaks(hit)).map(|(&t, _)| t);
    let unrouted = |seen: &BTreeMap<usize, Seen>, below: usize| -> Vec<usize> {
        (0..below).filter(|t| !seen.contains_key(t)).collect()
    };
    let stable = ctx.router.prefix_stable(ctx.base.dims().0);
    let derived = match (first_leak(&seen), stable) {
        (None, true) => unrouted(&seen, count),
        (Some(first), false) => {
            // The exhaustive probe's first leak is at or below `first`: route upward until found.
            for chunk in unrouted(&seen, first).chunks(SCAN_CHUNK) {
                seen.extend(route(ctx, cases, chunk)?);
                if chunk.iter().any(|t| leaks(&seen[t].1)) {
                    break;
                }
            }
            Vec::new()
        }
        _ => {
            let rest = unrouted(&seen, count);
            seen.extend(route(ctx, cases, &rest)?);
            Vec::new()
        }
    };

    let mut tally = Tally::default();
    seen.values().for_each(|(t, _)| tally.merge(t));
    // A derived prefix compares its b sequences' first t + 1 tokens and finds them alike.
    let b = ctx.base.dims().0;
    tally.merge(&Tally::unaffected(derived.iter().map(|t| b * (t + 1)).sum()));
    tally.finish(&mut finding);
    let routed = seen.len();
    finding.searched = routed < count;
    finding.note = if routed == count {
        crate::analyze::explain::plural(count, "case")
    } else if !derived.is_empty() {
        format!("{count} cases, {routed} routed: the router is prefix-stable, the others route alike")
    } else {
        format!("{count} cases, {routed} routed: up to the first leak and at log-spaced lengths")
    };
    let hits = seen.iter().filter_map(|(&t, (_, hit))| hit.map(|hit| (t, hit)));
    if let Some((t, hit)) = hits.fold(None, |kept, next| witness_hit(kept, Some(next), |(_, hit)| hit)) {
        finding.witness = witness::build(ctx.router, Probe::P, &*cases.get(t)?, (hit.batch, hit.pos))?;
    }
    Ok(finding)
}

/// Routes the prefix cases `ts` in parallel (the caller has checked the router is pure).
fn route(ctx: &Ctx, cases: &Cases, ts: &[usize]) -> Result<BTreeMap<usize, Seen>> {
    ctx.progress.plan(ts.len());
    ts.par_iter()
        .map(|&t| {
            let case = cases.get(t)?;
            let outcome = case.outcome(&ctx.base_routing, &case.b.routes(ctx.router)?);
            ctx.progress.done(1);
            Ok((t, (Tally::of(&outcome), pick_witness_token(&outcome))))
        })
        .collect()
}

/// P at position t: every sequence truncated after t; positions ≤ t compared.
fn case(base: &Arc<Call>, t: usize) -> Case {
    let b = base.dims().0;
    Case { compare: vec![t + 1; b], change_from: vec![Some(t + 1); b], ..Case::aligned(base, base.truncate(t + 1)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_are_dense_then_log_spaced_and_end_at_the_longest() {
        assert_eq!(planned(1), vec![0]);
        assert_eq!(planned(7), (0..7).collect::<Vec<_>>());
        assert_eq!(planned(33), (0..33).collect::<Vec<_>>());
        let long = planned(8191);
        assert_eq!(&long[..32], &(0..32).collect::<Vec<_>>()[..]);
        assert_eq!(&long[32..36], &[37, 44, 53, 63]);
        assert_eq!(long.last(), Some(&8190));
        assert!(long.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(long.len(), 32 + 31 + 1);
    }
}
