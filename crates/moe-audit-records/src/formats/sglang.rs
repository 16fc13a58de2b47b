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
//! - row count: `seqlen - 1` at 0.5.10 (`routed_experts_capturer.py` L211-220), `seqlen - 1 -
//!   start` at 0.5.23 (`base.py` L173-188, the request's `routed_experts_start_len`, 0.5.10
//!   `srt/managers/io_struct.py` L172-173), seqlen being `meta_info.prompt_tokens +
//!   completion_tokens` (0.5.10 `scheduler_output_processor_mixin.py` L1044-1046,
//!   `tokenizer_manager.py` L1552, L1578); OpenAI endpoints: the response's `usage`, which sums
//!   every choice (`entrypoints/openai/usage_processor.py` L18-29), so only with one choice.
//!
//! The payload has no shape: layers and top-k come from the config; without it, the rows from
//! the response's own counts and top-k from the other record (layers = ids / rows / top-k), and
//! a response without counts is shaped as the other record (said in a note).

use super::{bad, base64, ids_of_bytes, Axis, Dtype, Format, Raw, ShapeHint};
use crate::array::Elem;
use crate::budget::Budget;
use crate::settings::CONFIG;
use moe_audit_core::error::{excerpt, Result, Text};
use moe_audit_core::text;
use serde_json::Value;
use std::path::Path;

/// Reads SGLang responses, shaped by `config` (decoder layers, top-k) when given, else by their
/// own row counts and the `other` record's top-k.
pub(crate) fn read(
    path: &Path,
    items: &[&Value],
    config: Option<(usize, usize)>,
    other: Option<ShapeHint>,
    budget: &mut Budget,
) -> Result<Raw> {
    let mut parts = Vec::with_capacity(items.len());
    let mut how = None;
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
        if raw.len() % elem.size() != 0 {
            return Err(bad(path, format!("response {i}: {} bytes are not whole {} values", raw.len(), elem.name())));
        }
        let (n_layers, top_k) = shape(raw.len() / elem.size(), rows(item, start), config, other, &mut how)
            .map_err(|m| bad(path, text!(format!("response {i}: "), m)))?;
        if n_layers == 0 || top_k == 0 {
            return Err(bad(path, format!("response {i}: shaped as {n_layers} layers x top-k {top_k}: no routes")));
        }
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
    if let Some(how) = how {
        all.notes.push(text!(
            "no shape in the payload and no ",
            CONFIG,
            format!(": shaped as [rows, {}, {}], {how}", all.n_layers, all.top_k)
        ));
    }
    Ok(all)
}

/// The rows a response says it holds: prompt + completion - 1 - start, from `meta_info` (native)
/// or a one-choice response's `usage` (OpenAI endpoints).
fn rows(item: &Value, start: usize) -> Option<usize> {
    let counts = match item.get("meta_info") {
        Some(m) => m,
        None if item.get("choices").and_then(Value::as_array).is_some_and(|c| c.len() == 1) => item.get("usage")?,
        None => return None,
    };
    let count = |key: &str| counts.get(key).and_then(Value::as_u64).map(|n| n as usize);
    // SGLang clamps the start to the last row (0.5.23 base.py L182).
    Some(count("prompt_tokens")?.saturating_add(count("completion_tokens")?).saturating_sub(1).saturating_sub(start))
}

/// `(layers, top-k)` of a response holding `ids` values: the config's, else `rows` (the
/// response's own count) rows of the other record's top-k, else the other record's shape;
/// `how` says which, when not the config.
fn shape(
    ids: usize,
    rows: Option<usize>,
    config: Option<(usize, usize)>,
    other: Option<ShapeHint>,
    how: &mut Option<String>,
) -> std::result::Result<(usize, usize), Text> {
    if let Some(shape) = config {
        return Ok(shape);
    }
    let give = text!("give the model's config.json (", CONFIG, ") for num_hidden_layers and top-k");
    let Some(rows) = rows else {
        let other = other
            .ok_or_else(|| text!("SGLang routes have no shape and no prompt_tokens and completion_tokens: ", &give))?;
        how.get_or_insert_with(|| {
            "as the other record (no prompt_tokens and completion_tokens in the response)".into()
        });
        return Ok((other.layers, other.top_k));
    };
    if rows == 0 || !ids.is_multiple_of(rows) {
        return Err(text!(
            format!("{ids} ids are not {rows} rows (prompt_tokens + completion_tokens - 1 - routed_experts_start_len) of whole layers x top-k (a start not returned with the response?): "),
            give
        ));
    }
    let per_row = ids / rows;
    let Some(other) = other else {
        return Err(text!(format!("{rows} rows of {per_row} ids each, layers x top-k: "), give, " to tell them apart"));
    };
    if other.top_k == 0 || !per_row.is_multiple_of(other.top_k) {
        return Err(text!(
            format!(
                "{rows} rows of {per_row} ids each are not whole layers of the other record's top-k {}: ",
                other.top_k
            ),
            give
        ));
    }
    how.get_or_insert_with(|| "rows by its prompt_tokens + completion_tokens, top-k the other record's".into());
    Ok((per_row / other.top_k, other.top_k))
}
