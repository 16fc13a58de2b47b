//! From one token's logits to its choices: score functions, selection bias, group-limited
//! top-k, and gates. Everything here is per token, so it is causal by construction; the
//! leaks live in what happens after (capacity).
//!
//! Ties go to the lowest expert id (the CUDA `torch.topk` rule); `-0.0 == 0.0`.

use crate::config::{RouterConfig, ScoreFn};
use crate::error::{Error, Result};
use ndarray::ArrayView3;
use std::borrow::Cow;
use std::cmp::Ordering;

/// Descending order on finite (or infinite) floats; equal values compare equal.
pub(crate) fn desc(a: f32, b: f32) -> Ordering {
    b.partial_cmp(&a).unwrap_or(Ordering::Equal)
}

/// Rejects NaN and infinite logits, naming the first offender.
pub fn check_finite(logits: &ArrayView3<f32>) -> Result<()> {
    // Every call of every probe passes here: one branch-free (vectorised) pass first, the
    // indexed search only to name an offender.
    let all_finite = match logits.as_slice() {
        Some(flat) => flat.iter().fold(true, |ok, v| ok & v.is_finite()),
        None => logits.iter().all(|v| v.is_finite()),
    };
    if all_finite {
        return Ok(());
    }
    match logits.indexed_iter().find(|(_, v)| !v.is_finite()) {
        Some(((batch, pos, expert), &value)) => Err(Error::NonFiniteScore { batch, pos, expert, value }),
        None => Ok(()),
    }
}

/// Numerically safe softmax in f32, summed in expert order.
#[cfg(test)]
pub(crate) fn softmax(logits: &[f32]) -> Vec<f32> {
    let mut out = Vec::with_capacity(logits.len());
    softmax_into(logits, &mut out);
    out
}

/// [`softmax`] appended to `out`.
fn softmax_into(logits: &[f32], out: &mut Vec<f32>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let start = out.len();
    out.extend(logits.iter().map(|&l| (l - max).exp()));
    let sum: f32 = out[start..].iter().sum();
    out[start..].iter_mut().for_each(|e| *e /= sum);
}

/// [`softmax`] of `values`, in place (the same operations in the same order).
fn softmax_in_place(values: &mut [f32]) {
    let max = values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    values.iter_mut().for_each(|v| *v = (*v - max).exp());
    let sum: f32 = values.iter().sum();
    values.iter_mut().for_each(|v| *v /= sum);
}

/// The softmax of every `width`-wide row of `flat`, rows concatenated.
pub fn softmax_rows(flat: &[f32], width: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(flat.len());
    flat.chunks_exact(width).for_each(|row| softmax_into(row, &mut out));
    out
}

/// One token's scores: its logits and their softmax. A call computes every row's softmax once:
/// softmax-pre affinities and the load statistics' mean probabilities both read it. When neither
/// does (a routes-only assignment of a softmax-post or sigmoid router), `softmax` is empty.
#[derive(Debug, Clone, Copy)]
pub struct Row<'a> {
    /// The token's logits, one per expert.
    pub logits: &'a [f32],
    /// Their softmax, or empty when nothing reads it.
    pub softmax: &'a [f32],
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Per-expert affinity before selection: the softmax probability or the sigmoid. `softmax-post`
/// selects on raw logits.
pub(crate) fn affinities(score: ScoreFn, row: Row<'_>) -> Cow<'_, [f32]> {
    match score {
        ScoreFn::SoftmaxPre => Cow::Borrowed(row.softmax),
        ScoreFn::SoftmaxPost => Cow::Borrowed(row.logits),
        ScoreFn::Sigmoid => Cow::Owned(row.logits.iter().map(|&l| sigmoid(l)).collect()),
    }
}

/// Indices of the `k` largest values, largest first, ties to the lowest index.
pub fn top_k(values: &[f32], k: usize) -> Vec<usize> {
    let mut out = Vec::with_capacity(k);
    top_k_into(values, k, &mut out);
    out
}

/// [`top_k`] appended to `out`.
///
/// One pass with a sorted buffer of k (O(E·k)): k is small and this runs for every token of
/// every probe. A value enters before the first kept value it strictly exceeds, so an equal
/// value stays behind the lower index. Up to [`SMALL_K`] the buffer is `(value, index)` pairs on
/// the stack (no indirect loads, no allocation): at E = 256 this is most of an assignment.
fn top_k_into(values: &[f32], k: usize, out: &mut Vec<usize>) {
    if k == 0 {
        return;
    }
    if k > SMALL_K {
        out.extend(top_k_large(values, k));
        return;
    }
    let mut best = [(f32::NEG_INFINITY, 0usize); SMALL_K];
    let mut len = 0;
    for (i, &v) in values.iter().enumerate() {
        if len == k {
            // Full: only a value strictly above the k-th enters, and the k-th leaves.
            if v.partial_cmp(&best[k - 1].0) != Some(Ordering::Greater) {
                continue;
            }
            len -= 1;
        }
        let mut at = len;
        while at > 0 && v > best[at - 1].0 {
            best[at] = best[at - 1];
            at -= 1;
        }
        best[at] = (v, i);
        len += 1;
    }
    out.extend(best[..len].iter().map(|&(_, i)| i));
}

/// The largest k kept on the stack by [`top_k`].
const SMALL_K: usize = 16;

/// [`top_k`] for a large k, on a heap buffer of indices.
fn top_k_large(values: &[f32], k: usize) -> Vec<usize> {
    let mut best: Vec<usize> = Vec::with_capacity(k + 1);
    // The k-th best value so far: anything not above it cannot enter once the buffer is full.
    let mut floor = f32::NEG_INFINITY;
    for (i, &v) in values.iter().enumerate() {
        if best.len() == k && v <= floor {
            continue;
        }
        let at = best.iter().position(|&j| v > values[j]).unwrap_or(best.len());
        best.insert(at, i);
        best.truncate(k);
        floor = values[*best.last().expect("not empty")];
    }
    best
}

/// The choices of a group's tokens, `k` per token (a validated router has k ≤ E, and top-k
/// always fills k): experts in choice order and their gates, before any capacity and before
/// `routed_scaling`. Flat, with scratch rows reused from token to token, so that choosing for a
/// group allocates a handful of buffers rather than a few per token.
#[derive(Debug, Clone, PartialEq)]
pub struct Choices {
    k: usize,
    experts: Vec<usize>,
    gates: Vec<f32>,
    /// Scratch: the row selected on, its affinities (sigmoid), group scores and indices.
    scratch: Scratch,
}

#[derive(Debug, Clone, Default, PartialEq)]
struct Scratch {
    select: Vec<f32>,
    affinities: Vec<f32>,
    groups: Vec<f32>,
    indices: Vec<usize>,
}

impl Choices {
    /// Room for `tokens` tokens' choices under `config`.
    pub fn new(config: &RouterConfig, tokens: usize) -> Choices {
        let k = config.k();
        Choices {
            k,
            experts: Vec::with_capacity(tokens * k),
            gates: Vec::with_capacity(tokens * k),
            scratch: Scratch::default(),
        }
    }

    /// Choices given whole: `experts` and `gates` hold `k` per token.
    #[cfg(test)]
    pub(crate) fn from_parts(k: usize, experts: Vec<usize>, gates: Vec<f32>) -> Choices {
        assert!(k > 0 && experts.len() == gates.len() && experts.len().is_multiple_of(k));
        Choices { k, experts, gates, scratch: Scratch::default() }
    }

    /// Routes per token.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Tokens chosen for so far.
    pub fn tokens(&self) -> usize {
        self.experts.len() / self.k
    }

    /// Every token's experts and gates, in token order.
    pub fn iter(&self) -> impl Iterator<Item = (&[usize], &[f32])> {
        self.experts.chunks_exact(self.k).zip(self.gates.chunks_exact(self.k))
    }

    /// Appends the choice of a token-choice router for one token.
    pub fn push(&mut self, config: &RouterConfig, row: Row<'_>) {
        self.push_from(config, row, None)
    }

    /// [`Choices::push`] selecting on `select` (a Sinkhorn-balanced row) instead of the
    /// affinities; the gates still come from the token's own scores.
    pub(crate) fn push_on(&mut self, config: &RouterConfig, row: Row<'_>, select: &[f32]) {
        self.push_from(config, row, Some(select))
    }

    fn push_from(&mut self, config: &RouterConfig, row: Row<'_>, select_on: Option<&[f32]>) {
        let Scratch { select: buf, affinities: sig, groups, indices } = &mut self.scratch;
        let aff: &[f32] = match config.score {
            ScoreFn::SoftmaxPre => row.softmax,
            ScoreFn::SoftmaxPost => row.logits,
            ScoreFn::Sigmoid => {
                sig.clear();
                sig.extend(row.logits.iter().map(|&l| sigmoid(l)));
                sig.as_slice()
            }
        };
        let mut select = select_on.unwrap_or(aff);
        let tc = config.token_choice();
        let (expert_bias, group_limit) =
            (tc.and_then(|t| t.expert_bias.as_ref()), tc.and_then(|t| t.group_limit.as_ref()));
        if expert_bias.is_some() || group_limit.is_some() {
            buf.clear();
            buf.extend_from_slice(select);
            if let Some(bias) = expert_bias {
                buf.iter_mut().zip(bias).for_each(|(s, b)| *s += b);
            }
            if let Some(g) = group_limit {
                let per_group = config.experts / g.groups;
                groups.clear();
                for chunk in buf.chunks(per_group) {
                    indices.clear();
                    top_k_into(chunk, g.score_top, indices);
                    groups.push(indices.iter().map(|&i| chunk[i]).sum());
                }
                indices.clear();
                top_k_into(groups, g.top_groups, indices);
                for (group, chunk) in buf.chunks_mut(per_group).enumerate() {
                    if !indices.contains(&group) {
                        chunk.fill(f32::NEG_INFINITY);
                    }
                }
            }
            select = buf.as_slice();
        }
        let start = self.experts.len();
        top_k_into(select, self.k, &mut self.experts);
        let experts = &self.experts[start..];
        let from = self.gates.len();
        match config.score {
            ScoreFn::SoftmaxPost => {
                self.gates.extend(experts.iter().map(|&e| row.logits[e]));
                softmax_in_place(&mut self.gates[from..]);
            }
            _ => self.gates.extend(experts.iter().map(|&e| aff[e])),
        }
        let gates = &mut self.gates[from..];
        if config.normalizes() && config.score != ScoreFn::SoftmaxPost {
            let sum: f32 = gates.iter().sum();
            // DeepSeek-V3 adds 1e-20 for sigmoid; Mixtral divides by the plain sum.
            let denom = if config.score == ScoreFn::Sigmoid { sum + 1e-20 } else { sum };
            gates.iter_mut().for_each(|g| *g /= denom);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::preset;

    /// One token's (experts, gates).
    fn choose(config: &RouterConfig, row: Row<'_>) -> (Vec<usize>, Vec<f32>) {
        let mut choices = Choices::new(config, 1);
        choices.push(config, row);
        let (experts, gates) = choices.iter().next().expect("one token");
        (experts.to_vec(), gates.to_vec())
    }

    #[test]
    fn top_k_breaks_ties_to_the_lowest_index() {
        assert_eq!(top_k(&[1.0, 3.0, 3.0, 2.0, 3.0], 3), vec![1, 2, 4]);
        assert_eq!(top_k(&[0.0, -0.0, 0.0], 2), vec![0, 1]);
    }

    #[test]
    fn top_k_equals_a_stable_sort_on_every_small_input() {
        // Every vector of length 5 over {-1, 0, 1, 2, -inf}: ties everywhere.
        let alphabet = [-1.0, 0.0, 1.0, 2.0, f32::NEG_INFINITY];
        for code in 0..alphabet.len().pow(5) {
            let values: Vec<f32> = (0..5).map(|i| alphabet[code / alphabet.len().pow(i) % alphabet.len()]).collect();
            let mut sorted: Vec<usize> = (0..5).collect();
            sorted.sort_by(|&a, &b| desc(values[a], values[b]));
            for k in 1..=5 {
                assert_eq!(top_k(&values, k), sorted[..k], "{values:?} k={k}");
                assert_eq!(top_k_large(&values, k), sorted[..k], "{values:?} k={k}");
            }
        }
    }

    #[test]
    fn top_k_on_either_side_of_the_stack_buffer_equals_a_stable_sort() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(15);
        for _ in 0..2000 {
            let n = rng.random_range(1..48);
            let values: Vec<f32> = (0..n).map(|_| rng.random_range(-3..4) as f32 * 0.5).collect();
            let mut sorted: Vec<usize> = (0..n).collect();
            sorted.sort_by(|&a, &b| desc(values[a], values[b]));
            let k = rng.random_range(1..=n.min(2 * SMALL_K));
            assert_eq!(top_k(&values, k), sorted[..k], "{values:?} k={k}");
        }
    }

    #[test]
    fn softmax_survives_large_logits() {
        let p = softmax(&[1000.0, 1000.0, -1000.0]);
        assert_eq!(p, vec![0.5, 0.5, 0.0]);
    }

    #[test]
    fn mixtral_renormalises_the_two_softmax_probabilities() {
        let config = preset("mixtral").unwrap().config().unwrap();
        let logits = [0.0, 2.0, 1.0, -1.0, 0.5, 0.0, 0.0, 0.0];
        let c = choose(&config, Row { logits: &logits, softmax: &softmax(&logits) });
        assert_eq!(c.0, vec![1, 2]);
        let p = softmax(&logits);
        assert_eq!(c.1, vec![p[1] / (p[1] + p[2]), p[2] / (p[1] + p[2])]);
    }

    #[test]
    fn softmax_post_is_the_softmax_of_the_chosen_logits() {
        let config = preset("megatron-probs").unwrap().config().unwrap();
        let c = choose(
            &config,
            Row {
                logits: &[0.0, 2.0, 1.0, -1.0, 0.5, 0.0, 0.0, 0.0],
                softmax: &softmax(&[0.0, 2.0, 1.0, -1.0, 0.5, 0.0, 0.0, 0.0]),
            },
        );
        assert_eq!(c.0, vec![1, 2]);
        assert_eq!(c.1, softmax(&[2.0, 1.0]));
    }

    #[test]
    fn deepseek_bias_selects_but_does_not_weigh() {
        let mut config = preset("deepseek-v3").unwrap().config().unwrap();
        config.experts = 8;
        let tc = config.token_choice_mut().unwrap();
        (tc.top_k, tc.group_limit) = (2, None);
        let mut bias = vec![0.0; 8];
        bias[7] = 10.0;
        tc.expert_bias = Some(bias);
        let logits = [3.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0, -3.0];
        let c = choose(&config, Row { logits: &logits, softmax: &softmax(&logits) });
        assert_eq!(c.0, vec![7, 0]);
        let (s7, s0) = (sigmoid(-3.0), sigmoid(3.0));
        assert_eq!(c.1, vec![s7 / (s7 + s0 + 1e-20), s0 / (s7 + s0 + 1e-20)]);
    }

    #[test]
    fn group_limit_excludes_experts_of_unchosen_groups() {
        let mut config = preset("deepseek-v3").unwrap().config().unwrap();
        config.experts = 8;
        let tc = config.token_choice_mut().unwrap();
        tc.top_k = 2;
        tc.group_limit = Some(crate::config::GroupLimit { groups: 4, top_groups: 1, score_top: 2 });
        // Group 0 = {0,1}: best single expert (5.0) but weak partner; group 2 = {4,5}: 4.0 + 4.0.
        let c = choose(
            &config,
            Row {
                logits: &[5.0, -5.0, 0.0, 0.0, 4.0, 4.0, 0.0, 0.0],
                softmax: &softmax(&[5.0, -5.0, 0.0, 0.0, 4.0, 4.0, 0.0, 0.0]),
            },
        );
        assert_eq!(c.0, vec![4, 5]);
    }
}
