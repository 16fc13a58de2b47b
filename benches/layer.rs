//! MoE layer forward on CPU, f32, against its two references, side by side:
//!
//! * `layer/E{E}/moe`: our [`MoeLayer`] (Mixtral preset: softmax, top-2, renormalised,
//!   dropless), gate + routing + dispatch + experts + combine;
//! * `layer/E{E}/dense`: the ceiling, one dense SwiGLU FFN with the same active FLOPs
//!   (FFN size k × 1024 = 2048 on every token), built as our own [`Expert`] so it runs the
//!   same kernel code as our experts;
//! * `layer/E{E}/mixtral`: candle-transformers 0.11.1's Mixtral `SparseMoeBlock` on the same
//!   gate and expert tensors. That type is private in candle-transformers (so are its config
//!   fields), so `mixtral_block` below is a verbatim copy of its `forward`, built on the crate's
//!   public `with_tracing::linear_no_bias` exactly as the original is.
//!
//! Shapes: batch 1 × seq 2048 = T 2048 tokens, H 512, expert FFN 1024, k 2, E 8 and E 64.
//! Setup asserts that our output equals the Mixtral block's on the same input.
//!
//! Run: `cargo bench --bench layer`.

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::VarBuilder;
use criterion::{criterion_group, criterion_main, Criterion, SamplingMode, Throughput};
use moe_audit::layer::{seeded_weights, Expert, LayerDims, MoeLayer, Seeded};
use std::collections::HashMap;
use std::time::Duration;

const BATCH: usize = 1;
const SEQ: usize = 2048;
const HIDDEN: usize = 512;
const FFN: usize = 1024;
const TOP_K: usize = 2;
const SIZES: [usize; 2] = [8, 64];

const LAYER_SEED: u64 = 0;
const DENSE_SEED: u64 = 1;
const INPUT_SEED: u64 = 2;

/// candle-transformers 0.11.1 `models::mixtral::{BlockSparseTop2MLP, SparseMoeBlock}`, copied
/// verbatim (MIT/Apache-2.0) because both types are private; only the `Config` argument is
/// replaced by explicit sizes (its fields are `pub(crate)` too). Tensor names are the same:
/// `gate.weight`, `experts.{i}.w1.weight`, `experts.{i}.w2.weight`, `experts.{i}.w3.weight`.
mod mixtral_block {
    use candle_core::{DType, Module, Result, Tensor};
    use candle_nn::{Activation, VarBuilder};
    use candle_transformers::models::with_tracing::{linear_no_bias, Linear};

    #[derive(Debug, Clone)]
    struct BlockSparseTop2MLP {
        w1: Linear,
        w2: Linear,
        w3: Linear,
        act_fn: Activation,
    }

    impl BlockSparseTop2MLP {
        fn new(hidden_sz: usize, intermediate_sz: usize, vb: VarBuilder) -> Result<Self> {
            let w1 = linear_no_bias(hidden_sz, intermediate_sz, vb.pp("w1"))?;
            let w2 = linear_no_bias(intermediate_sz, hidden_sz, vb.pp("w2"))?;
            let w3 = linear_no_bias(hidden_sz, intermediate_sz, vb.pp("w3"))?;
            Ok(Self { w1, w2, w3, act_fn: Activation::Silu })
        }
    }

    impl Module for BlockSparseTop2MLP {
        fn forward(&self, xs: &Tensor) -> Result<Tensor> {
            let lhs = xs.apply(&self.w1)?.apply(&self.act_fn)?;
            let rhs = xs.apply(&self.w3)?;
            (lhs * rhs)?.apply(&self.w2)
        }
    }

    #[derive(Debug, Clone)]
    pub struct SparseMoeBlock {
        gate: Linear,
        experts: Vec<BlockSparseTop2MLP>,
        num_experts_per_tok: usize,
    }

    impl SparseMoeBlock {
        pub fn new(hidden: usize, ffn: usize, num_local_experts: usize, num_experts_per_tok: usize, vb: VarBuilder) -> Result<Self> {
            let gate = linear_no_bias(hidden, num_local_experts, vb.pp("gate"))?;
            let mut experts = Vec::with_capacity(num_local_experts);
            let vb = vb.pp("experts");
            for idx in 0..num_local_experts {
                let expert = BlockSparseTop2MLP::new(hidden, ffn, vb.pp(idx))?;
                experts.push(expert)
            }
            Ok(SparseMoeBlock { gate, experts, num_experts_per_tok })
        }
    }

    impl Module for SparseMoeBlock {
        fn forward(&self, xs: &Tensor) -> Result<Tensor> {
            let (b_size, seq_len, hidden_dim) = xs.dims3()?;
            let xs = xs.reshape(((), hidden_dim))?;
            let router_logits = xs.apply(&self.gate)?;
            let routing_weights = candle_nn::ops::softmax_last_dim(&router_logits)?;
            let routing_weights = routing_weights.to_dtype(DType::F32)?.to_vec2::<f32>()?;
            let mut top_x = vec![vec![]; self.experts.len()];
            let mut selected_rws = vec![vec![]; self.experts.len()];
            for (row_idx, rw) in routing_weights.iter().enumerate() {
                let mut dst = (0..rw.len() as u32).collect::<Vec<u32>>();
                dst.sort_by(|&i, &j| rw[j as usize].total_cmp(&rw[i as usize]));
                let mut sum_routing_weights = 0f32;
                for &expert_idx in dst.iter().take(self.num_experts_per_tok) {
                    let expert_idx = expert_idx as usize;
                    let routing_weight = rw[expert_idx];
                    sum_routing_weights += routing_weight;
                    top_x[expert_idx].push(row_idx as u32);
                }
                for &expert_idx in dst.iter().take(self.num_experts_per_tok) {
                    let expert_idx = expert_idx as usize;
                    let routing_weight = rw[expert_idx];
                    selected_rws[expert_idx].push(routing_weight / sum_routing_weights)
                }
            }
            let mut ys = xs.zeros_like()?;
            for (expert_idx, expert_layer) in self.experts.iter().enumerate() {
                let top_x = &top_x[expert_idx];
                if top_x.is_empty() {
                    continue;
                }
                let top_x = Tensor::new(top_x.as_slice(), xs.device())?;
                let selected_rws = Tensor::new(selected_rws[expert_idx].as_slice(), xs.device())?.reshape(((), 1))?;
                let current_state = xs.index_select(&top_x, 0)?.reshape(((), hidden_dim))?;
                let current_hidden_states = expert_layer.forward(&current_state)?;
                let current_hidden_states = current_hidden_states.broadcast_mul(&selected_rws)?;
                ys = ys.index_add(&top_x, &current_hidden_states, 0)?;
            }
            let ys = ys.reshape((b_size, seq_len, hidden_dim))?;
            Ok(ys)
        }
    }
}

use mixtral_block::SparseMoeBlock;

/// One size: the three implementations and the shared input.
struct Case {
    experts: usize,
    moe: MoeLayer,
    dense: Expert,
    mixtral: SparseMoeBlock,
    x: Tensor,
}

fn setup(experts: usize, device: &Device) -> Case {
    let mut config = moe_audit::config::preset("mixtral").expect("mixtral preset").config().expect("mixtral preset parses");
    config.experts = experts;
    assert_eq!(config.k(), TOP_K);

    let tensors: HashMap<String, Tensor> =
        seeded_weights(LayerDims { hidden: HIDDEN, ffn: FFN, experts }, LAYER_SEED, device).expect("seeded layer weights");
    let mixtral_vb = VarBuilder::from_tensors(tensors.clone(), DType::F32, device);
    let mixtral = SparseMoeBlock::new(HIDDEN, FFN, experts, TOP_K, mixtral_vb).expect("mixtral block");
    let moe = MoeLayer::from_tensors(config, tensors, DType::F32, device).expect("moe layer");

    let dense_tensors = seeded_weights(LayerDims { hidden: HIDDEN, ffn: TOP_K * FFN, experts: 1 }, DENSE_SEED, device)
        .expect("seeded dense weights");
    let dense_vb = VarBuilder::from_tensors(dense_tensors, DType::F32, device);
    let dense = Expert::new(HIDDEN, TOP_K * FFN, dense_vb.pp("experts.0")).expect("dense expert");

    let x = Seeded::new(INPUT_SEED).normal(&[BATCH, SEQ, HIDDEN], device).expect("seeded input");

    // Same weights, same routing rule: the outputs must agree up to float summation order.
    let (ours, _) = moe.forward(&x).expect("moe forward");
    let theirs = mixtral.forward(&x).expect("mixtral forward");
    let scale = theirs.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    let diff = (&ours - &theirs).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    assert!(diff <= 1e-4 * scale.max(1e-3), "E={experts}: MoeLayer and Mixtral SparseMoeBlock differ: max |diff| {diff:e}, max |y| {scale:e}");
    eprintln!("E={experts}: MoeLayer vs Mixtral SparseMoeBlock max |diff| {diff:.3e} (max |y| {scale:.3e})");

    Case { experts, moe, dense, mixtral, x }
}

/// The dense ceiling on `[batch, seq, hidden]` (our experts take `[tokens, hidden]`).
fn dense_forward(dense: &Expert, x: &Tensor) -> candle_core::Result<Tensor> {
    let (b, s, h) = x.dims3()?;
    dense.forward(&x.reshape((b * s, h))?)?.reshape((b, s, h))
}

fn bench_layer(c: &mut Criterion) {
    let device = Device::Cpu;
    for experts in SIZES {
        let case = setup(experts, &device);
        let mut group = c.benchmark_group(format!("layer/E{}", case.experts));
        group
            .sampling_mode(SamplingMode::Flat)
            .sample_size(10)
            .warm_up_time(Duration::from_secs(1))
            .measurement_time(Duration::from_secs(3))
            .throughput(Throughput::Elements((BATCH * SEQ) as u64));
        group.bench_function("moe", |b| b.iter(|| case.moe.forward(&case.x).unwrap()));
        group.bench_function("dense", |b| b.iter(|| dense_forward(&case.dense, &case.x).unwrap()));
        group.bench_function("mixtral", |b| b.iter(|| case.mixtral.forward(&case.x).unwrap()));
        group.finish();
    }
}

criterion_group!(benches, bench_layer);
criterion_main!(benches);
