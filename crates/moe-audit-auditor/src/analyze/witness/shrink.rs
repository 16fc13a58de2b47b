//! Building a witness, and shrinking it: the smallest input pair found that still shows the
//! leak the audit judged.
//!
//! Shrinking is greedy and deterministic: drop whole sequences, then positions, then undo changed
//! tokens, the last two in halving chunks (delta debugging), keeping each step only if the token
//! still routes differently; repeat until nothing more goes. Each attempt is a replay
//! (`replay::replay_pair`), under a budget of steps and routed tokens.

use super::replay::{replay_pair, Pair};
use super::{store, TokenRef, Witness, FORMAT};
use crate::analyze::case::{Call, Case};
use crate::analyze::Probe;
use crate::hints::HintsOf;
use crate::mode::Mode;
use moe_audit_core::config::RouterConfig;
use moe_audit_core::error::Result;
use moe_audit_core::router::Router;
use moe_audit_core::routing::{diff_token, Routing, TokenDiff};
use ndarray::{s, Axis};

/// Caps the shrinking work on large inputs.
const MAX_SHRINK_STEPS: usize = 4000;
/// Caps the tokens routed over all shrinking attempts: this many times the starting pair's, and
/// at least [`MIN_SHRINK_TOKENS`]. Each attempt routes the pair, so 4000 attempts on a long pair
/// made shrinking the audit's largest cost (F at 4 × 8192: 20 s); small pairs never reach it.
const SHRINK_WORK: usize = 64;
/// The floor of the shrinking budget in routed tokens.
const MIN_SHRINK_TOKENS: usize = 1 << 22;
/// Pairs of this many tokens or more try [`window`]s before removing positions in chunks.
const WINDOW_FROM_TOKENS: usize = 1 << 14;

/// Builds a shrunk witness for token `token` (in `case.a`), when the router has a config.
pub(crate) fn build(router: &dyn Router, probe: Probe, case: &Case, token: (usize, usize)) -> Result<Option<Witness>> {
    match router.config() {
        Some(_) => build_routed(router, probe, case, token, None, (Mode::Train, Mode::Train)),
        None => Ok(None),
    }
}

/// Builds a witness for token `token` (in `case.a`): shrunk when the router has a config; for
/// a router with a handshake, the case's calls as sent, `routed` being the routings the audit
/// compared (`a`'s, then `b`'s). `modes` are the modes the calls were routed in.
pub(crate) fn build_routed(
    router: &dyn Router,
    probe: Probe,
    case: &Case,
    token: (usize, usize),
    routed: Option<(&Routing, &Routing)>,
    modes: (Mode, Mode),
) -> Result<Option<Witness>> {
    let pair =
        Pair { a: Call::clone(&case.a), b: case.b.clone(), seq_map: case.seq_map.clone(), offset: case.offset, token };
    let Some(config) = router.config() else {
        let (Some(handshake), Some(routed), Some(tb)) = (router.handshake(), routed, pair.token_b()) else {
            return Ok(None);
        };
        let diff = diff_token(routed.0, token, routed.1, tb);
        return diff
            .any()
            .then(|| witness(&pair, (routed.0, routed.1, diff), probe, None, Some(handshake), modes, tb))
            .transpose();
    };
    // Shrinking keeps what the audit judged: a changed decision stays one (a capacity-only
    // pair would replay as no leak), a capacity-only change stays at least that.
    let Ok((_, _, found)) = replay_pair(config, probe, &pair, modes) else { return Ok(None) };
    if !found.any() {
        return Ok(None);
    }
    let same_judgement = |d: TokenDiff| d.any() && d.decision() == found.decision();
    let leaks = |p: &Pair| replay_pair(config, probe, p, modes).is_ok_and(|(_, _, d)| same_judgement(d));
    let pair = shrink(pair, probe, &leaks);
    let (ra, rb, diff) = replay_pair(config, probe, &pair, modes)?;
    let tb = pair.token_b().expect("kept by shrinking");
    Ok(Some(witness(&pair, (&ra, &rb, diff), probe, Some(config.clone()), None, modes, tb)?))
}

fn witness(
    pair: &Pair,
    (ra, rb, diff): (&Routing, &Routing, TokenDiff),
    probe: Probe,
    router: Option<RouterConfig>,
    handshake: Option<serde_json::Value>,
    (a_mode, b_mode): (Mode, Mode),
    tb: (usize, usize),
) -> Result<Witness> {
    let mut witness = Witness {
        format: FORMAT.into(),
        router,
        handshake,
        a_mode,
        b_mode,
        probe,
        layout: None,
        property: probe.property(),
        differs: diff.describe(),
        a: store(&pair.a),
        b: store(&pair.b),
        token_a: TokenRef { batch: pair.token.0, pos: pair.token.1 },
        token_b: TokenRef { batch: tb.0, pos: tb.1 },
        before: ra.token(pair.token.0, pair.token.1).clone(),
        after: rb.token(tb.0, tb.1).clone(),
        sha256: String::new(),
    };
    witness.seal()?;
    Ok(witness)
}

fn shrink(mut pair: Pair, probe: Probe, leaks: &dyn Fn(&Pair) -> bool) -> Pair {
    let tokens = |p: &Pair| p.a.dims().0 * p.a.dims().1 + p.b.dims().0 * p.b.dims().1;
    let budget = (SHRINK_WORK * tokens(&pair)).max(MIN_SHRINK_TOKENS);
    let (steps, work) = (std::cell::Cell::new(0usize), std::cell::Cell::new(0usize));
    let spent = || steps.get() >= MAX_SHRINK_STEPS || work.get() > budget;
    let attempt = |candidate: Option<Pair>, pair: &mut Pair| -> bool {
        steps.set(steps.get() + 1);
        let Some(c) = candidate.filter(|_| !spent()) else { return false };
        work.set(work.get() + tokens(&c));
        let kept = leaks(&c);
        if kept {
            *pair = c;
        }
        kept
    };
    loop {
        let mut progress = false;
        // Whole sequences of a (with their image in b), then b-only sequences.
        progress |= drop_each(&mut pair, &attempt, |p| p.a.dims().0, drop_sequence);
        progress |= drop_each(&mut pair, &attempt, |p| p.b.dims().0, drop_b_sequence);
        // A long pair: the witness token and the first changed row with 0, 1, 4, 16, ... positions
        // around them, up to the first window that still leaks. Where capacity scales with the
        // tokens routed, removing large chunks rarely keeps a leak, so ddmin alone would route a
        // long pair hundreds of times (F at 4 × 8192: 2.3 M tokens); a window costs its size.
        progress |= tokens(&pair) >= WINDOW_FROM_TOKENS && windows(&mut pair, &attempt);
        // Positions, then changes undone (rows of b back to their aligned row of a), each in
        // halving chunks: big inputs shrink in a few tries.
        progress |= ddmin(&mut pair, &coordinates, &drop_coordinates, &attempt, &spent);
        if probe.rule().changes_input() {
            progress |= ddmin(&mut pair, &changed_rows, &|p, rows| Some(revert_rows(p, rows)), &attempt, &spent);
        }
        if !progress || spent() {
            return pair;
        }
    }
}

/// Delta debugging over the items `items(pair)` lists: tries removing chunks of half the items,
/// then quarters, ... down to single items, keeping every removal after which the leak remains;
/// it stops once the budget is `spent` (every further attempt would fail unseen).
fn ddmin<T: Clone>(
    pair: &mut Pair,
    items: &dyn Fn(&Pair) -> Vec<T>,
    remove: &dyn Fn(&Pair, &[T]) -> Option<Pair>,
    attempt: &dyn Fn(Option<Pair>, &mut Pair) -> bool,
    spent: &dyn Fn() -> bool,
) -> bool {
    let mut progress = false;
    let mut chunk = items(pair).len().div_ceil(2);
    while chunk >= 1 {
        let mut start = 0;
        loop {
            let all = items(pair);
            if start >= all.len() || spent() {
                break;
            }
            let part: Vec<T> = all.into_iter().skip(start).take(chunk).collect();
            if attempt(remove(pair, &part), pair) {
                progress = true;
            } else {
                start += chunk;
            }
        }
        if chunk == 1 {
            break;
        }
        chunk = chunk.div_ceil(2);
    }
    progress
}

/// Tries `drop(pair, i)` for each sequence `i < count(pair)` in turn, keeping every drop that
/// still leaks: whether one did.
fn drop_each(
    pair: &mut Pair,
    attempt: &dyn Fn(Option<Pair>, &mut Pair) -> bool,
    count: fn(&Pair) -> usize,
    drop: fn(&Pair, usize) -> Option<Pair>,
) -> bool {
    let (mut i, mut progress) = (0, false);
    while i < count(pair) {
        if attempt(drop(pair, i), pair) {
            progress = true;
        } else {
            i += 1;
        }
    }
    progress
}

/// Tries [`window`]s 0, 1, 4, 16, ... positions wide, keeping the first that leaks: whether one did.
fn windows(pair: &mut Pair, attempt: &dyn Fn(Option<Pair>, &mut Pair) -> bool) -> bool {
    let p = pair.token.1 as isize;
    let c = changed_rows(pair).iter().map(|&(_, q)| q as isize).min().unwrap_or(p);
    let mut w = 0;
    loop {
        if attempt(window(pair, (p, c), w), pair) {
            return true;
        }
        if w >= pair.a.dims().1 {
            return false;
        }
        w = (w * 4).max(1);
    }
}

/// The pair cut to the positions within `w` of `p` (the witness token's) or `c` (the first
/// changed row's); `None` when that keeps every position.
fn window(pair: &Pair, (p, c): (isize, isize), w: usize) -> Option<Pair> {
    let near = |x: isize, y: isize| (x - y).unsigned_abs() <= w;
    let outside: Vec<isize> = coordinates(pair).into_iter().filter(|&x| !near(x, p) && !near(x, c)).collect();
    if outside.is_empty() {
        return None;
    }
    drop_coordinates(pair, &outside)
}

fn drop_sequence(pair: &Pair, k: usize) -> Option<Pair> {
    let (ba, _) = pair.a.dims();
    if k == pair.token.0 || ba < 2 {
        return None;
    }
    let keep_a: Vec<usize> = (0..ba).filter(|&i| i != k).collect();
    let removed_b = pair.seq_map[k];
    let keep_b: Vec<usize> = (0..pair.b.dims().0).filter(|&j| Some(j) != removed_b).collect();
    if keep_b.is_empty() {
        return None;
    }
    let seq_map =
        keep_a.iter().map(|&i| pair.seq_map[i].map(|j| keep_b.iter().position(|&x| x == j).expect("kept"))).collect();
    let token = (if pair.token.0 > k { pair.token.0 - 1 } else { pair.token.0 }, pair.token.1);
    Some(Pair { a: pair.a.select(&keep_a), b: pair.b.select(&keep_b), seq_map, offset: pair.offset, token })
}

fn drop_b_sequence(pair: &Pair, j: usize) -> Option<Pair> {
    if pair.seq_map.contains(&Some(j)) || pair.b.dims().0 < 2 {
        return None;
    }
    let keep_b: Vec<usize> = (0..pair.b.dims().0).filter(|&x| x != j).collect();
    let seq_map = pair.seq_map.iter().map(|m| m.map(|x| if x > j { x - 1 } else { x })).collect();
    Some(Pair { b: pair.b.select(&keep_b), seq_map, ..pair.clone() })
}

/// Aligned (a-sequence, a-position) pairs whose rows differ between a and b.
fn changed_rows(pair: &Pair) -> Vec<(usize, usize)> {
    let (ba, sa) = pair.a.dims();
    let (_, sb) = pair.b.dims();
    let mut out = Vec::new();
    for i in 0..ba {
        let Some(j) = pair.seq_map[i] else { continue };
        for p in 0..sa {
            let q = p + pair.offset;
            if q < sb && pair.a.logits.slice(s![i, p, ..]) != pair.b.logits.slice(s![j, q, ..]) {
                out.push((i, p));
            }
        }
    }
    out
}

fn revert_rows(pair: &Pair, rows: &[(usize, usize)]) -> Pair {
    let mut out = pair.clone();
    for &(i, p) in rows {
        let j = pair.seq_map[i].expect("changed rows are aligned");
        out.b.logits.slice_mut(s![j, p + pair.offset, ..]).assign(&pair.a.logits.slice(s![i, p, ..]));
    }
    out
}

/// Position coordinates in a's frame covering both calls (b-only positions are negative or
/// beyond a's length), without the witness token's.
fn coordinates(pair: &Pair) -> Vec<isize> {
    let (_, sa) = pair.a.dims();
    let (_, sb) = pair.b.dims();
    let lo = -(pair.offset as isize);
    let hi = (sa as isize).max(sb as isize - pair.offset as isize);
    (lo..hi).filter(|&c| c != pair.token.1 as isize).collect()
}

fn drop_coordinates(pair: &Pair, coords: &[isize]) -> Option<Pair> {
    let (_, sa) = pair.a.dims();
    let (_, sb) = pair.b.dims();
    // `coords` is a run of the ascending `coordinates`: a binary search keeps this O(S log S).
    let dropped = |c: isize| coords.binary_search(&c).is_ok();
    let keep_a: Vec<usize> = (0..sa).filter(|&p| !dropped(p as isize)).collect();
    let keep_b: Vec<usize> = (0..sb).filter(|&q| !dropped(q as isize - pair.offset as isize)).collect();
    if keep_a.is_empty() || keep_b.is_empty() {
        return None;
    }
    // Only a's own positions (0..) shift the token; negative coordinates are b's left padding.
    let token_pos = pair.token.1 - coords.iter().filter(|&&x| (0..pair.token.1 as isize).contains(&x)).count();
    let offset = pair.offset - coords.iter().filter(|&&x| x < 0).count();
    let keep = |call: &Call, idx: &[usize]| Call {
        logits: call.logits.select(Axis(1), idx),
        padding: call.padding.as_ref().map(|m| m.select(Axis(1), idx)),
        placement: call.placement.clone(),
    };
    Some(Pair {
        a: keep(&pair.a, &keep_a),
        b: keep(&pair.b, &keep_b),
        seq_map: pair.seq_map.clone(),
        offset,
        token: (pair.token.0, token_pos),
    })
}
