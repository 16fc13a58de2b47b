//! Megatron-Core's pipeline split, as the config given with `--config` states it: which global
//! decoder layers each pipeline stage builds, and which stage a global rank runs. A router
//! trace numbers each stage's layers from 0 (the index in the stage's own `decoder.layers`) and
//! names no stage, so this is what merges the stages' files.
//!
//! Followed from NVIDIA/Megatron-LM core_v0.19.0: `megatron/core/transformer/transformer_layer.py`
//! L57-211 (`get_transformer_layer_offset`), `megatron/core/transformer/transformer_block.py`
//! L70-197 (`get_num_layers_to_build`), `megatron/core/transformer/pipeline_parallel_layer_layout.py`
//! L24-83 and L283-321 (the layout), `megatron/core/transformer/transformer_config.py` L1925-1990
//! (which settings exclude which), and the rank order `tp-cp-ep-dp-pp`, or `tp-cp-ep-pp-dp` with
//! `use_tp_pp_dp_mapping` (`megatron/training/initialize.py` L388; the weight-remat axis is
//! inserted after `tp`, `megatron/core/parallel_state.py` L582-598).

use crate::settings::CONFIG;
use moe_audit_core::error::Text;
use moe_audit_core::text;
use serde::Serialize;
use serde_json::Value;

/// The settings read here, by Megatron's own names.
const KEYS: [&str; 11] = [
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "num_layers_in_first_pipeline_stage",
    "num_layers_in_last_pipeline_stage",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
    "pipeline_model_parallel_layout",
    "use_tp_pp_dp_mapping",
    "tensor_model_parallel_size",
    "context_parallel_size",
    "world_size",
];

/// What moe-audit needs to merge a pipeline's trace, said once for every message that asks.
pub(crate) fn how_to_give() -> Text {
    text!(
        "give Megatron's `pipeline_model_parallel_size` in the ",
        CONFIG,
        " file (1 without pipeline parallelism; for an uneven split also `num_layers_in_first_pipeline_stage`, `num_layers_in_last_pipeline_stage` or `pipeline_model_parallel_layout`, as the run had them)"
    )
}

/// One pipeline stage: the global decoder layers it builds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Stage {
    /// Its first global decoder layer (0-based): `get_transformer_layer_offset`.
    pub first: usize,
    /// How many decoder layers it builds: `get_num_layers_to_build`.
    pub layers: usize,
}

/// Megatron-Core's pipeline split and rank order, as the config states them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Pipeline {
    /// `pipeline_model_parallel_size`.
    pub size: usize,
    /// Model chunks per pipeline rank (`virtual_pipeline_model_parallel_size`, or the layout's
    /// stages over the pipeline size): 1 without interleaving.
    pub chunks: usize,
    /// Each pipeline stage's decoder layers, by pipeline rank (empty when `chunks` > 1: a
    /// rank then builds several chunks, each numbering its layers from 0).
    pub stages: Vec<Stage>,
    /// Global ranks from one pipeline rank to the next when the config fixes it
    /// (`use_tp_pp_dp_mapping`: tensor x weight-remat x context parallel); `None` in the default
    /// order, where the pipeline rank is outermost: the world size over the stages.
    pub stride: Option<usize>,
    /// The config's `world_size`, when given.
    pub world: Option<usize>,
    /// How the split was given, for notes.
    pub split: String,
}

impl Pipeline {
    /// The split the config states (`None` when it names no pipeline setting); `decoder` is its
    /// decoder layer count. `top` is the config file, `inner` the part the layout is read from
    /// (a multimodal config's `text_config`): a setting is looked up in `top`, then in `inner`.
    pub(crate) fn from_config(top: &Value, inner: &Value, decoder: usize) -> Result<Option<Pipeline>, String> {
        let get = |k: &str| top.get(k).or_else(|| inner.get(k)).filter(|v| !v.is_null());
        let int = |k: &str| -> Result<Option<usize>, String> {
            get(k)
                .map(|v| {
                    v.as_u64()
                        .and_then(|n| usize::try_from(n).ok())
                        .ok_or(format!("`{k}` must be a non-negative integer, got {v}"))
                })
                .transpose()
        };
        let flag = |k: &str| -> Result<bool, String> {
            get(k).map_or(Ok(false), |v| v.as_bool().ok_or(format!("`{k}` must be true or false, got {v}")))
        };
        let Some(size) = int(KEYS[0])? else {
            if let Some(k) = KEYS[1..7].iter().find(|k| get(k).is_some()) {
                return Err(format!("`{k}` is given without `pipeline_model_parallel_size`"));
            }
            return Ok(None);
        };
        if size == 0 || size > 1 << 16 {
            return Err(format!("`pipeline_model_parallel_size` {size} is not a pipeline size"));
        }
        let (first, last) = (int(KEYS[2])?, int(KEYS[3])?);
        let (embedding, loss) = (flag(KEYS[4])?, flag(KEYS[5])?);
        let layout = get(KEYS[6]).map(layout_stages).transpose()?;
        let tp_pp_dp = flag(KEYS[7])?;
        let stride = tp_pp_dp.then(|| -> Result<usize, String> {
            let [tp, cp, gtp] =
                [KEYS[8], KEYS[9], "gtp_weight_remat_size"].map(|k| int(k).map(|v| v.unwrap_or(1).max(1)));
            Ok(tp? * cp? * gtp?)
        });
        let stride = stride.transpose()?;
        let world = int(KEYS[10])?;
        let uneven = first.is_some() || last.is_some();
        // Megatron refuses these together (transformer_config.py L1925-1953).
        if layout.is_some() && (uneven || embedding || loss) {
            return Err("`pipeline_model_parallel_layout` cannot be set with the other pipeline split settings (Megatron refuses it)".into());
        }
        if uneven && (embedding || loss) {
            return Err("`num_layers_in_first/last_pipeline_stage` cannot be set with `account_for_embedding/loss_in_pipeline_split` (Megatron refuses it)".into());
        }
        let mut chunks = int(KEYS[1])?.unwrap_or(1).max(1);
        let split;
        let stages: Vec<Stage> = if let Some(stages) = layout {
            if stages.len() % size != 0 {
                return Err(format!(
                    "`pipeline_model_parallel_layout` has {} stages, not a multiple of `pipeline_model_parallel_size` {size}",
                    stages.len()
                ));
            }
            let t: usize = stages.iter().map(|s| s.decoder).sum();
            if t != decoder {
                return Err(format!(
                    "`pipeline_model_parallel_layout` places {t} decoder layers, the config has {decoder}"
                ));
            }
            chunks = stages.len() / size;
            split = "its pipeline_model_parallel_layout".to_string();
            // Without interleaving the layout's stage p is pipeline rank p
            // (pipeline_parallel_layer_layout.py L48-54).
            let mut at = 0;
            stages
                .iter()
                .map(|s| {
                    at += s.decoder;
                    Stage { first: at - s.decoder, layers: s.decoder }
                })
                .collect()
        } else if size == 1 {
            split = "one pipeline stage".to_string();
            vec![Stage { first: 0, layers: decoder }]
        } else if uneven {
            split = [(first, "num_layers_in_first_pipeline_stage"), (last, "num_layers_in_last_pipeline_stage")]
                .iter()
                .filter_map(|(v, k)| v.map(|v| format!("{k} {v}")))
                .collect::<Vec<_>>()
                .join(", ");
            uneven_split(size, decoder, first, last)?
        } else {
            split = format!("{size} even stages");
            even_split(size, decoder, embedding, loss)?
        };
        let stages = if chunks > 1 { Vec::new() } else { stages };
        Ok(Some(Pipeline { size, chunks, stages, stride, world, split }))
    }

    /// The pipeline rank of global rank `rank` in a world of `world` ranks (`None`: unknown).
    pub(crate) fn stage_of(&self, rank: usize, world: Option<usize>) -> Result<usize, Text> {
        let size = self.size;
        let stride = match (self.stride, world.or(self.world)) {
            // Rank 0 is stage 0 in every order.
            _ if rank == 0 => 1,
            (Some(s), _) => s,
            (None, Some(w)) if w.is_multiple_of(size) && rank < w => w / size,
            (None, Some(w)) => {
                return Err(format!(
                    "rank {rank} in a world of {w} ranks over {size} pipeline stages: the world size must be a multiple of the stages and above every rank"
                )
                .into())
            }
            (None, None) => {
                return Err(text!(
                    format!("the pipeline stage of rank {rank} depends on the world size (the pipeline rank is the outermost): give the folder of every rank's router_trace_rank{{r}}.jsonl, or `world_size` in the "),
                    CONFIG,
                    " file"
                ))
            }
        };
        Ok((rank / stride) % size)
    }
}

/// The uniform split (`get_transformer_layer_offset` L171-208, `get_num_layers_to_build`
/// L141-153, L182-195): the embedding and the loss may count as a layer of the first and the
/// last stage.
fn even_split(size: usize, decoder: usize, embedding: bool, loss: bool) -> Result<Vec<Stage>, String> {
    let n = decoder + usize::from(embedding) + usize::from(loss);
    if !n.is_multiple_of(size) {
        return Err(format!(
            "{n} layers (num_hidden_layers {decoder}{}{}) do not split evenly over `pipeline_model_parallel_size` {size}: give `num_layers_in_first_pipeline_stage`, `num_layers_in_last_pipeline_stage` or `pipeline_model_parallel_layout` as the run had them",
            if embedding { " + the embedding" } else { "" },
            if loss { " + the loss" } else { "" }
        ));
    }
    let per = n / size;
    Ok((0..size)
        .map(|p| Stage {
            first: p * per - usize::from(embedding && p > 0),
            layers: per - usize::from(embedding && p == 0) - usize::from(loss && p == size - 1),
        })
        .collect())
}

/// An uneven first or last stage, the other layers evenly over the middle stages
/// (`get_transformer_layer_offset` L72-170, `get_num_layers_to_build` L97-140).
fn uneven_split(size: usize, decoder: usize, first: Option<usize>, last: Option<usize>) -> Result<Vec<Stage>, String> {
    let ends = first.unwrap_or(0) + last.unwrap_or(0);
    let middle_stages = size - usize::from(first.is_some()) - usize::from(last.is_some());
    let middle = decoder
        .checked_sub(ends)
        .ok_or(format!("the first and last pipeline stages hold {ends} layers, the config has {decoder}"))?;
    let per = match middle_stages {
        0 if middle > 0 => {
            return Err(format!(
            "the first and last pipeline stages hold {ends} of {decoder} layers and no stage is left for the others"
        ))
        }
        0 => 0,
        m if !middle.is_multiple_of(m) => {
            return Err(format!("{middle} layers do not split evenly over the {m} middle pipeline stages"))
        }
        m => middle / m,
    };
    Ok((0..size)
        .map(|p| {
            let layers = match (p, first, last) {
                (0, Some(f), _) => f,
                (p, _, Some(l)) if p == size - 1 => l,
                _ => per,
            };
            let first_layer = if p == 0 { 0 } else { (p - usize::from(first.is_some())) * per + first.unwrap_or(0) };
            Stage { first: first_layer, layers }
        })
        .collect())
}

/// One stage of a layout: its decoder layers (`t`).
struct LayoutStage {
    decoder: usize,
}

/// `pipeline_model_parallel_layout`: Megatron's string (`parse_str_to_list`, L283-321: commas
/// dropped, `(...)*n` then `x*n` unrolled, stages split at `|`; `E` embedding, `t` decoder, `m`
/// MTP, `L` loss) or its list of lists of layer type names.
fn layout_stages(v: &Value) -> Result<Vec<LayoutStage>, String> {
    const LIMIT: usize = 1 << 20;
    let bad = |m: String| format!("`pipeline_model_parallel_layout`: {m}");
    let rows: Vec<Vec<char>> = match v {
        Value::String(s) => {
            let s: String = s.chars().filter(|&c| c != ',').collect();
            let s = unroll(&unroll(&s, true, LIMIT).map_err(bad)?, false, LIMIT).map_err(bad)?;
            s.split('|').map(|stage| stage.chars().collect()).collect()
        }
        Value::Array(stages) => stages
            .iter()
            .map(|stage| {
                stage
                    .as_array()
                    .ok_or_else(|| bad(format!("{stage} is not a list of layer types")))?
                    .iter()
                    .map(|t| match t.as_str().map(|s| s.trim().to_ascii_lowercase()).as_deref() {
                        Some("embedding") => Ok('E'),
                        Some("decoder") => Ok('t'),
                        Some("mtp") => Ok('m'),
                        Some("loss") => Ok('L'),
                        _ => Err(bad(format!("{t} is not a layer type (embedding, decoder, mtp, loss)"))),
                    })
                    .collect()
            })
            .collect::<Result<_, _>>()?,
        other => return Err(bad(format!("{other} is neither a layout string nor a list of stages"))),
    };
    rows.iter()
        .map(|row| match row.iter().find(|c| !"EtmL".contains(**c)) {
            Some(c) => Err(bad(format!("{c:?} is not a layer (E, t, m, L)"))),
            None => Ok(LayoutStage { decoder: row.iter().filter(|&&c| c == 't').count() }),
        })
        .collect()
}

/// One unrolling pass of `parse_str_to_list`: `(xy)*n` (`groups`) or `x*n`, each repeated n
/// times, the result at most `limit` characters.
fn unroll(s: &str, groups: bool, limit: usize) -> Result<String, String> {
    let c: Vec<char> = s.chars().collect();
    let mut out = String::new();
    let mut i = 0;
    while i < c.len() {
        // The repeated part `c[i..j]` (a group's inside, or one character), then `*n` at `j`.
        let part = if groups {
            (c[i] == '(')
                .then(|| c[i + 1..].iter().position(|&x| x == ')').map(|e| (i + 1, i + 1 + e, i + 2 + e)))
                .flatten()
                .filter(|&(a, b, _)| b > a)
        } else {
            Some((i, i + 1, i + 1))
        };
        let times = part.and_then(|(a, b, j)| {
            let digits = c.get(j + 1..)?.iter().take_while(|x| x.is_ascii_digit()).count();
            (c.get(j) == Some(&'*') && digits > 0)
                .then(|| (a, b, j + 1 + digits, c[j + 1..j + 1 + digits].iter().collect::<String>()))
        });
        match times {
            Some((a, b, end, n)) => {
                let n: usize = n.parse().map_err(|_| format!("repeat count {n} is too large"))?;
                if out.len().saturating_add((b - a).saturating_mul(n)) > limit {
                    return Err(format!("unrolls past {limit} layers"));
                }
                let part: String = c[a..b].iter().collect();
                out.push_str(&part.repeat(n));
                i = end;
            }
            None => {
                out.push(c[i]);
                i += 1;
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn split(v: Value, decoder: usize) -> Vec<(usize, usize)> {
        let p = Pipeline::from_config(&v, &v, decoder).unwrap().unwrap();
        p.stages.iter().map(|s| (s.first, s.layers)).collect()
    }

    #[test]
    fn splits_as_megatron_places_layers() {
        // Uniform: 8 layers over 4 stages.
        assert_eq!(split(json!({"pipeline_model_parallel_size": 4}), 8), [(0, 2), (2, 2), (4, 2), (6, 2)]);
        // The embedding and the loss counted as layers: 6 + 2 over 4.
        let v = json!({"pipeline_model_parallel_size": 4, "account_for_embedding_in_pipeline_split": true,
                       "account_for_loss_in_pipeline_split": true});
        assert_eq!(split(v, 6), [(0, 1), (1, 2), (3, 2), (5, 1)]);
        // Uneven ends: 1 first, 3 last, 8 over 2 middle stages.
        let v = json!({"pipeline_model_parallel_size": 4, "num_layers_in_first_pipeline_stage": 1,
                       "num_layers_in_last_pipeline_stage": 3});
        assert_eq!(split(v, 12), [(0, 1), (1, 4), (5, 4), (9, 3)]);
        let v = json!({"pipeline_model_parallel_size": 3, "num_layers_in_last_pipeline_stage": 1});
        assert_eq!(split(v, 7), [(0, 3), (3, 3), (6, 1)]);
        // The layout string of Megatron's docstring at 4 layers: "Et|(tt|)*1,m|L" -> E t | t t | m | L.
        let v = json!({"pipeline_model_parallel_size": 4, "pipeline_model_parallel_layout": "Et|(tt|)*1,m|L"});
        assert_eq!(split(v, 3), [(0, 1), (1, 2), (3, 0), (3, 0)]);
        let v = json!({"pipeline_model_parallel_size": 2, "pipeline_model_parallel_layout": "Et*3|t*5mL"});
        assert_eq!(split(v, 8), [(0, 3), (3, 5)]);
        let v = json!({"pipeline_model_parallel_size": 2,
                       "pipeline_model_parallel_layout": [["embedding", "decoder"], ["decoder", "mtp", "loss"]]});
        assert_eq!(split(v, 2), [(0, 1), (1, 1)]);
    }

    #[test]
    fn ranks_find_their_stage_in_either_order() {
        let p = Pipeline::from_config(&json!({"pipeline_model_parallel_size": 2}), &json!({}), 4).unwrap().unwrap();
        // Default order tp-cp-ep-dp-pp: 8 ranks, stage = rank / 4.
        assert_eq!((0..8).map(|r| p.stage_of(r, Some(8)).unwrap()).collect::<Vec<_>>(), [0, 0, 0, 0, 1, 1, 1, 1]);
        assert_eq!(p.stage_of(0, None), Ok(0));
        assert!(p.stage_of(3, None).unwrap_err().to_string().contains("depends on the world size"));
        // tp-cp-ep-pp-dp with tensor parallel 2: stage = (rank / 2) % 2.
        let v =
            json!({"pipeline_model_parallel_size": 2, "use_tp_pp_dp_mapping": true, "tensor_model_parallel_size": 2});
        let p = Pipeline::from_config(&v, &v, 4).unwrap().unwrap();
        assert_eq!((0..8).map(|r| p.stage_of(r, None).unwrap()).collect::<Vec<_>>(), [0, 0, 1, 1, 0, 0, 1, 1]);
    }

    #[test]
    fn splits_megatron_refuses_are_refused() {
        let err = |v: Value, d: usize| Pipeline::from_config(&v, &v, d).unwrap_err();
        assert!(err(json!({"pipeline_model_parallel_size": 2}), 5).contains("do not split evenly"));
        assert!(
            err(json!({"num_layers_in_first_pipeline_stage": 2}), 4).contains("without `pipeline_model_parallel_size`")
        );
        let v = json!({"pipeline_model_parallel_size": 2, "pipeline_model_parallel_layout": "Ett|tL",
                       "num_layers_in_first_pipeline_stage": 2});
        assert!(err(v, 3).contains("cannot be set with"));
        let v = json!({"pipeline_model_parallel_size": 2, "pipeline_model_parallel_layout": "Et|tx|L"});
        assert!(err(v, 2).contains("'x' is not a layer"));
        let v = json!({"pipeline_model_parallel_size": 2, "pipeline_model_parallel_layout": "Et*999999999999|L"});
        assert!(err(v, 2).contains("unrolls past"));
        // Interleaving is kept, with no stages: a trace cannot be merged then.
        let v = json!({"pipeline_model_parallel_size": 2, "pipeline_model_parallel_layout": "Et|t|t|tL"});
        let p = Pipeline::from_config(&v, &v, 4).unwrap().unwrap();
        assert_eq!((p.chunks, p.stages.len()), (2, 0));
        // No pipeline setting: no pipeline.
        assert_eq!(Pipeline::from_config(&json!({}), &json!({}), 4), Ok(None));
    }
}
