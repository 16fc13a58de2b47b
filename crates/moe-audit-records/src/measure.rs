//! The measures on aligned pairs: per layer the share of tokens whose expert set differs and
//! the mean top-k overlap; per token the first layer that differs; overall the R3 paper's two
//! headline numbers (share of router decisions that differ, share of tokens that differ in at
//! least one layer); with logits, the margin at each flip against the median margin.
//!
//! A decision is one (token, layer) pair where at least one side routes; its expert *set* is
//! compared (slot order is counted apart, as `order_only`). Counts are integers summed per
//! chunk, so the result is the same whatever the thread count.

use super::align::{Alignment, LayerPair};
use super::budget::Budget;
use super::record::Record;
use super::sides::{Role, Sides};
use moe_audit_core::error::Result;
use rayon::prelude::*;
use serde::Serialize;

/// One compared layer.
#[derive(Debug, Clone, Serialize)]
pub struct LayerMeasure {
    /// The rollout layer's global number.
    pub rollout: usize,
    /// The trainer layer's global number.
    pub trainer: usize,
    /// Decisions compared.
    pub decisions: usize,
    /// Share of them whose expert set differs.
    pub differ: f64,
    /// Mean share of the top-k both sides chose.
    pub overlap: f64,
    /// Tokens whose first differing layer (in trainer order) is this one.
    pub first_differing: usize,
}

/// Router margins at flips against all margins (the gap between the k-th and the (k+1)-th
/// logit of the side that recorded logits).
#[derive(Debug, Clone, Serialize)]
pub struct Margins {
    /// Whose logits.
    pub side: Role,
    /// Decisions whose set differs.
    pub flips: usize,
    /// Median margin over the flips.
    pub median_flip: f64,
    /// Median margin over every compared decision.
    pub median_all: f64,
    /// Share of flips whose margin is under a tenth of the median margin.
    pub near_ties: f64,
}

/// Everything measured on the aligned pairs.
#[derive(Debug, Clone, Serialize)]
pub struct Measures {
    /// Tokens compared.
    pub tokens: usize,
    /// Decisions compared.
    pub decisions: usize,
    /// Share of decisions whose expert set differs (headline 1).
    pub decisions_differ: f64,
    /// Share of tokens that differ in at least one layer (headline 2).
    pub tokens_differ: f64,
    /// Mean share of the top-k both sides chose, over all decisions.
    pub overlap: f64,
    /// Decisions with the same set in another slot order (counted as agreeing).
    pub order_only: usize,
    /// (token, layer) pairs routed on one side only (a missing route): not decisions.
    pub missing: usize,
    /// Per layer, in the trainer's order.
    pub layers: Vec<LayerMeasure>,
    /// Mean index (in trainer layer order, 0-based) of the first differing layer of the tokens
    /// that differ.
    pub mean_first_differing: Option<f64>,
    /// With logits: margins at flips against all margins.
    pub margins: Option<Margins>,
    /// The first [`LANES`] tokens that differ, in aligned order, with every flip: the HTML
    /// report's lanes (not in the JSON, whose figures are shares).
    #[serde(skip)]
    pub lanes: Vec<Lane>,
}

/// Tokens kept as lanes: enough to see a pattern, few enough for a page.
pub const LANES: usize = 48;

/// One token that differs in at least one layer.
#[derive(Debug, Clone, PartialEq)]
pub struct Lane {
    /// Its index among the aligned tokens (segment order).
    pub order: usize,
    /// The sequence.
    pub sequence: usize,
    /// Its rollout row.
    pub rollout: usize,
    /// Its trainer row.
    pub trainer: usize,
    /// Every layer whose expert set differs, in trainer order.
    pub flips: Vec<Flip>,
}

/// One decision whose expert set differs.
#[derive(Debug, Clone, PartialEq)]
pub struct Flip {
    /// Index into [`Measures::layers`].
    pub layer: usize,
    /// The rollout's experts, sorted.
    pub rollout: Vec<i32>,
    /// The trainer's experts, sorted.
    pub trainer: Vec<i32>,
    /// The router margin there, when a side recorded logits.
    pub margin: Option<f32>,
}

/// Counts of one chunk of tokens, summed afterwards.
#[derive(Default, Clone)]
struct Counts {
    decisions: Vec<u64>,
    differ: Vec<u64>,
    common: Vec<u64>,
    width: Vec<u64>,
    first: Vec<u64>,
    order_only: u64,
    missing: u64,
    tokens_differ: u64,
    first_sum: u64,
    margins: Vec<(f32, bool)>,
    lanes: Vec<Lane>,
}

impl Counts {
    fn new(layers: usize) -> Self {
        let z = vec![0; layers];
        Counts {
            decisions: z.clone(),
            differ: z.clone(),
            common: z.clone(),
            width: z.clone(),
            first: z,
            ..Default::default()
        }
    }

    fn add(mut self, o: Counts) -> Counts {
        for (x, y) in [
            (&mut self.decisions, &o.decisions),
            (&mut self.differ, &o.differ),
            (&mut self.common, &o.common),
            (&mut self.width, &o.width),
            (&mut self.first, &o.first),
        ] {
            x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
        }
        self.order_only += o.order_only;
        self.missing += o.missing;
        self.tokens_differ += o.tokens_differ;
        self.first_sum += o.first_sum;
        self.margins.extend(o.margins);
        // The first lanes in aligned order, whatever order the pieces are summed in.
        self.lanes.extend(o.lanes);
        self.lanes.sort_unstable_by_key(|l| l.order);
        self.lanes.truncate(LANES);
        self
    }
}

/// A decision as an expert set: the non-negative ids of a row (a negative id is no route),
/// sorted, into `out`. What `routes compare` compares, so that every comparison of decisions
/// (the engine audit's too) agrees on what a change is.
pub fn expert_set(row: &[i32], out: &mut Vec<i32>) {
    out.clear();
    out.extend(row.iter().copied().filter(|&e| e >= 0));
    out.sort_unstable();
}

/// How many experts two [`expert_set`]s share (both sorted).
pub fn shared_experts(x: &[i32], y: &[i32]) -> usize {
    let (mut i, mut j, mut n) = (0, 0, 0);
    while i < x.len() && j < y.len() {
        match x[i].cmp(&y[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                n += 1;
                i += 1;
                j += 1;
            }
        }
    }
    n
}

/// The gap between the k-th and (k+1)-th largest of `row` (`scratch` reused).
fn margin(row: &[f32], k: usize, scratch: &mut Vec<f32>) -> f32 {
    if k == 0 || k >= row.len() {
        return f32::INFINITY;
    }
    scratch.clear();
    scratch.extend_from_slice(row);
    scratch.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
    let kth = scratch[k - 1];
    let next = scratch[k..].iter().copied().fold(f32::NEG_INFINITY, f32::max);
    kth - next
}

fn median(values: &mut [f32]) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mid = values.len() / 2;
    let (_, m, _) = values.select_nth_unstable_by(mid, f32::total_cmp);
    *m as f64
}

impl Measures {
    /// Nothing measured (a record with no route at all).
    pub fn none() -> Measures {
        Measures {
            tokens: 0,
            decisions: 0,
            decisions_differ: 0.0,
            tokens_differ: 0.0,
            overlap: 0.0,
            order_only: 0,
            missing: 0,
            layers: Vec::new(),
            mean_first_differing: None,
            margins: None,
            lanes: Vec::new(),
        }
    }
}

/// Tokens per parallel chunk.
const CHUNK: usize = 1024;

pub(super) fn measure(a: &Record, b: &Record, al: &Alignment, budget: &mut Budget) -> Result<Measures> {
    measure_in(a, b, al, budget, CHUNK)
}

/// [`measure`] reading `chunk` tokens of each side at a time (any size gives the same result), in
/// steps: the aligned rows cut into [`Piece`]s, each piece's [`Counts`] taken in parallel and
/// summed, the measures taken from the counts.
pub(super) fn measure_in(
    a: &Record,
    b: &Record,
    al: &Alignment,
    budget: &mut Budget,
    chunk: usize,
) -> Result<Measures> {
    let records = Sides::new(a, b);
    let logits = Logits::of(records);
    if logits.is_some() {
        budget.take("margins", (al.tokens * al.layers.len()) as u64 * 8)?;
    }
    let measuring = Measuring { records, al, logits, widths: records.map(|r| r.layers.len() * r.top_k) };
    let counts = pieces(al, chunk)
        .par_iter()
        .map_init(Buffers::default, |buffers, piece| measuring.count(piece, buffers))
        .reduce(|| Counts::new(al.layers.len()), Counts::add);
    Ok(measures_from(counts, al, measuring.logits.map(|l| l.role)))
}

/// Aligned rows read together: `len` tokens from row `rows` of each side, the first being
/// aligned token `order` (of sequence `sequence`).
#[derive(Debug, Clone, Copy)]
struct Piece {
    rows: Sides<usize>,
    len: usize,
    order: usize,
    sequence: usize,
}

/// Every aligned run of rows, in pieces of `chunk` tokens.
fn pieces(al: &Alignment, chunk: usize) -> Vec<Piece> {
    let starts = al.segments.iter().scan(0, |order, s| {
        *order += s.len;
        Some(*order - s.len)
    });
    al.segments
        .iter()
        .zip(starts)
        .flat_map(|(s, start)| {
            (0..s.len).step_by(chunk).map(move |k| Piece {
                rows: Sides::new(s.rollout + k, s.trainer + k),
                len: chunk.min(s.len - k),
                order: start + k,
                sequence: s.sequence,
            })
        })
        .collect()
}

/// With logits, one margin per decision: the trainer's when it has them, else the rollout's.
#[derive(Clone, Copy)]
struct Logits<'a> {
    role: Role,
    record: &'a Record,
    logits: &'a [f32],
    width: usize,
}

impl<'a> Logits<'a> {
    fn of(records: Sides<&'a Record>) -> Option<Self> {
        [Role::Trainer, Role::Rollout].into_iter().find_map(|role| {
            let record = records[role];
            Some(Logits { role, record, logits: record.logits.as_deref()?, width: record.num_experts? })
        })
    }

    /// The margin of token `i` of `piece` at the layer pair `pair`.
    fn margin(&self, piece: &Piece, i: usize, pair: &LayerPair, scratch: &mut Vec<f32>) -> f32 {
        let (t, layer) = match self.role {
            Role::Trainer => (piece.rows.trainer + i, pair.trainer_index),
            Role::Rollout => (piece.rows.rollout + i, pair.rollout_index),
        };
        let at = (t * self.record.layers.len() + layer) * self.width;
        margin(&self.logits[at..at + self.width], self.record.top_k, scratch)
    }
}

/// One thread's buffers: both sides' rows of a piece, two sorted sets, a margin's scratch.
#[derive(Default)]
struct Buffers {
    rows: Sides<Vec<i32>>,
    x: Vec<i32>,
    y: Vec<i32>,
    scratch: Vec<f32>,
}

/// What every piece is measured against.
struct Measuring<'a> {
    records: Sides<&'a Record>,
    al: &'a Alignment,
    logits: Option<Logits<'a>>,
    /// Ids per token row of each side.
    widths: Sides<usize>,
}

impl Measuring<'_> {
    /// The counts of one piece: both sides' rows read once (and their pages given back).
    fn count(&self, piece: &Piece, buffers: &mut Buffers) -> Counts {
        for (role, r) in self.records {
            let (from, w) = (piece.rows[role], self.widths[role]);
            r.rows(from..from + piece.len, &mut buffers.rows[role]);
            r.ids.release(from * w..(from + piece.len) * w);
        }
        let mut c = Counts::new(self.al.layers.len());
        for i in 0..piece.len {
            self.count_token(piece, i, buffers, &mut c);
        }
        c
    }

    /// Token `i` of `piece` at every layer pair: its decisions, first differing layer, lane.
    fn count_token(&self, piece: &Piece, i: usize, buffers: &mut Buffers, c: &mut Counts) {
        let Buffers { rows, x, y, scratch } = buffers;
        let (a, b) = (self.records.rollout, self.records.trainer);
        let mut first = None;
        let mut flips = Vec::new();
        for (p, pair) in self.al.layers.iter().enumerate() {
            let ra_row = &rows.rollout[i * self.widths.rollout + pair.rollout_index * a.top_k..][..a.top_k];
            let rb_row = &rows.trainer[i * self.widths.trainer + pair.trainer_index * b.top_k..][..b.top_k];
            let Some(same) = c.decide(p, ra_row, rb_row, x, y) else { continue };
            let mut flip = None;
            if !same {
                first.get_or_insert(p);
                if c.lanes.len() < LANES {
                    flip = Some(Flip { layer: p, rollout: x.clone(), trainer: y.clone(), margin: None });
                }
            }
            if let Some(logits) = &self.logits {
                let m = logits.margin(piece, i, pair, scratch);
                c.margins.push((m, !same));
                flip.iter_mut().for_each(|f| f.margin = Some(m));
            }
            flips.extend(flip);
        }
        if let Some(p) = first {
            c.tokens_differ += 1;
            c.first[p] += 1;
            c.first_sum += p as u64;
        }
        if !flips.is_empty() {
            let (rollout, trainer) = (piece.rows.rollout + i, piece.rows.trainer + i);
            c.lanes.push(Lane { order: piece.order + i, sequence: piece.sequence, rollout, trainer, flips });
        }
    }
}

impl Counts {
    /// One decision at layer pair `p`: whether both sides chose the same expert set, counted
    /// (`x` and `y` hold the sorted sets when they differ); `None` when it is no decision (no
    /// route on either side, or on one side only: a missing route, counted apart).
    fn decide(&mut self, p: usize, ra_row: &[i32], rb_row: &[i32], x: &mut Vec<i32>, y: &mut Vec<i32>) -> Option<bool> {
        // (Compared element by element: a slice `==` calls memcmp for 8 ids.)
        let same = if ra_row.len() == rb_row.len() && ra_row.iter().zip(rb_row).all(|(x, y)| x == y) {
            // The common case, without sorting: one set, in one slot order.
            let routes = ra_row.iter().filter(|&&e| e >= 0).count();
            if routes == 0 {
                return None;
            }
            self.common[p] += routes as u64;
            self.width[p] += routes as u64;
            true
        } else {
            expert_set(ra_row, x);
            expert_set(rb_row, y);
            if x.is_empty() || y.is_empty() {
                self.missing += u64::from(x.len() != y.len());
                return None;
            }
            let same = x == y;
            if same {
                self.order_only += 1;
            } else {
                self.differ[p] += 1;
            }
            self.common[p] += shared_experts(x, y) as u64;
            self.width[p] += x.len().max(y.len()) as u64;
            same
        };
        self.decisions[p] += 1;
        Some(same)
    }
}

/// The measures from the summed counts; margins from the side `margins` when it had logits.
fn measures_from(counts: Counts, al: &Alignment, margins: Option<Role>) -> Measures {
    let compared = al.tokens;
    let share = |x: u64, of: u64| if of == 0 { 0.0 } else { x as f64 / of as f64 };
    let layers = al
        .layers
        .iter()
        .enumerate()
        .map(|(p, pair)| LayerMeasure {
            rollout: pair.rollout,
            trainer: pair.trainer,
            decisions: counts.decisions[p] as usize,
            differ: share(counts.differ[p], counts.decisions[p]),
            overlap: share(counts.common[p], counts.width[p]),
            first_differing: counts.first[p] as usize,
        })
        .collect();
    let decisions: u64 = counts.decisions.iter().sum();
    let differ: u64 = counts.differ.iter().sum();
    let margins = margins.map(|side| {
        let mut flips: Vec<f32> = counts.margins.iter().filter(|m| m.1).map(|m| m.0).collect();
        let threshold = {
            let mut all: Vec<f32> = counts.margins.iter().map(|m| m.0).collect();
            median(&mut all)
        };
        let near = flips.iter().filter(|&&m| (m as f64) < threshold / 10.0).count();
        Margins {
            side,
            flips: flips.len(),
            near_ties: share(near as u64, flips.len() as u64),
            median_flip: median(&mut flips),
            median_all: threshold,
        }
    });
    Measures {
        tokens: compared,
        decisions: decisions as usize,
        decisions_differ: share(differ, decisions),
        tokens_differ: share(counts.tokens_differ, compared as u64),
        overlap: share(counts.common.iter().sum(), counts.width.iter().sum()),
        order_only: counts.order_only as usize,
        missing: counts.missing as usize,
        layers,
        mean_first_differing: (counts.tokens_differ > 0).then(|| counts.first_sum as f64 / counts.tokens_differ as f64),
        margins,
        lanes: counts.lanes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{from_ids, IdArray};

    fn record(name: &str, ids: &[i32], tokens: usize, budget: &mut Budget) -> Record {
        let bytes = ids.iter().flat_map(|x| (*x as i16).to_le_bytes()).collect::<Vec<u8>>();
        let part = IdArray { bytes: bytes.into(), dtype: "int16".into(), shape: [tokens, 3, 2] };
        from_ids(name, vec![part], None, None, budget).expect("a record")
    }

    /// Pieces of any size, and rows shifted between two sequences, give the same measures.
    #[test]
    fn any_chunk_gives_the_same_measures() {
        let tokens = 2500;
        // Distinct pairs of 16 experts, the trainer's differing on every 7th row.
        let a: Vec<i32> = (0..tokens * 3).flat_map(|r| [(r * 5 % 16) as i32, ((r * 5 + 3) % 16) as i32]).collect();
        let b: Vec<i32> = a
            .chunks(2)
            .enumerate()
            .flat_map(|(r, p)| if r % 7 == 0 { [p[0], (p[1] + 1) % 16] } else { [p[0], p[1]] })
            .collect();
        let mut budget = Budget::new(moe_audit_core::MemoryBudget::from_request(None));
        let (ra, rb) = (record("a", &a, tokens, &mut budget), record("b", &b, tokens, &mut budget));
        let (al, _) = crate::align::align(&ra, &rb, &mut budget).expect("aligned");
        let one = measure_in(&ra, &rb, &al, &mut budget, tokens).unwrap();
        let whole = serde_json::to_string(&one).unwrap();
        // The lanes: the first differing tokens, in order (row 3t + layer differs every 7th row:
        // tokens 0, 2, 4, ...).
        assert_eq!(one.lanes.len(), LANES);
        assert_eq!(one.lanes.iter().map(|l| l.order).take(3).collect::<Vec<_>>(), [0, 2, 4]);
        for chunk in [1, 7, 512, 1024] {
            let m = measure_in(&ra, &rb, &al, &mut budget, chunk).unwrap();
            assert_eq!(serde_json::to_string(&m).unwrap(), whole, "chunk {chunk}");
            assert_eq!(m.lanes, one.lanes, "chunk {chunk}");
        }
        assert!(whole.contains("\"decisions\":7500"), "{whole}");
    }
}
