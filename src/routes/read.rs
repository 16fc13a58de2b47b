//! Routing records from every source, read within `--max-memory` and checked as they are read:
//! SGLang responses (base64 `routed_experts`), bare `[tokens, layers, top_k]` arrays (vLLM),
//! the generic format (`moe-audit-routes/1`, `.safetensors` or `.npz`), Megatron `RouterReplay`
//! dumps (`layer.N`). A record never names another file: nothing in it is followed.

use super::array::{self, Array};
use super::config::Layout;
use super::Budget;
use crate::error::{Error, Result, Setting};
use crate::files::read_bounded;
use base64::Engine;
use serde::Serialize;
use serde_json::Value;
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// The generic format's `format` metadata.
pub const GENERIC: &str = "moe-audit-routes/1";

/// Where a record came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Format {
    /// `moe-audit-routes/1` (`.safetensors` or `.npz`): experts, optional logits, token ids,
    /// sequence boundaries and layer numbers.
    Generic,
    /// A bare `.npy` `[tokens, layers, top_k]` array (vLLM's routed experts).
    Npy,
    /// A Megatron `RouterReplay` dump: safetensors `layer.N` `[tokens, top_k]`.
    Megatron,
    /// An SGLang response (`meta_info.routed_experts` or `sgl_ext`), or a list of them.
    Sglang,
}

impl Format {
    /// How the report names it.
    pub fn name(self) -> &'static str {
        match self {
            Format::Generic => "moe-audit-routes/1",
            Format::Npy => "npy [tokens, layers, top_k]",
            Format::Megatron => "Megatron RouterReplay (layer.N)",
            Format::Sglang => "SGLang routed_experts",
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

/// A routing record: expert ids `[tokens, layers, top_k]` (-1 = no route), the global number
/// of each layer of axis 1, and what else the file carried.
#[derive(Debug, Clone)]
pub struct Record {
    /// The file it was read from.
    pub path: PathBuf,
    /// Its format.
    pub format: Format,
    /// Rows (tokens).
    pub tokens: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Global layer number of each layer of axis 1.
    pub layers: Vec<usize>,
    /// Whether the file named the layers (else they were inferred: see [`Record::layer_note`]).
    pub layers_declared: bool,
    /// How undeclared layer numbers were inferred, when they were.
    pub layer_note: Option<String>,
    /// Expert ids, `[tokens, layers, top_k]` row-major; -1 = no route.
    pub experts: Vec<i32>,
    /// Router logits `[tokens, layers, width]`, when recorded.
    pub logits: Option<Vec<f32>>,
    /// Experts per layer (the logits' width, or the config's), when known.
    pub num_experts: Option<usize>,
    /// Token ids, when recorded.
    pub input_ids: Option<Vec<i64>>,
    /// The sequences (one when the file gives no boundaries).
    pub sequences: Vec<Sequence>,
    /// The file's metadata (generic format).
    pub meta: BTreeMap<String, String>,
}

impl Record {
    /// The ids of `token` at layer index `layer`.
    pub fn row(&self, token: usize, layer: usize) -> &[i32] {
        let at = (token * self.layers.len() + layer) * self.top_k;
        &self.experts[at..at + self.top_k]
    }

    /// Whether any route of the layer index is not -1 (a dense layer's placeholder has none).
    pub fn layer_routed(&self, layer: usize) -> bool {
        (0..self.tokens).any(|t| self.row(t, layer).iter().any(|&e| e >= 0))
    }

    /// Whether a token has no route in any layer (padding).
    pub fn token_empty(&self, token: usize) -> bool {
        let w = self.layers.len() * self.top_k;
        self.experts[token * w..(token + 1) * w].iter().all(|&e| e < 0)
    }
}

/// What the other record tells about a flat SGLang record: its top-k and layer count.
#[derive(Debug, Clone, Copy)]
pub struct ShapeHint {
    /// Layers of the layer axis.
    pub layers: usize,
    /// Experts per token.
    pub top_k: usize,
}

/// Reads a record, checking it (and against `layout` when given). `hint` shapes a flat SGLang
/// record when no layout is given.
pub fn load(path: &Path, layout: Option<&Layout>, hint: Option<ShapeHint>, budget: &mut Budget) -> Result<Record> {
    // A regular file's size is known before reading: say it against the limit.
    let what = format!("reading {}", path.display());
    if let Some(size) = std::fs::metadata(path).ok().filter(|m| m.is_file()).map(|m| m.len()) {
        Budget::clone(budget).take(&what, size)?;
    }
    let bytes = read_bounded(path, budget.left(), &Setting::MaxMemory.to_string())?;
    budget.take(&what, bytes.len() as u64)?;
    let record = if bytes.starts_with(b"\x93NUMPY") {
        let a = array::npy(&bytes, "experts", path)?;
        from_arrays(path, Format::Npy, vec![a], BTreeMap::new(), budget)?
    } else if bytes.starts_with(b"PK\x03\x04") || bytes.starts_with(b"PK\x05\x06") {
        let entries = array::npz(&bytes, path, budget)?;
        let arrays = entries.iter().map(|(name, data)| array::npy(data, name, path)).collect::<Result<Vec<_>>>()?;
        from_arrays(path, Format::Generic, arrays, BTreeMap::new(), budget)?
    } else if bytes.iter().find(|b| !b.is_ascii_whitespace()).is_some_and(|&b| b == b'{' || b == b'[') {
        sglang(path, &bytes, layout, hint, budget)?
    } else {
        let (arrays, meta) = array::safetensors(&bytes, path)?;
        let megatron = !arrays.is_empty() && arrays.iter().all(|a| layer_number(&a.name).is_some());
        if megatron {
            megatron_record(path, arrays, budget)?
        } else {
            from_arrays(path, Format::Generic, arrays, meta, budget)?
        }
    };
    check(record, layout)
}

fn bad(path: &Path, message: impl Into<String>) -> Error {
    Error::input(path, message.into())
}

/// `N` of a Megatron key `layer.N` (or `layers.N`, `decoder.layers.N.mlp.router`).
fn layer_number(name: &str) -> Option<usize> {
    let rest = name.strip_prefix("layer.").or_else(|| name.strip_prefix("layers."))?;
    rest.parse().ok()
}

/// The generic format (or a bare `.npy`, whose one array is `experts`).
fn from_arrays(
    path: &Path,
    format: Format,
    arrays: Vec<Array<'_>>,
    meta: BTreeMap<String, String>,
    budget: &mut Budget,
) -> Result<Record> {
    if let Some(f) = meta.get("format").filter(|f| f.as_str() != GENERIC) {
        return Err(bad(path, format!("metadata format `{f}` is not {GENERIC}")));
    }
    let find = |name: &str| arrays.iter().find(|a| a.name == name);
    let experts = find("experts").ok_or_else(|| {
        let names: Vec<&str> = arrays.iter().map(|a| a.name.as_str()).collect();
        bad(
            path,
            format!("no `experts` array (found: {}); expected [tokens, layers, top_k] integers", names.join(", ")),
        )
    })?;
    let [tokens, n_layers, top_k] = experts.shape[..] else {
        return Err(bad(path, format!("`experts` has shape {:?}; expected [tokens, layers, top_k]", experts.shape)));
    };
    if tokens == 0 || n_layers == 0 || top_k == 0 {
        return Err(bad(path, format!("`experts` has shape {:?}: no routes", experts.shape)));
    }
    let ids = experts.expert_ids(path, budget)?;
    let logits = match find("logits") {
        None => None,
        Some(a) => {
            if a.shape.len() != 3 || a.shape[0] != tokens || a.shape[1] != n_layers || a.shape[2] < top_k {
                return Err(bad(
                    path,
                    format!(
                        "`logits` has shape {:?}; expected [{tokens}, {n_layers}, experts >= {top_k}] like `experts`",
                        a.shape
                    ),
                ));
            }
            Some((a.floats(path, budget)?, a.shape[2]))
        }
    };
    let input_ids = match find("input_ids") {
        None => None,
        Some(a) if a.shape.len() == 1 && a.shape[0] == tokens => Some(a.ints(path, budget)?),
        Some(a) => return Err(bad(path, format!("`input_ids` has shape {:?}; expected [{tokens}]", a.shape))),
    };
    let sequences = match find("cu_seqlens") {
        None => vec![Sequence { rows: 0..tokens, first_position: 0 }],
        Some(a) => {
            let cu = a.ints(path, budget)?;
            boundaries(&cu, tokens).map_err(|m| bad(path, format!("`cu_seqlens` {m}")))?
        }
    };
    let declared = match (meta.get("layers"), find("layers")) {
        (Some(text), _) => Some(
            serde_json::from_str::<Vec<usize>>(text)
                .map_err(|e| bad(path, format!("metadata `layers` is not a JSON list of layer numbers: {e}")))?,
        ),
        (None, Some(a)) => Some(a.ints(path, budget)?.into_iter().map(|v| v.max(0) as usize).collect()),
        (None, None) => None,
    };
    Ok(Record {
        path: path.to_path_buf(),
        format,
        tokens,
        top_k,
        layers_declared: declared.is_some(),
        layers: declared.unwrap_or_else(|| (0..n_layers).collect()),
        layer_note: None,
        experts: ids,
        num_experts: logits.as_ref().map(|l| l.1),
        logits: logits.map(|l| l.0),
        input_ids,
        sequences,
        meta,
    })
}

/// Sequences from `cu_seqlens` (`[0, ..., tokens]`, non-decreasing).
fn boundaries(cu: &[i64], tokens: usize) -> std::result::Result<Vec<Sequence>, String> {
    if cu.len() < 2 || cu[0] != 0 || cu[cu.len() - 1] != tokens as i64 {
        return Err(format!("must run from 0 to the {tokens} tokens, got {:?}", &cu[..cu.len().min(8)]));
    }
    if let Some(w) = cu.windows(2).find(|w| w[1] < w[0]) {
        return Err(format!("must not decrease ({} then {})", w[0], w[1]));
    }
    Ok(cu.windows(2).map(|w| Sequence { rows: w[0] as usize..w[1] as usize, first_position: 0 }).collect())
}

/// A Megatron `RouterReplay` dump: one `[tokens, top_k]` array per layer, keyed `layer.N`.
fn megatron_record(path: &Path, mut arrays: Vec<Array<'_>>, budget: &mut Budget) -> Result<Record> {
    arrays.sort_by_key(|a| layer_number(&a.name));
    let shape = arrays[0].shape.clone();
    let [tokens, top_k] = shape[..] else {
        return Err(bad(path, format!("`{}` has shape {shape:?}; expected [tokens, top_k]", arrays[0].name)));
    };
    if tokens == 0 || top_k == 0 {
        return Err(bad(path, format!("`{}` has shape {shape:?}: no routes", arrays[0].name)));
    }
    let n = arrays.len();
    let mut layers = Vec::with_capacity(n);
    let mut per_layer = Vec::with_capacity(n);
    for a in &arrays {
        if a.shape != shape {
            return Err(bad(path, format!("`{}` has shape {:?}, `{}` {shape:?}", a.name, a.shape, arrays[0].name)));
        }
        let number = layer_number(&a.name).expect("checked");
        if layers.last() == Some(&number) {
            return Err(bad(path, format!("layer {number} appears twice")));
        }
        layers.push(number);
        per_layer.push(a.expert_ids(path, budget)?);
    }
    budget.take(&format!("reading {}", path.display()), (tokens * n * top_k) as u64 * 4)?;
    let mut experts = Vec::with_capacity(tokens * n * top_k);
    for t in 0..tokens {
        for ids in &per_layer {
            experts.extend_from_slice(&ids[t * top_k..(t + 1) * top_k]);
        }
    }
    Ok(Record {
        path: path.to_path_buf(),
        format: Format::Megatron,
        tokens,
        top_k,
        layers,
        layers_declared: true,
        layer_note: None,
        experts,
        logits: None,
        num_experts: None,
        input_ids: None,
        sequences: vec![Sequence { rows: 0..tokens, first_position: 0 }],
        meta: BTreeMap::new(),
    })
}

/// The `routed_experts` strings of an SGLang response or list of responses, each with its
/// start position (`routed_experts_start_len`).
fn sglang_payloads<'v>(value: &'v Value, path: &Path) -> Result<Vec<(&'v str, usize)>> {
    fn one(v: &Value) -> Option<(&str, usize)> {
        for holder in [v.get("meta_info"), v.get("sgl_ext"), Some(v)].into_iter().flatten() {
            if let Some(s) = holder.get("routed_experts").and_then(Value::as_str) {
                let start = holder.get("routed_experts_start_len").and_then(Value::as_u64).unwrap_or(0);
                return Some((s, start as usize));
            }
        }
        None
    }
    let items: Vec<&Value> = match value {
        Value::Array(items) => items.iter().collect(),
        Value::Object(o) => match o.get("choices").and_then(Value::as_array) {
            Some(choices) if one(value).is_none() => choices.iter().collect(),
            _ => vec![value],
        },
        _ => Vec::new(),
    };
    let found: Vec<_> = items.iter().map(|v| one(v)).collect();
    match found.iter().position(Option::is_none) {
        _ if items.is_empty() => Err(bad(path, "no SGLang response: expected an object or a list of them")),
        Some(i) => {
            Err(bad(path, format!("response {i} has no `meta_info.routed_experts` or `sgl_ext.routed_experts` string")))
        }
        None => Ok(found.into_iter().flatten().collect()),
    }
}

/// An SGLang response: base64 of int32 `[tokens, layers, top_k]` covering positions
/// `[routed_experts_start_len, seqlen - 1)`, every decoder layer (-1 in dense ones).
fn sglang(
    path: &Path,
    bytes: &[u8],
    layout: Option<&Layout>,
    hint: Option<ShapeHint>,
    budget: &mut Budget,
) -> Result<Record> {
    // The parsed tree holds the base64 text once more.
    budget.take(&format!("parsing {}", path.display()), bytes.len() as u64 * 2)?;
    let value: Value = serde_json::from_slice(bytes).map_err(|e| bad(path, format!("not JSON: {e}")))?;
    let payloads = sglang_payloads(&value, path)?;
    let (n_layers, top_k) = match (layout, hint) {
        (Some(l), _) => (l.kinds.iter().filter(|k| **k != super::LayerKind::Mtp).count(), l.top_k),
        (None, Some(h)) => (h.layers, h.top_k),
        (None, None) => {
            return Err(bad(
                path,
                format!(
                    "SGLang routes are flat int32: give the model's config.json ({}) to know its layers and top-k",
                    crate::error::Setting::Config
                ),
            ))
        }
    };
    let width = n_layers * top_k;
    let mut experts = Vec::new();
    let mut sequences = Vec::new();
    for (i, (text, start)) in payloads.iter().enumerate() {
        budget.take(&format!("decoding {}", path.display()), text.len() as u64 / 4 * 3 * 2)?;
        let raw = base64::engine::general_purpose::STANDARD
            .decode(text)
            .map_err(|e| bad(path, format!("response {i}: `routed_experts` is not base64: {e}")))?;
        if raw.len() % 4 != 0 || (raw.len() / 4) % width != 0 {
            return Err(bad(
                path,
                format!(
                    "response {i}: {} bytes of int32 do not divide into rows of {n_layers} layers x top-k {top_k}",
                    raw.len()
                ),
            ));
        }
        let rows = raw.len() / 4 / width;
        let first = experts.len() / width;
        experts.extend(raw.chunks_exact(4).map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]])));
        if let Some(at) = experts[first * width..].iter().position(|&e| e < -1) {
            let v = experts[first * width + at];
            return Err(bad(path, format!("response {i}: value {v} at flat index {at} is not an expert id or -1")));
        }
        sequences.push(Sequence { rows: first..first + rows, first_position: *start });
    }
    let tokens = experts.len() / width;
    if tokens == 0 {
        return Err(bad(path, "`routed_experts` is empty: no routes"));
    }
    Ok(Record {
        path: path.to_path_buf(),
        format: Format::Sglang,
        tokens,
        top_k,
        layers: (0..n_layers).collect(),
        // SGLang reports every decoder layer, in order.
        layers_declared: layout.is_some(),
        layer_note: None,
        experts,
        logits: None,
        num_experts: None,
        input_ids: None,
        sequences,
        meta: BTreeMap::new(),
    })
}

/// Checks a record in itself and against the layout, and gives undeclared layers their numbers.
fn check(mut r: Record, layout: Option<&Layout>) -> Result<Record> {
    let path = r.path.clone();
    let n = r.layers.len();
    if r.experts.len() != r.tokens * n * r.top_k {
        return Err(bad(&path, format!("{} layer numbers for a layer axis of another size", n)));
    }
    let mut seen = r.layers.clone();
    seen.sort_unstable();
    if let Some(w) = seen.windows(2).find(|w| w[0] == w[1]) {
        return Err(bad(&path, format!("layer {} appears twice in its layer numbers", w[0])));
    }
    let limit = layout.map(|l| l.experts).or(r.num_experts);
    if let Some(e) = limit {
        if let Some(i) = r.experts.iter().position(|&id| id >= e as i32) {
            let (t, rest) = (i / (n * r.top_k), i % (n * r.top_k));
            let whose = if layout.is_some() { "the config's" } else { "the logits'" };
            return Err(bad(
                &path,
                format!(
                    "expert id {} at token {t}, layer {} is not below {whose} {e} experts",
                    r.experts[i],
                    r.layers[rest / r.top_k]
                ),
            ));
        }
    }
    if let Some(ids) = &r.input_ids {
        if let Some(v) = ids.iter().find(|&&v| v < 0) {
            return Err(bad(&path, format!("`input_ids` holds {v}, not a token id")));
        }
    }
    let Some(layout) = layout else { return Ok(r) };
    let contradicts = |m: String| bad(&path, format!("the config contradicts the record: {m}"));
    if r.top_k != layout.top_k {
        return Err(contradicts(format!("top-k {} in the config, {} in the record", layout.top_k, r.top_k)));
    }
    let routed = layout.routed();
    let backbone = layout.kinds.iter().filter(|k| **k != super::LayerKind::Mtp).count();
    if !r.layers_declared {
        let (layers, note) = if n == routed.len() {
            (routed.clone(), format!("its {n} layers are the config's routed layers {}", ranges(&routed)))
        } else if n == backbone || n == layout.kinds.len() {
            ((0..n).collect(), format!("its {n} layers are every decoder layer 0 to {}", n - 1))
        } else {
            return Err(contradicts(format!(
                "{n} layers in the record; the config has {} routed layers and {} decoder layers",
                routed.len(),
                layout.kinds.len()
            )));
        };
        r.layers = layers;
        r.layers_declared = true;
        r.layer_note = Some(note);
    }
    for (i, &l) in r.layers.iter().enumerate() {
        match layout.kinds.get(l) {
            None => {
                return Err(contradicts(format!(
                    "layer {l} in the record; the config has {} layers",
                    layout.kinds.len()
                )))
            }
            Some(k) if !k.routed() && r.layer_routed(i) => {
                return Err(contradicts(format!("layer {l} is dense in the config but has routes in the record")))
            }
            _ => {}
        }
    }
    Ok(r)
}

/// `3..61` style list of layer numbers: runs joined.
pub(crate) fn ranges(layers: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < layers.len() {
        let mut j = i;
        while j + 1 < layers.len() && layers[j + 1] == layers[j] + 1 {
            j += 1;
        }
        out.push(if j > i { format!("{} to {}", layers[i], layers[j]) } else { layers[i].to_string() });
        i = j + 1;
    }
    out.join(", ")
}
