//! SGLang's routed experts, as `sglang==0.5.10` and `0.5.23` return them (and SGLang main at
//! a6463a1, which adds `routed_experts_dtype`):
//!
//! - native `/generate`: `meta_info.routed_experts`, base64 of the raw C-order bytes of
//!   `[seqlen - 1 - start, num_hidden_layers, top_k]`, no header, no shape
//!   (0.5.10 `srt/managers/tokenizer_manager.py` L1593-1598; 0.5.23
//!   `srt/managers/detokenizer_manager.py` L432-466); a batch is a JSON list of responses;
//! - OpenAI endpoints: response-level `sglext.routed_experts` (0.5.10
//!   `srt/entrypoints/openai/protocol.py` L334-348), first choice only;
//! - dtype: `meta_info.routed_experts_dtype` (`int32`, `uint16`, `uint8`), absent = int32
//!   (main `srt/state_capturer/routed_experts_wire.py`);
//! - layer axis: every decoder layer (`hf_text_config.num_hidden_layers`), never MTP; buffers
//!   `torch.zeros`, so dense and uncaptured layers read 0 (0.5.10
//!   `srt/layers/moe/routed_experts_capturer.py` L38-50, L78-87; 0.5.23 `srt/state_capturer/base.py`
//!   L38-42, L68-75); ids logical (captured before `topk_ids_logical_to_physical`, 0.5.10
//!   `srt/layers/moe/topk.py` L954-959);
//! - rows: positions `[routed_experts_start_len, seqlen - 1)` (0.5.23 `base.py` L173-188); the
//!   start is not echoed in the response, so a `routed_experts_start_len` found next to the
//!   payload is taken, else 0.
//!
//! The payload has no shape: layers and top-k come from the config, or (said in a note) from the
//! other record.

use super::{bad, base64, ids_of_bytes, Dtype, Raw};
use crate::array::Elem;
use crate::clean::Axis;
use crate::record::Format;
use crate::Budget;
use moe_audit_core::error::{excerpt, Result};
use serde_json::Value;
use std::path::Path;

pub(crate) fn read(path: &Path, items: &[&Value], shape: Option<(usize, usize)>, budget: &mut Budget) -> Result<Raw> {
    let Some((n_layers, top_k)) = shape else {
        return Err(bad(
            path,
            format!(
                "SGLang routes have no shape: give the model's config.json ({}) for num_hidden_layers and top-k",
                moe_audit_core::error::Setting::Config
            ),
        ));
    };
    let mut parts = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let holder = item.get("meta_info").or_else(|| item.get("sglext"));
        let text = holder.and_then(|h| h.get("routed_experts")).and_then(Value::as_str).ok_or_else(|| {
            bad(path, format!("response {i} has no `meta_info.routed_experts` or `sglext.routed_experts` string"))
        })?;
        let dtype = match holder.and_then(|h| h.get("routed_experts_dtype")) {
            None | Some(Value::Null) => Dtype::of(Elem::I32),
            Some(Value::String(s))
                if matches!(s.trim().to_ascii_lowercase().as_str(), "int32" | "uint16" | "uint8") =>
            {
                Dtype::named(s).expect("listed")
            }
            Some(v) => {
                return Err(bad(
                    path,
                    format!(
                        "response {i}: `routed_experts_dtype` {} is not int32, uint16 or uint8",
                        excerpt(&v.to_string())
                    ),
                ))
            }
        };
        let elem = dtype.elem.expect("an array dtype");
        let start =
            holder.and_then(|h| h.get("routed_experts_start_len")).and_then(Value::as_u64).unwrap_or(0) as usize;
        let raw = base64(path, &format!("response {i}: `routed_experts`"), text, budget)?;
        let width = n_layers * top_k * elem.size();
        if raw.len() % width != 0 {
            return Err(bad(
                path,
                format!(
                    "response {i}: {} bytes of {} do not divide into rows of {n_layers} layers x top-k {top_k}",
                    raw.len(),
                    elem.name()
                ),
            ));
        }
        let rows = raw.len() / width;
        let ids = ids_of_bytes(path, "routed_experts", raw, elem, budget)?;
        let mut part = Raw::bare(Format::Sglang, dtype, [rows, n_layers, top_k], ids);
        part.sequences[0].first_position = start;
        part.axis = Axis::Decoder;
        parts.push(part);
    }
    let mut all = Raw::concat(path, parts, budget)?;
    all.axis = Axis::Decoder;
    Ok(all)
}
