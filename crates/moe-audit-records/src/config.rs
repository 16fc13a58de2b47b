//! A Hugging Face `config.json` as a layer layout: which decoder layers are MoE, dense or MTP,
//! the expert count and top-k. Each family spells it differently; every spelling moe-audit
//! knows is read here, and a config that names none of them is refused rather than guessed.
//! Megatron-Core's pipeline settings, when the file has them, are read by the `pipeline` module.

pub use crate::pipeline::{Pipeline, Stage};
use moe_audit_core::error::{excerpt, Error, Result};
use moe_audit_core::files::{read_text, TEXT_LIMIT};
use serde::Serialize;
use serde_json::Value;
use std::path::Path;

/// What a decoder layer is (one type with `moe_audit::model`'s layers).
pub use moe_audit_core::layer::LayerKind;

/// The layers of a model, by global number (backbone, then MTP), its experts and top-k.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Layout {
    /// Every decoder layer's kind, indexed by global layer number.
    pub kinds: Vec<LayerKind>,
    /// Routed experts per MoE layer.
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Megatron-Core's pipeline split, when the config states it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<Pipeline>,
}

impl Layout {
    /// The global numbers of the routed layers (MoE and MTP), in order.
    pub fn routed(&self) -> Vec<usize> {
        (0..self.kinds.len()).filter(|&l| self.kinds[l].routed()).collect()
    }

    /// Reads `config.json` (a multimodal config's `text_config` when it has one).
    pub fn load(path: &Path) -> Result<Layout> {
        let text = read_text(path, TEXT_LIMIT, "a config.json")?;
        let value: Value = serde_json::from_str(&text).map_err(|e| Error::parse(path, "not a JSON config", e))?;
        Layout::from_json(&value).map_err(|m| Error::input(path, m))
    }

    /// The layout a parsed config describes; `Err` says which field is missing or wrong.
    pub fn from_json(config: &Value) -> std::result::Result<Layout, String> {
        let c = config.get("text_config").filter(|t| t.is_object()).unwrap_or(config);
        let int =
            |key: &str| -> std::result::Result<Option<usize>, String> {
                match c.get(key) {
                    None | Some(Value::Null) => Ok(None),
                    Some(v) => v.as_u64().and_then(|n| usize::try_from(n).ok()).map(Some).ok_or_else(|| {
                        format!("`{key}` must be a non-negative integer, got {}", excerpt(&v.to_string()))
                    }),
                }
            };
        let first = |keys: &[&str]| -> std::result::Result<Option<(usize, String)>, String> {
            for k in keys {
                if let Some(v) = int(k)? {
                    return Ok(Some((v, k.to_string())));
                }
            }
            Ok(None)
        };
        let layers = int("num_hidden_layers")?.ok_or("no `num_hidden_layers`")?;
        let (experts, experts_key) =
            first(&["n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts"])?.ok_or(
                "no expert count (`n_routed_experts`, `num_experts`, `num_local_experts` or `moe_num_experts`)",
            )?;
        let (top_k, _) = first(&["num_experts_per_tok", "moe_topk", "num_experts_per_token", "top_k"])?
            .ok_or("no top-k (`num_experts_per_tok`, `moe_topk`, `num_experts_per_token` or `top_k`)")?;
        if experts == 0 || top_k == 0 || top_k > experts {
            return Err(format!("`{experts_key}` {experts} and top-k {top_k}: need 1 <= top-k <= experts"));
        }
        if layers > 1 << 16 {
            return Err(format!("`num_hidden_layers` {layers} is beyond any model"));
        }
        let first_dense = int("first_k_dense_replace")?.unwrap_or(0);
        let freq = int("moe_layer_freq")?.unwrap_or(1).max(1);
        let sparse_step = int("decoder_sparse_step")?.unwrap_or(1).max(1);
        let interleave = int("interleave_moe_layer_step")?.unwrap_or(1).max(1);
        let mlp_only: Vec<usize> = match c.get("mlp_only_layers") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_u64()
                        .map(|n| n as usize)
                        .ok_or_else(|| format!("`mlp_only_layers` holds {}, not a layer", excerpt(&v.to_string())))
                })
                .collect::<std::result::Result<_, _>>()?,
            Some(v) => {
                return Err(format!("`mlp_only_layers` must be a list of layers, got {}", excerpt(&v.to_string())))
            }
        };
        let mtp = int("num_nextn_predict_layers")?.unwrap_or(0);
        let moe = |l: usize| {
            l >= first_dense
                && l.is_multiple_of(freq)
                && (l + 1).is_multiple_of(sparse_step)
                && (l + 1).is_multiple_of(interleave)
                && !mlp_only.contains(&l)
        };
        let mut kinds: Vec<LayerKind> =
            (0..layers).map(|l| if moe(l) { LayerKind::Moe } else { LayerKind::Dense }).collect();
        kinds.extend(std::iter::repeat_n(LayerKind::Mtp, mtp.min(64)));
        if !kinds.iter().any(|k| k.routed()) {
            return Err("no layer is MoE under this config".into());
        }
        let pipeline = Pipeline::from_config(config, c, layers)?;
        Ok(Layout { kinds, experts, top_k, pipeline })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn kinds(v: Value) -> String {
        Layout::from_json(&v).unwrap().kinds.iter().map(|k| &k.name()[..1]).collect()
    }

    #[test]
    fn every_family_spelling() {
        // DeepSeek-V3: 3 dense layers, then MoE; one MTP layer.
        let ds = json!({"num_hidden_layers": 6, "n_routed_experts": 256, "num_experts_per_tok": 8,
                        "first_k_dense_replace": 3, "moe_layer_freq": 1, "num_nextn_predict_layers": 1});
        assert_eq!(kinds(ds), "dddmmmm");
        // Qwen3-MoE: sparse step 2, layer 1 dense by mlp_only_layers.
        let qw = json!({"num_hidden_layers": 6, "num_experts": 64, "num_experts_per_tok": 8,
                        "decoder_sparse_step": 2, "mlp_only_layers": [1]});
        assert_eq!(kinds(qw), "dddmdm");
        // Mixtral: every layer.
        assert_eq!(kinds(json!({"num_hidden_layers": 3, "num_local_experts": 8, "num_experts_per_tok": 2})), "mmm");
        // Llama 4 interleaving, nested in text_config.
        let l4 = json!({"text_config": {"num_hidden_layers": 4, "num_local_experts": 16,
                        "num_experts_per_tok": 1, "interleave_moe_layer_step": 2}});
        assert_eq!(kinds(l4), "dmdm");
    }

    #[test]
    fn contradictions_are_refused() {
        let no_k = json!({"num_hidden_layers": 2, "num_experts": 8});
        assert!(Layout::from_json(&no_k).unwrap_err().contains("top-k"));
        let big_k = json!({"num_hidden_layers": 2, "num_experts": 8, "num_experts_per_tok": 9});
        assert!(Layout::from_json(&big_k).unwrap_err().contains("top-k 9"));
        let dense =
            json!({"num_hidden_layers": 2, "num_experts": 8, "num_experts_per_tok": 2, "first_k_dense_replace": 2});
        assert!(Layout::from_json(&dense).unwrap_err().contains("no layer is MoE"));
    }
}
