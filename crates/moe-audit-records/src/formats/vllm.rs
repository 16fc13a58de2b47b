//! vLLM's routed experts, as vLLM 0.22–0.33 return them (0.25.0 and 0.33.0 read in full):
//!
//! - offline: `CompletionOutput.routed_experts`, a numpy array `[P + O - 1 - prompt_start,
//!   num_hidden_layers, top_k]`, uint8 when the model has at most 256 experts, else uint16
//!   (`model_executor/layers/fused_moe/routed_experts_capturer.py` @0.25.0 L279-287); int32 in
//!   0.14–0.20. Saved with `np.save`, it is a bare `.npy` (read by `array::npy`, dtype and shape
//!   from its header);
//! - HTTP (`/inference/v1/generate`, `/v1/completions`, `/v1/chat/completions`):
//!   `choices[i].routed_experts` = base64 of that `.npy` file
//!   (`entrypoints/scale_out/token_in_token_out/serving.py` @0.25.0 L287-291); `null` when the
//!   request was aborted before a forward pass;
//! - layer axis: every decoder layer by absolute index, MTP dropped (capturer L200-201); zero
//!   buffers (L93-106, `clear_buffer` L207-212), so dense layers read 0; ids logical (captured
//!   before `_apply_eplb_mapping`, `router/base_router.py` L296-300);
//! - rows: position `prompt_start + t`; `routed_experts_prompt_start` is not recorded
//!   (`sampling_params.py` L328-334), so a record that starts later shows as a prompt start
//!   offset in the alignment.

use super::{bad, base64, choices, Axis, Dtype, Format, Raw};
use crate::array;
use crate::budget::Budget;
use bytes::Bytes;
use moe_audit_core::error::Result;
use serde_json::Value;
use std::path::Path;

/// A bare `.npy` `[tokens, layers, top_k]`, whoever saved it.
pub(crate) fn npy(path: &Path, bytes: &Bytes, budget: &mut Budget) -> Result<Raw> {
    let a = array::npy(bytes, "experts", path)?;
    match a.shape.len() {
        4 => Ok(super::batch(Format::Batch, &a, path, budget)?.0),
        _ => {
            let (shape, ids) = super::ids3(&a, path, budget)?;
            Ok(Raw::bare(Format::Npy, Dtype::of(a.elem), shape, ids))
        }
    }
}

/// An HTTP response (or a list of them): one sequence per choice.
pub(crate) fn http(path: &Path, items: &[&Value], budget: &mut Budget) -> Result<Raw> {
    let mut parts = Vec::new();
    for (i, c) in choices(path, items)?.into_iter().enumerate() {
        let text = c.get("routed_experts").and_then(Value::as_str).ok_or_else(|| {
            bad(path, format!("choice {i} has no `routed_experts` (null: the request was aborted or capture was off)"))
        })?;
        let bytes = base64(path, &format!("choice {i}: `routed_experts`"), text, budget)?;
        if !bytes.starts_with(b"\x93NUMPY") {
            return Err(bad(path, format!("choice {i}: `routed_experts` is not a base64 .npy (no \\x93NUMPY magic)")));
        }
        let a = array::npy(&Bytes::from(bytes), "routed_experts", path)?;
        let (shape, ids) = super::ids3(&a, path, budget)?;
        let mut part = Raw::bare(Format::VllmHttp, Dtype::of(a.elem), shape, ids);
        part.axis = Axis::Decoder;
        parts.push(part);
    }
    let mut all = Raw::concat(path, parts, budget)?;
    all.axis = Axis::Decoder;
    Ok(all)
}
