//! From what a writer stored to what is compared. Every writer fills slots that hold no route:
//! engines zero-fill (dense layers, the last token, padding: SGLang and vLLM allocate with
//! `torch.zeros`/`np.zeros`), SkyRL and NeMo-RL pad with `arange(top_k)` in every layer, slime
//! with `arange(n·layers·top_k) % experts`, NeMo-RL marks a missing route with -1, and compact
//! dtypes wrap a -1 to 255. Here each is recognised, counted in [`Found`] and set to -1 (nothing
//! to compare), the layer numbers are fixed (declared, or inferred from the config *and* the
//! data), and ids are checked against the expert count.
//!
//! A token row is padding when it can hold no route (-1 in every slot, a repeated id in every
//! layer), by the writer's own mask, or by the writer's fill where that writer puts it ([`Fill`]):
//! a fill a router could also choose (`[0, 1]` then `[2, 3]` is a route of 8 experts, top-2) is
//! never taken from one row's values alone, nor from a writer that does not write it.

use super::array::Elem;
use super::config::{LayerKind, Layout};
use super::file::bad;
use super::formats::{Axis, Dtype, Fill, Format, Raw, Sequence};
use super::ids::Ids;
use super::text::ranges;
use moe_audit_core::error::{Result, Text};
use rayon::prelude::*;
use serde::Serialize;
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;

/// What one (token, layer) row holds.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Row {
    /// Every slot -1.
    Empty,
    /// Every slot 0 with top-k > 1 (no router picks one expert twice).
    Zero,
    /// Another repeated id: a fill, not a route.
    Repeat,
    /// A route (possibly partial).
    Route,
}

fn classify(row: &[i32]) -> Row {
    let k = row.len();
    let (mut negative, mut zero) = (0, 0);
    for &e in row {
        negative += usize::from(e < 0);
        zero += usize::from(e == 0);
    }
    if negative == k {
        return Row::Empty;
    }
    if k > 1 && zero == k {
        return Row::Zero;
    }
    // Fills repeat 0 or one constant; only such rows are searched for a repeat (the search
    // is most of the cost of this pass).
    if zero >= 2 || (k > 1 && (row[0] == row[1] || row[0] == row[k - 1])) {
        for i in 1..k {
            let x = row[i];
            if x >= 0 && row[..i].contains(&x) {
                return Row::Repeat;
            }
        }
    }
    Row::Route
}

/// Why a token row holds no route whoever wrote it (`None`: it may hold one), from its layers'
/// classes: -1 in every slot (NeMo-RL's missing route, not padding), 0 or a repeated id in
/// every layer (no top-k picks an expert twice).
fn no_route(classes: &[Row], format: Format) -> Option<&'static str> {
    if classes.iter().all(|c| *c == Row::Empty) {
        (format != Format::NemoRl).then_some("no route (-1) in any layer")
    } else if classes.iter().all(|c| *c == Row::Zero) {
        Some("all-zero")
    } else if classes.iter().all(|c| *c != Row::Route) {
        Some("repeated ids in every layer")
    } else {
        None
    }
}

/// Consecutive token rows padding by one cause.
type Run = (Range<usize>, &'static str);

const SLIME_FILL: &str = "fill arange(n*layers*top_k) % experts";

/// Whether `ids`, the values of a block from its first, continue `arange(n) % experts` from
/// `from` (`experts` unknown: where the values first wrap to 0, found and kept in `experts`).
fn continues_arange(ids: &[i32], from: usize, experts: &mut Option<usize>) -> bool {
    ids.iter().enumerate().all(|(i, &v)| {
        let at = from + i;
        if experts.is_none() && v == 0 && at > 0 {
            *experts = Some(at);
        }
        usize::try_from(v).is_ok_and(|v| v == at % experts.unwrap_or(usize::MAX))
    })
}

impl Fill {
    /// Why `row` (after the value rule) is this edge fill, if it is (slime's is read by blocks).
    fn cause(self, row: &[i32], k: usize) -> Option<&'static str> {
        match self {
            Fill::ZeroTail if row.iter().all(|&e| e == 0) => Some("all-zero"),
            Fill::TopK { .. } if row.chunks_exact(k).all(|l| l.iter().enumerate().all(|(i, &e)| e == i as i32)) => {
                Some("fill arange(top_k) in every layer")
            }
            _ => None,
        }
    }

    /// The rows this fill makes padding, as runs in order: only a sequence's edges are read, a
    /// row at a time; a row `padding` already (a mask, no route) is passed over, the first route
    /// ends the edge.
    fn rows(
        self,
        experts: &Ids,
        value: &Value,
        sequences: &[Sequence],
        [n_layers, k]: [usize; 2],
        num_experts: Option<usize>,
        padding: impl Fn(usize, &[Row]) -> bool,
    ) -> Vec<Run> {
        let mut runs: Vec<Run> = Vec::new();
        if self == Fill::None {
            return runs;
        }
        let w = n_layers * k;
        let mut buf = Vec::with_capacity(w);
        let row = |t: usize, buf: &mut Vec<i32>| {
            experts.decode(t * w..(t + 1) * w, buf);
            value.apply(buf);
        };
        let passed = |t: usize, buf: &[i32]| {
            let classes: Vec<Row> = buf.chunks_exact(k).map(classify).collect();
            padding(t, &classes) || classes.iter().all(|c| *c == Row::Empty)
        };
        for (i, s) in sequences.iter().enumerate().filter(|(_, s)| !s.rows.is_empty()) {
            if self == Fill::Slime {
                // The last segment may be the stream's pad, one arange from its first row
                // (THUDM/slime v0.3.1 slime/backends/megatron_utils/cp_utils.py:384-385, :393-394).
                let mut e = num_experts;
                let whole = i + 1 == sequences.len()
                    && s.rows.clone().all(|t| {
                        row(t, &mut buf);
                        continues_arange(&buf, (t - s.rows.start) * w, &mut e)
                    });
                if whole {
                    runs.push((s.rows.clone(), SLIME_FILL));
                    continue;
                }
                // Else a sample's segment, closed by its one pad row (cp_utils.py:376).
                let last = s.rows.end - 1;
                row(last, &mut buf);
                if continues_arange(&buf, 0, &mut num_experts.clone()) {
                    runs.push((last..last + 1, SLIME_FILL));
                }
                continue;
            }
            let mut head = s.rows.start;
            if self == (Fill::TopK { head: true }) {
                while head < s.rows.end {
                    row(head, &mut buf);
                    if !passed(head, &buf) {
                        let Some(c) = self.cause(&buf, k) else { break };
                        push(&mut runs, head, c);
                    }
                    head += 1;
                }
            }
            let mut tail = Vec::new();
            for t in (head..s.rows.end).rev() {
                row(t, &mut buf);
                if !passed(t, &buf) {
                    let Some(c) = self.cause(&buf, k) else { break };
                    tail.push((t, c));
                }
            }
            for (t, c) in tail.into_iter().rev() {
                push(&mut runs, t, c);
            }
        }
        runs
    }
}

/// Adds row `t` to the runs (in order).
fn push(runs: &mut Vec<Run>, t: usize, cause: &'static str) {
    match runs.last_mut() {
        Some((r, c)) if r.end == t && *c == cause => r.end = t + 1,
        _ => runs.push((t..t + 1, cause)),
    }
}

/// What cleaning decided about a stored record: how its values read, its layers' numbers and
/// which carry routes, the sequences kept, and what it found.
pub(crate) struct Cleaned {
    pub fix: Fix,
    pub layers: Vec<usize>,
    pub layers_declared: bool,
    pub routed: Vec<bool>,
    pub sequences: Vec<Sequence>,
    pub num_experts: Option<usize>,
    pub found: Found,
}

/// Decides how a writer's stored record reads as the compared one (see the module doc), in
/// steps: the shape checked, every row classified in one pass, ids checked, padding segments
/// dropped, the layer numbers fixed, dense and empty layers cleared, missing routes counted.
/// Takes the notes, sequences and layer numbers out of `raw`.
pub(crate) fn clean(path: &Path, raw: &mut Raw, layout: Option<&Layout>) -> Result<Cleaned> {
    let (format, tokens, k, n_layers, fill, axis) =
        (raw.format, raw.tokens, raw.top_k, raw.n_layers, raw.fill, raw.axis);
    let (experts, dtype, logits, pad_mask) = (&raw.experts, &raw.dtype, &raw.logits, raw.pad_mask.as_deref());
    let (notes, mut sequences, layers) =
        (std::mem::take(&mut raw.notes), std::mem::take(&mut raw.sequences), raw.layers.take());
    check_shape(path, [tokens, n_layers, k], experts.len(), layout)?;
    let mut found = Found { dtype: dtype.name.clone(), notes, ..Found::default() };
    let num_experts = layout.map(|l| l.experts).or(logits.as_ref().map(|l| l.1));
    let value = Value::of(experts, dtype, num_experts, &mut found);
    let limit = num_experts.map_or(i32::MAX, |e| e as i32);
    let pads = Pads { mask: pad_mask, fills: &[], format };
    let fills = fill.rows(experts, &value, &sequences, [n_layers, k], num_experts, |t, c| pads.cause(t, c).is_some());
    let mut scan = scan(experts, &value, [tokens, n_layers, k], limit, Pads { fills: &fills, ..pads });
    match value {
        Value::MinusOne(_) => found.wrapped_minus_one = scan.wrapped,
        Value::Unwrap(_) => found.wrapped_ids = scan.wrapped,
        Value::AsIs => {}
    }
    for (c, n) in std::mem::take(&mut scan.causes) {
        *found.padding.entry(c.to_string()).or_default() += n;
    }
    check_ids(path, &scan, limit, [n_layers, k], layout, &mut found)?;
    // A trailing packed segment made only of padding (slime's pad to a multiple of the TP size).
    while sequences.len() > 1 && sequences.last().is_some_and(|s| s.rows.clone().all(|t| scan.pad[t])) {
        sequences.pop();
        found.pad_segments += 1;
    }
    // With top-1, a 0 is a route unless the whole layer holds nothing else.
    if k == 1 {
        for h in scan.held.iter_mut().filter(|h| h.0 > 0) {
            h.0 += h.1;
            h.1 = 0;
        }
        let held = &scan.held;
        scan.odd.retain(|&(at, c)| !(c == Row::Zero && held[at % n_layers].1 == 0));
    }
    let (numbers, declared, numbering) = layer_numbers(path, layers, layout, axis, n_layers, |l| scan.held[l].0 > 0)?;
    found.numbering = numbering;
    let acts = layer_acts(path, &numbers, layout, &scan.held, &mut found)?;
    // In the kept layers, zero or repeated rows are cleared and, with -1 rows, counted missing.
    let mut holes = Vec::new();
    for &(at, c) in &scan.odd {
        match (acts[at % n_layers], c) {
            (Act::Keep { .. }, Row::Zero | Row::Repeat) if k > 1 => {
                holes.push(at);
                found.missing += 1;
            }
            (Act::Keep { count_empty: true }, Row::Empty) => found.missing += 1,
            _ => {}
        }
    }
    let clear: Vec<bool> = acts.iter().map(|a| *a == Act::Clear).collect();
    let routed = (0..n_layers).map(|l| !clear[l] && scan.held[l].0 > 0).collect();
    if let Some(v) = raw.input_ids.as_ref().and_then(|ids| ids.iter().find(|&&v| v < 0)) {
        return Err(bad(path, format!("`input_ids` holds {v}, not a token id")));
    }
    Ok(Cleaned {
        fix: Fix { value, pad: scan.pad, clear, holes, n_layers, top_k: k },
        layers: numbers,
        layers_declared: declared,
        routed,
        sequences,
        num_experts: logits.as_ref().map(|l| l.1).or(num_experts),
        found,
    })
}

/// `[tokens, layers, top_k]` with routes, `ids` of them, and the config's top-k if any.
fn check_shape(path: &Path, [tokens, n_layers, k]: [usize; 3], ids: usize, layout: Option<&Layout>) -> Result<()> {
    if tokens == 0 || n_layers == 0 || k == 0 {
        return Err(bad(path, format!("[{tokens}, {n_layers}, {k}] routes: no routes")));
    }
    if ids != tokens * n_layers * k {
        return Err(bad(path, format!("{ids} ids for [{tokens}, {n_layers}, {k}]")));
    }
    match layout {
        Some(l) if k != l.top_k => Err(bad(
            path,
            format!("the config contradicts the record: top-k {} in the config, {k} in the record", l.top_k),
        )),
        _ => Ok(()),
    }
}

/// What makes a token row padding besides holding no route: the writer's mask, its fill.
#[derive(Clone, Copy)]
struct Pads<'a> {
    mask: Option<&'a [bool]>,
    /// From [`Fill::rows`], in order.
    fills: &'a [Run],
    format: Format,
}

impl Pads<'_> {
    /// Why token `t` (its layers' `classes`) is padding, if it is.
    fn cause(&self, t: usize, classes: &[Row]) -> Option<&'static str> {
        if self.mask.is_some_and(|m| m[t]) {
            return Some("mask");
        }
        let run = self.fills.partition_point(|r| r.0.end <= t);
        match self.fills.get(run) {
            Some((rows, cause)) if rows.contains(&t) => Some(cause),
            _ => no_route(classes, self.format),
        }
    }
}

/// One token-major pass over blocks of tokens (in parallel, merged in order, so the result is
/// the same whatever the thread count): every (token, layer) row classified, ids checked
/// (below -1, at or beyond the expert count), padding rows found; rows that are no route kept
/// aside.
fn scan(experts: &Ids, value: &Value, [tokens, n_layers, k]: [usize; 3], limit: i32, pads: Pads<'_>) -> Block {
    let blocks: Vec<Block> = experts
        .par_chunks(tokens, n_layers * k, BLOCK, |rows, chunk| {
            let wrapped = value.apply(chunk);
            let mut b = block(chunk, rows.start, [n_layers, k], limit, pads);
            b.wrapped = wrapped;
            b
        })
        .collect();
    let mut all = Block {
        wrapped: 0,
        negative: None,
        beyond: (0, -1, 0),
        pad: Vec::with_capacity(tokens),
        causes: Vec::new(),
        odd: Vec::new(),
        held: vec![(0, 0); n_layers],
    };
    for b in blocks {
        all.negative = all.negative.or(b.negative);
        if b.beyond.1 > all.beyond.1 {
            all.beyond = (all.beyond.0, b.beyond.1, b.beyond.2);
        }
        all.beyond.0 += b.beyond.0;
        all.wrapped += b.wrapped;
        all.pad.extend(b.pad);
        all.odd.extend(b.odd);
        for (h, x) in all.held.iter_mut().zip(b.held) {
            h.0 += x.0;
            h.1 += x.1;
        }
        all.causes.extend(b.causes);
    }
    all
}

/// Fails on an id below -1, or far beyond the expert count; ids a little beyond may be physical
/// (EPLB) slots, tested against the other record, and are noted in `found`.
fn check_ids(
    path: &Path,
    scan: &Block,
    limit: i32,
    [n_layers, k]: [usize; 2],
    layout: Option<&Layout>,
    found: &mut Found,
) -> Result<()> {
    if let Some((i, v)) = scan.negative {
        return Err(bad(path, format!("value {v} at flat index {i} is not an expert id or -1")));
    }
    let (count, largest, at) = scan.beyond;
    if count > 0 {
        let e = limit as usize;
        let w = n_layers * k;
        let (t, l) = (at / w, at % w / k);
        let whose = if layout.is_some() { "the config's" } else { "the logits'" };
        if largest as usize >= 2 * e {
            return Err(bad(
                path,
                format!(
                    "expert id {largest} at token {t}, layer index {l} is not below {whose} {e} experts (nor a physical slot of an expert-parallel layout, at most {})",
                    2 * e - 1
                ),
            ));
        }
        found.beyond = Some((count, largest));
    }
    Ok(())
}

/// The global number of each layer of the axis: declared (checked), inferred from the config
/// and where routes are, or taken as `0..n`; whether they were given, and how they were taken.
fn layer_numbers(
    path: &Path,
    layers: Option<Vec<usize>>,
    layout: Option<&Layout>,
    axis: Axis,
    n_layers: usize,
    routes_in: impl Fn(usize) -> bool,
) -> Result<(Vec<usize>, bool, String)> {
    match (layers, layout) {
        (Some(numbers), _) => {
            if numbers.len() != n_layers {
                return Err(bad(path, format!("{} layer numbers for a layer axis of {n_layers}", numbers.len())));
            }
            let mut seen = numbers.clone();
            seen.sort_unstable();
            if let Some(w) = seen.windows(2).find(|w| w[0] == w[1]) {
                return Err(bad(path, format!("layer {} appears twice in its layer numbers", w[0])));
            }
            Ok((numbers, true, "declared in the file".to_string()))
        }
        (None, Some(l)) => {
            let (numbers, how) = infer_numbers(n_layers, l, axis, &routes_in)
                .map_err(|m| bad(path, format!("the config contradicts the record: {m}")))?;
            Ok((numbers, true, how))
        }
        (None, None) => {
            Ok(((0..n_layers).collect(), false, format!("its {n_layers} layers are taken as 0 to {}", n_layers - 1)))
        }
    }
}

/// What is done with a layer's slots.
#[derive(Clone, Copy, PartialEq)]
enum Act {
    Clear,
    Keep { count_empty: bool },
}

/// Dense layers (by the config) are never compared, whatever they hold; a layer of zeros is
/// cleared too; in the others, zero or repeated rows and -1 rows are missing, counted apart.
fn layer_acts(
    path: &Path,
    numbers: &[usize],
    layout: Option<&Layout>,
    held: &[(usize, usize)],
    found: &mut Found,
) -> Result<Vec<Act>> {
    let mut acts = Vec::with_capacity(numbers.len());
    for (&g, &(routes, zeros)) in numbers.iter().zip(held) {
        let kind = match layout {
            Some(l) => Some(*l.kinds.get(g).ok_or_else(|| {
                bad(
                    path,
                    format!(
                        "the config contradicts the record: layer {g} in the record; the config has {} layers",
                        l.kinds.len()
                    ),
                )
            })?),
            None => None,
        };
        acts.push(if kind == Some(LayerKind::Dense) {
            if routes + zeros > 0 {
                found.dense_filled.push(g);
            }
            Act::Clear
        } else if routes == 0 && zeros > 0 {
            // Only zeros: dense (zero-filled) without a config, capture never ran with one.
            found.zero_layers.push(g);
            Act::Clear
        } else {
            Act::Keep { count_empty: kind.is_some() || routes > 0 }
        });
    }
    Ok(acts)
}

/// Tokens per block of the classifying pass.
const BLOCK: usize = 512;

/// What the classifying pass found in one block of tokens (merged: in the whole record).
struct Block {
    /// Values the value rule changed.
    wrapped: usize,
    negative: Option<(usize, i32)>,
    beyond: (usize, i32, usize),
    pad: Vec<bool>,
    causes: Vec<(&'static str, usize)>,
    odd: Vec<(usize, Row)>,
    held: Vec<(usize, usize)>,
}

/// Classifies the rows of `chunk` (tokens from `first`), finds its padding rows.
fn block(chunk: &[i32], first: usize, [n_layers, k]: [usize; 2], limit: i32, pads: Pads<'_>) -> Block {
    let w = n_layers * k;
    let mut out = Block {
        wrapped: 0,
        negative: None,
        beyond: (0, -1, 0),
        pad: Vec::with_capacity(chunk.len() / w),
        causes: Vec::new(),
        odd: Vec::new(),
        held: vec![(0, 0); n_layers],
    };
    let mut classes = vec![Row::Empty; n_layers];
    for (j, row) in chunk.chunks_exact(w).enumerate() {
        let t = first + j;
        // Ids out of range are rare: the whole token row is checked at once, each id only then.
        let (lo, hi) = row.iter().fold((i32::MAX, i32::MIN), |(lo, hi), &e| (lo.min(e), hi.max(e)));
        let check = lo < -1 || hi >= limit;
        for (l, c) in classes.iter_mut().enumerate() {
            let ids = &row[l * k..(l + 1) * k];
            for (i, &id) in ids.iter().enumerate().filter(|_| check) {
                if id < -1 {
                    out.negative.get_or_insert((t * w + l * k + i, id));
                } else if id >= limit {
                    out.beyond.0 += 1;
                    if id > out.beyond.1 {
                        out.beyond = (out.beyond.0, id, t * w + l * k);
                    }
                }
            }
            *c = classify(ids);
        }
        let cause = pads.cause(t, &classes);
        out.pad.push(cause.is_some());
        if let Some(c) = cause {
            match out.causes.iter_mut().find(|x| x.0 == c) {
                Some(x) => x.1 += 1,
                None => out.causes.push((c, 1)),
            }
            continue;
        }
        for (l, &c) in classes.iter().enumerate() {
            let at = t * n_layers + l;
            match c {
                Row::Route if k == 1 && row[l] == 0 => {
                    out.held[l].1 += 1;
                    out.odd.push((at, Row::Zero));
                }
                Row::Route => out.held[l].0 += 1,
                Row::Zero => {
                    out.held[l].1 += 1;
                    out.odd.push((at, c));
                }
                Row::Repeat | Row::Empty => out.odd.push((at, c)),
            }
        }
    }
    out
}

/// What a stored value means, by its dtype and the expert count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Value {
    /// As stored.
    AsIs,
    /// This value (255 in uint8, 65535 in uint16) is a -1 stored unsigned.
    MinusOne(i32),
    /// Values below -1 are ids wrapped negative by a signed narrowing cast (int8, int16):
    /// unwrapped with this mask.
    Unwrap(i32),
}

impl Value {
    /// The rule for `ids` of `dtype` with `e` experts (when known); says a cast too narrow.
    fn of(ids: &Ids, dtype: &Dtype, e: Option<usize>, found: &mut Found) -> Value {
        let Some(elem) = dtype.elem else { return Value::AsIs };
        let narrow = matches!(elem, Elem::U8 | Elem::I8) && e.is_some_and(|e| e > 256);
        if narrow {
            found.narrow_for = e;
        }
        match elem {
            Elem::U8 | Elem::U16 => {
                let all = if elem == Elem::U8 { 255 } else { 65535 };
                // 255 is an expert of a model with 256; a -1 when the model has fewer (or, without
                // a config, when no other id comes near).
                let wrapped = match e {
                    Some(e) => (all as usize) >= e,
                    None => elem == Elem::U16 || ids.max_except(all).unwrap_or(0) < 128,
                };
                if wrapped {
                    Value::MinusOne(all)
                } else {
                    Value::AsIs
                }
            }
            Elem::I8 => Value::Unwrap(0xff),
            Elem::I16 => Value::Unwrap(0xffff),
            _ => Value::AsIs,
        }
    }

    /// Applies the rule to `ids`; returns how many values it changed.
    fn apply(self, ids: &mut [i32]) -> usize {
        let mut n = 0;
        match self {
            Value::AsIs => {}
            Value::MinusOne(all) => ids.iter_mut().filter(|v| **v == all).for_each(|v| {
                *v = -1;
                n += 1;
            }),
            Value::Unwrap(mask) => ids.iter_mut().filter(|v| **v < -1).for_each(|v| {
                *v &= mask;
                n += 1;
            }),
        }
        n
    }
}

/// What cleaning decided, applied to every row read: the value rule, padding tokens, cleared
/// layers, and the rows (token × layer + layer index) that are a fill, not a route.
#[derive(Debug, Clone)]
pub(crate) struct Fix {
    value: Value,
    pad: Vec<bool>,
    clear: Vec<bool>,
    holes: Vec<usize>,
    n_layers: usize,
    top_k: usize,
}

impl Fix {
    /// Cleans `ids`, the stored ids of token rows `tokens`.
    pub(crate) fn apply(&self, tokens: std::ops::Range<usize>, ids: &mut [i32]) {
        self.value.apply(ids);
        let (l, k) = (self.n_layers, self.top_k);
        let mut h = self.holes.partition_point(|&r| r < tokens.start * l);
        for (t, row) in tokens.zip(ids.chunks_exact_mut(l * k)) {
            if self.pad[t] {
                row.fill(-1);
            }
            for (layer, _) in self.clear.iter().enumerate().filter(|c| *c.1) {
                row[layer * k..(layer + 1) * k].fill(-1);
            }
            while h < self.holes.len() && self.holes[h] < (t + 1) * l {
                let layer = self.holes[h] - t * l;
                row[layer * k..(layer + 1) * k].fill(-1);
                h += 1;
            }
        }
    }

    /// Cleans `ids`, the stored ids of one (token, layer index) row.
    pub(crate) fn apply_row(&self, token: usize, layer: usize, ids: &mut [i32]) {
        self.value.apply(ids);
        if self.pad[token] || self.clear[layer] || self.holes.binary_search(&(token * self.n_layers + layer)).is_ok() {
            ids.fill(-1);
        }
    }
}

/// The global numbers of an undeclared layer axis of `n` layers: every decoder layer (without,
/// then with the MTP layers after them), then the MoE layers without MTP, then with MTP; the
/// first whose count matches and whose dense layers hold no route is taken, and the note says
/// which and why.
fn infer_numbers(
    n: usize,
    l: &Layout,
    axis: Axis,
    routes_in: &dyn Fn(usize) -> bool,
) -> std::result::Result<(Vec<usize>, String), String> {
    let backbone = l.kinds.iter().filter(|k| **k != LayerKind::Mtp).count();
    let moe: Vec<usize> = (0..backbone).filter(|&g| l.kinds[g] == LayerKind::Moe).collect();
    let candidates: Vec<(Vec<usize>, &str)> = [
        ((0..backbone).collect::<Vec<_>>(), "every decoder layer", axis != Axis::Routers),
        ((0..l.kinds.len()).collect(), "every decoder layer and the MTP layers", axis == Axis::Any),
        (moe.clone(), "the MoE layers", axis != Axis::Decoder),
        (l.routed(), "the MoE and MTP layers", axis != Axis::Decoder),
    ]
    .into_iter()
    .filter(|c| c.2 && c.0.len() == n)
    .map(|c| (c.0, c.1))
    .collect();
    // Numberings that give the same layers are one (a model with no dense and no MTP layer).
    let mut candidates = candidates;
    let mut seen: Vec<Vec<usize>> = Vec::new();
    candidates.retain(|c| {
        let new = !seen.contains(&c.0);
        seen.push(c.0.clone());
        new
    });
    let dense_with_routes = |numbers: &[usize]| -> Vec<usize> {
        numbers
            .iter()
            .enumerate()
            .filter(|&(i, &g)| l.kinds[g] == LayerKind::Dense && routes_in(i))
            .map(|(_, &g)| g)
            .collect()
    };
    let mut rejected = Vec::new();
    for (numbers, name) in &candidates {
        let wrong = dense_with_routes(numbers);
        if wrong.is_empty() {
            let mut how = format!("its {n} layers are {name} ({})", ranges(numbers));
            if let Some(first) = rejected.first() {
                how.push_str(&format!("; not {first}"));
            } else if candidates.len() > 1 {
                let others: Vec<&str> = candidates.iter().skip(1).map(|c| c.1).collect();
                how.push_str(&format!(
                    " (taken first; the count also fits {}, but the layers the config calls dense hold no route)",
                    others.join(", ")
                ));
            }
            return Ok((numbers.clone(), how));
        }
        rejected.push(format!("{name} (config-dense layer {} holds routes)", ranges(&wrong)));
    }
    if let Some((numbers, name)) = candidates.first() {
        // Every count-matching numbering puts routes in a dense layer: say it, take the first.
        return Ok((numbers.clone(), format!("its {n} layers are taken as {name}, although {}", rejected.join("; "))));
    }
    let mtp = l.kinds.len() - backbone;
    let with_mtp = if mtp > 0 { format!(" and {mtp} MTP layer(s)") } else { String::new() };
    Err(format!("{n} layers in the record; the config has {backbone} decoder layers, {} of them MoE,{with_mtp} (tried every decoder layer, MoE layers, with and without MTP)", moe.len()))
}

/// What reading a record found and inferred: said by `routes show`, used by the diagnoses.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Found {
    /// The element type as stored (`int32`, `uint8`, JSON ints, ...).
    pub dtype: String,
    /// How the layer numbers were taken (declared in the file, or inferred and why).
    pub numbering: String,
    /// Token rows left out as padding, by cause (`all-zero`, `mask`, a writer's fill, ...).
    pub padding: BTreeMap<String, usize>,
    /// Trailing packed segments made only of padding (slime's pad segment), dropped.
    pub pad_segments: usize,
    /// (token, layer) slots of routed layers with no route (-1: NeMo-RL's missing route, or a
    /// zero/fill row in one layer): counted apart, never compared.
    pub missing: usize,
    /// Layers the config says are dense whose slots held values (engines zero-fill them): ignored.
    pub dense_filled: Vec<usize>,
    /// Routed (or unknown) layers holding only zeros: dense without a config, else capture never ran.
    pub zero_layers: Vec<usize>,
    /// Values that are a -1 stored unsigned (255 in uint8, 65535 in uint16): read as -1.
    pub wrapped_minus_one: usize,
    /// Expert ids wrapped negative by a signed narrowing cast (int8, int16): unwrapped.
    pub wrapped_ids: usize,
    /// Expert ids stored in a type too narrow for the model's experts (ids modulo 256).
    pub narrow_for: Option<usize>,
    /// Ids not below the expert count (physical EPLB slots?): count and largest.
    pub beyond: Option<(usize, i32)>,
    /// Notes of the reader (steps or ranks merged, a shape taken from the other record, ...).
    pub notes: Vec<Text>,
}

impl Found {
    /// Whether the layer numbers were given (in the file, or by the caller of `from_ids`),
    /// not inferred.
    pub fn numbering_declared(&self) -> bool {
        self.numbering.starts_with("declared")
    }
}
