//! `routes compare` on records built exactly as each writer's code builds them (the line cited
//! above each builder), for one model with a dense layer, three MoE layers and an MTP layer
//! (GLM-4.5-Air's layout: MoE + MTP layers = `num_hidden_layers`), three requests and the
//! writer's own padding. The trainer is `moe_audit.routes.record`'s format with the global
//! layer numbers, MTP included. A clean pair passes with the exact rates; each defect a writer
//! really makes is named; bad input is one line and exit 2.

use crate::routes::route_files::*;
use crate::routes::{bad, compare, dir, put};
use base64::Engine;
use serde_json::{json, Value};
use std::path::Path;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_moe-audit");
const E: usize = 32;
const K: usize = 4;
/// Decoder layers: 0 dense, 1..3 MoE; layer 4 is the MTP layer.
const DECODER: usize = 4;
/// Routed layers of the trainer's record: 1, 2, 3 and MTP 4.
const ROUTED: usize = 4;
/// Tokens (prompt + response) of the three requests.
const LENS: [usize; 3] = [40, 57, 33];

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// GLM-4.5-Air's layout at small size: layer 0 dense, MoE after it, one MTP layer.
fn config(d: &Path) -> String {
    let c = json!({"model_type": "glm4_moe", "num_hidden_layers": DECODER, "n_routed_experts": E,
        "num_experts_per_tok": K, "first_k_dense_replace": 1, "num_nextn_predict_layers": 1});
    put(d, "config.json", c.to_string())
}

/// Per request, the routes of every routed layer `[len, ROUTED, K]` (seeded).
fn model(seed: u64) -> Vec<Vec<i32>> {
    LENS.iter().enumerate().map(|(i, &n)| random_routes(n, ROUTED, K, E, seed + i as u64)).collect()
}

/// The trainer's record: every token, layers 1..4 (MTP included), one sequence per request.
fn trainer(d: &Path, seqs: &[Vec<i32>]) -> String {
    let routes: Vec<i32> = seqs.concat();
    let mut cu = vec![0i64];
    for s in seqs {
        cu.push(cu.last().unwrap() + (s.len() / ROUTED / K) as i64);
    }
    let tokens = *cu.last().unwrap() as usize;
    let g = Generic {
        routes: &routes,
        tokens,
        layers: &[1, 2, 3, 4],
        k: K,
        logits: None,
        input_ids: None,
        cu_seqlens: Some(&cu),
    };
    put(d, "trainer.safetensors", g.bytes())
}

/// What an engine captures for one request: `len - 1` rows (the last sampled token is never
/// forwarded), every decoder layer, dense layer 0 left at its zero fill, no MTP.
fn engine(seq: &[i32]) -> Vec<i32> {
    let rows = seq.len() / ROUTED / K - 1;
    let mut out = vec![0; rows * DECODER * K];
    for t in 0..rows {
        for l in 1..DECODER {
            let from = (t * ROUTED + l - 1) * K;
            out[(t * DECODER + l) * K..][..K].copy_from_slice(&seq[from..from + K]);
        }
    }
    out
}

fn as_u8(v: &[i32]) -> Vec<u8> {
    v.iter().map(|&x| x as u8).collect()
}

fn as_i16(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|&x| (x as i16).to_le_bytes()).collect()
}

/// `routes compare ... --format json`: exit code and report.
fn defects(r: &Value) -> Vec<String> {
    r["diagnoses"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|d| d["defect"] == true)
        .map(|d| d["kind"].as_str().unwrap().to_string())
        .collect()
}

fn text(r: &Value, kind: &str) -> String {
    let t: Vec<String> = r["diagnoses"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|d| d["kind"] == kind)
        .map(|d| format!("{} | {}", d["found"].as_str().unwrap(), d["change"].as_str().unwrap()))
        .collect();
    assert!(!t.is_empty(), "no {kind} in {}", r["diagnoses"]);
    t.join("\n")
}

/// A clean pair: no defect, exit 0, every decision of layers 1..3 compared (MTP has no
/// rollout counterpart), none differs; `flipped` of them differ when the trainer was changed.
fn assert_clean(r: &Value, code: i32, flipped: usize) {
    assert_eq!(code, 0, "{}", r["diagnoses"]);
    assert!(defects(r).is_empty(), "{:?}", defects(r));
    let decisions: usize = LENS.iter().map(|n| (n - 1) * 3).sum();
    assert_eq!(r["measures"]["decisions"], decisions, "{}", r["diagnoses"]);
    assert_eq!(r["measures"]["decisions_differ"].as_f64().unwrap(), flipped as f64 / decisions as f64);
    let pairs: Vec<(u64, u64)> = r["alignment"]["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["rollout"].as_u64().unwrap(), p["trainer"].as_u64().unwrap()))
        .collect();
    assert_eq!(pairs, [(1, 1), (2, 2), (3, 3)]);
}

/// Flips about 10% of the rows of layers 1..3 of the trainer (not MTP, not the last token,
/// which no rollout row covers); returns the model flipped and the count.
fn flipped(seqs: &[Vec<i32>]) -> (Vec<Vec<i32>>, usize) {
    let mut out = seqs.to_vec();
    let mut n = 0;
    for (i, s) in out.iter_mut().enumerate() {
        let rows = s.len() / ROUTED / K;
        for t in 0..rows - 1 {
            for l in 0..3 {
                let row = &mut s[(t * ROUTED + l) * K..][..K];
                if (t * 7 + l * 3 + i) % 10 == 0 {
                    let e = (0..E as i32).find(|e| !row.contains(e)).unwrap();
                    row[0] = e;
                    n += 1;
                }
            }
        }
    }
    (out, n)
}

// ---------------------------------------------------------------------------------------------
// SGLang

/// A batch response: a JSON list, one `meta_info.routed_experts` each, base64 of the raw int32
/// bytes (sgl-project/sglang@v0.5.10: python/sglang/srt/managers/tokenizer_manager.py:1593),
/// rows [0, seqlen-1), every decoder layer of a `torch.zeros` buffer
/// (sgl-project/sglang@v0.5.10: python/sglang/srt/layers/moe/routed_experts_capturer.py:78, :211);
/// with a dtype, the wire of SGLang main (sgl-project/sglang@a6463a1:
/// python/sglang/srt/state_capturer/routed_experts_wire.py:29-43 writes the bytes and their
/// dtype name, int32 when an id does not fit; :56-58 reads `routed_experts_dtype`, absent = int32).
fn sglang_batch(seqs: &[Vec<i32>], uint8: bool) -> String {
    let items: Vec<Value> = seqs
        .iter()
        .map(|s| {
            let rows = engine(s);
            let (payload, dtype) =
                if uint8 { (b64(&as_u8(&rows)), Some("uint8")) } else { (b64(&i32_bytes(&rows)), None) };
            let n = s.len() / ROUTED / K;
            let mut meta = json!({"prompt_tokens": n - 8, "completion_tokens": 8, "routed_experts": payload});
            if let Some(t) = dtype {
                meta["routed_experts_dtype"] = json!(t);
            }
            json!({"text": "..", "meta_info": meta})
        })
        .collect();
    Value::Array(items).to_string()
}

#[test]
fn sglang_clean_pair_int32_and_uint8() {
    let d = dir("sglang");
    let (c, seqs) = (config(&d), model(1));
    let t = trainer(&d, &seqs);
    for uint8 in [false, true] {
        let a = put(&d, "rollout.json", sglang_batch(&seqs, uint8));
        let (code, r) = compare(&[&a, &t, "--config", &c, "--max-disagreement", "0"]);
        assert_clean(&r, code, 0);
        // GLM-4.5-Air: 4 layers = every decoder layer = MoE + MTP; layer 0 holds zeros, so decoder.
        assert!(text(&r, "layer-numbers").contains("every decoder layer (0 to 3)"), "{}", text(&r, "layer-numbers"));
        assert!(text(&r, "unpaired").contains("layers 0 are dense in the config"));
        assert!(text(&r, "one-row-short").contains("3 sequence(s)"));
    }
    let (f, n) = flipped(&seqs);
    let t = trainer(&d, &f);
    let a = put(&d, "rollout.json", sglang_batch(&seqs, false));
    let (code, r) = compare(&[&a, &t, "--config", &c]);
    assert_clean(&r, code, n);
}

#[test]
fn sglang_capture_never_ran_and_an_unmerged_stage_are_named() {
    let d = dir("sglang-zero");
    let (c, seqs) = (config(&d), model(2));
    let t = trainer(&d, &seqs);
    let zero_layers = |layers: &[usize]| -> Vec<Vec<i32>> {
        seqs.iter()
            .map(|s| {
                let mut x = s.clone();
                for row in x.chunks_exact_mut(ROUTED * K) {
                    for &l in layers {
                        row[(l - 1) * K..l * K].fill(0);
                    }
                }
                x
            })
            .collect()
    };
    // MoE layer 2 never captured.
    let a = put(&d, "one.json", sglang_batch(&zero_layers(&[2]), false));
    let (code, r) = compare(&[&a, &t, "--config", &c]);
    assert_eq!((code, defects(&r)), (1, vec!["capture-never-ran".to_string()]));
    assert!(text(&r, "capture-never-ran").contains("MoE layer(s) 2 hold only zeros"));
    // The second pipeline stage (layers 2, 3) never merged (slime's validator refuses this).
    let a = put(&d, "stage.json", sglang_batch(&zero_layers(&[2, 3]), false));
    let (code, r) = compare(&[&a, &t, "--config", &c]);
    assert_eq!((code, defects(&r)), (1, vec!["pipeline-not-merged".to_string()]));
    assert!(text(&r, "pipeline-not-merged").contains("MoE layers 2 to 3 (2 of 3)"));
    // The whole record zero (vLLM's CPU build): capture never ran, not aliasing.
    let a = put(&d, "all.json", sglang_batch(&zero_layers(&[1, 2, 3]), false));
    let (code, r) = compare(&[&a, &t, "--config", &c]);
    assert_eq!((code, defects(&r)), (1, vec!["capture-never-ran".to_string()]));
    assert!(text(&r, "capture-never-ran").contains("the rollout record holds only zeros"));
}

#[test]
fn sglang_bad_input_is_one_line() {
    let d = dir("sglang-bad");
    let (c, seqs) = (config(&d), model(3));
    let t = trainer(&d, &seqs);
    let short = json!({"meta_info": {"routed_experts": b64(&i32_bytes(&engine(&seqs[0])[..21]))}}).to_string();
    let a = put(&d, "short.json", short);
    let e = bad(&["routes", "compare", &a, &t, "--config", &c]);
    assert!(e.contains("response 0: 84 bytes of int32 do not divide into rows of 4 layers x top-k 4"), "{e}");
    let dtype = json!({"meta_info": {"routed_experts": "AAAA", "routed_experts_dtype": "float32"}}).to_string();
    let e = bad(&["routes", "compare", &put(&d, "dtype.json", dtype), &t, "--config", &c]);
    assert!(e.contains("`routed_experts_dtype` \"float32\" is not int32, uint16 or uint8"), "{e}");
}

// ---------------------------------------------------------------------------------------------
// vLLM

/// `CompletionOutput.routed_experts` saved with `np.save`: uint8 for at most 256 experts
/// (vllm-project/vllm@v0.25.0: vllm/model_executor/layers/fused_moe/routed_experts_capturer.py:279),
/// rows `[prompt_start, P + O - 1)` (vllm-project/vllm@v0.25.0: vllm/v1/core/sched/scheduler.py:1664),
/// zero buffers.
fn vllm_npy(rows: &[i32], n: usize) -> Vec<u8> {
    npy("|u1", &[n, DECODER, K], &as_u8(rows))
}

/// The HTTP responses of `/inference/v1/generate`, one request (one prompt) each: its one
/// choice's `routed_experts` = base64 of the `.npy` that `np.save` writes, beside the
/// generated `token_ids` (vllm-project/vllm@v0.25.0:
/// vllm/entrypoints/scale_out/token_in_token_out/serving.py:281-299,
/// vllm/entrypoints/scale_out/token_in_token_out/protocol.py:75, :176-192, :215-227).
fn vllm_http(seqs: &[Vec<i32>]) -> String {
    let responses: Vec<Value> = seqs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let rows = engine(s);
            let n = rows.len() / DECODER / K;
            let choice = json!({"index": 0, "logprobs": null, "finish_reason": "length",
                "token_ids": (0..8).collect::<Vec<i64>>(), "routed_experts": b64(&vllm_npy(&rows, n))});
            json!({"request_id": format!("r{i}"), "model": null, "created": null, "choices": [choice], "usage": null})
        })
        .collect();
    Value::Array(responses).to_string()
}

#[test]
fn vllm_clean_pair_over_http_and_as_npy() {
    let d = dir("vllm");
    let (c, seqs) = (config(&d), model(4));
    let t = trainer(&d, &seqs);
    let a = put(&d, "rollout.json", vllm_http(&seqs));
    let (code, r) = compare(&[&a, &t, "--config", &c, "--max-disagreement", "0"]);
    assert_clean(&r, code, 0);
    assert_eq!(r["rollout"]["found"]["dtype"], "uint8");
    // One request as a bare .npy against a one-sequence trainer.
    let rows = engine(&seqs[0]);
    let a = put(&d, "one.npy", vllm_npy(&rows, LENS[0] - 1));
    let t1 = trainer(&d, &seqs[..1]);
    let (code, r) = compare(&[&a, &t1, "--config", &c, "--max-disagreement", "0"]);
    assert_eq!(code, 0, "{}", r["diagnoses"]);
    assert_eq!(r["measures"]["decisions"], (LENS[0] - 1) * 3);
}

#[test]
fn vllm_prompt_start_zero_capture_and_physical_ids_are_named() {
    let d = dir("vllm-defects");
    let (c, seqs) = (config(&d), model(5));
    let t1 = trainer(&d, &seqs[1..2]);
    let rows = engine(&seqs[1]);
    let n = LENS[1] - 1;
    // routed_experts_prompt_start = 6 drops the first 6 rows and is not recorded
    // (vllm-project/vllm@v0.25.0: vllm/sampling_params.py:328, vllm/v1/core/sched/scheduler.py:1672-1689).
    let a = put(&d, "start.npy", vllm_npy(&rows[6 * DECODER * K..], n - 6));
    let (code, r) = compare(&[&a, &t1, "--config", &c]);
    assert_eq!((code, defects(&r)), (1, vec!["prompt-start".to_string()]));
    assert!(text(&r, "prompt-start").contains("rollout row 0 is trainer position 6"), "{}", text(&r, "prompt-start"));
    assert_eq!(r["measures"]["decisions_differ"], 0.0);
    // Every id 0 (vLLM 0.25 on CPU): capture never ran.
    let a = put(&d, "zeros.npy", vllm_npy(&vec![0; rows.len()], n));
    let (code, r) = compare(&[&a, &t1, "--config", &c]);
    assert_eq!((code, defects(&r)), (1, vec!["capture-never-ran".to_string()]));
    // Physical slots (EPLB, 4 redundant experts): logical e sits in slot (e * 5 + 3) % 36.
    let phys: Vec<i32> = rows
        .iter()
        .enumerate()
        .map(|(i, &e)| if (i / K).is_multiple_of(DECODER) { 0 } else { (e * 5 + 3) % 36 })
        .collect();
    let a = put(&d, "physical.npy", vllm_npy(&phys, n));
    let (code, r) = compare(&[&a, &t1, "--config", &c]);
    assert_eq!((code, defects(&r)), (1, vec!["physical-ids".to_string()]), "{}", r["diagnoses"]);
    assert!(text(&r, "physical-ids").contains("layers 1 to 3"), "{}", text(&r, "physical-ids"));
}

#[test]
fn vllm_bad_input_is_one_line() {
    let d = dir("vllm-bad");
    let (c, seqs) = (config(&d), model(6));
    let t1 = trainer(&d, &seqs[..1]);
    let full = vllm_npy(&engine(&seqs[0]), LENS[0] - 1);
    let a = put(&d, "cut.npy", &full[..full.len() - 3]);
    assert!(bad(&["routes", "compare", &a, &t1, "--config", &c])
        .contains("truncated: shape (39, 4, 4) of uint8 needs 624 bytes"));
    // Ids far past any physical slot are no pattern: bad input.
    let mut rows = engine(&seqs[0]);
    rows[5] = 200;
    let a = put(&d, "far.npy", vllm_npy(&rows, LENS[0] - 1));
    let e = bad(&["routes", "compare", &a, &t1, "--config", &c]);
    assert!(e.contains("expert id 200 at token 0, layer index 1 is not below the config's 32 experts"), "{e}");
}

// ---------------------------------------------------------------------------------------------
// Megatron-Core

/// `router_trace_rank{rank}.jsonl` of the training hook path, one pipeline stage's: one line
/// per (forward, router) as `_make_index_record` builds it and `json.dumps` writes it, keys in
/// its order and with its `", "` and `": "` separators (NVIDIA/Megatron-LM@core_v0.19.0:
/// megatron/core/transformer/moe/router_trace.py:291-305, :465-474); `rank` the writer's global
/// rank (:298, set from `torch.distributed.get_rank()` in megatron/training/training.py:3567);
/// `layer` the index in the stage's own `decoder.layers` (router_trace.py:45-66), which every
/// stage builds from 0 (megatron/core/transformer/transformer_block.py:363-366): the global layer
/// less the stage's first, `first`; MTP (layer 4 here, on the last stage) as block `mtp`,
/// `mtp_idx` 0, layer 0 (router_trace.py:59-62); ids ascending (a bool routing map,
/// :353-361); `step` the training iteration (:245-248); one micro-batch (one request) per
/// forward. A rank with no router writes an empty file (:193).
fn megatron_trace(seqs: &[Vec<i32>], rank: usize, first: i64, layers: &[usize]) -> String {
    let mut out = String::new();
    for s in seqs {
        let n = s.len() / ROUTED / K;
        for &l in layers {
            let rows: Vec<String> = (0..n)
                .map(|t| {
                    let mut r = s[(t * ROUTED + l - 1) * K..][..K].to_vec();
                    r.sort_unstable();
                    format!("[{}]", r.iter().map(i32::to_string).collect::<Vec<_>>().join(", "))
                })
                .collect();
            let (block, layer, mtp) =
                if l == DECODER { ("mtp", 0, ", \"mtp_idx\": 0") } else { ("decoder", l as i64 - first, "") };
            out.push_str(&format!(
                "{{\"step\": 7, \"stage\": \"pre_dispatch\", \"block\": \"{block}\", \"layer\": {layer}, \"rank\": {rank}, \"num_tokens\": {n}, \"topk\": {K}{mtp}, \"top_indices\": [{}]}}\n",
                rows.join(", ")
            ));
        }
    }
    out
}

/// The GLM-4.5-Air-style config with Megatron's pipeline settings added.
fn pipeline_config(d: &Path, name: &str, settings: Value) -> String {
    let mut c = json!({"model_type": "glm4_moe", "num_hidden_layers": DECODER, "n_routed_experts": E,
        "num_experts_per_tok": K, "first_k_dense_replace": 1, "num_nextn_predict_layers": 1});
    c.as_object_mut().unwrap().extend(settings.as_object().unwrap().clone());
    put(d, name, c.to_string())
}

/// A folder of rank files, each `(rank, contents)`, made anew.
fn rank_folder(d: &Path, name: &str, ranks: &[(usize, String)]) -> String {
    let folder = d.join(name);
    let _ = std::fs::remove_dir_all(&folder);
    std::fs::create_dir_all(&folder).unwrap();
    for (r, text) in ranks {
        put(&folder, &format!("router_trace_rank{r}.jsonl"), text);
    }
    folder.to_str().unwrap().to_string()
}

#[test]
fn megatron_trace_and_inference_arrays_read_right() {
    let d = dir("megatron");
    let (c, seqs) = (config(&d), model(7));
    // One rank's trace of a run without pipeline parallelism as the trainer's record against
    // SGLang's rollout: its stage is the whole model, so its numbers are global.
    let a = put(&d, "rollout.json", sglang_batch(&seqs, false));
    let t = put(&d, "router_trace_rank0.jsonl", megatron_trace(&seqs, 0, 0, &[1, 2, 3, 4]));
    let (code, r) = compare(&[&a, &t, "--config", &c, "--max-disagreement", "0"]);
    assert_clean(&r, code, 0);
    assert!(text(&r, "order").contains("another slot order"));
    // Inference routing over HTTP: int16 `[P + O - 1, moe_layers, K]`, MoE routers in order,
    // MTP included, in the serializer's wrapper, `prompt_moe_topk_indices` the same wrapper
    // (its `[:prompt_length]` slices the 2-tuple), one choice per request, `index` counting
    // (NVIDIA/Megatron-LM@core_v0.19.0: megatron/core/inference/text_generation_controllers/text_generation_controller.py:1370-1374,
    // megatron/core/inference/inference_request.py:50-52, :190-195,
    // megatron/core/inference/text_generation_server/dynamic_text_gen_server/endpoints/completions.py:253-279).
    let choices: Vec<Value> = seqs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let n = s.len() / ROUTED / K - 1;
            let rows: Vec<Vec<Vec<i32>>> =
                (0..n).map(|t| (0..ROUTED).map(|l| s[(t * ROUTED + l) * K..][..K].to_vec()).collect()).collect();
            let wrapped = json!(["ndarray", {"data": rows, "dtype": "int16"}]);
            json!({"index": i, "text": "..", "finish_reason": "length", "moe_topk_indices": wrapped,
                   "prompt_moe_topk_indices": wrapped})
        })
        .collect();
    let a = put(&d, "inference.json", json!({"object": "text_completion", "choices": choices}).to_string());
    let (code, r) = compare(&[&a, &trainer(&d, &seqs), "--config", &c, "--max-disagreement", "0"]);
    assert_eq!(code, 0, "{}", r["diagnoses"]);
    assert!(text(&r, "layer-numbers").contains("the MoE and MTP layers (1 to 4)"), "{}", text(&r, "layer-numbers"));
    assert_eq!(r["measures"]["decisions"], LENS.iter().map(|n| (n - 1) * 4).sum::<usize>());
}

/// Two pipeline stages (decoder layers 0-1 and 2-3, MTP on the last), each numbering its
/// layers from 0: merged by where the config says each stage begins, or refused saying what
/// to give; one stage's file alone is a stage never merged.
#[test]
fn megatron_pipeline_stages_merge_by_the_config() {
    let d = dir("megatron-pp");
    let (plain, seqs) = (config(&d), model(18));
    let a = put(&d, "rollout.json", sglang_batch(&seqs, false));
    let pp2 = pipeline_config(&d, "pp2.json", json!({"pipeline_model_parallel_size": 2}));
    let stage0 = megatron_trace(&seqs, 0, 0, &[1]);
    let stage1 = megatron_trace(&seqs, 1, 2, &[2, 3, 4]);
    assert!(stage1
        .starts_with("{\"step\": 7, \"stage\": \"pre_dispatch\", \"block\": \"decoder\", \"layer\": 0, \"rank\": 1,"));
    let folder = rank_folder(&d, "pp2", &[(0, stage0.clone()), (1, stage1.clone())]);
    let (code, r) = compare(&[&a, &folder, "--config", &pp2, "--max-disagreement", "0"]);
    assert_clean(&r, code, 0);
    let reading = text(&r, "reading");
    assert!(reading.contains("rank(s) 0: stage 0, layers 0 to 1; rank(s) 1: stage 1, layers 2 to 3"), "{reading}");
    // Without the settings nothing tells where rank 1's layers begin: refused, saying what to give.
    let e = bad(&["routes", "compare", &a, &folder, "--config", &plain]);
    assert!(e.contains("2 rank files: which pipeline stage a rank ran is not in its trace"), "{e}");
    assert!(e.contains("`pipeline_model_parallel_size` in the --config file"), "{e}");
    // Rank 0's file alone, with or without them: stage 0, a stage never merged.
    for c in [&plain, &pp2] {
        let (code, r) = compare(&[&a, &format!("{folder}/router_trace_rank0.jsonl"), "--config", c]);
        assert_eq!((code, defects(&r)), (1, vec!["pipeline-not-merged".to_string()]), "{}", r["diagnoses"]);
        let t = text(&r, "pipeline-not-merged");
        assert!(t.contains("MoE layers 2 to 3 (2 of 3) are not in the record"), "{t}");
        assert!(t.contains("give the folder of every rank's router_trace_rank{r}.jsonl"), "{t}");
    }
    // An uneven split: the first stage holds dense layer 0 alone, so its file is empty.
    let folder = rank_folder(&d, "uneven", &[(0, String::new()), (1, megatron_trace(&seqs, 1, 1, &[1, 2, 3, 4]))]);
    for (name, settings) in [
        ("first.json", json!({"pipeline_model_parallel_size": 2, "num_layers_in_first_pipeline_stage": 1})),
        ("layout.json", json!({"pipeline_model_parallel_size": 2, "pipeline_model_parallel_layout": "Et|t*3mL"})),
    ] {
        let c = pipeline_config(&d, name, settings);
        let (code, r) = compare(&[&a, &folder, "--config", &c, "--max-disagreement", "0"]);
        assert_clean(&r, code, 0);
        assert!(text(&r, "reading").contains("rank(s) 0: stage 0, layers 0; rank(s) 1: stage 1, layers 1 to 3"));
    }
    // Four ranks, two data-parallel replicas a stage (requests 0-1 and 2), in Megatron's
    // default rank order (pipeline outermost, parallel_state.py:617) and in `tp-pp-dp`
    // (megatron/training/initialize.py:388).
    let dp = |rank: usize, stage: usize, part: &[Vec<i32>]| {
        if stage == 0 {
            megatron_trace(part, rank, 0, &[1])
        } else {
            megatron_trace(part, rank, 2, &[2, 3, 4])
        }
    };
    let (dp0, dp1) = (&seqs[..2], &seqs[2..]);
    for (settings, ranks) in [
        (json!({"pipeline_model_parallel_size": 2}), [(0, dp0), (0, dp1), (1, dp0), (1, dp1)]),
        (
            json!({"pipeline_model_parallel_size": 2, "use_tp_pp_dp_mapping": true}),
            [(0, dp0), (1, dp0), (0, dp1), (1, dp1)],
        ),
    ] {
        let files: Vec<(usize, String)> =
            ranks.iter().enumerate().map(|(r, &(stage, part))| (r, dp(r, stage, part))).collect();
        let folder = rank_folder(&d, "dp", &files);
        let c = pipeline_config(&d, "dp.json", settings);
        let (code, r) = compare(&[&a, &folder, "--config", &c, "--max-disagreement", "0"]);
        assert_clean(&r, code, 0);
    }
    // The inference path writes each router's 1-based global `layer_number` instead
    // (router_trace.py:407-463, text_generation_controller.py:3124-3131): the stages' numbers
    // do not collide, and the config tells the reading.
    let folder = rank_folder(
        &d,
        "inference",
        &[(0, megatron_trace(&seqs, 0, -1, &[1])), (1, megatron_trace(&seqs, 1, -1, &[2, 3]))],
    );
    let (code, r) = compare(&[&a, &folder, "--config", &pp2, "--max-disagreement", "0"]);
    assert_clean(&r, code, 0);
    assert!(text(&r, "reading").contains("read as 1-based global layer numbers"), "{}", text(&r, "reading"));
    // Without pipeline parallelism every rank builds the whole model: two data-parallel ranks'
    // files each hold every MoE layer, which places them without the settings; so is one of them.
    let folder = rank_folder(
        &d,
        "dp-only",
        &[(0, megatron_trace(dp0, 0, 0, &[1, 2, 3, 4])), (1, megatron_trace(dp1, 1, 0, &[1, 2, 3, 4]))],
    );
    let (code, r) = compare(&[&a, &folder, "--config", &plain, "--max-disagreement", "0"]);
    assert_clean(&r, code, 0);
    assert!(text(&r, "reading").contains("each holds every MoE layer of the config, so no pipeline stage"));
    let one = put(&d, "router_trace_rank1.jsonl", megatron_trace(&seqs, 1, 0, &[1, 2, 3, 4]));
    let (code, r) = compare(&[&a, &one, "--config", &plain, "--max-disagreement", "0"]);
    assert_clean(&r, code, 0);
    // What the trace cannot say is refused in one line.
    let vpp = pipeline_config(
        &d,
        "vpp.json",
        json!({"pipeline_model_parallel_size": 2, "pipeline_model_parallel_layout": "Et|t|t|tmL"}),
    );
    let folder = rank_folder(&d, "vpp", &[(0, stage0.clone()), (1, megatron_trace(&seqs, 1, 2, &[2, 3, 4]))]);
    assert!(bad(&["routes", "compare", &a, &folder, "--config", &vpp]).contains("2 model chunks per rank"));
    let t = put(&d, "router_trace_rank1.jsonl", megatron_trace(&seqs, 1, 2, &[2, 3, 4]));
    assert!(bad(&["routes", "compare", &a, &t, "--config", &pp2]).contains("depends on the world size"));
    // A split other than the run's: stage 1 would be layer 3 alone, but rank 1 wrote two layers.
    let late = pipeline_config(
        &d,
        "late.json",
        json!({"pipeline_model_parallel_size": 2, "num_layers_in_first_pipeline_stage": 3}),
    );
    let e = bad(&["routes", "compare", &a, &folder, "--config", &late]);
    assert!(e.contains("decoder layer 1 is not among its stage's 1 layers (from 3)"), "{e}");
    // A rank file whose lines name another rank (not what Megatron writes), and a missing rank.
    let folder = rank_folder(&d, "lying", &[(0, stage0.clone()), (1, megatron_trace(&seqs, 0, 2, &[2, 3, 4]))]);
    assert!(bad(&["routes", "compare", &a, &folder, "--config", &pp2]).contains("`rank` 0 in rank 1's file"));
    let folder = rank_folder(&d, "gap", &[(0, stage0.clone()), (2, megatron_trace(&seqs, 2, 2, &[2, 3, 4]))]);
    assert!(bad(&["routes", "compare", &a, &folder, "--config", &pp2]).contains("rank 1 is missing"));
    let folder = rank_folder(&d, "twice", &[(0, stage0), (1, stage1)]);
    put(Path::new(&folder), "router_trace_rank01.jsonl", megatron_trace(&seqs, 1, 2, &[2, 3, 4]));
    assert!(bad(&["routes", "compare", &a, &folder, "--config", &pp2]).contains("rank 1 has two files"));
}

/// The trace Megatron-LM core_v0.19.0 itself wrote (fixtures/megatron-trace/make.py: its
/// GPTModel and RouterTracer, four ranks, two pipeline stages of two data-parallel ranks, decoder
/// layer 0 dense, 1-3 MoE, one MTP layer): ranks 2 and 3 write layers 0 and 1 for global 2 and 3.
/// Merged by the config's pipeline size it is the record built here from the same lines with
/// the stages placed by hand; without it, refused.
#[test]
fn megatron_trace_written_by_megatron_reads_right() {
    let d = dir("megatron-real");
    let folder = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/megatron-trace/pp2-dp2");
    let model = json!({"num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2,
        "first_k_dense_replace": 1, "num_nextn_predict_layers": 1});
    let plain = put(&d, "config.json", model.to_string());
    let mut with_pp = model.clone();
    with_pp["pipeline_model_parallel_size"] = json!(2);
    let pp = put(&d, "pp.json", with_pp.to_string());
    // By hand: stage 0 (ranks 0, 1) holds global layer 1 as its layer 1; stage 1 (ranks 2, 3)
    // global 2 and 3 as its 0 and 1, and the MTP layer; data-parallel rank 0's micro-batch first.
    let lines = |r: usize| -> Vec<Value> {
        std::fs::read_to_string(format!("{folder}/router_trace_rank{r}.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let mut routes = Vec::new();
    for dp in 0..2 {
        let (s0, s1) = (lines(dp), lines(2 + dp));
        let layers = [&s0[0], &s1[0], &s1[1], &s1[2]];
        assert_eq!(
            layers.map(|v| (v["block"].as_str().unwrap(), v["layer"].as_u64().unwrap(), v["rank"].as_u64().unwrap())),
            [
                ("decoder", 1, dp as u64),
                ("decoder", 0, 2 + dp as u64),
                ("decoder", 1, 2 + dp as u64),
                ("mtp", 0, 2 + dp as u64)
            ]
        );
        for t in 0..6 {
            for v in layers {
                routes.extend(v["top_indices"][t].as_array().unwrap().iter().map(|x| x.as_i64().unwrap() as i32));
            }
        }
    }
    let g = Generic {
        routes: &routes,
        tokens: 12,
        layers: &[1, 2, 3, 4],
        k: 2,
        logits: None,
        input_ids: None,
        cu_seqlens: Some(&[0, 6, 12]),
    };
    let t = put(&d, "by-hand.safetensors", g.bytes());
    let (code, r) = compare(&[&t, folder, "--config", &pp, "--max-disagreement", "0"]);
    assert_eq!(code, 0, "{}", r["diagnoses"]);
    assert_eq!(
        (r["measures"]["decisions"].as_u64(), r["measures"]["decisions_differ"].as_f64()),
        (Some(48), Some(0.0))
    );
    let reading = text(&r, "reading");
    assert!(
        reading.contains("rank(s) 0 to 1: stage 0, layers 0 to 1; rank(s) 2 to 3: stage 1, layers 2 to 3"),
        "{reading}"
    );
    let e = bad(&["routes", "compare", &t, folder, "--config", &plain]);
    assert!(e.contains("4 rank files: which pipeline stage a rank ran is not in its trace"), "{e}");
}

#[test]
fn megatron_bad_trace_lines_are_one_line() {
    let d = dir("megatron-bad");
    let (c, seqs) = (config(&d), model(8));
    let a = put(&d, "rollout.json", sglang_batch(&seqs, false));
    let trace = megatron_trace(&seqs[..1], 0, 0, &[1, 2]).replace("\"num_tokens\": 40", "\"num_tokens\": 41");
    let t = put(&d, "router_trace_rank0.jsonl", trace);
    let e = bad(&["routes", "compare", &a, &t, "--config", &c]);
    assert!(e.contains("line 1: `top_indices` has 40 rows, `num_tokens` says 41"), "{e}");
    let t = put(&d, "router_trace_rank1.jsonl", format!("{}{{\"step\": 7\n", megatron_trace(&seqs[..1], 1, 0, &[1])));
    assert!(bad(&["routes", "compare", &a, &t, "--config", &c]).contains("line 2: not JSON"));
}

// ---------------------------------------------------------------------------------------------
// verl

/// verl's batch: `torch.zeros(1, P + R, L, K)`, the engine's rows from
/// `start_pos = prompt_length - len(prompt)`, int16, next to `attention_mask`
/// (verl-project/verl@1dda039: verl/experimental/agent_loop/agent_loop.py:750, :766-779).
fn verl(seqs: &[Vec<i32>], prompt_cfg: usize, response_cfg: usize) -> Vec<u8> {
    let total = prompt_cfg + response_cfg;
    let (mut routes, mut mask) = (Vec::new(), Vec::new());
    for s in seqs {
        let n = s.len() / ROUTED / K;
        let prompt = n - 8; // 8 response tokens each
        let start = prompt_cfg - prompt;
        let mut x = vec![0; total * DECODER * K];
        let rows = engine(s);
        x[start * DECODER * K..][..rows.len()].copy_from_slice(&rows);
        routes.extend(x);
        mask.extend((0..total).map(|p| i64::from(p >= start && p < start + n)));
    }
    npz(&[
        ("routed_experts.npy", npy("<i2", &[seqs.len(), total, DECODER, K], &as_i16(&routes))),
        ("attention_mask.npy", npy("<i8", &[seqs.len(), total], &i64_bytes(&mask))),
    ])
}

#[test]
fn verl_left_padding_is_padding_not_a_token_offset() {
    let d = dir("verl");
    let (c, seqs) = (config(&d), model(9));
    let t = trainer(&d, &seqs);
    let a = put(&d, "batch.npz", verl(&seqs, 64, 16));
    let (code, r) = compare(&[&a, &t, "--config", &c, "--max-disagreement", "0"]);
    assert_clean(&r, code, 0);
    assert!(text(&r, "padding").contains("mask"), "{}", text(&r, "padding"));
    assert_eq!(r["rollout"]["format"], "verl");
    let (f, n) = flipped(&seqs);
    let (code, r) = compare(&[&a, &trainer(&d, &f), "--config", &c]);
    assert_clean(&r, code, n);
    // A mask of the wrong shape.
    let bytes = npz(&[
        ("routed_experts.npy", npy("<i2", &[1, 80, DECODER, K], &as_i16(&vec![0; 80 * DECODER * K]))),
        ("attention_mask.npy", npy("<i8", &[1, 79], &i64_bytes(&[1; 79]))),
    ]);
    let e = bad(&["routes", "compare", &put(&d, "bad.npz", bytes), &t, "--config", &c]);
    assert!(e.contains("`attention_mask` has shape [1, 79]; expected one flag per row (80)"), "{e}");
}

// ---------------------------------------------------------------------------------------------
// slime

/// slime's packed replay target: each request's `len - 1` rows plus one pad row, then a
/// trailing pad segment to a multiple of 128, pad rows `arange(n*L*K) % E`
/// (THUDM/slime@624b824: slime/backends/megatron_utils/cp_utils.py:239-251, :268, :285),
/// `cu_seqlens` (`torch.int`) with a segment for the trailing pad
/// (slime/backends/megatron_utils/data.py:77-90).
fn slime(seqs: &[Vec<i32>]) -> Vec<u8> {
    let pad = |n: usize| -> Vec<i32> { (0..n * DECODER * K).map(|i| (i % E) as i32).collect() };
    let (mut packed, mut cu) = (Vec::new(), vec![0i64]);
    for s in seqs {
        packed.extend(engine(s));
        packed.extend(pad(1));
        cu.push((packed.len() / DECODER / K) as i64);
    }
    let rows = packed.len() / DECODER / K;
    let trailing = (128 - rows % 128) % 128;
    packed.extend(pad(trailing));
    cu.push((rows + trailing) as i64);
    npz(&[
        ("rollout_routed_experts.npy", npy("<i4", &[rows + trailing, DECODER, K], &i32_bytes(&packed))),
        ("cu_seqlens.npy", npy("<i4", &[cu.len()], &i32_bytes(&cu.iter().map(|&c| c as i32).collect::<Vec<_>>()))),
    ])
}

#[test]
fn slime_pad_rows_and_trailing_segment_are_padding() {
    let d = dir("slime");
    let (c, seqs) = (config(&d), model(10));
    let t = trainer(&d, &seqs);
    let a = put(&d, "rollout.json", sglang_batch(&seqs, false));
    let p = put(&d, "packed.npz", slime(&seqs));
    // The replay target as the trainer's record against the rollout.
    let (code, r) = compare(&[&a, &p, "--config", &c, "--max-disagreement", "0"]);
    assert_eq!(code, 0, "{}", r["diagnoses"]);
    let pad = text(&r, "padding");
    assert!(
        pad.contains("fill arange(n*layers*top_k) % experts") && pad.contains("1 trailing pad segment(s) dropped"),
        "{pad}"
    );
    assert_eq!(r["measures"]["decisions"], LENS.iter().map(|n| (n - 1) * 3).sum::<usize>());
    assert_eq!(r["measures"]["decisions_differ"], 0.0);
    // And as the rollout against the trainer.
    let (code, r) = compare(&[&p, &t, "--config", &c, "--max-disagreement", "0"]);
    assert_clean(&r, code, 0);
}

// ---------------------------------------------------------------------------------------------
// SkyRL

/// SkyRL's batch: compacted by the largest id (NovaSky-AI/SkyRL@a956457:
/// skyrl/backends/skyrl_train/utils/routed_experts.py:9-34: uint8 here), every row first
/// `arange(K)` in every layer, the routes copied left-padded to the batch's longest, and
/// `router_padding_mask` (True = no route) (NovaSky-AI/SkyRL@a956457:
/// skyrl/train/dataset/preprocess.py:17-55, :230-273).
fn skyrl(seqs: &[Vec<i32>]) -> Vec<u8> {
    let total = *LENS.iter().max().unwrap();
    let (mut batch, mut mask) = (Vec::new(), Vec::new());
    for s in seqs {
        let rows = engine(s);
        let n = rows.len() / DECODER / K;
        let start = total - (n + 1);
        let mut x: Vec<i32> = (0..total * DECODER * K).map(|i| (i % K) as i32).collect();
        x[start * DECODER * K..][..rows.len()].copy_from_slice(&rows);
        batch.extend(x);
        mask.extend((0..total).map(|p| u8::from(!(p >= start && p < start + n))));
    }
    npz(&[
        ("rollout_expert_indices.npy", npy("|u1", &[seqs.len(), total, DECODER, K], &as_u8(&batch))),
        ("router_padding_mask.npy", npy("|b1", &[seqs.len(), total], &mask)),
    ])
}

#[test]
fn skyrl_batch_and_wire_read_right() {
    let d = dir("skyrl");
    let (c, seqs) = (config(&d), model(11));
    let t = trainer(&d, &seqs);
    let a = put(&d, "batch.npz", skyrl(&seqs));
    let (code, r) = compare(&[&a, &t, "--config", &c, "--max-disagreement", "0"]);
    assert_clean(&r, code, 0);
    assert!(text(&r, "padding").contains("mask"));
    // The wire: one response per request, its one choice's `routed_experts` = `{data, shape,
    // dtype}` (NovaSky-AI/SkyRL@a956457:
    // skyrl/backends/skyrl_train/inference_servers/generate_wire.py:75-81,
    // skyrl/backends/skyrl_train/inference_servers/vllm_server_actor.py:462-475).
    let responses: Vec<Value> = seqs
        .iter()
        .map(|s| {
            let rows = engine(s);
            let wire =
                json!({"data": b64(&as_u8(&rows)), "shape": [rows.len() / DECODER / K, DECODER, K], "dtype": "uint8"});
            json!({"choices": [{"token_ids": (0..8).collect::<Vec<i64>>(), "finish_reason": "length", "logprobs": null,
                "routed_experts": wire}]})
        })
        .collect();
    let a = put(&d, "wire.json", Value::Array(responses).to_string());
    let (code, r) = compare(&[&a, &t, "--config", &c, "--max-disagreement", "0"]);
    assert_clean(&r, code, 0);
    let wrong =
        json!({"choices": [{"routed_experts": {"data": b64(&[1, 2, 3]), "shape": [1, DECODER, K], "dtype": "uint8"}}]});
    let e = bad(&["routes", "compare", &put(&d, "wrong.json", wrong.to_string()), &t, "--config", &c]);
    assert!(e.contains("3 bytes, shape [1, 4, 4] of uint8 needs Some(16)"), "{e}");
}

// ---------------------------------------------------------------------------------------------
// NeMo-RL

/// NeMo-RL's generation output: the narrowest signed dtype (int8 for 32 experts,
/// NVIDIA-NeMo/RL@7ea279a: nemo_rl/models/generation/interfaces.py:61-69), right padded to the
/// padded prompt length plus the longest generation (8 tokens each here), `arange(K)` first
/// and the engine's rows over it, -1 in every slot for rows vLLM did not return, with the
/// sequence lengths, `torch.long` (nemo_rl/models/generation/vllm/utils.py:171, :220-234,
/// nemo_rl/models/generation/vllm/vllm_worker.py:958, :994-1003, :1048-1062).
fn nemo(seqs: &[Vec<i32>], missing_last: usize) -> Vec<u8> {
    // The batch's padded prompt length (its longest prompt) plus its longest generation.
    let s_len = LENS.iter().map(|n| n - 8).max().unwrap() + 8;
    let mut out = Vec::new();
    for (i, s) in seqs.iter().enumerate() {
        let rows = engine(s);
        let n = rows.len() / DECODER / K;
        let mut x: Vec<i32> = (0..s_len * DECODER * K).map(|j| (j % K) as i32).collect();
        x[..rows.len()].copy_from_slice(&rows);
        if i == 0 && missing_last > 0 {
            x[(n - missing_last) * DECODER * K..n * DECODER * K].fill(-1);
        }
        out.extend(x);
    }
    let lens: Vec<i64> = LENS.iter().map(|&n| n as i64).collect();
    npz(&[
        (
            "routed_experts.npy",
            npy("|i1", &[seqs.len(), s_len, DECODER, K], &out.iter().map(|&v| v as i8 as u8).collect::<Vec<_>>()),
        ),
        ("unpadded_sequence_lengths.npy", npy("<i8", &[3], &i64_bytes(&lens))),
    ])
}

#[test]
fn nemo_rl_missing_routes_are_counted_apart() {
    let d = dir("nemo");
    let (c, seqs) = (config(&d), model(12));
    let t = trainer(&d, &seqs);
    let a = put(&d, "gen.npz", nemo(&seqs, 0));
    let (code, r) = compare(&[&a, &t, "--config", &c, "--max-disagreement", "0"]);
    assert_clean(&r, code, 0);
    // The last 5 rows of request 0 missing (-1): 5 x 3 layers counted apart, not as differing.
    let a = put(&d, "missing.npz", nemo(&seqs, 5));
    let (code, r) = compare(&[&a, &t, "--config", &c, "--max-disagreement", "0"]);
    assert_eq!(code, 0, "{}", r["diagnoses"]);
    assert_eq!(r["rollout"]["found"]["missing"], 15);
    assert_eq!(r["measures"]["decisions_differ"], 0.0);
    assert_eq!(r["measures"]["decisions"], LENS.iter().map(|n| (n - 1) * 3).sum::<usize>() - 15);
    // The Gym chat responses: one per request, its choice's `message.routed_experts` the
    // envelope of every position (`len` rows: the last, with no route, `arange(K)`)
    // (NVIDIA-NeMo/RL@7ea279a: nemo_rl/models/generation/vllm/utils.py:238-303,
    // nemo_rl/utils/routed_experts_codec.py:62-67).
    let responses: Vec<Value> = seqs
        .iter()
        .map(|s| {
            let mut rows = engine(s);
            rows.extend((0..DECODER * K).map(|j| (j % K) as i32));
            let n = rows.len() / DECODER / K;
            let bytes: Vec<u8> = rows.iter().map(|&v| v as i8 as u8).collect();
            let envelope = format!("nrlre1:int8:{n}x{DECODER}x{K}:{}", b64(&bytes));
            json!({"object": "chat.completion", "choices": [{"index": 0, "finish_reason": "length",
                "message": {"role": "assistant", "content": "..", "routed_experts": envelope}}]})
        })
        .collect();
    let a = put(&d, "gym.json", Value::Array(responses).to_string());
    let (code, r) = compare(&[&a, &t, "--config", &c, "--max-disagreement", "0"]);
    assert_clean(&r, code, 0);
}

// ---------------------------------------------------------------------------------------------
// Defects across writers: narrowing casts, a row short, not paired, dense placeholders.

#[test]
fn narrowing_casts_are_named() {
    let d = dir("narrow");
    let (c, seqs) = (config(&d), model(13));
    let t1 = trainer(&d, &seqs[..1]);
    // A NeMo-RL -1 cast to uint8 (verl <= v0.9.0 cast to uint8 when max <= 255,
    // verl-project/verl@v0.9.0: verl/workers/utils/padding.py:75-76): 255.
    let mut rows = engine(&seqs[0]);
    let n = LENS[0] - 1;
    rows[(n - 2) * DECODER * K..].fill(-1);
    let a = put(&d, "wrapped.npy", npy("|u1", &[n, DECODER, K], &as_u8(&rows)));
    let (code, r) = compare(&[&a, &t1, "--config", &c]);
    assert_eq!(code, 1);
    assert!(text(&r, "narrowing-cast").contains("slots hold 255 in a uint8 record"), "{}", r["diagnoses"]);
    // 384 experts stored as uint8: ids modulo 256.
    let big = json!({"num_hidden_layers": DECODER, "n_routed_experts": 384, "num_experts_per_tok": K,
        "first_k_dense_replace": 1, "num_nextn_predict_layers": 1});
    let c384 = put(&d, "config384.json", big.to_string());
    let wide: Vec<Vec<i32>> =
        LENS.iter().enumerate().map(|(i, &n)| random_routes(n, ROUTED, K, 384, 40 + i as u64)).collect();
    let t = trainer(&d, &wide[..1]);
    let rows = engine(&wide[0]);
    let a = put(&d, "mod256.npy", npy("|u1", &[n, DECODER, K], &as_u8(&rows)));
    let (code, r) = compare(&[&a, &t, "--config", &c384]);
    assert_eq!(code, 1);
    assert!(text(&r, "narrowing-cast").contains("equal modulo 256"), "{}", r["diagnoses"]);
}

#[test]
fn a_record_one_row_short_beyond_the_convention_is_named() {
    let d = dir("short");
    let (c, seqs) = (config(&d), model(14));
    let t = trainer(&d, &seqs);
    let short: Vec<Value> = seqs
        .iter()
        .map(|s| {
            let rows = engine(s);
            json!({"meta_info": {"routed_experts": b64(&i32_bytes(&rows[..rows.len() - DECODER * K]))}})
        })
        .collect();
    let a = put(&d, "short.json", Value::Array(short).to_string());
    let (code, r) = compare(&[&a, &t, "--config", &c]);
    assert_eq!((code, defects(&r)), (1, vec!["one-row-short".to_string()]));
}

#[test]
fn records_not_paired_fail_even_without_a_threshold() {
    let d = dir("unpaired");
    let (c, seqs) = (config(&d), model(15));
    let t = trainer(&d, &seqs);
    // The rollout of other requests.
    let a = put(&d, "other.json", sglang_batch(&model(99), false));
    let (code, r) = compare(&[&a, &t, "--config", &c]);
    assert_eq!((code, defects(&r)), (1, vec!["not-paired".to_string()]));
    assert!(text(&r, "not-paired").contains("probably not paired right"));
    // A payload shaped with another layer count (no config: shape from the other record).
    let a = put(&d, "rollout.json", sglang_batch(&seqs, false));
    let t5 = {
        let g: Vec<Vec<i32>> =
            LENS.iter().enumerate().map(|(i, &n)| random_routes(n, 5, K, E, 70 + i as u64)).collect();
        let routes = g.concat();
        let mut cu = vec![0i64];
        for &n in &LENS {
            cu.push(cu.last().unwrap() + n as i64);
        }
        let gen = Generic {
            routes: &routes,
            tokens: cu[3] as usize,
            layers: &[0, 1, 2, 3, 4],
            k: K,
            logits: None,
            input_ids: None,
            cu_seqlens: Some(&cu),
        };
        put(&d, "t5.safetensors", gen.bytes())
    };
    // Its rows come from its own counts (rows = prompt + completion - 1 - start, SGLang v0.5.10
    // `srt/layers/moe/routed_experts_capturer.py:211`), so its layer axis is its own: against a
    // trainer of another layer count it reads right and is not paired.
    let (code, r) = compare(&[&a, &t5]);
    assert_eq!((code, defects(&r)), (1, vec!["not-paired".to_string()]));
    // Counts that its bytes do not fit are bad input, refused in one line (exit 2).
    let mut lying: Value = serde_json::from_str(&sglang_batch(&seqs, false)).unwrap();
    lying[0]["meta_info"]["prompt_tokens"] = json!(lying[0]["meta_info"]["prompt_tokens"].as_u64().unwrap() + 1);
    let a = put(&d, "lying.json", lying.to_string());
    let err = bad(&["routes", "compare", &a, &t5, "--format", "json"]);
    assert_eq!(
        err,
        format!(
            "error: {a}: response 0: {} ids are not {} rows (prompt_tokens + completion_tokens - 1 - \
             routed_experts_start_len) of whole layers x top-k (a start not returned with the response?): \
             give the model's config.json (--config) for num_hidden_layers and top-k\n",
            (LENS[0] - 1) * DECODER * K,
            LENS[0]
        )
    );
}

#[test]
fn two_zero_filled_dense_layers_are_not_aliasing() {
    let d = dir("dense2");
    let c = put(
        &d,
        "config.json",
        json!({"num_hidden_layers": 5, "n_routed_experts": E, "num_experts_per_tok": K, "first_k_dense_replace": 2})
            .to_string(),
    );
    let moe = random_routes(64, 3, K, E, 16);
    let mut rows = vec![0; 63 * 5 * K];
    for t in 0..63 {
        rows[(t * 5 + 2) * K..(t * 5 + 5) * K].copy_from_slice(&moe[t * 3 * K..(t + 1) * 3 * K]);
    }
    let a = put(&d, "rollout.npy", npy("|u1", &[63, 5, K], &as_u8(&rows)));
    let g =
        Generic { routes: &moe, tokens: 64, layers: &[2, 3, 4], k: K, logits: None, input_ids: None, cu_seqlens: None };
    let t = put(&d, "trainer.safetensors", g.bytes());
    let (code, r) = compare(&[&a, &t, "--config", &c, "--max-disagreement", "0"]);
    assert_eq!(code, 0, "{}", r["diagnoses"]);
    assert!(defects(&r).is_empty());
    // Without a config, the zero layers are left out as dense, said so.
    let (code, r) = compare(&[&a, &a]);
    assert_eq!(code, 0, "{}", r["diagnoses"]);
    assert!(text(&r, "unpaired").contains("layers 0 to 1 hold only zeros"));
}

#[test]
fn show_says_what_it_inferred() {
    let d = dir("writers-show");
    let (c, seqs) = (config(&d), model(17));
    let a = put(&d, "batch.npz", nemo(&seqs, 5));
    let out = Command::new(BIN).args(["routes", "show", &a, "--config", &c]).output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    let t = String::from_utf8(out.stdout).unwrap();
    for want in [
        "writer: NeMo-RL routed_experts",
        "dtype: int8",
        "layers: not in the file: its 4 layers are every decoder layer",
        "padding rows:",
        "missing routes: 15",
        "dense layers holding placeholders: 0",
    ] {
        assert!(t.contains(want), "{want}\n{t}");
    }
}

// ---------------------------------------------------------------------------------------------
// Padding by the writer's rule: a fill a router could also choose is padding only where the
// writer that writes it puts it, never because one row looks like it.

/// Every layer MoE, 8 experts, top-2, 2 layers: slime's fill row `arange(L*K) % E` is `[0, 1]`
/// then `[2, 3]`, SkyRL's and NeMo-RL's `arange(top_k)` in every layer `[0, 1]` twice, and this
/// router may choose either.
const E8: usize = 8;
const L2: usize = 2;

/// Seeded routes `[n, L2, k]` of 8 experts, with the rows `at` set.
fn routes_with(n: usize, k: usize, seed: u64, at: &[(usize, &[i32])]) -> Vec<i32> {
    let mut r = random_routes(n, L2, k, E8, seed);
    for &(t, row) in at {
        r[t * L2 * k..(t + 1) * L2 * k].copy_from_slice(row);
    }
    r
}

/// `moe-audit-routes/1` of `seqs` (each `[n, L2, k]`), layers 0 and 1, one sequence each.
fn trainer_of(d: &Path, name: &str, seqs: &[&[i32]], k: usize) -> String {
    let mut cu = vec![0i64];
    for s in seqs {
        cu.push(cu.last().unwrap() + (s.len() / L2 / k) as i64);
    }
    let routes = seqs.concat();
    let g = Generic {
        routes: &routes,
        tokens: routes.len() / L2 / k,
        layers: &[0, 1],
        k,
        logits: None,
        input_ids: None,
        cu_seqlens: Some(&cu),
    };
    put(d, name, g.bytes())
}

fn mixtral_like(d: &Path) -> String {
    put(
        d,
        "config8.json",
        json!({"num_hidden_layers": L2, "num_local_experts": E8, "num_experts_per_tok": 2}).to_string(),
    )
}

#[test]
fn an_engines_routes_that_look_like_another_writers_fill_keep_every_token() {
    let d = dir("fill-like");
    // vLLM writes no fill: `P + O - 1` rows, each a captured route, uint8 for at most 256
    // experts (vllm-project/vllm@v0.25.0: vllm/model_executor/layers/fused_moe/routed_experts_capturer.py:279-287,
    // `get` :307-336). Its first and last rows route as slime's fill, one as SkyRL's.
    let full = routes_with(24, 2, 81, &[(0, &[0, 1, 2, 3]), (10, &[0, 1, 0, 1]), (22, &[0, 1, 2, 3])]);
    let rows = &full[..23 * L2 * 2];
    let a = put(&d, "engine.npy", npy("|u1", &[23, L2, 2], &as_u8(rows)));
    let t = trainer_of(&d, "trainer.safetensors", &[&full], 2);
    let c = mixtral_like(&d);
    for config in [&[][..], &["--config", &c][..]] {
        let (code, r) = compare(&[&[a.as_str(), &t, "--max-disagreement", "0"][..], config].concat());
        assert_eq!(code, 0, "{config:?}: {}", r["diagnoses"]);
        assert_eq!(r["measures"]["decisions"], 23 * L2, "{config:?}: {}", r["diagnoses"]);
        assert_eq!(r["rollout"]["found"]["padding"], json!({}), "{config:?}");
        assert_eq!(r["trainer"]["found"]["padding"], json!({}), "{config:?}");
    }
    // Top-1: expert 0 in every layer is a route, not a zero fill (vLLM fills no row).
    let full = routes_with(24, 1, 82, &[(3, &[0, 0]), (22, &[0, 0])]);
    let a = put(&d, "top1.npy", npy("|u1", &[23, L2, 1], &as_u8(&full[..23 * L2])));
    let t = trainer_of(&d, "top1.safetensors", &[&full], 1);
    let (code, r) = compare(&[&a, &t, "--max-disagreement", "0"]);
    assert_eq!((code, r["measures"]["decisions"].clone()), (0, json!(23 * L2)), "{}", r["diagnoses"]);
    assert_eq!(r["rollout"]["found"]["padding"], json!({}));
}

/// slime's packed replay target as `prepare_routed_experts_for_routing_replay` builds it
/// (THUDM/slime@v0.3.1: slime/backends/megatron_utils/cp_utils.py:376 one pad row per sample,
/// :393-394 a trailing pad to a multiple of the pad size, :347-359 each pad block
/// `arange(n*L*K) % E` from 0), with `cu_seqlens` as `get_batch` builds it (data.py:91-101, one
/// segment per sample and one for the trailing pad).
fn slime_packed(samples: &[&[i32]], k: usize, pad_size: usize) -> Vec<u8> {
    let w = L2 * k;
    let fill = |n: usize| -> Vec<i32> { (0..n * w).map(|i| (i % E8) as i32).collect() };
    let (mut packed, mut cu) = (Vec::new(), vec![0i64]);
    for s in samples {
        packed.extend_from_slice(&s[..s.len() - w]); // `len - 1` rows: the last token never forwarded
        packed.extend(fill(1));
        cu.push((packed.len() / w) as i64);
    }
    let pad = (pad_size - packed.len() / w % pad_size) % pad_size;
    packed.extend(fill(pad));
    cu.push((packed.len() / w) as i64);
    let rows = packed.len() / w;
    npz(&[
        ("rollout_routed_experts.npy", npy("<i4", &[rows, L2, k], &i32_bytes(&packed))),
        ("cu_seqlens.npy", npy("<i8", &[cu.len()], &i64_bytes(&cu))),
    ])
}

#[test]
fn slimes_pad_rows_are_padding_where_slime_puts_them_and_nowhere_else() {
    let d = dir("slime-fill");
    // Sample 0 routes as the fill in a middle row and in its last forwarded row, just before its
    // pad row; sample 1 as SkyRL's fill.
    let s0 = routes_with(12, 2, 83, &[(4, &[0, 1, 2, 3]), (10, &[0, 1, 2, 3])]);
    let s1 = routes_with(9, 2, 84, &[(2, &[0, 1, 0, 1])]);
    let p = put(&d, "packed.npz", slime_packed(&[&s0, &s1], 2, 8));
    let t = trainer_of(&d, "trainer.safetensors", &[&s0, &s1], 2);
    let c = mixtral_like(&d);
    // Without --config the expert count is where the fill wraps.
    for config in [&[][..], &["--config", &c][..]] {
        let (code, r) = compare(&[&[p.as_str(), &t, "--max-disagreement", "0"][..], config].concat());
        assert_eq!(code, 0, "{config:?}: {}", r["diagnoses"]);
        assert_eq!(r["measures"]["decisions"], (11 + 8) * L2, "{config:?}: {}", r["diagnoses"]);
        // 21 rows + 3 to a multiple of 8: a pad row per sample, the trailing segment dropped.
        assert_eq!(r["rollout"]["found"]["padding"], json!({"fill arange(n*layers*top_k) % experts": 5}), "{config:?}");
        assert_eq!(r["rollout"]["found"]["pad_segments"], 1);
    }
    // The same rows without `cu_seqlens` are a sample's array (slime/utils/types.py:377-395):
    // no pad, every row a route.
    let one = put(
        &d,
        "sample.npz",
        npz(&[("rollout_routed_experts.npy", npy("<i4", &[11, L2, 2], &i32_bytes(&s0[..11 * L2 * 2])))]),
    );
    let t0 = trainer_of(&d, "t0.safetensors", &[&s0], 2);
    let (code, r) = compare(&[&one, &t0, "--max-disagreement", "0"]);
    assert_eq!((code, r["measures"]["decisions"].clone()), (0, json!(11 * L2)), "{}", r["diagnoses"]);
}

/// DeepSeek-V3's layout at small size: 6 decoder layers, the first 3 dense, one MTP layer.
const DS_LAYERS: usize = 6;
const DS_K: usize = 8;

/// SGLang `/generate` responses for sequences `[n, 4, DS_K]` (MoE layers 3..5 and MTP 6): each
/// `meta_info` with `prompt_tokens`, `completion_tokens` (sgl-project/sglang@v0.5.10:
/// python/sglang/srt/managers/tokenizer_manager.py:1552, :1578, counted in
/// scheduler_output_processor_mixin.py:1044-1046) and `routed_experts`, base64 of int32
/// `[seqlen - 1, num_hidden_layers, top_k]` (routed_experts_capturer.py:211-220,
/// tokenizer_manager.py:1593-1598): every decoder layer, dense ones left 0, no MTP.
fn sglang_v3(seqs: &[Vec<i32>]) -> Vec<Value> {
    seqs.iter()
        .map(|s| {
            let n = s.len() / 4 / DS_K;
            let mut rows = vec![0; (n - 1) * DS_LAYERS * DS_K];
            for t in 0..n - 1 {
                rows[(t * DS_LAYERS + 3) * DS_K..(t * DS_LAYERS + 6) * DS_K].copy_from_slice(&s[t * 4 * DS_K..(t * 4 + 3) * DS_K]);
            }
            json!({"text": "..", "meta_info": {"prompt_tokens": n - 5, "completion_tokens": 5, "routed_experts": b64(&i32_bytes(&rows))}})
        })
        .collect()
}

#[test]
fn an_sglang_response_is_shaped_by_its_own_row_count() {
    let d = dir("sglang-v3");
    let config = json!({"num_hidden_layers": DS_LAYERS, "n_routed_experts": 256, "num_experts_per_tok": DS_K,
        "first_k_dense_replace": 3, "num_nextn_predict_layers": 1});
    let c = put(&d, "config.json", config.to_string());
    // 36 and 29 tokens: 35 and 28 rows of 48 ids are also whole rows of 7 layers x top-8, the
    // shape of the trainer's layers 3..6.
    let seqs: Vec<Vec<i32>> =
        [36, 29].iter().enumerate().map(|(i, &n)| random_routes(n, 4, DS_K, 256, 90 + i as u64)).collect();
    let routes = seqs.concat();
    let cu = [0i64, 36, 65];
    let g = Generic {
        routes: &routes,
        tokens: 65,
        layers: &[3, 4, 5, 6],
        k: DS_K,
        logits: None,
        input_ids: None,
        cu_seqlens: Some(&cu),
    };
    let t = put(&d, "trainer.safetensors", g.bytes());
    let a = put(&d, "rollout.json", Value::Array(sglang_v3(&seqs)).to_string());
    for config in [&[][..], &["--config", &c][..]] {
        let (code, r) = compare(&[&[a.as_str(), &t, "--max-disagreement", "0"][..], config].concat());
        assert_eq!(code, 0, "{config:?}: {}", r["diagnoses"]);
        assert_eq!(r["rollout"]["layers"], json!([0, 1, 2, 3, 4, 5]), "{config:?}");
        assert_eq!(r["measures"]["decisions"], (35 + 28) * 3, "{config:?}");
    }
    let (_, r) = compare(&[&a, &t]);
    assert!(
        text(&r, "reading").contains("shaped as [rows, 6, 8], rows by its prompt_tokens + completion_tokens"),
        "{}",
        text(&r, "reading")
    );
    // Layers from top-k takes top-k from somewhere: one line, exit 2, saying what to give.
    let e = bad(&["routes", "show", &a]);
    assert!(
        e.contains("response 0: 35 rows of 48 ids each, layers x top-k: give the model's config.json (--config)"),
        "{e}"
    );
    let e = bad(&["routes", "compare", &a, &a]);
    assert!(e.contains("35 rows of 48 ids each"), "{e}");
    // A start the response does not return (routed_experts_start_len = 5, sgl-project/sglang@v0.5.23:
    // python/sglang/srt/state_capturer/base.py:173-188): fewer rows than its counts say.
    let mut items = sglang_v3(&seqs[..1]);
    let payload = base64::engine::general_purpose::STANDARD
        .decode(items[0]["meta_info"]["routed_experts"].as_str().unwrap())
        .unwrap();
    items[0]["meta_info"]["routed_experts"] = json!(b64(&payload[5 * DS_LAYERS * DS_K * 4..]));
    let cut = put(&d, "start.json", Value::Array(items).to_string());
    let e = bad(&["routes", "compare", &cut, &t]);
    assert!(
        e.contains(
            "response 0: 1440 ids are not 35 rows (prompt_tokens + completion_tokens - 1 - routed_experts_start_len)"
        ),
        "{e}"
    );
}

#[test]
fn verls_zero_tail_and_skyrls_unmasked_fill_are_padding_at_their_place_only() {
    let d = dir("edge-fills");
    // verl at top-1: `torch.zeros`, the engine's `len - 1` rows copied from `start_pos`, the mask
    // 1 on the sequence (verl-project/verl@1dda039: verl/experimental/agent_loop/agent_loop.py:767-779):
    // the last token's zero row is the fill, a real token on expert 0 in every layer is a route.
    let full = routes_with(24, 1, 85, &[(5, &[0, 0])]);
    let (left, total) = (4, 4 + 24 + 3);
    let mut batch = vec![0; total * L2];
    batch[left * L2..][..23 * L2].copy_from_slice(&full[..23 * L2]);
    let mask: Vec<i64> = (0..total).map(|p| i64::from((left..left + 24).contains(&p))).collect();
    let a = put(
        &d,
        "verl.npz",
        npz(&[
            ("routed_experts.npy", npy("<i2", &[1, total, L2, 1], &as_i16(&batch))),
            ("attention_mask.npy", npy("<i8", &[1, total], &i64_bytes(&mask))),
        ]),
    );
    let t = trainer_of(&d, "verl-trainer.safetensors", &[&full], 1);
    let (code, r) = compare(&[&a, &t, "--max-disagreement", "0"]);
    assert_eq!((code, r["measures"]["decisions"].clone()), (0, json!(23 * L2)), "{}", r["diagnoses"]);
    assert_eq!(r["rollout"]["found"]["padding"], json!({"mask": 7, "all-zero": 1}));
    // SkyRL without its mask: every row `arange(top_k)` first, the routes copied left-padded
    // (NovaSky-AI/SkyRL@a956457: skyrl/backends/skyrl_train/utils/replay_utils.py:59-60,
    // skyrl/train/dataset/preprocess.py:265-272): the fill before and after the routes is
    // padding, a real token routing `[0, 1]` twice between them is not.
    let full = routes_with(24, 2, 86, &[(5, &[0, 1, 0, 1]), (20, &[0, 1, 0, 1])]);
    let (left, total) = (3, 3 + 24);
    let mut batch: Vec<i32> = (0..total * L2 * 2).map(|i| (i % 2) as i32).collect();
    batch[left * L2 * 2..][..23 * L2 * 2].copy_from_slice(&full[..23 * L2 * 2]);
    let a =
        put(&d, "skyrl.npz", npz(&[("rollout_expert_indices.npy", npy("|u1", &[1, total, L2, 2], &as_u8(&batch)))]));
    let t = trainer_of(&d, "skyrl-trainer.safetensors", &[&full], 2);
    let (code, r) = compare(&[&a, &t, "--max-disagreement", "0"]);
    assert_eq!((code, r["measures"]["decisions"].clone()), (0, json!(23 * L2)), "{}", r["diagnoses"]);
    assert_eq!(r["rollout"]["found"]["padding"], json!({"fill arange(top_k) in every layer": 4}));
}
