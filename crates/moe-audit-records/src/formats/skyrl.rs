//! SkyRL's routed experts, as NovaSky-AI/SkyRL a956457 writes them (not in any release up to
//! skyrl-v0.3.0):
//!
//! - each array compacted by its largest id: uint8 below 2^8, int16 below 2^15, else int32
//!   (`skyrl/backends/skyrl_train/utils/routed_experts.py` L6-34); no missing sentinel;
//! - wire: `choices[i].routed_experts = {"data": base64, "shape": [T, L, K], "dtype": ...}`
//!   (`inference_servers/generate_wire.py` L75-81);
//! - batch: `rollout_expert_indices` `[batch, max_total, layers, top_k]` in the widest dtype,
//!   every row first `arange(top_k)` in every layer (`replay_utils.py` L47-61), the routes
//!   copied left-padded (`skyrl/train/dataset/preprocess.py` L230-273), and `router_padding_mask`
//!   (True = no captured route: the left pad, the last token, anything after, L17-55);
//! - layer axis: every decoder layer (vLLM's).

use super::{bad, base64, batch, choices, ids_of_bytes, mask, Axis, Dtype, Fill, Format, Raw};
use crate::array::Array;
use crate::budget::Budget;
use moe_audit_core::error::Result;
use serde_json::Value;
use std::path::Path;

pub(crate) fn read(path: &Path, arrays: &[Array], budget: &mut Budget) -> Result<Raw> {
    let find = |n: &str| arrays.iter().find(|a| a.name == n);
    let a = find("rollout_expert_indices").expect("dispatched");
    if a.shape.len() == 3 {
        let (shape, ids) = super::ids3(a, path, budget)?;
        return Ok(Raw::bare(Format::Skyrl, Dtype::of(a.elem), shape, ids));
    }
    let (mut raw, _) = batch(Format::Skyrl, a, path, budget)?;
    raw.pad_mask = match (find("router_padding_mask"), find("attention_mask")) {
        (Some(m), _) => Some(mask(m, raw.tokens, path, budget, 1)?),
        (None, Some(m)) => Some(mask(m, raw.tokens, path, budget, 0)?),
        (None, None) => None,
    };
    // `router_padding_mask` marks every fill row, `attention_mask` only the pads: the rows past
    // the captured ones are filled too; without a mask, the left pad as well.
    raw.fill = Fill::TopK { head: raw.pad_mask.is_none() };
    Ok(raw)
}

/// The wire object of each choice: one sequence each.
pub(crate) fn wire(path: &Path, items: &[&Value], budget: &mut Budget) -> Result<Raw> {
    let mut parts = Vec::new();
    for (i, c) in choices(path, items)?.into_iter().enumerate() {
        let w = c.get("routed_experts").ok_or_else(|| bad(path, format!("choice {i} has no `routed_experts`")))?;
        let what = format!("choice {i}: `routed_experts`");
        let dtype = w
            .get("dtype")
            .and_then(Value::as_str)
            .and_then(Dtype::named)
            .ok_or_else(|| bad(path, format!("{what} has no integer `dtype`")))?;
        let shape: Vec<usize> = w
            .get("shape")
            .and_then(Value::as_array)
            .and_then(|s| s.iter().map(|d| d.as_u64().map(|d| d as usize)).collect())
            .filter(|s: &Vec<usize>| s.len() == 3)
            .ok_or_else(|| bad(path, format!("{what} has no `shape` [tokens, layers, top_k]")))?;
        let data =
            w.get("data").and_then(Value::as_str).ok_or_else(|| bad(path, format!("{what} has no `data` string")))?;
        let bytes = base64(path, &what, data, budget)?;
        let elem = dtype.elem.expect("named");
        let want = shape.iter().try_fold(elem.size(), |a, &d| a.checked_mul(d));
        if want != Some(bytes.len()) {
            return Err(bad(
                path,
                format!("{what}: {} bytes, shape {shape:?} of {} needs {want:?}", bytes.len(), elem.name()),
            ));
        }
        let ids = ids_of_bytes(path, &what, bytes, elem, budget)?;
        let mut part = Raw::bare(Format::Skyrl, dtype, [shape[0], shape[1], shape[2]], ids);
        part.axis = Axis::Decoder;
        parts.push(part);
    }
    let mut all = Raw::concat(path, parts, budget)?;
    all.axis = Axis::Decoder;
    Ok(all)
}
