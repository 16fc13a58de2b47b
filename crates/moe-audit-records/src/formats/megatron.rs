//! Megatron-Core's routing records, as `core_v0.19.0` (5be9626) writes them:
//!
//! - `router_trace_rank{r}.jsonl`, one per global rank `r` (`megatron/core/transformer/moe/router_trace.py`
//!   L191-193, created empty at start on every rank; `r` is `torch.distributed.get_rank()`,
//!   `megatron/training/training.py` L3566-3578): one JSON object a line (`_make_index_record`
//!   L291-305, `json.dumps(rec) + "\n"` L465-474) with `step`, `stage`, `block` (`decoder` |
//!   `mtp`), `layer`, `rank` (`r` again), `num_tokens`, `topk`, `mtp_idx` (MTP only) and
//!   `top_indices` `[num_tokens][topk]`. On the training hook path `layer` is the index in the
//!   rank's own `decoder.layers` (L40-66), which each pipeline stage builds from 0
//!   (`transformer_block.py` L363-366), so the stages' numbers collide and no line names its
//!   stage; on the inference path (L407-463) it is the router's 1-based global `layer_number`.
//!   A forward whose layer dropped tokens is skipped (L353-361); every micro-batch (and a
//!   recompute) writes its own line.
//!
//!   Read here: the first step; per router the lines concatenated in rank order, then file
//!   order, an exact repeat (recompute, a tensor-parallel replica) once. Which stage a rank ran,
//!   and so where its layers begin, comes from the config's pipeline settings (the `pipeline`
//!   module); without them only files that need none are read: rank 0's (stage 0 in every rank
//!   order), or files that each hold every MoE layer of the config (no pipeline).
//! - inference routing: `request.routing_indices` `[P + O - 1, num_moe_layers, top_k]` int16
//!   (int32 past 32768 experts), MoE routers in instantiation order, MTP included when built
//!   (`inference/text_generation_controllers/text_generation_controller.py` L1318-1375); over HTTP
//!   per choice `moe_topk_indices`, a nested list or the `["ndarray", {"data", "dtype"}]` wrapper
//!   (`inference_request.py` L50-52, L190-195, `.../endpoints/completions.py` L269-277).
//!
//! `RouterReplay` (`router_replay.py`) keeps Python lists and writes no file.

use super::{bad, choices, nested, Axis, Dtype, Format, Raw, Sequence};
use crate::budget::Budget;
use crate::config::{LayerKind, Layout};
use crate::file::TraceFile;
use crate::pipeline::how_to_give;
use crate::settings::CONFIG;
use crate::text::ranges;
use moe_audit_core::error::{excerpt, excerpt_long, Error, Result, Text};
use moe_audit_core::text;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Whether `bytes` look like a trace: JSON lines, the first an object with `top_indices`.
pub(crate) fn is_trace(bytes: &[u8]) -> bool {
    let first = bytes.split(|&b| b == b'\n').find(|l| l.iter().any(|b| !b.is_ascii_whitespace()));
    first.and_then(|l| serde_json::from_slice::<Value>(l).ok()).is_some_and(|v| v.get("top_indices").is_some())
}

/// One router: (block is MTP, mtp_idx, layer). In a rank's file `layer` is as written; once
/// merged, a decoder router's is its global 0-based number.
type Key = (bool, u64, u64);

/// One forward's rows of one router, `[num_tokens][topk]`.
type Block = Vec<Vec<i32>>;

/// A rank's file as read: its rank (its lines', else its name's) and its lines of the step read.
struct RankFile<'a> {
    name: &'a str,
    rank: Option<u64>,
    lines: Vec<(Key, Block)>,
}

impl RankFile<'_> {
    fn decoder(&self) -> BTreeSet<u64> {
        self.lines.iter().filter(|(k, _)| !k.0).map(|(k, _)| k.2).collect()
    }
}

/// Where a rank's decoder layers begin, and how many its stage builds (when known).
#[derive(Clone, Copy)]
struct At {
    first: u64,
    layers: Option<u64>,
}

/// Reads trace files as one record: one file, or a folder's (every rank's, in rank order), in
/// steps: each file's lines of the first step, where each rank's layers begin, how decoder
/// layers are numbered, every router's forwards by global layer, stacked token by token.
pub(crate) fn trace(path: &Path, files: &[TraceFile], layout: Option<&Layout>, budget: &mut Budget) -> Result<Raw> {
    let mut lines = Lines::default();
    let mut ranks = Vec::with_capacity(files.len());
    for (name, named, bytes) in files {
        budget.take(&format!("parsing {name}"), bytes.len() as u64 * 2)?;
        ranks.push(lines.read_file(path, name, *named, bytes)?);
    }
    let top_k = lines.top_k.ok_or_else(|| bad(path, "no router_trace line: no routes"))?;
    let folder = files.first().is_some_and(|f| f.1.is_some());
    let (at, mut notes) = stages(path, &ranks, folder, layout)?;
    let (one_based, how) = numbering(path, &ranks, &at, layout)?;
    if lines.steps.len() > 1 {
        notes.push(format!("{} steps in the trace; step {} read", lines.steps.len(), lines.step.unwrap_or(0)));
    }
    let (routers, repeats) = by_router(ranks, &at, one_based);
    if repeats > 0 {
        notes.push(format!("{repeats} repeated line(s) (recompute or tensor-parallel replicas) read once"));
    }
    let mut raw = stack(path, &routers, top_k, layout)?;
    raw.notes = notes.into_iter().map(Text::from).chain([how]).collect();
    Ok(raw)
}

/// What the lines of every file read so far agree on: the step read (the first), every step
/// seen, the top-k.
#[derive(Default)]
struct Lines {
    step: Option<u64>,
    steps: BTreeSet<u64>,
    top_k: Option<usize>,
}

impl Lines {
    /// A rank's file: its lines of the step read, its rank (its lines', else its name's).
    fn read_file<'a>(&mut self, path: &Path, name: &'a str, named: Option<u64>, bytes: &[u8]) -> Result<RankFile<'a>> {
        let mut file = RankFile { name, rank: None, lines: Vec::new() };
        for (n, line) in bytes.split(|&b| b == b'\n').enumerate() {
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            let at = |m: String| bad(path, format!("{name} line {}: {m}", n + 1));
            let v: Value = serde_json::from_slice(line).map_err(|e| at(format!("not JSON: {}", excerpt_long(&e))))?;
            file.lines.extend(self.line(&v, &at, named, &mut file.rank)?);
        }
        file.rank = file.rank.or(named);
        Ok(file)
    }

    /// One line: its router and rows, or `None` for a line of another step; its `rank` checked
    /// against the file's (`rank`, set by the first line) and name's (`named`).
    fn line(
        &mut self,
        v: &Value,
        at: &dyn Fn(String) -> Error,
        named: Option<u64>,
        rank: &mut Option<u64>,
    ) -> Result<Option<(Key, Block)>> {
        let int = |k: &str| v.get(k).and_then(Value::as_u64).ok_or_else(|| at(format!("no integer `{k}`")));
        let r = int("rank")?;
        if let Some(named) = named.filter(|&f| f != r) {
            return Err(at(format!("`rank` {r} in rank {named}'s file: Megatron writes a rank's own number in its file's name and in every line")));
        }
        if let Some(first) = rank.filter(|&f| f != r) {
            return Err(at(format!("`rank` {r}, earlier lines {first}: one file holds one rank's lines")));
        }
        *rank = Some(r);
        let s = int("step")?;
        self.steps.insert(s);
        if *self.step.get_or_insert(s) != s {
            return Ok(None);
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
        if k == 0 || *self.top_k.get_or_insert(k) != k {
            return Err(at(format!("`topk` {k}, earlier lines {}", self.top_k.unwrap_or(0))));
        }
        let ids = v.get("top_indices").and_then(Value::as_array).ok_or_else(|| at("no `top_indices` list".into()))?;
        if ids.len() != tokens {
            return Err(at(format!("`top_indices` has {} rows, `num_tokens` says {tokens}", ids.len())));
        }
        let block: Block = ids
            .iter()
            .map(|r| {
                r.as_array()
                    .filter(|r| r.len() == k)
                    .and_then(|r| {
                        r.iter().map(|x| x.as_i64().and_then(|x| i32::try_from(x).ok())).collect::<Option<Vec<i32>>>()
                    })
                    .ok_or_else(|| at(format!("a `top_indices` row is not {k} integers")))
            })
            .collect::<Result<_>>()?;
        Ok(Some((key, block)))
    }
}

/// Every router's forwards, by global key (decoder layers by number, then MTP), each rank's
/// lines at where its layers begin; an exact repeat once (and how many were repeats).
fn by_router(ranks: Vec<RankFile>, at: &[At], one_based: bool) -> (BTreeMap<Key, Vec<Block>>, usize) {
    let mut rows: BTreeMap<Key, Vec<Block>> = BTreeMap::new();
    let mut repeats = 0usize;
    for (file, at) in ranks.into_iter().zip(at) {
        for ((mtp, idx, layer), block) in file.lines {
            let global = match (mtp, one_based) {
                (true, _) => layer,
                (false, true) => layer - 1,
                (false, false) => at.first + layer,
            };
            let list = rows.entry((mtp, idx, global)).or_default();
            if list.contains(&block) {
                repeats += 1;
            } else {
                list.push(block);
            }
        }
    }
    (rows, repeats)
}

/// The routers' rows as one record `[tokens, routers, top_k]` (every router covering the same
/// tokens), MTP heads numbered after the decoder layers, one sequence per forward.
fn stack(path: &Path, rows: &BTreeMap<Key, Vec<Block>>, top_k: usize, layout: Option<&Layout>) -> Result<Raw> {
    let order: Vec<Key> = rows.keys().copied().collect();
    let tokens: Vec<usize> = order.iter().map(|k| rows[k].iter().map(Vec::len).sum()).collect();
    if let Some(i) = tokens.iter().position(|&t| t != tokens[0]) {
        return Err(bad(
            path,
            format!(
                "router {} has {} rows, router {} {}: the layers do not cover the same tokens (Megatron writes no line for a forward whose layer dropped tokens)",
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
    // MTP head h after the decoder layers.
    let backbone = match layout {
        Some(l) => l.kinds.iter().filter(|k| **k != LayerKind::Mtp).count() as u64,
        None => order.iter().filter(|k| !k.0).map(|k| k.2 + 1).max().unwrap_or(0),
    };
    let numbers = order.iter().map(|k| if k.0 { (backbone + k.1) as usize } else { k.2 as usize }).collect();
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
    Ok(raw)
}

fn name_of(k: Key) -> String {
    if k.0 {
        format!("mtp {} layer {}", k.1, k.2)
    } else {
        format!("decoder layer {}", k.2)
    }
}

/// Where each rank's decoder layers begin: by the config's pipeline split and rank order; else
/// at 0 when that is known without them (rank 0 is stage 0 in every rank order; files that each
/// hold every MoE layer of the config are no pipeline's stages); else refused, saying what to
/// give. Also the notes that say how.
fn stages(path: &Path, files: &[RankFile], folder: bool, layout: Option<&Layout>) -> Result<(Vec<At>, Vec<String>)> {
    let what = |f: &RankFile| f.rank.map_or_else(|| f.name.to_string(), |r| format!("rank {r}"));
    let Some(p) = layout.and_then(|l| l.pipeline.as_ref()) else {
        let start = vec![At { first: 0, layers: None }; files.len()];
        if files.iter().all(|f| f.rank.unwrap_or(0) == 0) {
            return Ok((start, Vec::new()));
        }
        if let Some(l) = layout {
            let moe: BTreeSet<u64> =
                (0..l.kinds.len()).filter(|&g| l.kinds[g] == LayerKind::Moe).map(|g| g as u64).collect();
            let plus1: BTreeSet<u64> = moe.iter().map(|g| g + 1).collect();
            if files.iter().all(|f| f.decoder() == moe || f.decoder() == plus1) {
                let note = format!(
                    "{} rank file(s) merged in rank order: each holds every MoE layer of the config, so no pipeline stage",
                    files.len()
                );
                return Ok((start, vec![note]));
            }
        }
        let whose = if folder { format!("{} rank files", files.len()) } else { format!("{}'s file", what(&files[0])) };
        return Err(bad(
            path,
            text!(format!("{whose}: which pipeline stage a rank ran is not in its trace (every stage numbers its layers from 0): "), how_to_give()),
        ));
    };
    if p.chunks > 1 {
        return Err(bad(
            path,
            format!(
                "the config's pipeline has {} model chunks per rank (virtual pipeline stages): each chunk numbers its layers from 0 in the same file and a line names no chunk (router_trace.py L40-66, L217-222), so the trace cannot be merged; trace a run without virtual pipeline stages",
                p.chunks
            ),
        ));
    }
    let world = folder.then_some(files.len());
    // A rank's stage follows from the world size: every rank's file must be there (Megatron
    // creates each at start, router_trace.py L191-193).
    if folder && p.size > 1 {
        if let Some(w) = p.world.filter(|&w| w != files.len()) {
            return Err(bad(path, format!("the folder holds {} rank files, the config's `world_size` is {w}: every rank writes its file (router_trace.py L191-193), so give them all", files.len())));
        }
        let ranks = files.iter().map(|f| f.rank.unwrap_or(0));
        if let Some((i, r)) = ranks.enumerate().find(|&(i, r)| r != i as u64) {
            let what = if r < i as u64 { format!("rank {r} has two files") } else { format!("rank {i} is missing") };
            return Err(bad(
                path,
                format!(
                    "the folder's rank files are not ranks 0 to {} once each: {what} (every rank writes its file, router_trace.py L191-193, and a rank's stage follows from the world size)",
                    files.len() - 1
                ),
            ));
        }
    }
    let mut by_stage: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    let at = files
        .iter()
        .map(|f| {
            let s = p
                .stage_of(f.rank.unwrap_or(0) as usize, world)
                .map_err(|e| bad(path, text!(format!("{}: ", f.name), e)))?;
            by_stage.entry(s).or_default().push(f.rank.unwrap_or(0) as usize);
            let stage = p.stages[s];
            Ok(At { first: stage.first as u64, layers: Some(stage.layers as u64) })
        })
        .collect::<Result<Vec<At>>>()?;
    let each: Vec<String> = by_stage
        .iter()
        .map(|(s, r)| {
            let stage = p.stages[*s];
            let layers = match stage.layers {
                0 => "no layer".to_string(),
                n => format!("layers {}", ranges(&(stage.first..stage.first + n).collect::<Vec<_>>())),
            };
            format!("rank(s) {}: stage {s}, {layers}", ranges(r))
        })
        .collect();
    let note = format!("pipeline stages by the config ({}, {} stage(s)): {}", p.split, p.size, each.join("; "));
    Ok((at, vec![note]))
}

/// Whether decoder `layer` is the 1-based global number (the inference path), and the note that
/// says how it was read. 0-based from its stage's first layer (the training hook path) unless
/// the config says it is not: read so, some number would be dense or outside its stage, while
/// read 1-based every one is a MoE layer inside it. Read 0-based, a number outside its stage
/// is refused: the config's split is not the run's.
fn numbering(path: &Path, files: &[RankFile], at: &[At], layout: Option<&Layout>) -> Result<(bool, Text)> {
    let moe = |g: u64| layout.is_none_or(|l| l.kinds.get(g as usize) == Some(&LayerKind::Moe));
    let within = |a: &At, g: u64| a.layers.is_none_or(|n| g >= a.first && g < a.first + n);
    let fits = |global: &dyn Fn(&At, u64) -> Option<u64>| {
        files
            .iter()
            .zip(at)
            .all(|(f, a)| f.decoder().iter().all(|&d| global(a, d).is_some_and(|g| within(a, g) && moe(g))))
    };
    let one_based = layout.is_some() && !fits(&|a, d| Some(a.first + d)) && fits(&|_, d| d.checked_sub(1));
    if !one_based {
        for (f, a) in files.iter().zip(at) {
            if let (Some(n), Some(d)) = (a.layers, f.decoder().into_iter().find(|&d| !within(a, a.first + d))) {
                return Err(bad(
                    path,
                    format!(
                        "{}: decoder layer {d} is not among its stage's {n} layers (from {}) under the config's pipeline split: the config's split is not the run's",
                        f.name, a.first
                    ),
                ));
            }
        }
    }
    let how = if one_based {
        "decoder `layer` read as 1-based global layer numbers (the inference path): read 0-based, some would be dense in the config or outside their stage".into()
    } else if layout.is_some() {
        "decoder `layer` read as the 0-based index in its pipeline stage (the training hook path), from the stage's first layer".into()
    } else {
        text!("decoder `layer` read as 0-based (the training hook path); the inference path writes 1-based numbers: give ", CONFIG, " to tell")
    };
    Ok((one_based, how))
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
