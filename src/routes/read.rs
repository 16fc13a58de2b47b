//! Reading a routing record within `--max-memory`: the bytes read with a bound, the writer
//! recognised by content (`formats`), then made comparable (`clean`). A record never names
//! another file: nothing in it is followed. A folder is read only for Megatron's per-rank
//! `router_trace_rank{r}.jsonl` files directly inside it (symlinks refused).

use super::config::Layout;
use super::formats::{self, Raw};
use super::{array, clean, Budget};
use crate::error::{Error, Result, Setting};
use crate::files::read_bounded;
use serde_json::Value;
use std::path::Path;

pub use super::record::{Format, Found, Record, Sequence, GENERIC};

/// What the other record tells about a record without a shape (SGLang's flat payload): its
/// top-k and layer count.
#[derive(Debug, Clone, Copy)]
pub struct ShapeHint {
    /// Layers of the layer axis.
    pub layers: usize,
    /// Experts per token.
    pub top_k: usize,
}

fn bad(path: &Path, message: impl Into<String>) -> Error {
    Error::input(path, message.into())
}

fn read(path: &Path, budget: &mut Budget) -> Result<Vec<u8>> {
    let what = format!("reading {}", path.display());
    if let Some(size) = std::fs::metadata(path).ok().filter(|m| m.is_file()).map(|m| m.len()) {
        Budget::clone(budget).take(&what, size)?;
    }
    let bytes = read_bounded(path, budget.left(), &Setting::MaxMemory.to_string())?;
    budget.take(&what, bytes.len() as u64)?;
    Ok(bytes)
}

/// The `router_trace_rank{r}.jsonl` files of a folder, in rank order.
fn trace_folder(dir: &Path, budget: &mut Budget) -> Result<Vec<(String, Vec<u8>)>> {
    let entries = std::fs::read_dir(dir).map_err(|e| bad(dir, format!("cannot read: {e}")))?;
    let mut ranks = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let rank = name
            .strip_prefix("router_trace_rank")
            .and_then(|r| r.strip_suffix(".jsonl"))
            .and_then(|r| r.parse::<u64>().ok());
        if let Some(r) = rank {
            if e.file_type().is_ok_and(|t| t.is_symlink()) {
                return Err(bad(&e.path(), "a symlink in a trace folder is not followed"));
            }
            ranks.push((r, name, e.path()));
        }
    }
    if ranks.is_empty() {
        return Err(bad(dir, "a folder holds a record only as Megatron's router_trace_rank{r}.jsonl files: none here"));
    }
    ranks.sort();
    ranks.into_iter().map(|(_, name, p)| Ok((name, read(&p, budget)?))).collect()
}

/// Reads a record, made comparable against `layout` when given. `hint` shapes a record with no
/// shape of its own (SGLang) when no layout is given; the record's notes say so.
pub fn load(path: &Path, layout: Option<&Layout>, hint: Option<ShapeHint>, budget: &mut Budget) -> Result<Record> {
    let raw = if std::fs::metadata(path).is_ok_and(|m| m.is_dir()) {
        let files = trace_folder(path, budget)?;
        formats::megatron::trace(path, &files, layout, budget)?
    } else {
        let bytes = read(path, budget)?;
        dispatch(path, &bytes, layout, hint, budget)?
    };
    clean::finish(path, raw, layout)
}

fn dispatch(
    path: &Path,
    bytes: &[u8],
    layout: Option<&Layout>,
    hint: Option<ShapeHint>,
    budget: &mut Budget,
) -> Result<Raw> {
    if bytes.starts_with(b"\x93NUMPY") {
        return formats::vllm::npy(path, bytes, budget);
    }
    if bytes.starts_with(b"PK\x03\x04") || bytes.starts_with(b"PK\x05\x06") {
        let entries = array::npz(bytes, path, budget)?;
        let arrays = entries.iter().map(|(name, data)| array::npy(data, name, path)).collect::<Result<Vec<_>>>()?;
        return formats::from_arrays(path, arrays, Default::default(), budget);
    }
    if bytes.iter().find(|b| !b.is_ascii_whitespace()).is_some_and(|&b| b == b'{' || b == b'[') {
        if formats::megatron::is_trace(bytes) {
            let name =
                path.file_name().map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into_owned());
            return formats::megatron::trace(path, &[(name, bytes.to_vec())], layout, budget);
        }
        // The parsed tree holds the base64 text once more.
        budget.take(&format!("parsing {}", path.display()), bytes.len() as u64 * 2)?;
        let value: Value = serde_json::from_slice(bytes).map_err(|e| bad(path, format!("not JSON: {e}")))?;
        let shape = match (layout, hint) {
            (Some(l), _) => Some((l.kinds.iter().filter(|k| **k != super::LayerKind::Mtp).count(), l.top_k)),
            (None, Some(h)) => Some((h.layers, h.top_k)),
            (None, None) => None,
        };
        let mut raw = formats::from_json(path, &value, shape, budget)?;
        if layout.is_none() && raw.format == Format::Sglang {
            raw.notes.push(format!(
                "no shape in the payload and no {}: shaped as [rows, {}, {}] from the other record",
                Setting::Config,
                raw.n_layers,
                raw.top_k
            ));
        }
        return Ok(raw);
    }
    let (arrays, meta) = array::safetensors(bytes, path)?;
    formats::from_arrays(path, arrays, meta, budget)
}

/// `3 to 61` style list of layer numbers: runs joined.
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
