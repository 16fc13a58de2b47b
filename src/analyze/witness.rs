//! Witnesses: the smallest input pair found that still shows a leak, saved as a file that
//! replays from itself alone (`moe-audit check --replay witness.json`).
//!
//! Shrinking is greedy and deterministic: drop whole sequences, then positions, then undo changed
//! tokens, the last two in halving chunks (delta debugging), keeping each step only if the token
//! still routes differently; repeat until nothing more goes.
//!
//! A router outside moe-audit (a subprocess, trace files) has no config to replay from: its
//! witness keeps the two calls as the audit sent them, unshrunk (shrinking would call the router
//! again, and change what a stateful router answers the probes after it), with its handshake,
//! and replays against the live router (`check --replay W --router-cmd CMD`).

use super::case::{Call, CallMode, Case};
use super::compare::{capacity_of, diff_token, TokenDiff};
use super::{Probe, Property};
use crate::config::RouterConfig;
use crate::error::{Error, Result};
use crate::router::Router;
use crate::routing::{assign_routes, Logits, Routing, TokenRouting};
use ndarray::{s, Array2, Axis};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The witness file format tag.
pub const FORMAT: &str = "moe-audit-witness/2";
/// The format before the content hash: such a witness cannot be checked, so it is refused.
const FORMAT_UNSEALED: &str = "moe-audit-witness/1";

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

/// One call as stored in a witness.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredCall {
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// `batch*seq_len` rows of logits (hidden states for an external router fed hidden
    /// states), sequence-major.
    pub logits: Vec<Vec<f32>>,
    /// `batch` rows of `seq_len` flags (`true` = padding), when the call has a mask.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub padding: Option<Vec<Vec<bool>>>,
}

/// A token of a stored call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenRef {
    /// Sequence.
    pub batch: usize,
    /// Position.
    pub pos: usize,
}

/// A minimal, replayable leak: token `token_a` of call `a` and token `token_b` of call `b` must
/// route alike, and do not.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Witness {
    /// Always [`FORMAT`].
    pub format: String,
    /// The router, complete (its `[inference]` table included); absent for a router outside
    /// moe-audit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router: Option<RouterConfig>,
    /// The handshake of a router outside moe-audit, which replays against the live router.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handshake: Option<serde_json::Value>,
    /// The mode call `a` is routed in (S: the same call around a call of the other mode).
    #[serde(default, skip_serializing_if = "CallMode::is_train")]
    pub a_mode: CallMode,
    /// The mode call `b` is routed in.
    #[serde(default, skip_serializing_if = "CallMode::is_train")]
    pub b_mode: CallMode,
    /// The probe that found it.
    pub probe: Probe,
    /// The property broken.
    pub property: Property,
    /// What differs, e.g. `kept, weight`.
    pub differs: String,
    /// The reference call. For S, `b` is the call made in between; for D and M, `b` is unused.
    pub a: StoredCall,
    /// The changed call.
    pub b: StoredCall,
    /// The token in `a`.
    pub token_a: TokenRef,
    /// The same token in `b`.
    pub token_b: TokenRef,
    /// Its routing in the reference run.
    pub before: TokenRouting,
    /// Its routing in the changed run.
    pub after: TokenRouting,
    /// Hex sha256 of every other field as written (compact JSON): a replay refuses a witness
    /// whose content no longer matches, so an edited witness cannot pass as "fixed". It guards
    /// against edits and corruption, not against someone who recomputes it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub sha256: String,
}

/// A case reduced to one token, the unit that shrinking works on.
#[derive(Debug, Clone)]
struct Pair {
    a: Call,
    b: Call,
    seq_map: Vec<Option<usize>>,
    offset: usize,
    token: (usize, usize),
}

impl Pair {
    fn token_b(&self) -> Option<(usize, usize)> {
        self.seq_map[self.token.0].map(|j| (j, self.token.1 + self.offset))
    }
}

/// Routes `call` under `config` for a comparison (routes only).
pub(crate) fn route_with(config: &RouterConfig, call: &Call) -> Result<Routing> {
    assign_routes(config, call.logits.view(), call.padding.as_ref().map(|m| m.view()))
}

/// What routes a witness's calls: its router config, or a live router.
pub(crate) trait Replayer: Sync {
    /// The routing of `call` in `mode`, for a comparison.
    fn route(&self, call: &Call, mode: CallMode) -> Result<Routing>;
    /// Whether two calls may be routed at once (a config's routing is a pure function).
    fn concurrent(&self) -> bool;
}

impl Replayer for RouterConfig {
    fn route(&self, call: &Call, mode: CallMode) -> Result<Routing> {
        match mode {
            CallMode::Train => route_with(self, call),
            CallMode::Inference => {
                let inference = self
                    .inference_config()?
                    .ok_or_else(|| Error::Usage("an inference-mode witness needs an [inference] table".into()))?;
                route_with(&inference, call)
            }
        }
    }

    fn concurrent(&self) -> bool {
        true
    }
}

/// A live router (an external one, for `check --replay W --router-cmd CMD`).
struct Live<'a>(&'a dyn Router);

impl Replayer for Live<'_> {
    fn route(&self, call: &Call, mode: CallMode) -> Result<Routing> {
        match mode {
            CallMode::Train => call.routes(self.0),
            CallMode::Inference => match self.0.inference()? {
                Some(inference) => call.routes(inference.as_ref()),
                None => Err(Error::Usage(format!("router `{}` has no inference mode", self.0.name()))),
            },
        }
    }

    fn concurrent(&self) -> bool {
        self.0.concurrent()
    }
}

/// Routes both sides as `probe` prescribes and diffs the token.
fn replay_pair(
    with: &dyn Replayer,
    probe: Probe,
    pair: &Pair,
    modes: (CallMode, CallMode),
) -> Result<(Routing, Routing, TokenDiff)> {
    let Some(tb) = pair.token_b() else {
        return Err(Error::Usage("witness token has no counterpart in call b".into()));
    };
    let (ra, rb) = probe.rule().replay(with, &pair.a, &pair.b, modes)?;
    let diff = diff_token(&ra, pair.token, &rb, tb);
    Ok((ra, rb, diff))
}

/// Builds a shrunk witness for token `token` (in `case.a`), when the router has a config.
pub(crate) fn build(router: &dyn Router, probe: Probe, case: &Case, token: (usize, usize)) -> Result<Option<Witness>> {
    match router.config() {
        Some(_) => build_routed(router, probe, case, token, None, (CallMode::Train, CallMode::Train)),
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
    modes: (CallMode, CallMode),
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
    (a_mode, b_mode): (CallMode, CallMode),
    tb: (usize, usize),
) -> Result<Witness> {
    let mut witness = Witness {
        format: FORMAT.into(),
        router,
        handshake,
        a_mode,
        b_mode,
        probe,
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
        let mut k = 0;
        while k < pair.a.dims().0 {
            if !attempt(drop_sequence(&pair, k), &mut pair) {
                k += 1;
            } else {
                progress = true;
            }
        }
        let mut j = 0;
        while j < pair.b.dims().0 {
            if !attempt(drop_b_sequence(&pair, j), &mut pair) {
                j += 1;
            } else {
                progress = true;
            }
        }
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
    };
    Some(Pair {
        a: keep(&pair.a, &keep_a),
        b: keep(&pair.b, &keep_b),
        seq_map: pair.seq_map.clone(),
        offset,
        token: (pair.token.0, token_pos),
    })
}

fn store(call: &Call) -> StoredCall {
    let (batch, seq_len) = call.dims();
    StoredCall {
        batch,
        seq_len,
        logits: call.logits.rows().into_iter().map(|r| r.to_vec()).collect(),
        padding: call.padding.as_ref().map(|m| m.rows().into_iter().map(|r| r.to_vec()).collect()),
    }
}

fn load(call: &StoredCall, name: &str, path: &Path) -> Result<Call> {
    let experts = call.logits.first().map_or(0, Vec::len);
    let Some(rows) = call.batch.checked_mul(call.seq_len) else {
        return Err(Error::input(
            path,
            format!("call `{name}`: batch {} x seq_len {} overflows", call.batch, call.seq_len),
        ));
    };
    if rows != call.logits.len() || call.logits.iter().any(|r| r.len() != experts) || experts == 0 {
        return Err(Error::input(path, format!("call `{name}`: expected {rows} rows of equal length")));
    }
    let logits = Logits::from_shape_vec((call.batch, call.seq_len, experts), call.logits.concat()).expect("checked");
    let padding = match &call.padding {
        Some(rows) if rows.len() != call.batch || rows.iter().any(|r| r.len() != call.seq_len) => {
            return Err(Error::input(
                path,
                format!("call `{name}`: padding must be {} rows of {} flags", call.batch, call.seq_len),
            ))
        }
        Some(rows) => Some(Array2::from_shape_vec((call.batch, call.seq_len), rows.concat()).expect("checked")),
        None => None,
    };
    Ok(Call { logits, padding })
}

/// The outcome of replaying a witness.
#[derive(Debug, Clone, PartialEq)]
pub struct Replay {
    /// The witness as read.
    pub witness: Witness,
    /// What differs now (nothing: the leak no longer reproduces).
    pub diff: TokenDiff,
    /// The token's routing in the reference run now.
    pub before: TokenRouting,
    /// The token's routing in the changed run now.
    pub after: TokenRouting,
    /// The capacity in force for the token in each run now (its own, else its group's).
    pub capacity: (Option<usize>, Option<usize>),
}

impl Replay {
    /// Whether the leak (X: the drift) reproduces, judged by the audit's rule
    /// ([`TokenDiff::decision`]): a capacity in force that changed while no decision did is no leak.
    pub fn reproduces(&self) -> bool {
        self.diff.decision()
    }
}

impl Witness {
    /// Reads a witness file (at most a quarter of the default memory limit).
    pub fn read(path: &Path) -> Result<Witness> {
        Self::read_within(path, crate::memory::limit(None))
    }

    /// Reads a witness file under the memory limit `max_memory`: the text, and the values parsed
    /// from it (about four times the text), must fit.
    pub fn read_within(path: &Path, max_memory: u64) -> Result<Witness> {
        let text = crate::files::read_text(
            path,
            max_memory / 4,
            &format!("a quarter of {}", crate::error::Setting::MaxMemory),
        )?;
        Self::parse(&text, path)
    }

    /// Parses and validates a witness; `path` names it in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Witness> {
        let w: Witness = serde_json::from_str(text).map_err(|e| Error::input(path, format!("not a witness: {e}")))?;
        if w.format == FORMAT_UNSEALED {
            return Err(Error::input(
                path,
                format!("format `{FORMAT_UNSEALED}` has no content hash to check: write the witness again with `check --witness-dir`"),
            ));
        }
        if w.format != FORMAT {
            return Err(Error::input(path, format!("format `{}` is not `{FORMAT}`", w.format)));
        }
        if w.sha256.is_empty() {
            return Err(Error::input(path, "no `sha256` content hash to check".to_string()));
        }
        match (&w.router, &w.handshake) {
            (Some(router), None) => router.validate().map_err(|(field, message)| {
                Error::config(&path.display().to_string(), &format!("router.{field}"), message)
            })?,
            (None, Some(_)) if w.experts().is_some() && w.name().is_some() => {}
            (None, Some(_)) => {
                return Err(Error::input(path, "`handshake` needs a `name` and a number of `experts` of at least 1"))
            }
            _ => return Err(Error::input(path, "a witness holds either a `router` config or a `handshake`")),
        }
        w.check_stored_routings().map_err(|m| Error::input(path, m))?;
        Ok(w)
    }

    /// The stored routings are what the witness claims: on valid experts, and different (a
    /// capacity difference aside, which lives in the group, not the token).
    fn check_stored_routings(&self) -> std::result::Result<(), String> {
        let experts = self.experts().expect("checked");
        for (name, t) in [("before", &self.before), ("after", &self.after)] {
            let mut seen = vec![false; experts];
            for r in &t.routes {
                if r.expert >= experts || std::mem::replace(&mut seen[r.expert], true) {
                    return Err(format!(
                        "`{name}` routes to expert {} twice or out of range 0 to {}",
                        r.expert,
                        experts.saturating_sub(1)
                    ));
                }
            }
        }
        if self.before.routes == self.after.routes && !self.differs.contains("capacity") {
            return Err(format!(
                "`before` and `after` route alike, yet the witness says `{}` differ: not a leak (was it edited?)",
                self.differs
            ));
        }
        Ok(())
    }

    /// Sets [`Witness::sha256`] from the content.
    pub fn seal(&mut self) -> Result<()> {
        self.sha256.clear();
        self.sha256 = self.content_hash()?;
        Ok(())
    }

    /// Hex sha256 of the compact JSON of the witness, its `sha256` field left out (empty fields
    /// are not written). Floats write in their shortest round-trip form, so a witness read back
    /// from a file hashes as it did when written.
    fn content_hash(&self) -> Result<String> {
        use sha2::{Digest, Sha256};
        debug_assert!(self.sha256.is_empty(), "the hash covers every field but itself");
        let mut hasher = Sha256::new();
        serde_json::to_writer(&mut hasher, self).map_err(|e| Error::Usage(format!("cannot hash a witness: {e}")))?;
        Ok(hasher.finalize().iter().map(|b| format!("{b:02x}")).collect())
    }

    /// The router's name (its config's, or its handshake's).
    pub fn name(&self) -> Option<&str> {
        match (&self.router, &self.handshake) {
            (Some(router), _) => Some(&router.name),
            (None, Some(h)) => h.get("name").and_then(|n| n.as_str()),
            (None, None) => None,
        }
    }

    /// The router's number of experts (its config's, or its handshake's).
    fn experts(&self) -> Option<usize> {
        match (&self.router, &self.handshake) {
            (Some(router), _) => Some(router.experts),
            (None, Some(h)) => h.get("experts").and_then(|e| e.as_u64()).and_then(|e| usize::try_from(e).ok()),
            (None, None) => None,
        }
        .filter(|&e| e > 0)
    }

    /// Replays the witness from its own contents (a witness with a router config).
    pub fn replay(self, path: &Path) -> Result<Replay> {
        let Some(config) = self.router.clone() else {
            return Err(Error::Usage(format!(
                "{}: the witness is of router `{}` outside moe-audit: replay it with --router-cmd",
                path.display(),
                self.name().unwrap_or_default()
            )));
        };
        self.replay_with(path, &config, config.experts)
    }

    /// Replays the witness against a live router, which must introduce itself as the witness's
    /// handshake says (name, experts, top-k, input and hidden size; the protocol may differ).
    pub fn replay_on(self, path: &Path, router: &dyn Router) -> Result<Replay> {
        let Some(stored) = &self.handshake else {
            return Err(Error::Usage(format!(
                "{}: the witness holds a router config: replay it without --router-cmd",
                path.display()
            )));
        };
        let live = router.handshake().unwrap_or_default();
        let same = ["name", "experts", "top_k", "input", "hidden_size"]
            .iter()
            .all(|k| stored.get(k).filter(|v| !v.is_null()) == live.get(k).filter(|v| !v.is_null()));
        if !same {
            return Err(Error::input(
                path,
                format!("the witness's router is {stored}, the command's router is {live}: not the same router"),
            ));
        }
        self.replay_with(path, &Live(router), router.row_width())
    }

    /// Replays with `with`, the calls' rows `width` wide.
    fn replay_with(mut self, path: &Path, with: &dyn Replayer, width: usize) -> Result<Replay> {
        let (a, b) = (load(&self.a, "a", path)?, load(&self.b, "b", path)?);
        if a.logits.dim().2 != width || b.logits.dim().2 != width {
            return Err(Error::input(
                path,
                format!("the calls' rows hold {} values, the router takes {width}", a.logits.dim().2),
            ));
        }
        let (ta, tb) = ((self.token_a.batch, self.token_a.pos), (self.token_b.batch, self.token_b.pos));
        let (ba, sa) = a.dims();
        let (bb, sb) = b.dims();
        let changes_input = self.probe.rule().changes_input();
        if ta.0 >= ba || ta.1 >= sa || (changes_input && (tb.0 >= bb || tb.1 >= sb)) {
            return Err(Error::input(path, "the witness token lies outside its calls".to_string()));
        }
        let mut seq_map = vec![None; ba];
        seq_map[ta.0] = Some(if changes_input { tb.0 } else { ta.0 });
        let offset = if changes_input {
            tb.1.checked_sub(ta.1).ok_or_else(|| Error::input(path, "token_b lies before token_a".to_string()))?
        } else {
            0
        };
        // Last of the checks, so that each edit above gets its own message.
        let stored = std::mem::take(&mut self.sha256);
        if stored != self.content_hash()? {
            return Err(Error::input(
                path,
                "the content does not match its `sha256` (edited or corrupted): write the witness again with `check --witness-dir`".to_string(),
            ));
        }
        self.sha256 = stored;
        let pair = Pair { a, b, seq_map, offset, token: ta };
        let (ra, rb, diff) = replay_pair(with, self.probe, &pair, (self.a_mode, self.b_mode))?;
        let tb = pair.token_b().expect("mapped");
        let (before, after) = (ra.token(ta.0, ta.1).clone(), rb.token(tb.0, tb.1).clone());
        let capacity = (capacity_of(&ra, &before), capacity_of(&rb, &after));
        Ok(Replay { before, after, capacity, diff, witness: self })
    }
}
