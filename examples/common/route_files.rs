//! Routing record files built in memory for tests and the `routes_cost` example: seeded random
//! routes, and writers for every format `moe-audit routes` reads (npy, npz, safetensors in the
//! generic layout, SGLang JSON). Writers take plain values, so a test can build a
//! broken file by changing one of them.
#![allow(dead_code)]

use base64::Engine;
use rand::seq::index::sample;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::BTreeMap;

/// Routes `[tokens, layers, k]` as a flat vector: each row `k` distinct experts of `experts`.
pub fn random_routes(tokens: usize, layers: usize, k: usize, experts: usize, seed: u64) -> Vec<i32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut out = Vec::with_capacity(tokens * layers * k);
    for _ in 0..tokens * layers {
        out.extend(sample(&mut rng, experts, k).into_iter().map(|e| e as i32));
    }
    out
}

/// Replaces one expert of a `share` of rows (seeded) by an expert the row does not hold;
/// returns how many rows changed.
pub fn flip(routes: &mut [i32], k: usize, experts: usize, share: f64, seed: u64) -> usize {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut changed = 0;
    for row in routes.chunks_exact_mut(k) {
        if row.iter().all(|&e| e < 0) || !rng.random_bool(share) {
            continue;
        }
        let slot = rng.random_range(0..k);
        loop {
            let e = rng.random_range(0..experts) as i32;
            if !row.contains(&e) {
                row[slot] = e;
                break;
            }
        }
        changed += 1;
    }
    changed
}

/// An `.npy` file's bytes: `descr` (e.g. `<i4`), shape, raw little-endian data.
pub fn npy(descr: &str, shape: &[usize], data: &[u8]) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let tuple = if dims.len() == 1 { format!("({},)", dims[0]) } else { format!("({})", dims.join(", ")) };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {tuple}, }}");
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

/// i32 values as little-endian bytes.
pub fn i32_bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// i64 values as little-endian bytes.
pub fn i64_bytes(v: &[i64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// f32 values as little-endian bytes.
pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// An `.npz` archive (stored entries, as `np.savez` writes them) of `name.npy` entries.
pub fn npz(entries: &[(&str, Vec<u8>)]) -> Vec<u8> {
    let mut zip = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let options = zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    for (name, bytes) in entries {
        zip.start_file(*name, options).expect("zip entry");
        std::io::Write::write_all(&mut zip, bytes).expect("zip write");
    }
    zip.finish().expect("zip finish").into_inner()
}

/// A tensor of a safetensors file: name, dtype (`I32`, `I64`, `F32`, ...), shape, bytes.
pub struct Tensor<'a> {
    pub name: &'a str,
    pub dtype: &'a str,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

/// A safetensors file's bytes with string metadata.
pub fn safetensors(tensors: &[Tensor<'_>], metadata: &BTreeMap<&str, String>) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    if !metadata.is_empty() {
        header.insert("__metadata__".into(), serde_json::json!(metadata));
    }
    let mut offset = 0;
    for t in tensors {
        header.insert(
            t.name.into(),
            serde_json::json!({"dtype": t.dtype, "shape": t.shape, "data_offsets": [offset, offset + t.data.len()]}),
        );
        offset += t.data.len();
    }
    let mut text = serde_json::to_string(&header).expect("json");
    while !text.len().is_multiple_of(8) {
        text.push(' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(text.as_bytes());
    for t in tensors {
        out.extend_from_slice(&t.data);
    }
    out
}

/// A generic (`moe-audit-routes/1`) safetensors record: routes `[tokens, layers.len(), k]`,
/// optional logits `[tokens, layers, experts]`, token ids and sequence boundaries.
pub struct Generic<'a> {
    pub routes: &'a [i32],
    pub tokens: usize,
    pub layers: &'a [usize],
    pub k: usize,
    pub logits: Option<(&'a [f32], usize)>,
    pub input_ids: Option<&'a [i64]>,
    pub cu_seqlens: Option<&'a [i64]>,
}

impl Generic<'_> {
    /// The file's bytes.
    pub fn bytes(&self) -> Vec<u8> {
        let mut tensors = vec![Tensor {
            name: "experts",
            dtype: "I32",
            shape: vec![self.tokens, self.layers.len(), self.k],
            data: i32_bytes(self.routes),
        }];
        if let Some((l, e)) = self.logits {
            tensors.push(Tensor {
                name: "logits",
                dtype: "F32",
                shape: vec![self.tokens, self.layers.len(), e],
                data: f32_bytes(l),
            });
        }
        if let Some(ids) = self.input_ids {
            tensors.push(Tensor { name: "input_ids", dtype: "I64", shape: vec![ids.len()], data: i64_bytes(ids) });
        }
        if let Some(cu) = self.cu_seqlens {
            tensors.push(Tensor { name: "cu_seqlens", dtype: "I64", shape: vec![cu.len()], data: i64_bytes(cu) });
        }
        let meta = BTreeMap::from([
            ("format", "moe-audit-routes/1".to_string()),
            ("layers", serde_json::to_string(self.layers).expect("json")),
            ("source", "test".to_string()),
        ]);
        safetensors(&tensors, &meta)
    }
}

/// An SGLang `/generate` response carrying `routes` (flat int32) as base64, with an optional
/// `routed_experts_start_len`.
pub fn sglang(routes: &[i32], start: Option<usize>) -> String {
    let b64 = base64::engine::general_purpose::STANDARD.encode(i32_bytes(routes));
    let mut meta = serde_json::json!({"id": "0", "finish_reason": {"type": "length"}, "routed_experts": b64});
    if let Some(s) = start {
        meta["routed_experts_start_len"] = serde_json::json!(s);
    }
    serde_json::json!({"text": "...", "meta_info": meta}).to_string()
}

/// Routes of `layers` layers with `dense` leading layers of -1 (as SGLang reports every layer),
/// the rest taken in order from `moe` (`[tokens, moe_layers, k]`).
pub fn with_dense(moe: &[i32], tokens: usize, moe_layers: usize, dense: usize, k: usize) -> Vec<i32> {
    let mut out = Vec::with_capacity(tokens * (moe_layers + dense) * k);
    for t in 0..tokens {
        out.extend(std::iter::repeat_n(-1, dense * k));
        out.extend_from_slice(&moe[t * moe_layers * k..(t + 1) * moe_layers * k]);
    }
    out
}

/// A Qwen3-MoE-style config.json: `layers` decoder layers, the first `dense` of them dense (as
/// `mlp_only_layers`), `experts` experts, top-`k`.
pub fn config(layers: usize, dense: usize, experts: usize, k: usize) -> String {
    serde_json::json!({
        "model_type": "qwen3_moe", "num_hidden_layers": layers, "num_experts": experts,
        "num_experts_per_tok": k, "decoder_sparse_step": 1, "mlp_only_layers": (0..dense).collect::<Vec<_>>()
    })
    .to_string()
}

/// Makes a flipped row of logits a near-tie: its chosen experts (`chosen`) clamped to [1, 1.5],
/// the weakest of them at 1 and the best other expert at 0.999, so its k-th and (k+1)-th
/// experts are 0.001 apart.
pub fn near_tie(row: &mut [f32], chosen: &[i32]) {
    for &e in chosen {
        row[e as usize] = row[e as usize].clamp(1.0, 1.5);
    }
    let low = *chosen.iter().min_by(|p, q| row[**p as usize].total_cmp(&row[**q as usize])).unwrap();
    row[low as usize] = 1.0;
    let out = (0..row.len() as i32).find(|e| !chosen.contains(e)).unwrap();
    row[out as usize] = 0.999;
}

/// Seeded router logits `[rows, experts]` whose top-`k` are the given routes (flat
/// `[rows, k]`): chosen experts score 1 + a random margin, the rest below 1.
pub fn logits_for(routes: &[i32], k: usize, experts: usize, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut out = Vec::with_capacity(routes.len() / k * experts);
    for row in routes.chunks_exact(k) {
        let mut l: Vec<f32> = (0..experts).map(|_| rng.random_range(-1.0f32..0.9)).collect();
        for (slot, &e) in row.iter().enumerate() {
            if e >= 0 {
                l[e as usize] = 2.0 - slot as f32 * 0.1;
            }
        }
        out.extend(l);
    }
    out
}
