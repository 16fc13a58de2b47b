//! NeMo-RL's routed experts, as NVIDIA-NeMo/RL 7ea279a writes them (int32 throughout at v0.7.0):
//!
//! - dtype: the narrowest signed type for the expert count, int8 up to 128 experts, int16 up to
//!   32768, else int32 (`nemo_rl/models/generation/interfaces.py` L27-69);
//! - `routed_experts` `[batch, S, layers, top_k]`, S = padded input + longest generation, right
//!   padded; per sample `arange(top_k)` everywhere first, the engine's rows over it, and **-1 in
//!   every slot** for rows vLLM did not return (a missing route: the live router is used)
//!   (`nemo_rl/models/generation/vllm/utils.py` L141-235); the sequence lengths are
//!   `unpadded_sequence_lengths` (or `input_lengths`);
//! - NeMo-Gym wire: `nrlre1:<int8|int16|int32>:<S>x<L>x<K>:<base64>` per choice
//!   (`nemo_rl/utils/routed_experts_codec.py` L24-25, L45-67);
//! - layer axis: every decoder layer (vLLM's), or the MoE ordinal (`router_replay.py` L167-188).

use super::{bad, base64, batch, choices, ids_of_bytes, length_mask, Dtype, Fill, Format, Raw};
use crate::array::Array;
use crate::budget::Budget;
use moe_audit_core::error::{excerpt, Result};
use serde_json::Value;
use std::path::Path;

pub(crate) fn read(path: &Path, arrays: &[Array], budget: &mut Budget) -> Result<Raw> {
    let find = |n: &str| arrays.iter().find(|a| a.name == n);
    let a = find("routed_experts").expect("dispatched");
    let (mut raw, s) = batch(Format::NemoRl, a, path, budget)?;
    for name in ["unpadded_sequence_lengths", "input_lengths"] {
        if let Some(l) = find(name) {
            let lengths = l.ints(path, budget)?;
            if lengths.len() != raw.sequences.len() {
                return Err(bad(
                    path,
                    format!("`{name}` has {} lengths for {} sequences", lengths.len(), raw.sequences.len()),
                ));
            }
            raw.pad_mask = Some(length_mask(&lengths, s, path, name)?);
            break;
        }
    }
    // Right padded: the fill rows past the routes, within the length too (the last token).
    raw.fill = Fill::TopK { head: false };
    Ok(raw)
}

/// `nrlre1:` envelopes, one sequence per choice (`choices[i].message.routed_experts` or
/// `choices[i].routed_experts`).
pub(crate) fn envelopes(path: &Path, items: &[&Value], budget: &mut Budget) -> Result<Raw> {
    let mut parts = Vec::new();
    for (i, c) in choices(path, items)?.into_iter().enumerate() {
        let what = format!("choice {i}: `routed_experts`");
        let text = c
            .get("message")
            .and_then(|m| m.get("routed_experts"))
            .or_else(|| c.get("routed_experts"))
            .and_then(Value::as_str)
            .ok_or_else(|| bad(path, format!("{what} is missing")))?;
        let fields: Vec<&str> = text.splitn(4, ':').collect();
        let [_, dtype, shape, data] = fields[..] else {
            return Err(bad(path, format!("{what} is not `nrlre1:<dtype>:<S>x<L>x<K>:<base64>`")));
        };
        let dtype = Dtype::named(dtype)
            .ok_or_else(|| bad(path, format!("{what}: dtype `{}` is not an integer type", excerpt(dtype))))?;
        let dims: Vec<usize> = shape.split('x').map(|d| d.parse().ok()).collect::<Option<_>>().unwrap_or_default();
        let [t, l, k] = dims[..] else {
            return Err(bad(path, format!("{what}: shape `{}` is not <S>x<L>x<K>", excerpt(shape))));
        };
        let bytes = base64(path, &what, data, budget)?;
        let elem = dtype.elem.expect("named");
        if Some(bytes.len()) != t.checked_mul(l).and_then(|x| x.checked_mul(k)).and_then(|x| x.checked_mul(elem.size()))
        {
            return Err(bad(path, format!("{what}: {} bytes for {t}x{l}x{k} {}", bytes.len(), elem.name())));
        }
        parts.push(Raw::bare(Format::NemoRl, dtype, [t, l, k], ids_of_bytes(path, &what, bytes, elem, budget)?));
    }
    let mut raw = Raw::concat(path, parts, budget)?;
    // Each envelope holds every position: the last, with no route, is the `arange(top_k)` fill
    // (`nemo_rl/models/generation/vllm/utils.py` L238-303).
    raw.fill = Fill::TopK { head: false };
    Ok(raw)
}
