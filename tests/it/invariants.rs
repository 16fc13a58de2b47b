//! Property tests: the invariants docs/ROUTING.md states for every router, checked on arbitrary
//! finite logits (with many exact ties) for every preset and for scaled-down variants in which
//! capacity actually binds.
//!
//! The checks re-derive each decision from the rules, not from the library's code paths: the
//! selection (top-k with ties to the lowest expert id, selection-only bias, group-limited top-k),
//! the group's priority order (flattening and scope), the capacity (`capacity()` per group) and
//! the set each expert keeps (a prefix of the policy's order). Selection scores are recomputed in
//! `f32` the way docs/ROUTING.md describes them (max-shifted softmax, `1 / (1 + exp(-x))`), so exact
//! ties in the logits are exact ties here too.
//!
//! Runs are reproducible: a fixed proptest seed unless `PROPTEST_RNG_SEED` is set, case counts
//! overridable with `PROPTEST_CASES`, and no regression files are written.

use moe_audit::config::{
    preset, presets, Arithmetic, CapacityConfig, DropPolicy, ExpertChoice, Flatten, GroupLimit, RouterConfig,
    RouterKind, ScopeConfig, ScopeGroup, ScoreFn, Selection, TokenChoice,
};
use moe_audit::routing::capacity::capacity;
use moe_audit::routing::LoadStats;
use moe_audit::{assign, Routing};
use ndarray::Array3;
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, RngSeed, TestCaseError, TestRunner};
use std::cmp::Ordering;

type Check = Result<(), TestCaseError>;

// ---------------------------------------------------------------------------------------------
// Inputs

/// One logit: mostly from a small set (exact ties, both zeros), otherwise a general float.
fn value(mode: u8) -> BoxedStrategy<f32> {
    let ties = prop_oneof![(-3i8..=3).prop_map(|i| f32::from(i) * 0.5), Just(-0.0f32)];
    match mode {
        // Heavy ties: whole rows often coincide.
        0 => prop_oneof![Just(-1.0f32), Just(0.0), Just(-0.0), Just(1.0)].boxed(),
        1 => prop_oneof![ties, -10.0f32..10.0].boxed(),
        _ => (-10.0f32..10.0).boxed(),
    }
}

/// `[batch 1..4, seq_len 1..12, experts]` finite logits.
fn logits(experts: usize) -> impl Strategy<Value = Array3<f32>> {
    (1usize..4, 1usize..12, 0u8..3).prop_flat_map(move |(b, s, mode)| {
        prop::collection::vec(value(mode), b * s * experts)
            .prop_map(move |v| Array3::from_shape_vec((b, s, experts), v).expect("length matches"))
    })
}

/// Finite logits that stress the arithmetic: ±f32::MAX, huge and tiny magnitudes.
fn extreme_logits(experts: usize) -> impl Strategy<Value = Array3<f32>> {
    let v = prop_oneof![
        Just(f32::MAX),
        Just(-f32::MAX),
        Just(1e30f32),
        Just(-1e30f32),
        Just(88.0f32),
        Just(-104.0f32),
        Just(f32::MIN_POSITIVE),
        Just(0.0f32),
        -200.0f32..200.0,
    ];
    (1usize..3, 1usize..8).prop_flat_map(move |(b, s)| {
        prop::collection::vec(v.clone(), b * s * experts)
            .prop_map(move |v| Array3::from_shape_vec((b, s, experts), v).expect("length matches"))
    })
}

fn runner(cases: u32) -> TestRunner {
    let defaults = Config::default();
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(cases);
    let rng_seed = match defaults.rng_seed {
        RngSeed::Random => RngSeed::Fixed(0x6d6f_655f_6175_6474),
        seed => seed,
    };
    TestRunner::new(Config { cases, rng_seed, failure_persistence: None, max_shrink_iters: 2_000, ..defaults })
}

fn run(config: &RouterConfig, cases: u32, strategy: impl Strategy<Value = Array3<f32>>, extreme: bool) {
    let result = runner(cases).run(&strategy, |x| check_all(config, &x, extreme));
    if let Err(e) = result {
        panic!("router `{}`: {e}", config.name);
    }
}

fn cfg(name: &str) -> RouterConfig {
    preset(name).unwrap_or_else(|| panic!("no preset {name}")).config().expect("presets validate")
}

// ---------------------------------------------------------------------------------------------
// The rules, re-derived (docs/ROUTING.md)

fn desc(a: f32, b: f32) -> Ordering {
    b.partial_cmp(&a).unwrap_or(Ordering::Equal)
}

fn softmax(x: &[f32]) -> Vec<f32> {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = x.iter().map(|&l| (l - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    exps.iter().map(|e| e / sum).collect()
}

fn affinity(score: ScoreFn, row: &[f32]) -> Vec<f32> {
    match score {
        ScoreFn::SoftmaxPre => softmax(row),
        ScoreFn::SoftmaxPost => row.to_vec(),
        ScoreFn::Sigmoid => row.iter().map(|&x| 1.0 / (1.0 + (-x).exp())).collect(),
    }
}

/// Largest first, ties to the lowest index.
fn top_k(v: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| desc(v[a], v[b]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// A token's experts in choice order and their gates before capacity and scaling.
struct Choice {
    experts: Vec<usize>,
    gates: Vec<f32>,
}

/// Sinkhorn balancing of one group (Megatron-LM `sinkhorn`, written out from its definition):
/// alternately scale rows and columns of `exp(logits - max)` to mass 1/T and 1/E, in f64.
fn reference_sinkhorn(rows: &[Vec<f32>]) -> Vec<Vec<f32>> {
    let (t, e) = (rows.len(), rows[0].len());
    let max = rows.iter().flatten().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let cost: Vec<Vec<f64>> =
        rows.iter().map(|r| r.iter().map(|&v| (f64::from(v) - f64::from(max)).exp()).collect()).collect();
    let (mut rs, mut cs) = (vec![1.0f64; t], vec![1.0f64; e]);
    for _ in 0..200 {
        rs = cost
            .iter()
            .map(|r| 1.0 / (t as f64 * (r.iter().zip(&cs).map(|(c, b)| c * b).sum::<f64>() + 1e-8)))
            .collect();
        let next: Vec<f64> =
            (0..e).map(|j| 1.0 / (e as f64 * ((0..t).map(|i| cost[i][j] * rs[i]).sum::<f64>() + 1e-8))).collect();
        let change: f64 = next.iter().zip(&cs).map(|(n, o)| (n - o).abs() / n.abs().max(1e-8)).sum::<f64>() / e as f64;
        cs = next;
        if change < 1e-4 {
            break;
        }
    }
    (0..t).map(|i| (0..e).map(|j| (cost[i][j] * rs[i] * cs[j]) as f32).collect()).collect()
}

/// Each token's choice; Sinkhorn selection balances over the token's routing group.
fn reference_choices(c: &RouterConfig, x: &Array3<f32>) -> Vec<Choice> {
    let (b, s, _) = x.dim();
    if c.token_choice().is_none_or(|tc| tc.selection == Selection::TopK) {
        return (0..b * s).map(|i| reference_choice(c, &row(x, i), None)).collect();
    }
    let mut out: Vec<Option<Choice>> = (0..b * s).map(|_| None).collect();
    for members in reference_groups(&c.scope, b, s) {
        let rows: Vec<Vec<f32>> = members.iter().map(|&i| row(x, i)).collect();
        for ((&i, r), balanced) in members.iter().zip(&rows).zip(reference_sinkhorn(&rows)) {
            out[i] = Some(reference_choice(c, r, Some(balanced)));
        }
    }
    out.into_iter().map(|c| c.expect("every token is in a group")).collect()
}

fn reference_choice(c: &RouterConfig, row: &[f32], select_on: Option<Vec<f32>>) -> Choice {
    let aff = affinity(c.score, row);
    let mut select = select_on.unwrap_or_else(|| aff.clone());
    let tc = c.token_choice().expect("a token-choice router");
    if let Some(bias) = &tc.expert_bias {
        select.iter_mut().zip(bias).for_each(|(s, b)| *s += b);
    }
    if let Some(GroupLimit { groups, top_groups, score_top }) = tc.group_limit.clone() {
        let per = c.experts / groups;
        let group_score: Vec<f32> =
            select.chunks(per).map(|chunk| top_k(chunk, score_top).iter().map(|&i| chunk[i]).sum()).collect();
        let chosen = top_k(&group_score, top_groups);
        for (e, s) in select.iter_mut().enumerate() {
            if !chosen.contains(&(e / per)) {
                *s = f32::NEG_INFINITY;
            }
        }
    }
    let experts = top_k(&select, c.k());
    let mut gates: Vec<f32> = match c.score {
        ScoreFn::SoftmaxPost => softmax(&experts.iter().map(|&e| row[e]).collect::<Vec<_>>()),
        _ => experts.iter().map(|&e| aff[e]).collect(),
    };
    if c.normalizes() && c.score != ScoreFn::SoftmaxPost {
        let sum: f32 = gates.iter().sum();
        let denom = if c.score == ScoreFn::Sigmoid { sum + 1e-20 } else { sum };
        gates.iter_mut().for_each(|g| *g /= denom);
    }
    Choice { experts, gates }
}

/// Flat token indices of each routing group, in priority order.
fn reference_groups(scope: &ScopeConfig, b: usize, s: usize) -> Vec<Vec<usize>> {
    let flat: Vec<usize> = match scope.flatten {
        Flatten::SequenceMajor => (0..b * s).collect(),
        Flatten::PositionMajor => (0..s).flat_map(|p| (0..b).map(move |q| q * s + p)).collect(),
    };
    match scope.group {
        ScopeGroup::Batch => vec![flat],
        ScopeGroup::Sequence => (0..b).map(|q| (q * s..(q + 1) * s).collect()).collect(),
        ScopeGroup::Tokens(n) => flat.chunks(n).map(<[usize]>::to_vec).collect(),
    }
}

fn close(got: f32, want: f32) -> bool {
    (got - want).abs() <= 1e-5 * want.abs().max(1.0)
}

// ---------------------------------------------------------------------------------------------
// The checks

fn check_all(c: &RouterConfig, x: &Array3<f32>, extreme: bool) -> Check {
    let r = assign(c, x.view()).map_err(|e| TestCaseError::fail(format!("assign failed on finite logits: {e}")))?;
    check_record(c, x, &r)?;
    match c.kind {
        RouterKind::TokenChoice(_) => check_token_choice(c, x, &r, extreme)?,
        RouterKind::ExpertChoice(_) => check_expert_choice(c, x, &r)?,
        RouterKind::ExpertThreshold(_) => check_expert_threshold(c, x, &r)?,
    }
    check_loads(&r)?;
    // D: the same call twice gives the same record, and the same JSON bytes.
    let again = assign(c, x.view()).expect("routed once already");
    prop_assert_eq!(&again, &r, "assign is not deterministic");
    let json = serde_json::to_string(&r).expect("a record serialises");
    prop_assert_eq!(serde_json::to_string(&again).unwrap(), json.clone());
    // The JSON record is a faithful copy: every decision exactly, the f64 summary figures to
    // within an ulp (exact equality is `json_round_trip_is_exact`, a known bug).
    let back: Routing = serde_json::from_str(&json).expect("the record parses back");
    let near = |a: f64, b: f64| (a - b).abs() <= 4.0 * f64::EPSILON * a.abs().max(b.abs());
    let (s, t) = (&back.stats, &r.stats);
    prop_assert!(
        near(s.max_over_mean_load, t.max_over_mean_load)
            && near(s.load_cv, t.load_cv)
            && near(s.drop_rate, t.drop_rate)
            && near(s.aux_loss, t.aux_loss),
        "JSON round trip changed the stats: {:?} -> {:?}",
        t,
        s
    );
    prop_assert_eq!(Routing { stats: r.stats, ..back }, r.clone(), "JSON round trip changed the record");
    Ok(())
}

/// `Routing` → JSON → `Routing` must give back the very same record (probes compare records
/// that may have travelled through trace files).
fn check_round_trip(c: &RouterConfig, x: &Array3<f32>) -> Check {
    let r = assign(c, x.view()).expect("finite logits route");
    let back: Routing = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
    prop_assert_eq!(back, r);
    Ok(())
}

/// `assign_routes` (what the analyzer compares) is `assign` with the load statistics left out.
fn check_routes_only(c: &RouterConfig, x: &Array3<f32>) -> Check {
    let full = assign(c, x.view()).expect("finite logits route");
    let routes = moe_audit::routing::assign_routes(c, x.view(), None).expect("finite logits route");
    prop_assert_eq!(routes.stats, LoadStats::default());
    prop_assert_eq!(Routing { stats: full.stats, ..routes }, full);
    Ok(())
}

/// `check` on arbitrary logits for every preset (fewer cases for the wide ones).
fn every_preset(check: fn(&RouterConfig, &Array3<f32>) -> Check) {
    for p in presets() {
        let c = p.config().unwrap();
        let cases = if c.experts > 16 { 8 } else { 32 };
        if let Err(e) = runner(cases).run(&logits(c.experts), |x| check(&c, &x)) {
            panic!("router `{}`: {e}", c.name);
        }
    }
}

#[test]
fn routes_only_assignment_equals_the_full_one_but_for_stats() {
    every_preset(check_routes_only);
}

#[test]
fn json_round_trip_is_exact() {
    every_preset(check_round_trip);
}

fn row(x: &Array3<f32>, flat: usize) -> Vec<f32> {
    let (_, s, _) = x.dim();
    x.slice(ndarray::s![flat / s, flat % s, ..]).to_vec()
}

/// Shape, tokens, groups and capacity fields.
fn check_record(c: &RouterConfig, x: &Array3<f32>, r: &Routing) -> Check {
    let (b, s, e) = x.dim();
    let e = e - c.null_experts();
    prop_assert_eq!((r.batch, r.seq_len, r.experts), (b, s, e));
    prop_assert_eq!(&r.router, &c.name);
    prop_assert_eq!(r.top_k, c.token_choice().map(|tc| tc.top_k));
    prop_assert_eq!(r.tokens.len(), b * s);
    for (i, t) in r.tokens.iter().enumerate() {
        prop_assert_eq!((t.batch, t.pos), (i / s, i % s), "tokens are not sequence-major");
    }
    prop_assert_eq!(r.scope.group, c.scope.group.into());
    prop_assert_eq!(r.scope.flatten, c.scope.flatten);
    let groups = reference_groups(&c.scope, b, s);
    prop_assert_eq!(r.scope.groups.len(), groups.len(), "number of routing groups");
    let k = c.k();
    for (g, members) in groups.iter().enumerate() {
        let rec = &r.scope.groups[g];
        prop_assert_eq!(rec.tokens, members.len(), "tokens of group {}", g);
        for &i in members {
            prop_assert_eq!(r.tokens[i].group, g, "group of token {}", i);
        }
        let want = c.capacity.as_ref().map(|cap| capacity(cap, members.len(), k, e));
        prop_assert_eq!(rec.capacity, want, "capacity of group {} ({} tokens)", g, members.len());
    }
    let total: usize = r.scope.groups.iter().filter_map(|g| g.capacity).sum();
    prop_assert_eq!(
        &r.capacity,
        &c.capacity.as_ref().map(|_| vec![total; e]),
        "record capacity is the sum over groups"
    );
    for t in &r.tokens {
        for route in &t.routes {
            prop_assert!(route.expert < e);
            prop_assert!(
                route.weight.is_finite() && route.weight >= 0.0 && route.weight <= c.routed_scaling * (1.0 + 1e-6),
                "token ({}, {}): weight {} outside [0, {}]",
                t.batch,
                t.pos,
                route.weight,
                c.routed_scaling
            );
            if route.padded {
                prop_assert!(route.kept && route.weight == 0.0, "padding slot must be kept at weight 0: {:?}", route);
            }
        }
        let mut ids: Vec<usize> = t.routes.iter().map(|r| r.expert).collect();
        ids.sort_unstable();
        ids.dedup();
        prop_assert_eq!(
            ids.len(),
            t.routes.len(),
            "token ({}, {}) has an expert twice: {:?}",
            t.batch,
            t.pos,
            t.routes
        );
    }
    Ok(())
}

fn check_loads(r: &Routing) -> Check {
    prop_assert_eq!(r.experts_load.len(), r.experts);
    let (mut routed, mut kept) = (0usize, 0usize);
    for (e, l) in r.experts_load.iter().enumerate() {
        let routes = r.tokens.iter().flat_map(|t| &t.routes).filter(|x| x.expert == e);
        let (mut lr, mut lk, mut lp) = (0, 0, 0);
        for x in routes {
            if x.padded {
                lp += 1;
            } else {
                lr += 1;
                lk += usize::from(x.kept);
            }
        }
        prop_assert_eq!((l.expert, l.routed, l.kept, l.padded), (e, lr, lk, lp), "experts_load[{}]", e);
        routed += lr;
        kept += lk;
    }
    let drop_rate = if routed == 0 { 0.0 } else { (routed - kept) as f64 / routed as f64 };
    prop_assert!((r.stats.drop_rate - drop_rate).abs() < 1e-12, "drop_rate {} != {}", r.stats.drop_rate, drop_rate);
    let s = &r.stats;
    prop_assert!(s.max_over_mean_load.is_finite() && s.load_cv.is_finite() && s.aux_loss.is_finite());
    Ok(())
}

fn check_token_choice(c: &RouterConfig, x: &Array3<f32>, r: &Routing, extreme: bool) -> Check {
    let (b, s, e) = x.dim();
    let k = c.k();
    let scale = c.routed_scaling;
    let choices = reference_choices(c, x);
    let renorm = c.capacity.as_ref().is_some_and(|cap| cap.renormalize_after_drop);

    for (i, t) in r.tokens.iter().enumerate() {
        let real: Vec<_> = t.routes.iter().filter(|r| !r.padded).collect();
        let pads: Vec<_> = t.routes.iter().filter(|r| r.padded).collect();
        // Null experts' choices are not in the record: the others keep their order and gates.
        let ch = &choices[i];
        let (kept_ids, kept_gates): (Vec<usize>, Vec<f32>) =
            ch.experts.iter().zip(&ch.gates).filter(|(&x, _)| x < c.real_experts()).map(|(&x, &g)| (x, g)).unzip();
        let ch = &Choice { experts: kept_ids, gates: kept_gates };
        let k = if c.null_experts() > 0 { ch.experts.len() } else { k };
        // Exactly k real routes, in choice order, then the padding slots by expert id.
        prop_assert_eq!(real.len(), k, "token ({}, {}) has {} routes, want k = {}", t.batch, t.pos, real.len(), k);
        prop_assert!(t.routes.iter().take(k).all(|r| !r.padded), "padding slot before a real route: {:?}", t.routes);
        prop_assert!(pads.windows(2).all(|w| w[0].expert < w[1].expert), "padding slots not by expert id");
        let ids: Vec<usize> = real.iter().map(|r| r.expert).collect();
        prop_assert_eq!(
            &ids,
            &ch.experts,
            "token ({}, {}) logits {:?}: experts / choice order",
            t.batch,
            t.pos,
            row(x, i)
        );
        if c.capacity.is_none() {
            prop_assert!(
                t.routes.iter().all(|r| r.kept && !r.padded),
                "dropless router dropped or padded: {:?}",
                t.routes
            );
        }
        // Gates: before dropping fixed by the score function; after dropping only DeepSpeed-style
        // routers renormalise the survivors (with the denominator clamped at f32 eps).
        let survivors: f32 = real.iter().zip(&ch.gates).filter(|(r, _)| r.kept).map(|(_, g)| g).sum();
        for (route, &g) in real.iter().zip(&ch.gates) {
            let want = if renorm && route.kept { g / survivors.max(f32::EPSILON) * scale } else { g * scale };
            prop_assert!(
                close(route.weight, want),
                "token ({}, {}) expert {}: weight {} want {}",
                t.batch,
                t.pos,
                route.expert,
                route.weight,
                want
            );
        }
        let kept_sum: f32 = real.iter().filter(|r| r.kept).map(|r| r.weight).sum();
        let all_sum: f32 = real.iter().map(|r| r.weight).sum();
        let gate_sum: f32 = ch.gates.iter().sum();
        if renorm {
            if survivors >= 2.0 * f32::EPSILON {
                prop_assert!(
                    close(kept_sum, scale),
                    "token ({}, {}): kept weights sum to {}, want {}",
                    t.batch,
                    t.pos,
                    kept_sum,
                    scale
                );
            }
        } else if c.normalizes() && c.null_experts() == 0 && (!extreme || gate_sum > 0.5) {
            // Normalised gates sum to 1 before dropping; dropped routes keep their gate.
            prop_assert!(
                close(all_sum, scale),
                "token ({}, {}): gates sum to {}, want {}",
                t.batch,
                t.pos,
                all_sum,
                scale
            );
        }
    }

    if let Some(cap) = &c.capacity {
        for (g, members) in reference_groups(&c.scope, b, s).iter().enumerate() {
            let cap_g = capacity(cap, members.len(), k, e);
            check_dropping(c, cap, cap_g, g, members, &choices, r)?;
        }
    }
    Ok(())
}

/// One group: each expert keeps exactly the first min(C, n) of its routes in the policy's order;
/// padding fills the lowest-index non-routed tokens.
fn check_dropping(
    c: &RouterConfig,
    cap: &CapacityConfig,
    cap_g: usize,
    g: usize,
    members: &[usize],
    choices: &[Choice],
    r: &Routing,
) -> Check {
    let renorm = cap.renormalize_after_drop;
    if cap.policy == DropPolicy::Causal {
        return check_causal(c, cap, members, r);
    }
    for e in 0..c.experts {
        // (priority index in group, choice rank, pre-drop gate, kept, the token's top gate)
        let mut routes: Vec<(usize, usize, f32, bool, f32)> = Vec::new();
        let mut padded: Vec<usize> = Vec::new();
        let mut rows = 0;
        for (p, &i) in members.iter().enumerate() {
            let t = &r.tokens[i];
            for (rank, route) in t.routes.iter().enumerate().filter(|(_, x)| x.expert == e) {
                if route.padded {
                    padded.push(p);
                    rows += 1;
                    continue;
                }
                // Compare like with like: renormalised weights are no longer the gates.
                let gate = if renorm { choices[i].gates[rank] } else { route.weight };
                routes.push((p, rank, gate, route.kept, choices[i].gates[0]));
                rows += usize::from(route.kept);
            }
        }
        prop_assert!(rows <= cap_g, "group {} expert {}: {} rows kept over capacity {}", g, e, rows, cap_g);

        let mut order = routes.clone();
        order.sort_by(|a, b| match cap.policy {
            DropPolicy::Probs => desc(a.2, b.2).then(a.0.cmp(&b.0)),
            DropPolicy::Position => a.0.cmp(&b.0),
            DropPolicy::ChoiceRank => a.1.cmp(&b.1).then(a.0.cmp(&b.0)),
            DropPolicy::BatchPriority => a.1.cmp(&b.1).then(desc(a.4, b.4)).then(a.0.cmp(&b.0)),
            DropPolicy::Causal => unreachable!("checked by check_causal"),
        });
        let keep = cap_g.min(order.len());
        for (n, route) in order.iter().enumerate() {
            prop_assert_eq!(
                route.3,
                n < keep,
                "group {} expert {} ({:?}, capacity {}): route (priority {}, choice {}, gate {}) kept = {}; routes in policy order {:?}",
                g,
                e,
                cap.policy,
                cap_g,
                route.0,
                route.1,
                route.2,
                route.3,
                order
            );
        }
        // The two monotonicity rules, stated directly.
        match cap.policy {
            DropPolicy::Position => {
                let first_dropped = routes.iter().filter(|r| !r.3).map(|r| r.0).min();
                if let Some(d) = first_dropped {
                    prop_assert!(
                        routes.iter().all(|r| !r.3 || r.0 < d),
                        "position: a later route kept after an earlier drop"
                    );
                }
            }
            DropPolicy::ChoiceRank | DropPolicy::BatchPriority => {
                if routes.iter().any(|r| r.1 > 0 && r.3) {
                    prop_assert!(
                        routes.iter().all(|r| r.1 > 0 || r.3),
                        "choice-rank: a 2nd choice kept while a 1st choice dropped"
                    );
                }
            }
            DropPolicy::Probs | DropPolicy::Causal => {}
        }

        let slots = cap_g.min(members.len());
        if cap.pad {
            let want: Vec<usize> = if routes.len() < slots {
                let routed: Vec<usize> = routes.iter().map(|r| r.0).collect();
                (0..members.len()).filter(|p| !routed.contains(p)).take(slots - routes.len()).collect()
            } else {
                Vec::new()
            };
            padded.sort_unstable();
            prop_assert_eq!(&padded, &want, "group {} expert {}: padding rows (priority indices)", g, e);
            prop_assert_eq!(rows, slots, "group {} expert {}: pad-to-capacity must give exactly min(C, T) rows", g, e);
        } else {
            prop_assert!(padded.is_empty(), "padding without pad = true");
        }
    }
    Ok(())
}

/// Causal capacity in one sequence: position p keeps expert e iff fewer than C(p) = capacity of a
/// (p + 1)-token group of earlier positions kept e; C(p) is the capacity recorded for the token.
fn check_causal(c: &RouterConfig, cap: &CapacityConfig, members: &[usize], r: &Routing) -> Check {
    let mut kept_before = vec![0usize; c.experts];
    for (p, &i) in members.iter().enumerate() {
        let t = &r.tokens[i];
        let limit = capacity(cap, p + 1, c.k(), c.experts);
        prop_assert_eq!(t.capacity, Some(limit), "token ({}, {}): capacity in force", t.batch, t.pos);
        for route in &t.routes {
            prop_assert!(!route.padded, "causal capacity never pads");
            prop_assert_eq!(
                route.kept,
                kept_before[route.expert] < limit,
                "token ({}, {}) expert {}: {} earlier kept, C = {}",
                t.batch,
                t.pos,
                route.expert,
                kept_before[route.expert],
                limit
            );
        }
        t.routes.iter().filter(|x| x.kept).for_each(|x| kept_before[x.expert] += 1);
    }
    Ok(())
}

/// Expert threshold: exactly the experts whose score is strictly above their threshold, gate the
/// score, strongest first, ties to the lower id; whatever the other tokens are.
fn check_expert_threshold(c: &RouterConfig, x: &Array3<f32>, r: &Routing) -> Check {
    let tau = &c.threshold().expect("expert threshold has thresholds").values;
    for (i, t) in r.tokens.iter().enumerate() {
        let aff = affinity(c.score, &row(x, i));
        let mut want: Vec<usize> = (0..c.experts).filter(|&e| aff[e] > tau[e]).collect();
        want.sort_by(|&p, &q| desc(aff[p], aff[q]).then(p.cmp(&q)));
        let got: Vec<usize> = t.routes.iter().map(|r| r.expert).collect();
        prop_assert_eq!(&got, &want, "token ({}, {}) logits {:?}", t.batch, t.pos, row(x, i));
        for route in &t.routes {
            prop_assert!(route.kept && !route.padded);
            prop_assert!(close(route.weight, aff[route.expert] * c.routed_scaling), "{:?}", route);
        }
    }
    Ok(())
}

fn check_expert_choice(c: &RouterConfig, x: &Array3<f32>, r: &Routing) -> Check {
    let (b, s, e) = x.dim();
    let cap = c.capacity.as_ref().expect("expert choice has a capacity");
    let aff: Vec<Vec<f32>> = (0..b * s).map(|i| affinity(c.score, &row(x, i))).collect();
    for t in &r.tokens {
        prop_assert!(t.routes.iter().all(|r| r.kept && !r.padded), "expert choice drops or pads nothing");
        let sorted = t
            .routes
            .windows(2)
            .all(|w| desc(w[0].weight, w[1].weight).then(w[0].expert.cmp(&w[1].expert)) == Ordering::Less);
        prop_assert!(sorted, "token ({}, {}): routes not by weight desc, expert asc: {:?}", t.batch, t.pos, t.routes);
    }
    for (g, members) in reference_groups(&c.scope, b, s).iter().enumerate() {
        let cap_g = capacity(cap, members.len(), 1, e);
        #[allow(clippy::needless_range_loop)] // `expert` is a column of every row of `aff`
        for expert in 0..e {
            let mut order: Vec<usize> = (0..members.len()).collect();
            order.sort_by(|&p, &q| desc(aff[members[p]][expert], aff[members[q]][expert]).then(p.cmp(&q)));
            let mut want: Vec<usize> = order.into_iter().take(cap_g.min(members.len())).map(|p| members[p]).collect();
            want.sort_unstable();
            let got: Vec<usize> = members
                .iter()
                .copied()
                .filter(|&i| r.tokens[i].routes.iter().any(|x| x.expert == expert))
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect();
            prop_assert_eq!(
                got.len(),
                cap_g.min(members.len()),
                "group {} expert {}: not exactly min(C, T) tokens",
                g,
                expert
            );
            prop_assert_eq!(&got, &want, "group {} expert {} (capacity {}): chosen tokens", g, expert, cap_g);
            for &i in &got {
                let w = r.tokens[i].routes.iter().find(|x| x.expert == expert).unwrap().weight;
                prop_assert!(close(w, aff[i][expert] * c.routed_scaling), "expert-choice gate is the score");
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Every preset

macro_rules! preset_props {
    ($($fn_name:ident: $preset:literal, $cases:expr;)*) => {$(
        #[test]
        fn $fn_name() {
            let c = cfg($preset);
            run(&c, $cases, logits(c.experts), false);
        }
    )*};
}

preset_props! {
    preset_mixtral: "mixtral", 64;
    preset_deepseek_v3: "deepseek-v3", 12;
    preset_switch: "switch", 64;
    preset_megatron_probs: "megatron-probs", 64;
    preset_megatron_position: "megatron-position", 64;
    preset_megatron_probs_pad: "megatron-probs-pad", 64;
    preset_deepspeed_top1: "deepspeed-top1", 64;
    preset_deepspeed_top2: "deepspeed-top2", 64;
    preset_deepspeed_topk_probs: "deepspeed-topk-probs", 64;
    preset_expert_choice: "expert-choice", 64;
    preset_aux_loss_free: "aux-loss-free", 64;
    preset_causal_capacity: "causal-capacity", 64;
    preset_sinkhorn: "sinkhorn", 64;
    preset_batch_prioritized: "batch-prioritized", 64;
    preset_expert_choice_tc_serve: "expert-choice-tc-serve", 64;
    preset_expert_threshold: "expert-threshold", 64;
    preset_null_experts: "null-experts", 64;
}

#[test]
fn the_preset_list_is_the_one_these_tests_cover() {
    let names: Vec<&str> = presets().iter().map(|p| p.name).collect();
    assert_eq!(
        names,
        [
            "mixtral",
            "deepseek-v3",
            "switch",
            "megatron-probs",
            "megatron-position",
            "megatron-probs-pad",
            "deepspeed-top1",
            "deepspeed-top2",
            "deepspeed-topk-probs",
            "expert-choice",
            "aux-loss-free",
            "causal-capacity",
            "sinkhorn",
            "batch-prioritized",
            "expert-choice-tc-serve",
            "expert-threshold",
            "null-experts"
        ],
        "a preset was added or removed: add it to preset_props!"
    );
}

#[test]
fn every_preset_survives_extreme_finite_logits() {
    for p in presets() {
        let c = p.config().unwrap();
        let cases = if c.experts > 16 { 4 } else { 24 };
        run(&c, cases, extreme_logits(c.experts), true);
    }
}

// ---------------------------------------------------------------------------------------------
// Scaled-down and modified configurations: capacity binds, other scopes and orders

/// A preset at E experts, with DeepSpeed's minimum capacity removed so that capacity binds.
fn small(name: &str, experts: usize) -> RouterConfig {
    let mut c = cfg(name);
    c.name = format!("{name}-e{experts}");
    c.experts = experts;
    if let Some(cap) = &mut c.capacity {
        cap.min = 0;
    }
    c
}

fn deepseek_small(bias: bool) -> RouterConfig {
    let mut c = cfg("deepseek-v3");
    c.name = "deepseek-small".into();
    c.experts = 16;
    let tc = c.token_choice_mut().unwrap();
    tc.top_k = 4;
    tc.group_limit = Some(GroupLimit { groups: 4, top_groups: 2, score_top: 2 });
    // A selection-only bias large enough to change choices (gates stay unbiased).
    tc.expert_bias = bias.then(|| (0..16).map(|e| ((e * 7) % 5) as f32 * 0.3 - 0.6).collect());
    c
}

fn modified_configs() -> Vec<RouterConfig> {
    let mut out = vec![deepseek_small(false), deepseek_small(true)];
    for name in [
        "megatron-probs",
        "megatron-position",
        "megatron-probs-pad",
        "deepspeed-top1",
        "deepspeed-top2",
        "deepspeed-topk-probs",
        "expert-choice",
    ] {
        out.push(small(name, 4));
    }
    for name in ["causal-capacity", "batch-prioritized"] {
        out.push(small(name, 4));
    }
    let mut c = small("causal-capacity", 4);
    c.name += "-k1-cf0.5-renorm";
    c.token_choice_mut().unwrap().top_k = 1;
    let cap = c.capacity.as_mut().unwrap();
    (cap.factor, cap.renormalize_after_drop) = (Some(0.5), true);
    out.push(c);
    let mut c = small("batch-prioritized", 4);
    c.name += "-k2";
    c.token_choice_mut().unwrap().top_k = 2;
    out.push(c);
    let mut c = small("sinkhorn", 4);
    c.name += "-k2-softmax-per-sequence";
    c.token_choice_mut().unwrap().top_k = 2;
    (c.score, c.scope.group) = (ScoreFn::SoftmaxPre, ScopeGroup::Sequence);
    out.push(c);
    let mut switch = small("switch", 4);
    switch.capacity.as_mut().unwrap().fixed = Some(2);
    out.push(switch);

    // Other scopes and flattening orders.
    let mut c = small("megatron-probs", 4);
    c.name += "-tokens5";
    c.scope.group = ScopeGroup::Tokens(5);
    out.push(c);
    let mut c = small("megatron-probs-pad", 4);
    c.name += "-seq-major-tokens3";
    c.scope = ScopeConfig { group: ScopeGroup::Tokens(3), flatten: Flatten::SequenceMajor };
    out.push(c);
    let mut c = small("deepspeed-top2", 4);
    c.name += "-per-sequence-pos-major";
    c.scope = ScopeConfig { group: ScopeGroup::Sequence, flatten: Flatten::PositionMajor };
    out.push(c);
    let mut c = small("megatron-position", 4);
    c.name += "-seq-major";
    c.scope.flatten = Flatten::SequenceMajor;
    out.push(c);
    let mut c = small("expert-choice", 4);
    c.name += "-tokens3";
    c.scope.group = ScopeGroup::Tokens(3);
    out.push(c);

    // Sigmoid, k = 3 of 6, position policy, renormalised after dropping, scaled by 2.
    out.push(RouterConfig {
        name: "sigmoid-k3-renorm".into(),
        description: String::new(),
        kind: RouterKind::TokenChoice(TokenChoice::new(3)),
        experts: 6,
        score: ScoreFn::Sigmoid,
        normalize: None,
        routed_scaling: 2.0,
        capacity: Some(CapacityConfig {
            factor: Some(0.75),
            fixed: None,
            policy: DropPolicy::Position,
            arithmetic: Arithmetic::Megatron,
            min: 0,
            pad: false,
            renormalize_after_drop: true,
        }),
        scope: ScopeConfig { group: ScopeGroup::Batch, flatten: Flatten::PositionMajor },
        ..cfg("megatron-probs")
    });
    // Softmax-pre, normalised top-3 of 4, probs with padding, cf 0.5, sequence groups.
    out.push(RouterConfig {
        name: "softmax-pre-k3-pad".into(),
        description: String::new(),
        kind: RouterKind::TokenChoice(TokenChoice::new(3)),
        experts: 4,
        score: ScoreFn::SoftmaxPre,
        normalize: Some(true),
        routed_scaling: 1.0,
        capacity: Some(CapacityConfig {
            factor: Some(0.5),
            fixed: None,
            policy: DropPolicy::Probs,
            arithmetic: Arithmetic::Deepspeed,
            min: 1,
            pad: true,
            renormalize_after_drop: false,
        }),
        scope: ScopeConfig { group: ScopeGroup::Sequence, flatten: Flatten::SequenceMajor },
        ..cfg("megatron-probs")
    });
    // Sigmoid expert choice, scaled, with a minimum capacity.
    out.push(RouterConfig {
        name: "expert-choice-sigmoid".into(),
        description: String::new(),
        kind: RouterKind::ExpertChoice(ExpertChoice),
        experts: 4,
        score: ScoreFn::Sigmoid,
        normalize: None,
        routed_scaling: 1.5,
        capacity: Some(CapacityConfig {
            factor: Some(0.5),
            fixed: None,
            policy: DropPolicy::Probs,
            arithmetic: Arithmetic::Megatron,
            min: 1,
            pad: false,
            renormalize_after_drop: false,
        }),
        scope: ScopeConfig::default(),
        ..cfg("expert-choice")
    });
    out
}

#[test]
fn modified_configs_are_valid() {
    for c in modified_configs() {
        let text = toml::to_string(&c).unwrap();
        let back = RouterConfig::from_toml(&text, "modified.toml").unwrap_or_else(|e| panic!("{}: {e}", c.name));
        assert_eq!(back, c);
    }
}

#[test]
fn modified_configs_hold_the_invariants() {
    for c in modified_configs() {
        let cases = if c.experts > 8 { 32 } else { 64 };
        run(&c, cases, logits(c.experts), false);
    }
}

#[test]
fn capacity_binds_in_the_scaled_down_configs() {
    // Otherwise the dropping checks above pass vacuously (docs/PROPERTIES.md, "targeted rows").
    let mut rng = TestRunner::new(Config { rng_seed: RngSeed::Fixed(7), ..Config::default() });
    for c in modified_configs().iter().filter(|c| c.capacity.is_some() && c.token_choice().is_some()) {
        let mut dropped = 0;
        for _ in 0..20 {
            let x = logits(c.experts).new_tree(&mut rng).unwrap().current();
            dropped += assign(c, x.view()).unwrap().tokens.iter().flat_map(|t| &t.routes).filter(|r| !r.kept).count();
        }
        assert!(dropped > 0, "{}: no route was ever dropped", c.name);
    }
}

// ---------------------------------------------------------------------------------------------
// Non-finite logits

#[test]
fn non_finite_logits_are_rejected_naming_batch_position_and_expert() {
    let mut configs: Vec<RouterConfig> = presets().iter().map(|p| p.config().unwrap()).collect();
    configs.push(deepseek_small(true));
    let strategy = (0usize..configs.len(), 1usize..4, 1usize..6, any::<prop::sample::Index>(), 0u8..3, any::<bool>());
    runner(96)
        .run(&strategy, |(ci, b, s, at, kind, second)| {
            let c = &configs[ci];
            let e = c.experts;
            let mut x = Array3::<f32>::zeros((b, s, e));
            let flat = at.index(b * s * e);
            let (bi, pi, ei) = (flat / (s * e), flat / e % s, flat % e);
            let bad = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][kind as usize];
            x[[bi, pi, ei]] = bad;
            if second && flat + 1 < b * s * e {
                // A later offender does not change which one is named: the first in [B, S, E] order.
                let later = flat + 1;
                x[[later / (s * e), later / e % s, later % e]] = f32::NAN;
            }
            let err = assign(c, x.view()).err();
            prop_assert!(err.is_some(), "{}: routed a logit {} at ({}, {}, {})", c.name, bad, bi, pi, ei);
            let msg = err.unwrap().to_string();
            let place = format!("batch {bi}, position {pi}, expert {ei}");
            prop_assert!(msg.contains(&place), "{}: message {:?} does not name {}", c.name, msg, place);
            prop_assert!(msg.contains(&bad.to_string()), "message {:?} does not show the value {}", msg, bad);
            Ok(())
        })
        .unwrap();
}
