//! One reader per writer, each following the writer's own source at a named release (the
//! module doc of each file names it). A reader only lays out what the file holds, as the writer
//! stored it: ids in the stored dtype, its rows and sequences, a padding mask when the writer
//! keeps one, which fill its writer pads with (`clean::Fill`), layer numbers when the file states
//! them. What the values mean (fill, wraps, missing routes, dense layers, numbering) is decided
//! once for every writer in `clean`.
//!
//! Which reader: by the file's content, never by its name: `.npy` magic, zip (`.npz`),
//! JSON (by the keys each writer uses), JSON lines (Megatron's trace), a folder of trace files,
//! else safetensors (by array names).

pub(crate) mod generic;
pub(crate) mod megatron;
pub(crate) mod nemo_rl;
pub(crate) mod sglang;
pub(crate) mod skyrl;
pub(crate) mod slime;
pub(crate) mod verl;
pub(crate) mod vllm;

use super::array::{Array, Elem};
use super::budget::Budget;
pub(crate) use super::file::bad;
use super::ids::Ids;
use bytes::Bytes;
use moe_audit_core::error::{excerpt, excerpt_names, Error, Result, Text};
use serde::Serialize;
use serde_json::Value;
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;

/// The generic format's `format` metadata.
pub const GENERIC: &str = "moe-audit-routes/1";

/// Which writer's layout a record was read as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Format {
    /// `moe-audit-routes/1` (`.safetensors` or `.npz`), as `moe_audit.routes.record` writes it.
    Generic,
    /// A bare `.npy` `[tokens, layers, top_k]` (vLLM's `CompletionOutput.routed_experts`,
    /// a SkyRL trajectory, a Megatron inference array saved with `np.save`).
    Npy,
    /// An SGLang response: `meta_info.routed_experts` or `sglext.routed_experts`.
    Sglang,
    /// A vLLM HTTP response: `choices[i].routed_experts`, base64 of an `.npy`.
    VllmHttp,
    /// Megatron-Core `router_trace_rank{r}.jsonl` (one file or a folder of them).
    MegatronTrace,
    /// Megatron-Core inference routing: `moe_topk_indices` `[tokens, moe_layers, top_k]`.
    MegatronInference,
    /// verl's batch: `routed_experts` `[batch, prompt + response, layers, top_k]` + `attention_mask`.
    Verl,
    /// slime's replay targets: `rollout_routed_experts` (packed, with `cu_seqlens`) or per sample.
    Slime,
    /// SkyRL: `rollout_expert_indices` `[batch, tokens, layers, top_k]` + `router_padding_mask`,
    /// or the wire object `{data, shape, dtype}`.
    Skyrl,
    /// NeMo-RL: `routed_experts` `[batch, tokens, layers, top_k]` (-1 = missing), or `nrlre1:`.
    NemoRl,
    /// A batch `[batch, tokens, layers, top_k]` of no writer recognised by its names.
    Batch,
}

impl Format {
    /// How the report names it.
    pub fn name(self) -> &'static str {
        match self {
            Format::Generic => "moe-audit-routes/1",
            Format::Npy => "npy [tokens, layers, top_k]",
            Format::Sglang => "SGLang routed_experts",
            Format::VllmHttp => "vLLM HTTP routed_experts (base64 .npy)",
            Format::MegatronTrace => "Megatron-Core router_trace JSONL",
            Format::MegatronInference => "Megatron-Core inference moe_topk_indices",
            Format::Verl => "verl routed_experts [batch, tokens, layers, top_k]",
            Format::Slime => "slime rollout_routed_experts",
            Format::Skyrl => "SkyRL rollout_expert_indices",
            Format::NemoRl => "NeMo-RL routed_experts",
            Format::Batch => "batch [batch, tokens, layers, top_k]",
        }
    }
}

/// One sequence of a record: its rows, and the position in the sequence of its first row
/// (SGLang's `routed_experts_start_len`; 0 otherwise).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Sequence {
    /// Rows of the record.
    pub rows: Range<usize>,
    /// Sequence position of the first row.
    pub first_position: usize,
}

/// What the writer says its layer axis is, when it says anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum Axis {
    /// Unknown: every numbering is tried.
    #[default]
    Any,
    /// Every decoder layer, never MTP (SGLang's and vLLM's capture buffers).
    Decoder,
    /// The MoE routers in instantiation order, MTP included when built (Megatron inference).
    Routers,
}

/// How and where a writer fills token rows with values a router could also choose, as its code
/// does (the reader names its writer's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum Fill {
    /// No such fill: engines (SGLang, vLLM), Megatron, moe-audit's own format, an unknown batch.
    #[default]
    None,
    /// `torch.zeros` rows after each sequence's routes (verl: the last token, a multi-turn tail).
    ZeroTail,
    /// `arange(top_k)` in every layer after each sequence's routes (NeMo-RL's right pad, SkyRL's
    /// rows past the captured ones), and before them when `head` (SkyRL's left pad, when no mask
    /// marks it).
    TopK { head: bool },
    /// slime's packed replay target: each sample closed by one `arange(layers·top_k) % experts`
    /// row, the stream by a last segment `arange(n·layers·top_k) % experts`.
    Slime,
}

/// What the other record tells about a record without a shape (SGLang's flat payload): its
/// top-k and layer count.
#[derive(Debug, Clone, Copy)]
pub struct ShapeHint {
    /// Layers of the layer axis (the highest layer number + 1).
    pub layers: usize,
    /// Experts per token.
    pub top_k: usize,
}

/// The element type as stored: an array's, or `None` for ids written as JSON numbers.
#[derive(Debug, Clone)]
pub(crate) struct Dtype {
    pub elem: Option<Elem>,
    pub name: String,
}

impl Dtype {
    pub(crate) fn of(elem: Elem) -> Dtype {
        Dtype { elem: Some(elem), name: elem.name().to_string() }
    }

    pub(crate) fn json() -> Dtype {
        Dtype { elem: None, name: "JSON integers".to_string() }
    }

    /// A dtype by its numpy/torch name (`uint8`, `int16`, ...), for the formats that say it.
    pub(crate) fn named(name: &str) -> Option<Dtype> {
        let elem = match name.trim().to_ascii_lowercase().as_str() {
            "int8" => Elem::I8,
            "uint8" => Elem::U8,
            "int16" => Elem::I16,
            "uint16" => Elem::U16,
            "int32" => Elem::I32,
            "uint32" => Elem::U32,
            "int64" => Elem::I64,
            "uint64" => Elem::U64,
            _ => return None,
        };
        Some(Dtype::of(elem))
    }
}

/// A record as its writer stored it (see the module doc).
#[derive(Debug)]
pub(crate) struct Raw {
    pub format: Format,
    pub dtype: Dtype,
    pub tokens: usize,
    pub top_k: usize,
    pub n_layers: usize,
    /// Global layer numbers, when the file states them.
    pub layers: Option<Vec<usize>>,
    /// What the writer's layer axis is, when it is one thing.
    pub axis: Axis,
    /// `[tokens, n_layers, top_k]` as stored (a uint8 255 is 255 here).
    pub experts: Ids,
    pub logits: Option<(Vec<f32>, usize)>,
    pub input_ids: Option<Vec<i64>>,
    pub sequences: Vec<Sequence>,
    /// Per row: padding by the writer's own mask.
    pub pad_mask: Option<Vec<bool>>,
    /// The writer's fill that a router could also choose, and where the writer puts it.
    pub fill: Fill,
    pub meta: BTreeMap<String, String>,
    pub notes: Vec<Text>,
}

impl Raw {
    /// One sequence of `[tokens, layers, top_k]` ids, nothing else known.
    pub(crate) fn bare(format: Format, dtype: Dtype, shape: [usize; 3], experts: impl Into<Ids>) -> Raw {
        Raw {
            format,
            dtype,
            tokens: shape[0],
            n_layers: shape[1],
            top_k: shape[2],
            layers: None,
            axis: Axis::Any,
            experts: experts.into(),
            logits: None,
            input_ids: None,
            sequences: vec![Sequence { rows: 0..shape[0], first_position: 0 }],
            pad_mask: None,
            fill: Fill::None,
            meta: BTreeMap::new(),
            notes: Vec::new(),
        }
    }

    /// Several records of one layer axis and top-k, one sequence each, concatenated (their ids
    /// copied into one buffer, within `budget`).
    pub(crate) fn concat(path: &Path, parts: Vec<Raw>, budget: &mut Budget) -> Result<Raw> {
        let mut parts = parts.into_iter();
        let mut all = parts.next().ok_or_else(|| Error::input(path, "no routes"))?;
        let mut ids = vec![std::mem::replace(&mut all.experts, Ids::Owned(Vec::new()))];
        for (i, p) in parts.enumerate() {
            if (p.n_layers, p.top_k) != (all.n_layers, all.top_k) {
                return Err(Error::input(
                    path,
                    format!(
                        "response {} has [{}, {}] layers x top-k, response 0 [{}, {}]",
                        i + 1,
                        p.n_layers,
                        p.top_k,
                        all.n_layers,
                        all.top_k
                    ),
                ));
            }
            let start = all.tokens;
            all.sequences.extend(p.sequences.iter().map(|s| Sequence {
                rows: s.rows.start + start..s.rows.end + start,
                first_position: s.first_position,
            }));
            all.tokens += p.tokens;
            ids.push(p.experts);
            if p.dtype.name != all.dtype.name {
                all.dtype.name = format!("{} and {}", all.dtype.name, p.dtype.name);
            }
        }
        all.experts = if ids.len() == 1 {
            ids.pop().expect("one")
        } else {
            Ids::concat(ids, budget, &format!("reading {}", path.display()))?
        };
        Ok(all)
    }
}

/// An array's shape as a message shows it: the file says how many dimensions.
pub(crate) fn shape_of(a: &Array) -> String {
    excerpt(&format!("{:?}", a.shape))
}

/// A `[tokens, layers, top_k]` array of expert ids.
pub(crate) fn ids3(a: &Array, path: &Path, budget: &mut Budget) -> Result<([usize; 3], Ids)> {
    let [t, l, k] = a.shape[..] else {
        return Err(bad(
            path,
            format!("`{}` has shape {}; expected [tokens, layers, top_k]", excerpt(&a.name), shape_of(a)),
        ));
    };
    Ok(([t, l, k], Ids::of_array(a, path, budget)?))
}

/// A batch `[batch, tokens, layers, top_k]`: one sequence per batch row.
pub(crate) fn batch(format: Format, a: &Array, path: &Path, budget: &mut Budget) -> Result<(Raw, usize)> {
    let [b, s, l, k] = a.shape[..] else {
        return Err(bad(
            path,
            format!("`{}` has shape {}; expected [batch, tokens, layers, top_k]", excerpt(&a.name), shape_of(a)),
        ));
    };
    let mut raw = Raw::bare(format, Dtype::of(a.elem), [b * s, l, k], Ids::of_array(a, path, budget)?);
    raw.sequences = (0..b).map(|i| Sequence { rows: i * s..(i + 1) * s, first_position: 0 }).collect();
    Ok((raw, s))
}

/// A `[batch, tokens]` mask as one flag per row, `true` = padding (`pad_when` is the stored
/// value that means padding).
pub(crate) fn mask(a: &Array, rows: usize, path: &Path, budget: &mut Budget, pad_when: i64) -> Result<Vec<bool>> {
    if a.shape.iter().product::<usize>() != rows || a.shape.len() > 2 {
        return Err(bad(
            path,
            format!("`{}` has shape {}; expected one flag per row ({rows})", excerpt(&a.name), shape_of(a)),
        ));
    }
    let v =
        if a.elem == Elem::Bool { a.data.iter().map(|&b| i64::from(b != 0)).collect() } else { a.ints(path, budget)? };
    Ok(v.into_iter().map(|x| x == pad_when).collect())
}

/// Rows at or past each sequence's length are padding (`lengths` `[batch]`, rows `s` each).
pub(crate) fn length_mask(lengths: &[i64], s: usize, path: &Path, what: &str) -> Result<Vec<bool>> {
    let mut m = Vec::with_capacity(lengths.len() * s);
    for (i, &n) in lengths.iter().enumerate() {
        if n < 0 || n as usize > s {
            return Err(bad(path, format!("`{what}`[{i}] is {n}, not a length within {s} rows")));
        }
        m.extend((0..s).map(|t| t >= n as usize));
    }
    Ok(m)
}

/// Reads the arrays of an `.npz` or safetensors file as the writer their names say.
pub(crate) fn from_arrays(
    path: &Path,
    arrays: Vec<Array>,
    meta: BTreeMap<String, String>,
    budget: &mut Budget,
) -> Result<Raw> {
    let has = |n: &str| arrays.iter().any(|a| a.name == n);
    if has("experts") {
        generic::read(path, arrays, meta, budget)
    } else if has("rollout_routed_experts") {
        slime::read(path, &arrays, budget)
    } else if has("rollout_expert_indices") {
        skyrl::read(path, &arrays, budget)
    } else if has("routed_experts") {
        let a = arrays.iter().find(|a| a.name == "routed_experts").expect("checked");
        if a.shape.len() == 3 {
            let (shape, ids) = ids3(a, path, budget)?;
            Ok(Raw::bare(Format::Npy, Dtype::of(a.elem), shape, ids))
        } else if has("attention_mask") && !has("unpadded_sequence_lengths") && !has("input_lengths") {
            verl::read(path, &arrays, budget)
        } else {
            nemo_rl::read(path, &arrays, budget)
        }
    } else {
        Err(bad(
            path,
            format!(
                "no routing array (found: {}); expected `experts` (moe-audit-routes/1), `routed_experts` (verl, NeMo-RL), `rollout_routed_experts` (slime) or `rollout_expert_indices` (SkyRL)",
                excerpt_names(arrays.iter().map(|a| a.name.as_str()))
            ),
        ))
    }
}

/// Reads a JSON response of an engine by the keys its writer uses.
pub(crate) fn from_json(
    path: &Path,
    value: &Value,
    config: Option<(usize, usize)>,
    other: Option<ShapeHint>,
    budget: &mut Budget,
) -> Result<Raw> {
    let items: Vec<&Value> = match value {
        Value::Array(items) => items.iter().collect(),
        v => vec![v],
    };
    let first = items.first().copied().ok_or_else(|| bad(path, "an empty JSON list: no response"))?;
    let choice0 = first.get("choices").and_then(Value::as_array).and_then(|c| c.first());
    let choice_field = |c: &Value, key: &str| c.get(key).or_else(|| c.get("message").and_then(|m| m.get(key))).cloned();
    if first.get("meta_info").is_some() || first.get("sglext").is_some() {
        return sglang::read(path, &items, config, other, budget);
    }
    if let Some(c) = choice0 {
        if c.get("moe_topk_indices").is_some() {
            return megatron::inference(path, &items, budget);
        }
        match choice_field(c, "routed_experts") {
            Some(Value::String(s)) if s.starts_with("nrlre1:") => return nemo_rl::envelopes(path, &items, budget),
            Some(Value::String(_)) => return vllm::http(path, &items, budget),
            Some(Value::Object(_)) => return skyrl::wire(path, &items, budget),
            _ => {}
        }
    }
    Err(bad(
        path,
        "no routing record in this JSON: expected `meta_info.routed_experts` or `sglext.routed_experts` (SGLang), `choices[i].routed_experts` (vLLM, SkyRL, NeMo-RL) or `choices[i].moe_topk_indices` (Megatron-Core)",
    ))
}

/// Every response's choices, in order (a response without `choices` is refused).
pub(crate) fn choices<'v>(path: &Path, items: &[&'v Value]) -> Result<Vec<&'v Value>> {
    let mut out = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let c = item
            .get("choices")
            .and_then(Value::as_array)
            .ok_or_else(|| bad(path, format!("response {i} has no `choices`")))?;
        out.extend(c.iter());
    }
    Ok(out)
}

/// Base64 (standard, padded) decoded within the budget.
pub(crate) fn base64(path: &Path, what: &str, text: &str, budget: &mut Budget) -> Result<Vec<u8>> {
    use ::base64::Engine;
    budget.take(&format!("decoding {}", path.display()), text.len() as u64 / 4 * 3)?;
    ::base64::engine::general_purpose::STANDARD
        .decode(text.trim())
        .map_err(|e| Error::parse(path, format!("{what} is not base64"), e))
}

/// Little-endian bytes of `elem` as expert ids.
pub(crate) fn ids_of_bytes(path: &Path, what: &str, bytes: Vec<u8>, elem: Elem, budget: &mut Budget) -> Result<Ids> {
    if !bytes.len().is_multiple_of(elem.size()) {
        return Err(bad(path, format!("{what}: {} bytes are not whole {} values", bytes.len(), elem.name())));
    }
    let a = Array { name: what.to_string(), shape: vec![bytes.len() / elem.size()], elem, data: Bytes::from(bytes) };
    Ids::of_array(&a, path, budget)
}

/// Ids nested `[tokens][layers][top_k]` in JSON.
pub(crate) fn nested(path: &Path, what: &str, v: &Value) -> Result<([usize; 3], Vec<i32>)> {
    let shape_err = || bad(path, format!("{what} is not a [tokens][layers][top_k] list of integers"));
    let rows = v.as_array().ok_or_else(shape_err)?;
    let l = rows.first().and_then(Value::as_array).map_or(0, Vec::len);
    let k = rows.first().and_then(|r| r.as_array()?.first()?.as_array().map(Vec::len)).unwrap_or(0);
    let mut ids = Vec::with_capacity(rows.len() * l * k);
    for row in rows {
        let layers = row.as_array().filter(|x| x.len() == l).ok_or_else(shape_err)?;
        for layer in layers {
            let slots = layer.as_array().filter(|x| x.len() == k).ok_or_else(shape_err)?;
            for s in slots {
                let id = s.as_i64().and_then(|x| i32::try_from(x).ok()).ok_or_else(shape_err)?;
                ids.push(id);
            }
        }
    }
    Ok(([rows.len(), l, k], ids))
}
