//! Megatron-Core's routing records, as `core_v0.19.0` (5be9626) writes them:
//!
//! - `router_trace_rank{r}.jsonl`, one per global rank (`megatron/core/transformer/moe/router_trace.py`
//!   L192): one JSON object a line (`_make_index_record` L291-305, `json.dumps(rec) + "\n"`
//!   L465-474) with `step`, `stage`, `block` (`decoder` | `mtp`), `layer`, `rank`, `num_tokens`,
//!   `topk`, `mtp_idx` (MTP only) and `top_indices` `[num_tokens][topk]`. `layer` is the 0-based
//!   index in the stage's `decoder.layers` (hook path, L45-66) or the 1-based global
//!   `layer_number` (inference path, L407-463); a forward whose layer dropped tokens is skipped
//!   (L353-361); every micro-batch (and a recompute) writes its own line. Read here: the first
//!   step; per (block, mtp_idx, layer) the lines concatenated in file order, an exact repeat
//!   (recompute, a tensor-parallel replica) once; a folder merges every rank's file in rank order.
//! - inference routing: `request.routing_indices` `[P + O - 1, num_moe_layers, top_k]` int16
//!   (int32 past 32768 experts), MoE routers in instantiation order, MTP included when built
//!   (`inference/text_generation_controllers/text_generation_controller.py` L1318-1375); over HTTP
//!   per choice `moe_topk_indices`, a nested list or the `["ndarray", {"data", "dtype"}]` wrapper
//!   (`inference_request.py` L50-52, `.../endpoints/completions.py` L269-277).
//!
//! `RouterReplay` (`router_replay.py`) keeps Python lists and writes no file.

use super::{bad, choices, nested, Dtype, Raw};
use crate::clean::Axis;
use crate::config::{LayerKind, Layout};
use crate::record::{Format, Sequence};
use crate::Budget;
use moe_audit_core::error::{excerpt, excerpt_long, Result};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

/// Whether `bytes` look like a trace: JSON lines, the first an object with `top_indices`.
pub(crate) fn is_trace(bytes: &[u8]) -> bool {
    let first = bytes.split(|&b| b == b'\n').find(|l| l.iter().any(|b| !b.is_ascii_whitespace()));
    first.and_then(|l| serde_json::from_slice::<Value>(l).ok()).is_some_and(|v| v.get("top_indices").is_some())
}

/// One router's rows: (block is MTP, mtp_idx, layer) → rows of top-k ids.
type Key = (bool, u64, u64);

/// Reads trace files (one rank each, in rank order) as one record.
pub(crate) fn trace(
    path: &Path,
    files: &[(String, Vec<u8>)],
    layout: Option<&Layout>,
    budget: &mut Budget,
) -> Result<Raw> {
    let mut order: Vec<Key> = Vec::new();
    let mut rows: BTreeMap<Key, Vec<Vec<Vec<i32>>>> = BTreeMap::new();
    let (mut step, mut steps, mut top_k, mut repeats) = (None, std::collections::BTreeSet::new(), None, 0usize);
    for (name, bytes) in files {
        budget.take(&format!("parsing {name}"), bytes.len() as u64 * 2)?;
        for (n, line) in bytes.split(|&b| b == b'\n').enumerate() {
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            let at = |m: String| bad(path, format!("{name} line {}: {m}", n + 1));
            let v: Value = serde_json::from_slice(line).map_err(|e| at(format!("not JSON: {}", excerpt_long(&e))))?;
            let int = |k: &str| v.get(k).and_then(Value::as_u64).ok_or_else(|| at(format!("no integer `{k}`")));
            let s = int("step")?;
            steps.insert(s);
            if *step.get_or_insert(s) != s {
                continue;
            }
            let mtp = match v.get("block").and_then(Value::as_str) {
                Some("decoder") => false,
                Some("mtp") => true,
                _ => {
                    let block = v.get("block").map_or("missing".into(), |b| excerpt(&b.to_string()));
                    return Err(at(format!("`block` is {block}, not \"decoder\" or \"mtp\"")));
                }
            };
            let key = (mtp, if mtp { int("mtp_idx").unwrap_or(0) } else { 0 }, int("layer")?);
            let (tokens, k) = (int("num_tokens")? as usize, int("topk")? as usize);
            if k == 0 || *top_k.get_or_insert(k) != k {
                return Err(at(format!("`topk` {k}, earlier lines {}", top_k.unwrap_or(0))));
            }
            let ids =
                v.get("top_indices").and_then(Value::as_array).ok_or_else(|| at("no `top_indices` list".into()))?;
            if ids.len() != tokens {
                return Err(at(format!("`top_indices` has {} rows, `num_tokens` says {tokens}", ids.len())));
            }
            let block: Vec<Vec<i32>> = ids
                .iter()
                .map(|r| {
                    r.as_array()
                        .filter(|r| r.len() == k)
                        .and_then(|r| {
                            r.iter()
                                .map(|x| x.as_i64().and_then(|x| i32::try_from(x).ok()))
                                .collect::<Option<Vec<i32>>>()
                        })
                        .ok_or_else(|| at(format!("a `top_indices` row is not {k} integers")))
                })
                .collect::<Result<_>>()?;
            let list = rows.entry(key).or_default();
            if list.iter().any(|b| b.len() == block.len() && *b == block) {
                repeats += 1;
                continue;
            }
            if list.is_empty() {
                order.push(key);
            }
            list.push(block);
        }
    }
    let top_k = top_k.ok_or_else(|| bad(path, "no router_trace line: no routes"))?;
    let mut notes = Vec::new();
    if steps.len() > 1 {
        notes.push(format!("{} steps in the trace; step {} read", steps.len(), step.unwrap_or(0)));
    }
    if repeats > 0 {
        notes.push(format!("{repeats} repeated line(s) (recompute or tensor-parallel replicas) read once"));
    }
    // Layers in global order: decoder by number, then MTP.
    order.sort();
    let tokens: Vec<usize> = order.iter().map(|k| rows[k].iter().map(Vec::len).sum()).collect();
    if let Some(i) = tokens.iter().position(|&t| t != tokens[0]) {
        return Err(bad(
            path,
            format!(
                "router {} has {} rows, router {} {}: a layer that dropped tokens is not traced, or pipeline stages' local layer numbers collide (give the stages' files apart)",
                name_of(order[i]),
                tokens[i],
                name_of(order[0]),
                tokens[0]
            ),
        ));
    }
    let n = order.len();
    let mut experts = Vec::with_capacity(tokens[0] * n * top_k);
    let flat: Vec<Vec<&Vec<i32>>> = order.iter().map(|k| rows[k].iter().flatten().collect()).collect();
    for t in 0..tokens[0] {
        for layer in &flat {
            experts.extend_from_slice(layer[t]);
        }
    }
    let (numbers, how) = numbering(&order, layout);
    notes.push(how);
    let mut raw = Raw::bare(Format::MegatronTrace, Dtype::json(), [tokens[0], n, top_k], experts);
    raw.layers = Some(numbers);
    // One sequence per forward (a micro-batch), as the first router's lines give them.
    let mut at = 0;
    raw.sequences = rows[&order[0]]
        .iter()
        .map(|b| {
            at += b.len();
            Sequence { rows: at - b.len()..at, first_position: 0 }
        })
        .collect();
    raw.notes = notes;
    Ok(raw)
}

fn name_of(k: Key) -> String {
    if k.0 {
        format!("mtp {} layer {}", k.1, k.2)
    } else {
        format!("decoder layer {}", k.2)
    }
}

/// Global numbers of the traced routers: decoder layers 0-based (the hook path) unless the
/// config says they are 1-based (the inference path: every 0-based number dense, every
/// 1-based one MoE); MTP head h after the decoder layers.
fn numbering(order: &[Key], layout: Option<&Layout>) -> (Vec<usize>, String) {
    let decoder: Vec<u64> = order.iter().filter(|k| !k.0).map(|k| k.2).collect();
    let moe = |g: u64| layout.is_some_and(|l| l.kinds.get(g as usize) == Some(&LayerKind::Moe));
    let one_based = !decoder.contains(&0)
        && layout.is_some()
        && !decoder.iter().all(|&g| moe(g))
        && decoder.iter().all(|&g| moe(g - 1));
    let backbone = match layout {
        Some(l) => l.kinds.iter().filter(|k| **k != LayerKind::Mtp).count() as u64,
        None => decoder.iter().max().map_or(0, |m| m + 1 - u64::from(one_based)),
    };
    let numbers = order
        .iter()
        .map(|k| if k.0 { (backbone + k.1) as usize } else { (k.2 - u64::from(one_based)) as usize })
        .collect();
    let how = if one_based {
        "decoder `layer` read as 1-based global layer numbers (the inference path): 0-based they would all be dense in the config".to_string()
    } else if layout.is_some() {
        "decoder `layer` read as 0-based layer numbers (the training hook path, one pipeline stage)".to_string()
    } else {
        "decoder `layer` read as 0-based (the training hook path); the inference path writes 1-based numbers: give --config to tell".to_string()
    };
    (numbers, how)
}

/// Inference routing from HTTP responses: one sequence per choice.
pub(crate) fn inference(path: &Path, items: &[&Value], budget: &mut Budget) -> Result<Raw> {
    let mut parts = Vec::new();
    for (i, c) in choices(path, items)?.into_iter().enumerate() {
        let v = c.get("moe_topk_indices").ok_or_else(|| bad(path, format!("choice {i} has no `moe_topk_indices`")))?;
        // A bare nested list, or the serializer's `["ndarray", {"data", "dtype"}]` / `{"data", "dtype"}`.
        let inner = match v {
            Value::Array(a) if a.first().and_then(Value::as_str) == Some("ndarray") => a.get(1).unwrap_or(&Value::Null),
            other => other,
        };
        let (data, dtype) = match inner.get("data") {
            Some(d) => {
                (d, inner.get("dtype").and_then(Value::as_str).and_then(Dtype::named).unwrap_or_else(Dtype::json))
            }
            None => (inner, Dtype::json()),
        };
        budget.take(&format!("reading {}", path.display()), 64)?;
        let (shape, ids) = nested(path, &format!("choice {i}: `moe_topk_indices`"), data)?;
        let mut part = Raw::bare(Format::MegatronInference, dtype, shape, ids);
        part.axis = Axis::Routers;
        parts.push(part);
    }
    let mut all = Raw::concat(path, parts, budget)?;
    all.axis = Axis::Routers;
    Ok(all)
}
