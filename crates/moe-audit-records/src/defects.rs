//! Diagnoses of what a writer did, beside the alignment's: what reading found in each record
//! (a capture that never ran, a pipeline stage never merged, a narrowing cast, missing routes,
//! padding, dense layers, the layer numbering taken), and what the measures show about the
//! pair (physical instead of logical ids, ids modulo 256, records not paired at all). No
//! comparison ends silently: one that is implausible for two routers of one model fails.

use super::align::Alignment;
use super::config::{LayerKind, Layout};
use super::diagnosis::{defect, note, Diagnosis, DiagnosisKind};
use super::formats::Format;
use super::measure::{LayerMeasure, Measures};
use super::pipeline::how_to_give;
use super::record::Record;
use super::sides::Role;
use super::text::{pct, ranges};
use crate::settings::CONFIG;
use moe_audit_core::error::{Error, Result};
use moe_audit_core::text;
use std::collections::HashMap;

/// What reading `r` found, as diagnoses: one function each, in the report's order.
pub(super) fn of_record(role: Role, r: &Record, layout: Option<&Layout>) -> Vec<Diagnosis> {
    if r.is_empty() {
        return vec![capture_never_ran(role, r)];
    }
    let mut out = Vec::new();
    out.extend(layer_numbers(role, r, layout));
    out.extend(r.found.notes.iter().map(|n| note(DiagnosisKind::Reading, text!(format!("{role}: "), n), "")));
    out.extend(zero_layers(role, r, layout));
    out.extend(layout.and_then(|l| absent_stage(role, r, l)));
    out.extend(dense_filled(role, r));
    out.extend(wrapped_minus_one(role, r));
    out.extend(wrapped_ids(role, r));
    out.extend(missing_slots(role, r));
    out.extend(padding(role, r));
    out
}

/// A record with no route at all: the capture never ran.
fn capture_never_ran(role: Role, r: &Record) -> Diagnosis {
    let f = &r.found;
    let held =
        if f.zero_layers.is_empty() && !f.padding.contains_key("all-zero") { "no route (-1 or fill)" } else { "zeros" };
    defect(
        DiagnosisKind::CaptureNeverRan,
        format!("the {role} record holds only {held}: {} rows, no layer with a route", r.tokens),
        "the capture never ran: check that the engine was started with routed-expert capture on (SGLang --enable-return-routed-experts, vLLM --enable-return-routed-experts) and the request asked for it (return_routed_experts); a CPU build of vLLM returns zeros",
    )
}

/// Layer numbers the file did not give: how they were inferred.
fn layer_numbers(role: Role, r: &Record, layout: Option<&Layout>) -> Option<Diagnosis> {
    let f = &r.found;
    if f.numbering.is_empty() || f.numbering_declared() {
        return None;
    }
    let change = if layout.is_some() {
        "write the global layer numbers in the file (metadata `layers`) to make this explicit".into()
    } else {
        text!("give ", CONFIG, " (config.json) so dense and MTP layers are known, or write `layers` in the file")
    };
    Some(note(DiagnosisKind::LayerNumbers, format!("the {role} file gives no layer numbers: {}", f.numbering), change))
}

/// Layers holding only zeros: dense without a config; with one, a MoE layer's capture that never
/// ran or a pipeline stage never merged.
fn zero_layers(role: Role, r: &Record, layout: Option<&Layout>) -> Option<Diagnosis> {
    let zero = &r.found.zero_layers;
    if zero.is_empty() {
        return None;
    }
    Some(match layout {
        None => note(
            DiagnosisKind::Unpaired,
            text!(
                format!(
                    "{role} layers {} hold only zeros: left out as dense (engines zero-fill dense layers); with ",
                    ranges(zero)
                ),
                CONFIG,
                " a MoE layer holding only zeros is a capture that never ran"
            ),
            "",
        ),
        Some(l) => zero_moe_layers(role, r, l),
    })
}

/// Layers the config calls dense that hold placeholders.
fn dense_filled(role: Role, r: &Record) -> Option<Diagnosis> {
    let dense = &r.found.dense_filled;
    (!dense.is_empty()).then(|| {
        note(
            DiagnosisKind::Unpaired,
            format!(
                "{role} layers {} are dense in the config and hold placeholders (engines write 0 there): not compared",
                ranges(dense)
            ),
            "",
        )
    })
}

/// A -1 stored unsigned (255, 65535).
fn wrapped_minus_one(role: Role, r: &Record) -> Option<Diagnosis> {
    let f = &r.found;
    if f.wrapped_minus_one == 0 {
        return None;
    }
    let (v, t) = if f.dtype.contains("uint16") { (65535, "uint16") } else { (255, "uint8") };
    Some(defect(
        DiagnosisKind::NarrowingCast,
        format!(
            "{role}: {} slots hold {v} in a {t} record of a model with fewer experts: a -1 (no route) wrapped by a narrowing cast; read as missing",
            f.wrapped_minus_one
        ),
        "never cast a -1 into an unsigned dtype: keep the record signed (int16), or int32 as SGLang's wire does when an id does not fit",
    ))
}

/// Ids wrapped negative by a signed narrowing cast.
fn wrapped_ids(role: Role, r: &Record) -> Option<Diagnosis> {
    let f = &r.found;
    (f.wrapped_ids > 0).then(|| {
        defect(
            DiagnosisKind::NarrowingCast,
            format!(
                "{role}: {} expert ids are negative in a {} record: ids past the type's range wrapped by a narrowing cast; read modulo {}",
                f.wrapped_ids,
                f.dtype,
                if f.dtype.contains("int8") { 256 } else { 65536 }
            ),
            "store ids in a type that holds every expert id (NeMo-RL picks int16 past 128 experts, int32 past 32768)",
        )
    })
}

/// Routed-layer slots with no route.
fn missing_slots(role: Role, r: &Record) -> Option<Diagnosis> {
    (r.found.missing > 0).then(|| {
        note(
            DiagnosisKind::Missing,
            format!(
                "{role}: {} (token, layer) slots of routed layers hold no route (-1, or a zero or repeated-id row): counted apart, never as a disagreement",
                r.found.missing
            ),
            "",
        )
    })
}

/// Padding rows left out, by cause.
fn padding(role: Role, r: &Record) -> Option<Diagnosis> {
    let f = &r.found;
    if f.padding.is_empty() && f.pad_segments == 0 {
        return None;
    }
    let causes: Vec<String> = f.padding.iter().map(|(c, n)| format!("{n} {c}")).collect();
    let seg = if f.pad_segments > 0 {
        format!("; {} trailing pad segment(s) dropped", f.pad_segments)
    } else {
        String::new()
    };
    Some(note(
        DiagnosisKind::Padding,
        format!("{role}: {} padding rows left out of every rate ({}){seg}", r.padding_rows(), causes.join(", ")),
        "",
    ))
}

/// MoE layers holding only zeros: a block at one end of the MoE layers is a pipeline stage
/// captured elsewhere and never merged; otherwise the capture never ran for those layers.
fn zero_moe_layers(role: Role, r: &Record, l: &Layout) -> Diagnosis {
    let zero = &r.found.zero_layers;
    let moe: Vec<usize> = r.layers.iter().copied().filter(|&g| l.kinds.get(g) == Some(&LayerKind::Moe)).collect();
    let contiguous = zero
        .windows(2)
        .all(|w| moe.iter().position(|&g| g == w[1]) == moe.iter().position(|&g| g == w[0]).map(|p| p + 1));
    let at_end = moe.last() == zero.last() || moe.first() == zero.first();
    if zero.len() >= 2 && contiguous && at_end && zero.len() < moe.len() {
        return defect(
            DiagnosisKind::PipelineNotMerged,
            format!(
                "{role}: MoE layers {} ({} of {}) hold only zeros while the others route: the layers of one pipeline stage, captured on another rank and never merged",
                ranges(zero),
                zero.len(),
                moe.len()
            ),
            "merge the routing captures of every pipeline stage before the record is returned or replayed (slime's validator refuses this; SGLang 0.5.10 with pipeline parallelism does not gather)",
        );
    }
    defect(
        DiagnosisKind::CaptureNeverRan,
        format!("{role}: MoE layer(s) {} hold only zeros: their capture never ran (replaying them replays expert 0 everywhere)", ranges(zero)),
        "check that every MoE layer's router reaches the capture (a fused or custom MoE kernel may skip it; vLLM on CPU returns zeros)",
    )
}

/// A record with declared layers that lacks a block of the config's MoE layers at one end:
/// one pipeline stage's file (Megatron writes one trace per rank).
fn absent_stage(role: Role, r: &Record, l: &Layout) -> Option<Diagnosis> {
    if !r.layers_declared || !r.found.numbering_declared() && r.format != Format::MegatronTrace {
        return None;
    }
    let moe: Vec<usize> = (0..l.kinds.len()).filter(|&g| l.kinds[g] == LayerKind::Moe).collect();
    let absent: Vec<usize> = moe.iter().copied().filter(|g| !r.layers.contains(g)).collect();
    if absent.is_empty() || absent.len() == moe.len() {
        return None;
    }
    let block = absent.windows(2).all(|w| w[1] == w[0] + 1) || {
        let n = absent.len();
        moe[moe.len() - n..] == absent[..] || moe[..n] == absent[..]
    };
    let change = if r.format == Format::MegatronTrace {
        text!("give the folder of every rank's router_trace_rank{r}.jsonl, the stages' files merged by where each stage's layers begin: ", how_to_give())
    } else {
        "merge every pipeline stage's record (every rank's) before it is compared or replayed".into()
    };
    block.then(|| {
        defect(
            DiagnosisKind::PipelineNotMerged,
            format!(
                "{role}: the config's MoE layers {} ({} of {}) are not in the record: another pipeline stage's layers",
                ranges(&absent),
                absent.len(),
                moe.len()
            ),
            &change,
        )
    })
}

/// The measures' verdict on the pair: ids relabelled one-to-one (physical EPLB slots), equal
/// modulo 256 (a narrowing cast), or nothing a router pair of one model would show.
pub(super) fn of_pair(
    a: &Record,
    b: &Record,
    al: &Alignment,
    m: &Measures,
    found_defect: bool,
) -> Result<Vec<Diagnosis>> {
    let mut out = Vec::new();
    let heavy: Vec<usize> =
        (0..m.layers.len()).filter(|&p| m.layers[p].decisions >= 16 && m.layers[p].differ > 0.5).collect();
    let beyond = a.found.beyond.or(b.found.beyond);
    let relabelled = if heavy.is_empty() {
        false
    } else {
        let heavy = heavy_layers(a, b, al, &heavy);
        out.extend(narrowed_ids(a, b, &heavy.modulo));
        out.extend(physical_ids(&heavy, beyond));
        !heavy.relabel.is_empty()
    };
    if let (Some((n, max)), false) = (beyond, relabelled) {
        let r = if a.found.beyond.is_some() { a } else { b };
        let mapped = if heavy.is_empty() {
            ""
        } else {
            " and do not map one-to-one onto the other record's ids as physical slots would"
        };
        return Err(Error::input(
            &r.path,
            format!("{n} expert ids are not below the {} experts (up to {max}){mapped}", r.num_experts.unwrap_or(0)),
        ));
    }
    if out.is_empty() && !found_defect {
        out.extend(not_paired(m));
    }
    Ok(out)
}

/// The layers where most decisions differ, by what the differing sets show.
struct Heavy {
    /// Equal modulo 256 where they differ.
    modulo: Vec<usize>,
    /// One id relabelled onto another, one-to-one.
    relabel: Vec<usize>,
    /// One pair relabelled.
    example: Option<(i32, i32)>,
}

/// Reads the expert sets of the `heavy` layers (indices into the alignment's layers) on up to
/// 4096 aligned tokens: equal modulo 256, or relabelled one-to-one.
fn heavy_layers(a: &Record, b: &Record, al: &Alignment, heavy: &[usize]) -> Heavy {
    let rows: Vec<(usize, usize)> = al
        .segments
        .iter()
        .flat_map(|s| (0..s.len).map(move |k| (s.rollout + k, s.trainer + k)))
        .step_by((al.tokens / 4096).max(1))
        .collect();
    let mut found = Heavy { modulo: Vec::new(), relabel: Vec::new(), example: None };
    for &p in heavy {
        let pair = &al.layers[p];
        let mut row = Vec::new();
        let mut set_of = |r: &Record, t: usize, layer: usize| {
            r.row(t, layer, &mut row);
            set(&row)
        };
        let sets: Vec<(Vec<i32>, Vec<i32>)> = rows
            .iter()
            .map(|&(ta, tb)| (set_of(a, ta, pair.rollout_index), set_of(b, tb, pair.trainer_index)))
            .filter(|(x, y)| !x.is_empty() && !y.is_empty())
            .collect();
        let n = sets.len().max(1) as f64;
        let wraps = sets.iter().filter(|(x, y)| x != y && set_mod(x) == set_mod(y)).count();
        let differ = sets.iter().filter(|(x, y)| x != y).count().max(1);
        if wraps as f64 >= 0.9 * differ as f64 {
            found.modulo.push(pair.trainer);
            continue;
        }
        if let Some((agree, ex)) = mapping(&sets) {
            if agree as f64 >= 0.9 * n {
                found.relabel.push(pair.trainer);
                found.example.get_or_insert(ex);
            }
        }
    }
    found
}

/// Layers whose differing sets are equal modulo 256: ids narrowed to 8 bits.
fn narrowed_ids(a: &Record, b: &Record, modulo: &[usize]) -> Option<Diagnosis> {
    (!modulo.is_empty()).then(|| {
        defect(
            DiagnosisKind::NarrowingCast,
            format!(
                "layers {}: where the expert sets differ they are equal modulo 256 ({} and {} as stored): ids narrowed to 8 bits",
                ranges(modulo),
                a.found.dtype,
                b.found.dtype
            ),
            "store ids in uint16 or wider when the model has more than 256 experts (vLLM does; a compact dtype chosen by the largest id seen is not enough)",
        )
    })
}

/// Layers whose ids map one-to-one onto the other side's: physical expert slots.
fn physical_ids(heavy: &Heavy, beyond: Option<(usize, i32)>) -> Option<Diagnosis> {
    if heavy.relabel.is_empty() {
        return None;
    }
    let (x, y) = heavy.example.unwrap_or((0, 0));
    Some(defect(
        DiagnosisKind::PhysicalIds,
        format!(
            "layers {}: rollout ids map one-to-one onto other trainer ids on at least 90% of tokens (rollout {x} is trainer {y}, ...){}: one side records physical expert slots, not logical experts",
            ranges(&heavy.relabel),
            beyond.map_or(String::new(), |(n, max)| format!("; {n} ids beyond the expert count, up to {max}"))
        ),
        "record logical expert ids, before the expert-parallel load balancer (EPLB) maps them to physical slots (vLLM 0.14 and 0.21 capture after the mapping; SGLang and later vLLM before it)",
    ))
}

/// Disagreement no two routers of one model show: the records are probably not paired right.
fn not_paired(m: &Measures) -> Option<Diagnosis> {
    let whole = m.layers.iter().filter(|l| l.decisions >= 16 && l.differ >= 1.0).map(|l| l.trainer).collect::<Vec<_>>();
    if m.decisions_differ <= 0.5 && whole.is_empty() {
        return None;
    }
    let what = if m.decisions_differ > 0.5 {
        format!("{:.1}% of router decisions differ", m.decisions_differ * 100.0)
    } else {
        format!("every token differs in layer(s) {}", ranges(&whole))
    };
    Some(defect(
        DiagnosisKind::NotPaired,
        format!(
            "{what}: two routers of one model on the same tokens differ on about 10% (Ma et al. 2025), so these records are probably not paired right"
        ),
        "check that both records cover the same requests in the same order, the same layer axis (a payload shaped with another layer count or dtype reads as noise), the same step of training, and logical expert ids",
    ))
}

fn set(row: &[i32]) -> Vec<i32> {
    let mut s: Vec<i32> = row.iter().copied().filter(|&e| e >= 0).collect();
    s.sort_unstable();
    s
}

fn set_mod(s: &[i32]) -> Vec<i32> {
    let mut m: Vec<i32> = s.iter().map(|e| e & 0xff).collect();
    m.sort_unstable();
    m
}

/// The most frequent partner of each rollout id; how many token sets it maps exactly onto the
/// trainer's, and one pair it relabels (`None` when it relabels nothing).
fn mapping(sets: &[(Vec<i32>, Vec<i32>)]) -> Option<(usize, (i32, i32))> {
    let mut co: HashMap<(i32, i32), usize> = HashMap::new();
    for (x, y) in sets {
        for &i in x {
            for &j in y {
                *co.entry((i, j)).or_default() += 1;
            }
        }
    }
    let mut best: HashMap<i32, (usize, i32)> = HashMap::new();
    for (&(i, j), &n) in &co {
        let e = best.entry(i).or_insert((0, j));
        if n > e.0 || (n == e.0 && j < e.1) {
            *e = (n, j);
        }
    }
    let example = best.iter().filter(|(i, (_, j))| *i != j).map(|(&i, &(_, j))| (i, j)).min()?;
    let agree = sets
        .iter()
        .filter(|(x, y)| {
            let mut m: Vec<i32> = x.iter().map(|i| best[i].1).collect();
            m.sort_unstable();
            m == *y
        })
        .count();
    Some((agree, example))
}

/// What a replay check (`--max-disagreement 0`) concludes from the measures: replayed routes
/// are identical by construction, so every layer that differs did not receive the replay.
pub(super) fn replay_check(m: &Measures) -> Option<Diagnosis> {
    let off: Vec<&LayerMeasure> = m.layers.iter().filter(|l| l.differ > 0.0).collect();
    let first = off.first()?;
    let all = off.len() == m.layers.len();
    let list: Vec<String> = off.iter().take(8).map(|l| format!("{} ({})", l.trainer, pct(l.differ))).collect();
    let more = if off.len() > 8 { format!(" and {} more", off.len() - 8) } else { String::new() };
    let found = format!(
        "{} of {} layers differ from the rollout: {}{more}; {} of all router decisions differ (an unreplayed engine-trainer pair differs on about 10%, Ma et al. 2025)",
        off.len(),
        m.layers.len(),
        list.join(", "),
        pct(m.decisions_differ)
    );
    let change = if all {
        "the replay was not applied at all: check that the trainer's live routers receive the replay targets (a rebuilt or re-wrapped decoder keeps the old ones)".to_string()
    } else {
        format!(
            "layers from {} on did not receive the replay: register every router with the replay (MoE and MTP layers alike)",
            first.trainer
        )
    };
    Some(defect(DiagnosisKind::ReplayNotApplied, found, &change))
}

/// The order note: same expert sets in another order, left out of the disagreement.
pub(super) fn order_note(m: &Measures) -> Option<Diagnosis> {
    (m.order_only > 0).then(|| {
        note(
            DiagnosisKind::Order,
            format!(
                "{} of {} (token, layer) pairs have the same expert set in another slot order ({}): counted as agreeing",
                m.order_only,
                m.decisions,
                pct(m.order_only as f64 / m.decisions.max(1) as f64)
            ),
            "nothing: the set of experts decides the computation; compare weights per expert, not per slot",
        )
    })
}

/// The note on aligned pairs routed on one side only.
pub(super) fn missing_note(m: &Measures) -> Option<Diagnosis> {
    (m.missing > 0).then(|| {
        note(
            DiagnosisKind::Missing,
            format!(
                "{} aligned (token, layer) pairs have a route on one side only: counted apart, not as decisions",
                m.missing
            ),
            "",
        )
    })
}
