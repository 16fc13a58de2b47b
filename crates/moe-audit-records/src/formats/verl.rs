//! verl's R3 batch, as verl-project/verl 1dda039 (after v0.9.0) builds it in
//! `AgentLoopWorker._agent_loop_postprocess` (`verl/experimental/agent_loop/agent_loop.py`
//! L723-779): `routed_experts` `[batch, prompt_length + response_length, layers, top_k]`,
//! `torch.zeros` then the engine's `len - 1` rows copied from `start_pos = prompt_length -
//! len(prompt)` (L767-779), int16 (L766; the engine's dtype at v0.9.0), next to
//! `attention_mask` `[batch, prompt_length + response_length]` (L750, 1 on real tokens). The left
//! pad, the last token's row, a multi-turn tail and the right pad are zero rows; the layer axis is
//! every decoder layer (the engine's), dense layers 0. verl writes no file: this reads the two
//! arrays saved together (`.npz` or safetensors), e.g. from `batch.batch`.

use super::{bad, batch, mask, Fill, Format, Raw};
use crate::array::Array;
use crate::budget::Budget;
use moe_audit_core::error::Result;
use std::path::Path;

pub(crate) fn read(path: &Path, arrays: &[Array], budget: &mut Budget) -> Result<Raw> {
    let find = |n: &str| arrays.iter().find(|a| a.name == n);
    let a = find("routed_experts").expect("dispatched");
    let (mut raw, _) = batch(Format::Verl, a, path, budget)?;
    let m = find("attention_mask").ok_or_else(|| bad(path, "verl routes need `attention_mask` next to them"))?;
    raw.pad_mask = Some(mask(m, raw.tokens, path, budget, 0)?);
    // The mask covers the pads; the zero rows past the engine's (the last token, a multi-turn
    // tail) are real tokens' (agent_loop.py:767-779).
    raw.fill = Fill::ZeroTail;
    Ok(raw)
}
