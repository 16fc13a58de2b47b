//! slime's routed experts, as THUDM/slime 624b824 (same layout at v0.3.1) keeps them:
//!
//! - per sample `rollout_routed_experts` int32 `[len(tokens) - 1, num_layers, top_k]`, decoded
//!   from SGLang as int32 whatever its dtype (`slime/utils/types.py` L352-395,
//!   `slime/utils/misc.py` L13-35); every decoder layer, dense ones 0, no MTP; on disk inside
//!   `torch.save` of the samples (`slime/observability/rollout_data_utils.py` L140-153), which
//!   moe-audit does not unpickle: save the arrays as `.npz`/safetensors;
//! - the trainer's packed replay target (THUDM/slime v0.3.1
//!   `slime/backends/megatron_utils/cp_utils.py` L362-405): each sample plus one pad row (L376),
//!   concatenated, then a trailing pad block to a multiple of the TP size x the pad multiplier
//!   (L384-385, L393-394); pad rows are `arange(n*layers*top_k).reshape(n, layers, top_k) %
//!   num_experts`, counted from 0 in each block (L347-359), which look like routes; `cu_seqlens`
//!   has one segment per sample and one for the trailing pad (`data.py` L72-101). Read from
//!   `rollout_routed_experts` `[tokens, layers, top_k]` with `cu_seqlens`: the pad is the last
//!   row of each segment and a last segment that is one fill block (`clean::Fill::Slime`);
//!   without `cu_seqlens` the array is a sample's, which has no pad.

use super::generic::boundaries;
use super::{bad, Dtype, Fill, Format, Raw};
use crate::array::Array;
use crate::budget::Budget;
use moe_audit_core::error::Result;
use std::path::Path;

pub(crate) fn read(path: &Path, arrays: &[Array], budget: &mut Budget) -> Result<Raw> {
    let find = |n: &str| arrays.iter().find(|a| a.name == n);
    let a = find("rollout_routed_experts").expect("dispatched");
    let (shape, ids) = super::ids3(a, path, budget)?;
    let mut raw = Raw::bare(Format::Slime, Dtype::of(a.elem), shape, ids);
    if let Some(cu) = find("cu_seqlens") {
        let cu = cu.ints(path, budget)?;
        raw.sequences = boundaries(&cu, raw.tokens).map_err(|m| bad(path, format!("`cu_seqlens` {m}")))?;
        // The packed replay target: its pad rows close the segments (without `cu_seqlens`, the
        // per-sample array, which has none).
        raw.fill = Fill::Slime;
    }
    Ok(raw)
}
