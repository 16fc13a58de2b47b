//! `moe-audit-routes/1`, the format `moe_audit.routes.record` (python/moe_audit/routes.py)
//! writes and any tool may: `experts` `[tokens, layers, top_k]` (any integer dtype, -1 = no
//! route), optional `logits` `[tokens, layers, experts]`, `input_ids` `[tokens]`, `cu_seqlens`
//! `[sequences + 1]`, and the global layer numbers in metadata `layers` (safetensors) or an
//! array `layers` (`.npz`).

use super::{bad, ids3, shape_of, Dtype, Format, Raw, Sequence, GENERIC};
use crate::array::Array;
use crate::budget::Budget;
use moe_audit_core::error::{excerpt, Error, Result};
use std::collections::BTreeMap;
use std::path::Path;

pub(crate) fn read(
    path: &Path,
    arrays: Vec<Array>,
    meta: BTreeMap<String, String>,
    budget: &mut Budget,
) -> Result<Raw> {
    if let Some(f) = meta.get("format").filter(|f| f.as_str() != GENERIC) {
        return Err(bad(path, format!("metadata format `{}` is not {GENERIC}", excerpt(f))));
    }
    let find = |name: &str| arrays.iter().find(|a| a.name == name);
    let experts = find("experts").expect("dispatched on `experts`");
    let (shape, ids) = ids3(experts, path, budget)?;
    let [tokens, n_layers, top_k] = shape;
    if tokens == 0 || n_layers == 0 || top_k == 0 {
        return Err(bad(path, format!("`experts` has shape {}: no routes", shape_of(experts))));
    }
    let mut raw = Raw::bare(Format::Generic, Dtype::of(experts.elem), shape, ids);
    raw.logits = match find("logits") {
        None => None,
        Some(a) => {
            if a.shape.len() != 3 || a.shape[0] != tokens || a.shape[1] != n_layers || a.shape[2] < top_k {
                return Err(bad(
                    path,
                    format!(
                        "`logits` has shape {}; expected [{tokens}, {n_layers}, experts >= {top_k}] like `experts`",
                        shape_of(a)
                    ),
                ));
            }
            Some((a.floats(path, budget)?, a.shape[2]))
        }
    };
    raw.input_ids = match find("input_ids") {
        None => None,
        Some(a) if a.shape.len() == 1 && a.shape[0] == tokens => Some(a.ints(path, budget)?),
        Some(a) => return Err(bad(path, format!("`input_ids` has shape {}; expected [{tokens}]", shape_of(a)))),
    };
    if let Some(a) = find("cu_seqlens") {
        let cu = a.ints(path, budget)?;
        raw.sequences = boundaries(&cu, tokens).map_err(|m| bad(path, format!("`cu_seqlens` {m}")))?;
    }
    raw.layers = match (meta.get("layers"), find("layers")) {
        (Some(text), _) => Some(
            serde_json::from_str::<Vec<usize>>(text)
                .map_err(|e| Error::parse(path, "metadata `layers` is not a JSON list of layer numbers", e))?,
        ),
        (None, Some(a)) => Some(a.ints(path, budget)?.into_iter().map(|v| v.max(0) as usize).collect()),
        (None, None) => None,
    };
    raw.meta = meta;
    Ok(raw)
}

/// Sequences from `cu_seqlens` (`[0, ..., tokens]`, non-decreasing).
pub(crate) fn boundaries(cu: &[i64], tokens: usize) -> std::result::Result<Vec<Sequence>, String> {
    if cu.len() < 2 || cu[0] != 0 || cu[cu.len() - 1] != tokens as i64 {
        return Err(format!("must run from 0 to the {tokens} tokens, got {:?}", &cu[..cu.len().min(8)]));
    }
    if let Some(w) = cu.windows(2).find(|w| w[1] < w[0]) {
        return Err(format!("must not decrease ({} then {})", w[0], w[1]));
    }
    Ok(cu.windows(2).map(|w| Sequence { rows: w[0] as usize..w[1] as usize, first_position: 0 }).collect())
}
