//! What each token probe calls the model with (the audit's first step, a child of `audit.rs`): the cases of a probe, planned from the base call
//! (one case is one model call; its reference is the base call), and the note its finding
//! carries.

use super::ModelAuditOptions;
use crate::analyze::Probe;
use crate::model::{Mode, ModelInfo, Path, TokenCall};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// One case: call `b` (after the calls `before`, whose answers are ignored) against the base
/// call, and the token pairs `(index in base, index in b)` that must not change.
pub(super) struct Case {
    pub before: Vec<TokenCall>,
    pub b: TokenCall,
    pub pairs: Vec<(usize, usize)>,
}

impl Case {
    /// Call `b` alone against the base call.
    fn single(b: TokenCall, pairs: Vec<(usize, usize)>) -> Case {
        Case { before: Vec::new(), b, pairs }
    }
}

/// A probe's cases (none when it does not apply) and one line on what they are, or why none.
pub(super) struct Plan {
    pub cases: Vec<Case>,
    pub note: String,
}

impl Plan {
    fn new(cases: Vec<Case>, note: impl Into<String>) -> Plan {
        Plan { cases, note: note.into() }
    }

    /// The probe does not apply, for this reason.
    fn none(why: &str) -> Plan {
        Plan::new(Vec::new(), why)
    }

    /// The cases of `probe` on `base`; random choices from `rng` (the probe's own stream).
    pub fn of(
        probe: Probe,
        info: &ModelInfo,
        base: &TokenCall,
        options: &ModelAuditOptions,
        rng: &mut ChaCha8Rng,
    ) -> Plan {
        let (b, s) = (base.batch, base.seq_len);
        let every = || pairs_of(s, s, &same_rows(b), s, 0);
        let vocab = info.vocab as u32;
        match probe {
            Probe::P if s == 1 => Plan::none("a sequence of one token has no prefix"),
            Probe::P => prefixes(base),
            Probe::F if s > 1 => futures(base, options.trials, vocab, rng),
            Probe::F => Plan::none("a sequence of one token has no future"),
            Probe::N if b > 1 => neighbours(base, options.trials, vocab, rng),
            Probe::N => Plan::none("a batch of one sequence has no neighbour"),
            Probe::R => rebatched(base, info.padding_mask),
            Probe::D => Plan::new(vec![Case::single(base.clone(), every())], "the base call twice"),
            Probe::S => {
                let other: Vec<u32> = (0..b * s).map(|_| rng.random_range(0..vocab)).collect();
                let other = TokenCall { tokens: other, ..base.clone() };
                let case = Case { before: vec![other], b: base.clone(), pairs: every() };
                Plan::new(vec![case], "the base call after another call")
            }
            Probe::M => Plan::new(
                vec![Case::single(TokenCall { mode: Mode::Inference, ..base.clone() }, every())],
                "inference mode against training mode",
            ),
            Probe::G if info.generate => {
                let call = TokenCall { path: Path::Generate { prefill: options.prefill }, ..base.clone() };
                let note =
                    format!("prefill {} positions, then one token at a time through the KV cache", options.prefill);
                Plan::new(vec![Case::single(call, every())], note)
            }
            Probe::G => Plan::none("the model does not run the generation path"),
            // The registry's other probes audit routers only; `audit_model` refuses them.
            other => {
                debug_assert!(!Probe::MODEL.contains(&other), "probe {other} serves models and has no plan");
                Plan::none("a router probe")
            }
        }
    }
}

/// P: prefix lengths 1, 2, 4, ... and s - 1, one call each (a shorter call cannot be packed
/// with others without padding, which is R's question).
fn prefixes(base: &TokenCall) -> Plan {
    let (b, s) = (base.batch, base.seq_len);
    let mut lengths: Vec<usize> = std::iter::successors(Some(1usize), |n| Some(n * 2)).take_while(|&n| n < s).collect();
    if lengths.last() != Some(&(s - 1)) {
        lengths.push(s - 1);
    }
    let cases: Vec<Case> = lengths
        .iter()
        .map(|&n| {
            let tokens = (0..b).flat_map(|i| base.tokens[i * s..i * s + n].iter().copied()).collect();
            Case::single(TokenCall { seq_len: n, tokens, ..base.clone() }, pairs_of(s, n, &same_rows(b), n, 0))
        })
        .collect();
    let note = format!("{} prefixes of every sequence, lengths {lengths:?}", cases.len());
    Plan::new(cases, note)
}

/// F: the tokens after a random position t of one sequence replaced; odd trials are targeted
/// (later tokens equal to token t want its experts).
fn futures(base: &TokenCall, trials: usize, vocab: u32, rng: &mut ChaCha8Rng) -> Plan {
    let (b, s) = (base.batch, base.seq_len);
    let cases = (0..trials)
        .map(|trial| {
            let (i, t) = (trial % b, rng.random_range(0..s - 1));
            let mut call = base.clone();
            let keep = base.tokens[i * s + t];
            for p in t + 1..s {
                call.tokens[i * s + p] = if trial % 2 == 1 { keep } else { rng.random_range(0..vocab) };
            }
            Case::single(call, pairs_of(s, s, &[(i, i)], t + 1, 0))
        })
        .collect();
    Plan::new(cases, format!("{trials} trials: later tokens of one sequence random, or repeating token t"))
}

/// N: one sequence of the batch replaced by random tokens; the others compared.
fn neighbours(base: &TokenCall, trials: usize, vocab: u32, rng: &mut ChaCha8Rng) -> Plan {
    let (b, s) = (base.batch, base.seq_len);
    let cases = (0..trials)
        .map(|trial| {
            let i = trial % b;
            let mut call = base.clone();
            call.tokens[i * s..(i + 1) * s].iter_mut().for_each(|t| *t = rng.random_range(0..vocab));
            let others: Vec<(usize, usize)> = same_rows(b).into_iter().filter(|&(j, _)| j != i).collect();
            Case::single(call, pairs_of(s, s, &others, s, 0))
        })
        .collect();
    Plan::new(cases, format!("{trials} trials: one sequence of the batch replaced"))
}

/// R: the batch reversed and halved (more than one sequence), padded right and left (a model
/// that takes a padding mask).
fn rebatched(base: &TokenCall, padding_mask: bool) -> Plan {
    let (b, s) = (base.batch, base.seq_len);
    let mut cases = Vec::new();
    let mut what = Vec::new();
    if b > 1 {
        let reversed: Vec<usize> = (0..b).rev().collect();
        let map: Vec<(usize, usize)> = reversed.iter().enumerate().map(|(j, &i)| (i, j)).collect();
        cases.push(Case::single(rebuilt(base, &reversed, (0, 0)), pairs_of(s, s, &map, s, 0)));
        let half: Vec<usize> = (0..b.div_ceil(2)).collect();
        let map: Vec<(usize, usize)> = half.iter().map(|&i| (i, i)).collect();
        cases.push(Case::single(rebuilt(base, &half, (0, 0)), pairs_of(s, s, &map, s, 0)));
        what.push("reversed, halved");
    }
    if padding_mask {
        let pad = r_padding(s);
        let rows: Vec<usize> = (0..b).collect();
        let all = same_rows(b);
        cases.push(Case::single(rebuilt(base, &rows, (0, pad)), pairs_of(s, s + pad, &all, s, 0)));
        cases.push(Case::single(rebuilt(base, &rows, (pad, 0)), pairs_of(s, s + pad, &all, s, pad)));
        what.push("padded right and left");
    }
    let note = match what.is_empty() {
        true => "a batch of one sequence, and a model that takes no padding mask".to_string(),
        false => format!("the batch {}", what.join("; ")),
    };
    Plan::new(cases, note)
}

/// The tokens R pads a sequence of `s` with, on either side.
fn r_padding(s: usize) -> usize {
    (s / 4).max(1)
}

/// The sequence map of a call against itself: sequence i against sequence i.
fn same_rows(b: usize) -> Vec<(usize, usize)> {
    (0..b).map(|i| (i, i)).collect()
}

/// Every pair of a sequence map: token `p` of base sequence `i` against token `p + offset` of
/// sequence `j` of the other call, for positions `0..n`.
fn pairs_of(s: usize, other_len: usize, map: &[(usize, usize)], n: usize, offset: usize) -> Vec<(usize, usize)> {
    map.iter().flat_map(|&(i, j)| (0..n).map(move |p| (i * s + p, j * other_len + p + offset))).collect()
}

/// A call of sequences picked from the base (`rows[j]` = the base sequence of row j), each
/// padded with `left` and `right` padding tokens (id 0).
fn rebuilt(base: &TokenCall, rows: &[usize], (left, right): (usize, usize)) -> TokenCall {
    let s = base.seq_len;
    let len = left + s + right;
    let mut tokens = Vec::with_capacity(rows.len() * len);
    let mut mask = Vec::with_capacity(rows.len() * len);
    for &i in rows {
        tokens.extend(std::iter::repeat_n(0, left).chain(base.tokens[i * s..(i + 1) * s].iter().copied()));
        tokens.extend(std::iter::repeat_n(0, right));
        mask.extend((0..len).map(|p| p < left || p >= left + s));
    }
    let padding = (left + right > 0).then_some(mask);
    TokenCall { batch: rows.len(), seq_len: len, tokens, padding, ..base.clone() }
}

#[cfg(test)]
mod tests {
    /// No call of an audit is longer than [`super::super::largest_call`] says: R's padding is the
    /// longest.
    #[test]
    fn the_padded_rebatch_fits_the_largest_call() {
        assert_eq!(super::super::largest_call(4, 128), (4, 161));
        for s in 1..200 {
            assert!(s + super::r_padding(s) <= super::super::largest_call(2, s).1, "seq_len {s}");
        }
    }
}
