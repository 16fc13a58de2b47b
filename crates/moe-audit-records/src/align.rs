//! Alignment before any rate: which rollout token and layer each trainer token and layer is
//! compared with, and the diagnoses that explain why the obvious pairing was wrong (layer
//! numbering, token offsets, padding, packing, aliasing) or why a replay failed.
//!
//! The declared pairing comes from the files (layer numbers, sequence boundaries, start
//! positions, padding rows that route nowhere); the routes themselves then test it. Two
//! independent routers agree on a whole top-k set almost never by chance (1 in C(64, 8) for a
//! random pair), so a layer or offset that matches another on most tokens is that other one.

use super::budget::Budget;
use super::diagnosis::{defect, note, Diagnosis, DiagnosisKind};
use super::formats::Sequence;
use super::record::Record;
use super::sides::{Role, Sides};
use super::text::{pct, ranges};
use moe_audit_core::error::{Error, Result};
use rayon::prelude::*;
use serde::Serialize;

/// A run of compared tokens: rollout rows `rollout..rollout+len` against trainer rows
/// `trainer..trainer+len`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Segment {
    /// The sequence (index in both records).
    pub sequence: usize,
    /// First rollout row.
    pub rollout: usize,
    /// First trainer row.
    pub trainer: usize,
    /// Tokens compared.
    pub len: usize,
    /// The shift applied to the declared pairing (trainer row = declared + offset).
    pub offset: i64,
}

/// A rollout layer compared with a trainer layer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LayerPair {
    /// Index on the rollout's layer axis.
    pub rollout_index: usize,
    /// Index on the trainer's layer axis.
    pub trainer_index: usize,
    /// The rollout layer's global number.
    pub rollout: usize,
    /// The trainer layer's global number.
    pub trainer: usize,
}

/// How the two records were paired for measuring.
#[derive(Debug, Clone, Serialize)]
pub struct Alignment {
    /// Token runs compared.
    pub segments: Vec<Segment>,
    /// Layers compared, by the trainer's global order.
    pub layers: Vec<LayerPair>,
    /// Tokens compared (the segments' total).
    pub tokens: usize,
}

/// A share of at least this many sampled tokens makes a layer or offset "the same routes".
const SAME: f64 = 0.5;
/// ... when it also beats the declared pairing by this much.
const BETTER: f64 = 0.25;
/// Two layers of one record matching on this share of tokens are aliases.
const ALIAS: f64 = 0.95;
/// Offsets tried when looking for the layer mapping, and per sequence.
const GLOBAL_SHIFT: i64 = 8;
const SEQUENCE_SHIFT: i64 = 64;
/// Sampled tokens: for the layer mapping, for the offset search, per sequence.
const SAMPLE: usize = 2048;
const SEARCH_SAMPLE: usize = 256;
const SEQUENCE_SAMPLE: usize = 64;

/// A token set's hash: order-free (the ids sorted), 0 for a row with no route.
fn set_hash(row: &[i32], scratch: &mut Vec<i32>) -> u64 {
    scratch.clear();
    scratch.extend(row.iter().copied().filter(|&e| e >= 0));
    if scratch.is_empty() {
        return 0;
    }
    scratch.sort_unstable();
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &e in scratch.iter() {
        h = (h ^ e as u32 as u64).wrapping_mul(0x0000_0100_0000_01b3);
        h ^= h >> 29;
    }
    h | 1
}

/// The set hashes of some token rows of a record (every layer): only the rows alignment
/// samples are hashed, so its memory does not grow with the record.
struct Hashes {
    tokens: Vec<usize>,
    hashes: Vec<u64>,
    layers: usize,
}

impl Hashes {
    /// Hashes the rows of `tokens` (any order, repeats allowed) of `r`.
    fn of(r: &Record, mut tokens: Vec<usize>, budget: &mut Budget) -> Result<Hashes> {
        tokens.sort_unstable();
        tokens.dedup();
        let l = r.layers.len();
        budget.take("hashing routes", (tokens.len() * l) as u64 * 8)?;
        let hashes = tokens
            .par_chunks(256)
            .map_init(
                || (Vec::new(), Vec::new()),
                |(row, scratch), chunk| {
                    let mut out = Vec::with_capacity(chunk.len() * l);
                    for &t in chunk {
                        r.rows(t..t + 1, row);
                        out.extend(row.chunks_exact(r.top_k).map(|ids| set_hash(ids, scratch)));
                    }
                    if let (Some(first), Some(last)) = (chunk.first(), chunk.last()) {
                        r.ids.release(first * l * r.top_k..(last + 1) * l * r.top_k);
                    }
                    out
                },
            )
            .flatten()
            .collect();
        Ok(Hashes { tokens, hashes, layers: l })
    }

    /// Where the row of `token` (one of those hashed) is held.
    fn index(&self, token: usize) -> usize {
        self.tokens.binary_search(&token).expect("a hashed row")
    }

    /// The hash of the row held at `index`, at layer index `layer`.
    fn at(&self, index: usize, layer: usize) -> u64 {
        self.hashes[index * self.layers + layer]
    }
}

/// A sequence's rows that carry routes, and the position of its first such row.
struct Content {
    rows: std::ops::Range<usize>,
    first_position: usize,
    left_pad: usize,
    right_pad: usize,
}

fn content(r: &Record, s: &Sequence) -> Content {
    let mut lo = s.rows.start;
    while lo < s.rows.end && r.token_empty(lo) {
        lo += 1;
    }
    let mut hi = s.rows.end;
    while hi > lo && r.token_empty(hi - 1) {
        hi -= 1;
    }
    Content { rows: lo..hi, first_position: s.first_position, left_pad: lo - s.rows.start, right_pad: s.rows.end - hi }
}

/// `(rollout token, trainer token)` pairs as where their rows are held in `ha` and `hb`.
fn held(ha: &Hashes, hb: &Hashes, pairs: Vec<(usize, usize)>) -> Vec<(usize, usize)> {
    pairs.into_iter().map(|(ta, tb)| (ha.index(ta), hb.index(tb))).collect()
}

/// Match rate of rollout layer `i` against trainer layer `j` over `pairs` (rows held), counting
/// only tokens routed in both.
fn rate(ha: &Hashes, i: usize, hb: &Hashes, j: usize, pairs: &[(usize, usize)]) -> f64 {
    let (mut same, mut both) = (0usize, 0usize);
    for &(ta, tb) in pairs {
        let (x, y) = (ha.at(ta, i), hb.at(tb, j));
        if x != 0 && y != 0 {
            both += 1;
            same += usize::from(x == y);
        }
    }
    if both == 0 {
        0.0
    } else {
        same as f64 / both as f64
    }
}

/// `n` indices spread evenly over `0..len` (all of them when `len <= n`).
fn spread(len: usize, n: usize) -> impl Iterator<Item = usize> {
    let n = n.min(len);
    (0..n).map(move |i| i * len / n.max(1))
}

/// Pairs the records and diagnoses the pairing, in steps: the declared pairing (sequences,
/// positions, padding), the layer mapping the routes show, then each sequence's offset.
pub(super) fn align(a: &Record, b: &Record, budget: &mut Budget) -> Result<(Alignment, Vec<Diagnosis>)> {
    let (segments, mut diagnoses) = declared_segments(a, b)?;
    let records = Sides::new(a, b);
    let routed = records.map(routed_layers);
    if let Some((role, _)) = routed.iter().find(|(_, r)| r.is_empty()) {
        return Err(Error::input(&records[role].path, "no layer has any route (every id is -1)"));
    }
    let mapping = map_layers(a, b, &sample(&segments), &routed, budget)?;
    diagnoses.extend(mapping_diagnosis(a, b, &mapping.remapped));
    for (role, found) in &mapping.aliases {
        diagnoses.extend(aliasing_diagnosis(role, records[role], found));
    }
    diagnoses.extend(unpaired_note(a, b, &routed, &mapping.pairs));
    if mapping.pairs.is_empty() {
        return Err(Error::input(&b.path, "no trainer layer has a rollout counterpart to compare with"));
    }
    let (segments_found, shifts) = sequence_offsets(a, b, &segments, &mapping.pairs, budget)?;
    diagnoses.extend(offset_diagnosis(&segments, &shifts));
    let tokens = segments_found.iter().map(|s| s.len).sum();
    if tokens == 0 {
        return Err(Error::input(&b.path, "no token of the trainer pairs with a rollout token"));
    }
    let mut layers = mapping.pairs;
    layers.sort_by_key(|p| (p.trainer, p.rollout));
    Ok((Alignment { segments: segments_found, layers, tokens }, diagnoses))
}

/// Indices of the layers of `r` that carry any route.
fn routed_layers(r: &Record) -> Vec<usize> {
    (0..r.layers.len()).filter(|&i| r.layer_routed(i)).collect()
}

/// A token pair sampled along a declared segment, with the trainer rows its sequence may shift
/// within (`lo..hi`).
#[derive(Debug, Clone, Copy)]
struct Sampled {
    rollout: usize,
    trainer: usize,
    lo: usize,
    hi: usize,
}

impl Sampled {
    /// The pair with the trainer token moved by `d`, if it stays within its sequence.
    fn shifted(&self, d: i64) -> Option<(usize, usize)> {
        let t = self.trainer as i64 + d;
        (t >= self.lo as i64 && t < self.hi as i64).then_some((self.rollout, t as usize))
    }
}

/// [`SAMPLE`] token pairs spread evenly over the declared segments.
fn sample(segments: &[Declared]) -> Vec<Sampled> {
    let all: usize = segments.iter().map(|s| s.0.len).sum();
    let mut flat = Vec::with_capacity(SAMPLE.min(all));
    let (mut cum, mut seg) = (0, 0);
    for k in spread(all, SAMPLE) {
        while k >= cum + segments[seg].0.len {
            cum += segments[seg].0.len;
            seg += 1;
        }
        let (s, bounds) = &segments[seg];
        flat.push(Sampled {
            rollout: s.rollout + k - cum,
            trainer: s.trainer + k - cum,
            lo: bounds.start,
            hi: bounds.end,
        });
    }
    flat
}

/// A trainer layer that matches another rollout layer than its own number says.
struct Remap {
    trainer: usize,
    rollout: usize,
    /// Its match rate with that rollout layer, and with its own.
    rate: f64,
    own_rate: f64,
}

/// Two routed layers of one record (indices) that route the same on `share` of sampled tokens.
struct Alias {
    first: usize,
    second: usize,
    share: f64,
}

/// Which rollout layer each routed trainer layer is compared with.
struct LayerMapping {
    pairs: Vec<LayerPair>,
    remapped: Vec<Remap>,
    /// Aliased layers of each record.
    aliases: Sides<Vec<Alias>>,
}

/// The layer mapping, at the global offset (within [`GLOBAL_SHIFT`]) that matches best: each
/// trainer layer keeps the rollout layer of its own number unless another matches on at least
/// [`SAME`] and by [`BETTER`] more; an aliased trainer layer keeps its own.
fn map_layers(
    a: &Record,
    b: &Record,
    sample: &[Sampled],
    routed: &Sides<Vec<usize>>,
    budget: &mut Budget,
) -> Result<LayerMapping> {
    let (routed_a, routed_b) = (&routed.rollout, &routed.trainer);
    // The rows looked at: the sample, the trainer's shifted as far as searched.
    let ha = Hashes::of(a, sample.iter().map(|s| s.rollout).collect(), budget)?;
    let hb = Hashes::of(
        b,
        sample.iter().flat_map(|s| (-GLOBAL_SHIFT..=GLOBAL_SHIFT).filter_map(|d| s.shifted(d)).map(|p| p.1)).collect(),
        budget,
    )?;
    let shifted = |d: i64, n: usize| -> Vec<(usize, usize)> {
        let step = (sample.len() / n.max(1)).max(1);
        held(&ha, &hb, sample.iter().step_by(step).filter_map(|s| s.shifted(d)).collect())
    };
    let score = |pairs: &[(usize, usize)]| -> f64 {
        let best: f64 =
            routed_b.iter().map(|&j| routed_a.iter().map(|&i| rate(&ha, i, &hb, j, pairs)).fold(0.0, f64::max)).sum();
        best / routed_b.len() as f64
    };
    let mut best_d = 0i64;
    let mut best_score = score(&shifted(0, SEARCH_SAMPLE));
    for d in (1..=GLOBAL_SHIFT).flat_map(|d| [d, -d]) {
        let s = score(&shifted(d, SEARCH_SAMPLE));
        if s > best_score + 1e-12 {
            best_score = s;
            best_d = d;
        }
    }
    let pairs = shifted(best_d, SAMPLE);
    let aliases_b = aliases(&hb, routed_b, pairs.iter().map(|p| p.1));
    let aliases_a = aliases(&ha, routed_a, pairs.iter().map(|p| p.0));
    let declared_partner = |j: usize| a.layers.iter().position(|&g| g == b.layers[j]).filter(|i| routed_a.contains(i));
    let mut layer_pairs = Vec::new();
    let mut remapped = Vec::new();
    for &j in routed_b {
        let own = declared_partner(j);
        let own_rate = own.map_or(0.0, |i| rate(&ha, i, &hb, j, &pairs));
        let aliased = aliases_b.iter().any(|al| al.second == j);
        let (mut best_i, mut best_rate) = (own, own_rate);
        if !aliased {
            for &i in routed_a {
                let r = rate(&ha, i, &hb, j, &pairs);
                if r >= SAME && r >= own_rate + BETTER && best_i.is_none_or(|_| r > best_rate) {
                    best_i = Some(i);
                    best_rate = r;
                }
            }
        }
        if let Some(i) = best_i {
            if Some(i) != own {
                remapped.push(Remap { trainer: j, rollout: i, rate: best_rate, own_rate });
            }
            layer_pairs.push(LayerPair {
                rollout_index: i,
                trainer_index: j,
                rollout: a.layers[i],
                trainer: b.layers[j],
            });
        }
    }
    Ok(LayerMapping { pairs: layer_pairs, remapped, aliases: Sides::new(aliases_a, aliases_b) })
}

/// The aliasing defect of one record (`role`), if any of its layers repeat another.
fn aliasing_diagnosis(role: Role, r: &Record, found: &[Alias]) -> Option<Diagnosis> {
    let first = found.first()?;
    let list: Vec<String> = found
        .iter()
        .take(6)
        .map(|al| format!("layer {} repeats layer {} on {}", r.layers[al.second], r.layers[al.first], pct(al.share)))
        .collect();
    let more = if found.len() > 6 { format!(" (and {} more)", found.len() - 6) } else { String::new() };
    Some(defect(
        DiagnosisKind::Aliasing,
        format!("{role}: {}{more} of sampled tokens", list.join("; ")),
        format!(
            "give each router its own record slot: layer {} took layer {}'s routes (an MTP layer picking up the backbone's first MoE layer is the known case)",
            r.layers[first.second], r.layers[first.first]
        ),
    ))
}

/// The note on the layers left out of the comparison: routed with no counterpart, or dense.
fn unpaired_note(a: &Record, b: &Record, routed: &Sides<Vec<usize>>, pairs: &[LayerPair]) -> Option<Diagnosis> {
    let (routed_a, routed_b) = (&routed.rollout, &routed.trainer);
    let unpaired_b: Vec<usize> =
        routed_b.iter().filter(|&&j| !pairs.iter().any(|p| p.trainer_index == j)).map(|&j| b.layers[j]).collect();
    let unpaired_a: Vec<usize> =
        routed_a.iter().filter(|&&i| !pairs.iter().any(|p| p.rollout_index == i)).map(|&i| a.layers[i]).collect();
    let dense = |r: &Record, routed: &[usize]| -> Vec<usize> {
        (0..r.layers.len()).filter(|i| !routed.contains(i)).map(|i| r.layers[i]).collect()
    };
    let parts: Vec<String> = [
        ("trainer routed layers with no rollout counterpart", unpaired_b),
        ("rollout routed layers with no trainer counterpart", unpaired_a),
        ("rollout layers with no route at all (dense)", dense(a, routed_a)),
        ("trainer layers with no route at all (dense)", dense(b, routed_b)),
    ]
    .into_iter()
    .filter(|(_, list)| !list.is_empty())
    .map(|(what, list)| format!("{what}: {}", ranges(&list)))
    .collect();
    (!parts.is_empty()).then(|| note(DiagnosisKind::Unpaired, format!("left out: {}", parts.join("; ")), ""))
}

/// A sequence that matches the rollout better shifted by `offset` (match rate `rate`, against
/// `at_zero` unshifted).
struct Shift {
    sequence: usize,
    offset: i64,
    rate: f64,
    at_zero: f64,
}

/// Each declared segment at the offset (within [`SEQUENCE_SHIFT`]) where its mapped layers match
/// best, clipped to rows both sides have; and the sequences that moved. Sequences are searched
/// in parallel, each hashing only the rows it samples (results in sequence order).
fn sequence_offsets(
    a: &Record,
    b: &Record,
    segments: &[Declared],
    layer_pairs: &[LayerPair],
    budget: &Budget,
) -> Result<(Vec<Segment>, Vec<Shift>)> {
    let searched = segments
        .par_iter()
        .map(|(s, bounds)| -> Result<(i64, f64, f64)> {
            let reach = if s.len >= 8 { SEQUENCE_SHIFT.min(s.len as i64 - 1) } else { 0 };
            let pairs_at = |d: i64| -> Vec<(usize, usize)> {
                spread(s.len, SEQUENCE_SAMPLE)
                    .filter_map(|k| {
                        let t = (s.trainer + k) as i64 + d;
                        (t >= bounds.start as i64 && t < bounds.end as i64).then_some((s.rollout + k, t as usize))
                    })
                    .collect()
            };
            let mut local = Budget::clone(budget);
            let ha = Hashes::of(a, pairs_at(0).iter().map(|p| p.0).collect(), &mut local)?;
            let hb = Hashes::of(
                b,
                (-reach..=reach).flat_map(|d| pairs_at(d).into_iter().map(|p| p.1)).collect(),
                &mut local,
            )?;
            let mapped = |pairs: Vec<(usize, usize)>| -> f64 {
                let pairs = &held(&ha, &hb, pairs);
                if pairs.len() * 2 < s.len.min(SEQUENCE_SAMPLE) {
                    return 0.0;
                }
                layer_pairs.iter().map(|p| rate(&ha, p.rollout_index, &hb, p.trainer_index, pairs)).sum::<f64>()
                    / layer_pairs.len() as f64
            };
            let at_zero = mapped(pairs_at(0));
            let (mut d_best, mut r_best) = (0i64, at_zero);
            for d in (1..=reach).flat_map(|d| [d, -d]) {
                let r = mapped(pairs_at(d));
                if r > r_best + 1e-12 {
                    (d_best, r_best) = (d, r);
                }
            }
            Ok((d_best, r_best, at_zero))
        })
        .collect::<Result<Vec<_>>>()?;
    let mut found = Vec::with_capacity(segments.len());
    let mut shifts = Vec::new();
    for ((s, bounds), (d_best, r_best, at_zero)) in segments.iter().zip(searched) {
        let d = if d_best != 0 && r_best >= SAME && r_best >= at_zero + BETTER { d_best } else { 0 };
        if d != 0 {
            shifts.push(Shift { sequence: s.sequence, offset: d, rate: r_best, at_zero });
        }
        // The shifted pairing, clipped to rows both sides have.
        let lo = (bounds.start as i64 - (s.trainer as i64 + d)).max(0) as usize;
        let hi = (bounds.end as i64 - (s.trainer as i64 + d)).clamp(0, s.len as i64) as usize;
        if hi > lo {
            found.push(Segment {
                sequence: s.sequence,
                rollout: s.rollout + lo,
                trainer: (s.trainer as i64 + d + lo as i64) as usize,
                len: hi - lo,
                offset: d,
            });
        }
    }
    Ok((found, shifts))
}

/// Pairs of routed layers of one record that route the same on at least [`ALIAS`] of `rows` (held).
fn aliases(h: &Hashes, routed: &[usize], rows: impl Iterator<Item = usize>) -> Vec<Alias> {
    let rows: Vec<usize> = rows.collect();
    let mut out = Vec::new();
    for (x, &i) in routed.iter().enumerate() {
        for &j in &routed[x + 1..] {
            let (mut same, mut both) = (0usize, 0usize);
            for &t in &rows {
                let (p, q) = (h.at(t, i), h.at(t, j));
                if p != 0 && q != 0 {
                    both += 1;
                    same += usize::from(p == q);
                }
            }
            if both >= 16 && same as f64 >= ALIAS * both as f64 {
                out.push(Alias { first: i, second: j, share: same as f64 / both as f64 });
            }
        }
    }
    out
}

/// The layer-mapping defect, said as one shift when the remapped layers share one.
fn mapping_diagnosis(a: &Record, b: &Record, remapped: &[Remap]) -> Option<Diagnosis> {
    let first = remapped.first()?;
    let shift = |r: &Remap| a.layers[r.rollout] as i64 - b.layers[r.trainer] as i64;
    let common = shift(first);
    let same_shift = remapped.iter().all(|r| shift(r) == common);
    let worst = remapped.iter().map(|r| r.rate).fold(1.0, f64::min);
    let own = remapped.iter().map(|r| r.own_rate).fold(0.0, f64::max);
    let routed_b = (0..b.layers.len()).filter(|&j| b.layer_routed(j)).count();
    let found = if same_shift {
        let sign = if common >= 0 { format!("+{common}") } else { common.to_string() };
        format!(
            "trainer layer i matches rollout layer i{sign} on at least {} of sampled tokens, for {} of {} routed trainer layers (trainer layer {} = rollout layer {}); at its own number at most {}",
            pct(worst),
            remapped.len(),
            routed_b,
            b.layers[first.trainer],
            a.layers[first.rollout],
            pct(own)
        )
    } else {
        let list: Vec<String> = remapped
            .iter()
            .take(8)
            .map(|r| format!("trainer {} = rollout {} ({})", b.layers[r.trainer], a.layers[r.rollout], pct(r.rate)))
            .collect();
        format!("{} trainer layers match another rollout layer than their own: {}", remapped.len(), list.join(", "))
    };
    let change = if same_shift {
        format!(
            "index replay by global layer number: one side counts {} layers the other does not (dense layers before the first MoE layer, as a replay indexed by MoE-layer order does)",
            common.abs()
        )
    } else {
        "index replay by global layer number on both sides (write `layers` into each record)".to_string()
    };
    Some(defect(DiagnosisKind::LayerMapping, found, change))
}

/// The token-offset or packing defect from the sequences that matched shifted.
fn offset_diagnosis(segments: &[Declared], shifts: &[Shift]) -> Option<Diagnosis> {
    let first = shifts.first()?;
    let compared = segments.iter().filter(|s| s.0.len >= 8).count();
    if shifts.iter().all(|s| s.offset == first.offset) && shifts.len() == compared {
        let d = first.offset;
        let best = shifts.iter().map(|s| s.rate).fold(1.0, f64::min);
        let zero = shifts.iter().map(|s| s.at_zero).fold(0.0, f64::max);
        // The rollout's rows start d positions late and it is shorter by at least d: rows
        // dropped at the start and not recorded (vLLM's routed_experts_prompt_start).
        let late = d > 0
            && shifts.iter().all(|s| {
                segments.iter().find(|g| g.0.sequence == s.sequence).is_some_and(|g| g.1.len() >= g.0.len + d as usize)
            });
        if late {
            return Some(defect(
                DiagnosisKind::PromptStart,
                format!(
                    "rollout row 0 is trainer position {d}: the rollout starts {d} position(s) into the sequence (matching on at least {} of sampled (token, layer) pairs in {} sequence(s), against at most {} from position 0)",
                    pct(best),
                    shifts.len(),
                    pct(zero)
                ),
                format!("the start is not in the record (vLLM's routed_experts_prompt_start is not recorded): replay row t at position t + {d}, or record the start next to the routes (SGLang's routed_experts_start_len)"),
            ));
        }
        let change = if d.abs() == 1 {
            "shift the replayed rows by one: an engine's row t is the route of token t over positions [start, seqlen-1), one row short per request; the trainer must read row t for token t and pad the missing row at the end, not the start".to_string()
        } else {
            format!("shift the replayed rows by {d}: left padding or a prompt offset was not accounted for")
        };
        return Some(defect(
            DiagnosisKind::TokenOffset,
            format!(
                "rollout token t matches trainer token t{}{} on at least {} of sampled (token, layer) pairs in {} sequence(s), against at most {} at the declared alignment",
                if d > 0 { "+" } else { "" },
                d,
                pct(best),
                shifts.len(),
                pct(zero)
            ),
            change,
        ));
    }
    let list: Vec<String> =
        shifts.iter().take(8).map(|s| format!("sequence {} at {:+} ({})", s.sequence, s.offset, pct(s.rate))).collect();
    Some(defect(
        DiagnosisKind::Packing,
        format!(
            "{} of {} packed sequences match the rollout only when shifted, by different amounts: {}",
            shifts.len(),
            compared,
            list.join(", ")
        ),
        "index the replay of each packed sequence from its own start (cu_seqlens with the alignment padding, e.g. cu_seqlens_padded), not from the unpadded concatenation".to_string(),
    ))
}

/// A declared segment and the trainer rows of its sequence that carry routes (the bounds a
/// shifted pairing stays within).
type Declared = (Segment, std::ops::Range<usize>);

/// The declared pairing: sequence by sequence, by position, past padding rows; with the notes
/// on padding, length and start that it took.
fn declared_segments(a: &Record, b: &Record) -> Result<(Vec<Declared>, Vec<Diagnosis>)> {
    let mismatch =
        |m: String| Error::input(&b.path, format!("tokens do not match the rollout's ({}): {m}", a.path.display()));
    let sequences = Sides::new(sequences_of(a, b), sequences_of(b, a));
    let (sa, sb) = (&sequences.rollout, &sequences.trainer);
    if sa.len() != sb.len() {
        return Err(mismatch(format!("{} sequences in the rollout, {} in the trainer", sa.len(), sb.len())));
    }
    let mut out = Vec::new();
    let mut edges = Edges::default();
    for (s, (qa, qb)) in sa.iter().zip(sb).enumerate() {
        let content = Sides::new(content(a, qa), content(b, qb));
        if let Some(seg) = edges.pair(s, &content) {
            same_tokens(a, b, &seg, content.rollout.first_position.max(content.trainer.first_position))
                .map_err(mismatch)?;
            out.push((seg, content.trainer.rows.clone()));
        }
    }
    if out.is_empty() {
        return Err(mismatch("no position is covered by both records".into()));
    }
    Ok((out, edges.notes(sa.len())))
}

/// A record's sequences; one undivided sequence is cut as `other`'s when both have as many rows
/// (a trainer record of a packed batch stored as one array).
fn sequences_of(r: &Record, other: &Record) -> Vec<Sequence> {
    let split = r.sequences.len() == 1
        && other.sequences.len() > 1
        && r.tokens == other.tokens
        && r.sequences[0].first_position == 0;
    if split {
        other.sequences.iter().map(|s| Sequence { rows: s.rows.clone(), first_position: 0 }).collect()
    } else {
        r.sequences.clone()
    }
}

/// Where a declared segment's token ids (when both records carry them) differ: refused.
fn same_tokens(a: &Record, b: &Record, seg: &Segment, p0: usize) -> std::result::Result<(), String> {
    let (Some(ia), Some(ib)) = (&a.input_ids, &b.input_ids) else { return Ok(()) };
    match (0..seg.len).find(|&k| ia[seg.rollout + k] != ib[seg.trainer + k]) {
        Some(k) => Err(format!(
            "sequence {}, position {}: token id {} in the rollout, {} in the trainer",
            seg.sequence,
            p0 + k,
            ia[seg.rollout + k],
            ib[seg.trainer + k]
        )),
        None => Ok(()),
    }
}

/// What the declared pairing passed over at the sequences' edges: padding rows, later starts,
/// different ends.
#[derive(Default)]
struct Edges {
    /// (side, sequence, left, right) padding rows.
    pads: Vec<(Role, usize, usize, usize)>,
    /// (sequence, rollout end minus trainer end).
    ends: Vec<(usize, i64)>,
    /// (sequence, rollout start, trainer start).
    starts: Vec<(usize, usize, usize)>,
}

impl Edges {
    /// Sequence `s` paired by position over the positions both sides cover (`None`: none), its
    /// edges noted.
    fn pair(&mut self, s: usize, content: &Sides<Content>) -> Option<Segment> {
        for (role, c) in content {
            if c.left_pad + c.right_pad > 0 {
                self.pads.push((role, s, c.left_pad, c.right_pad));
            }
        }
        let (ca, cb) = (&content.rollout, &content.trainer);
        let (fa, fb) = (ca.first_position, cb.first_position);
        let (ea, eb) = (fa + ca.rows.len(), fb + cb.rows.len());
        if fa != fb {
            self.starts.push((s, fa, fb));
        }
        if ea != eb {
            self.ends.push((s, ea as i64 - eb as i64));
        }
        let (p0, p1) = (fa.max(fb), ea.min(eb));
        (p1 > p0).then(|| Segment {
            sequence: s,
            rollout: ca.rows.start + p0 - fa,
            trainer: cb.rows.start + p0 - fb,
            len: p1 - p0,
            offset: 0,
        })
    }

    /// The notes (and the one-row-short defect) on what was passed over, of `sequences`.
    fn notes(&self, sequences: usize) -> Vec<Diagnosis> {
        let mut notes = Vec::new();
        if !self.pads.is_empty() {
            let list: Vec<String> = self
                .pads
                .iter()
                .take(6)
                .map(|(role, s, l, r)| format!("{role} sequence {s}: {l} left, {r} right"))
                .collect();
            let more = if self.pads.len() > 6 { format!(" (and {} more)", self.pads.len() - 6) } else { String::new() };
            notes.push(note(
                DiagnosisKind::Padding,
                format!("padding rows (no route in any layer), aligned past: {}{more}", list.join("; ")),
                "",
            ));
        }
        if let Some(&(s, fa, fb)) = self.starts.first() {
            notes.push(note(
                DiagnosisKind::Length,
                format!(
                    "{} sequence(s) start at different positions (sequence {s}: rollout from position {fa}, trainer from {fb}, as SGLang's routed_experts_start_len); compared from the later",
                    self.starts.len()
                ),
                "",
            ));
        }
        notes.extend(self.end_notes(sequences));
        notes
    }

    /// Different ends: one row short per request (the engines' convention, or one beyond it),
    /// else the ends listed.
    fn end_notes(&self, sequences: usize) -> Vec<Diagnosis> {
        let ends = &self.ends;
        let Some(&(_, d)) = ends.first() else { return Vec::new() };
        let mut out = Vec::new();
        let same = ends.iter().all(|e| e.1 == d);
        if same && d == -2 && ends.len() == sequences {
            out.push(defect(
                DiagnosisKind::OneRowShort,
                format!("the rollout ends two positions before the trainer in all {} sequence(s): one row short per request beyond the engines' len-1 convention", ends.len()),
                "the engine dropped a row per request (a prefill-only off-by-one, SGLang #20964): engines return seqlen-1 rows, row t for token t",
            ));
        }
        let found = if same && d == -1 {
            format!("the rollout ends one position before the trainer in {} sequence(s): one row short per request, as engines write it (positions [start, seqlen-1): the last sampled token is never forwarded); the trainer's last position is not compared", ends.len())
        } else {
            let list: Vec<String> = ends.iter().take(6).map(|(s, d)| format!("sequence {s}: {d:+}")).collect();
            format!("the records end at different positions (rollout end minus trainer end): {}; compared where both have routes", list.join(", "))
        };
        let kind = if same && d == -1 { DiagnosisKind::OneRowShort } else { DiagnosisKind::Length };
        out.push(note(kind, found, ""));
        out
    }
}
