//! The layer-cost setup shared by `benches/layer.rs` and `examples/layer_cost.rs`: our layer and
//! its references on the same weights and input.
//!
//! * `moe`: our [`MoeLayer`] with the Mixtral preset (softmax, top-2, renormalised, dropless);
//! * `dense`: one dense SwiGLU FFN of size k × FFN on every token (the same active FLOPs) through
//!   our kernel (`Expert`'s `Module::forward`: packed weights, row blocks over the pool);
//! * `dense_candle`: the same FFN through candle's ops (three `candle_nn::Linear`): the FFN a
//!   candle model runs;
//! * `mixtral`: the algorithm of candle-transformers 0.11's Mixtral `SparseMoeBlock` (the common
//!   Rust baseline). That type and its config fields are private upstream, so it is written out
//!   here: softmax on the device, top-2 per row on the host by sorting, then per expert an
//!   `index_select` of its tokens, three `candle_nn::Linear` (`w1`, `w3`, `w2`, `x·Wᵀ`), a scale,
//!   and an `index_add` into a fresh output.
//!
//! The PyTorch references (Hugging Face's Mixtral block and the dense FFN) are
//! `benches/torch_block.py`, which `examples/layer_cost.rs --torch` times beside these.
//!
//! T = 2048 tokens (batch 1 × seq 2048), H 512, expert FFN 1024, k 2, E 8 and E 64.

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Linear, VarBuilder};
use moe_audit::layer::{seeded_weights, Expert, LayerDims, MoeLayer, Seeded};

pub const BATCH: usize = 1;
pub const SEQ: usize = 2048;
pub const HIDDEN: usize = 512;
pub const FFN: usize = 1024;
pub const TOP_K: usize = 2;
pub const SIZES: [usize; 2] = [8, 64];

type BoxResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// `w1`, `w3`, `w2` of one SwiGLU FFN as candle `Linear`s, named as Mixtral names them under `vb`.
fn swiglu_linears(vb: &VarBuilder, prefix: &str, ffn: usize) -> candle_core::Result<[Linear; 3]> {
    let w = |n: &str, shape| vb.get(shape, &format!("{prefix}.{n}.weight")).map(|w| Linear::new(w, None));
    Ok([w("w1", (ffn, HIDDEN))?, w("w3", (ffn, HIDDEN))?, w("w2", (HIDDEN, ffn))?])
}

/// `w2(silu(w1 x) * w3 x)` through candle's ops.
fn swiglu_candle([w1, w3, w2]: &[Linear; 3], x: &Tensor) -> candle_core::Result<Tensor> {
    w2.forward(&(candle_nn::ops::silu(&w1.forward(x)?)? * w3.forward(x)?)?)
}

/// The Mixtral block's algorithm (see the module docs).
pub struct MixtralBlock {
    gate: Linear,
    experts: Vec<[Linear; 3]>,
}

impl MixtralBlock {
    fn new(experts: usize, vb: &VarBuilder) -> candle_core::Result<Self> {
        let gate = Linear::new(vb.get((experts, HIDDEN), "gate.weight")?, None);
        let experts = (0..experts)
            .map(|i| swiglu_linears(vb, &format!("experts.{i}"), FFN))
            .collect::<candle_core::Result<_>>()?;
        Ok(Self { gate, experts })
    }

    /// # Shapes
    /// `x`: `[batch, seq, hidden]` → `[batch, seq, hidden]`.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (b, s, h) = x.dims3()?;
        let xs = x.reshape((b * s, h))?;
        let probs = candle_nn::ops::softmax_last_dim(&self.gate.forward(&xs)?)?.to_vec2::<f32>()?;
        let mut rows: Vec<Vec<u32>> = vec![Vec::new(); self.experts.len()];
        let mut weights: Vec<Vec<f32>> = vec![Vec::new(); self.experts.len()];
        for (t, p) in probs.iter().enumerate() {
            let mut order: Vec<usize> = (0..p.len()).collect();
            order.sort_by(|&i, &j| p[j].total_cmp(&p[i]));
            let top = &order[..TOP_K];
            let sum: f32 = top.iter().map(|&e| p[e]).sum();
            for &e in top {
                rows[e].push(t as u32);
                weights[e].push(p[e] / sum);
            }
        }
        let mut ys = xs.zeros_like()?;
        for (e, expert) in self.experts.iter().enumerate() {
            if rows[e].is_empty() {
                continue;
            }
            let index = Tensor::new(rows[e].as_slice(), xs.device())?;
            let weight = Tensor::new(weights[e].as_slice(), xs.device())?.unsqueeze(1)?;
            let xe = xs.index_select(&index, 0)?;
            let ye = swiglu_candle(expert, &xe)?;
            ys = ys.index_add(&index, &ye.broadcast_mul(&weight)?, 0)?;
        }
        ys.reshape((b, s, h))
    }
}

/// One size: the implementations and the shared input.
pub struct LayerCase {
    pub moe: MoeLayer,
    pub dense: Expert,
    pub dense_candle: [Linear; 3],
    pub mixtral: MixtralBlock,
    pub x: Tensor,
    /// max |moe − mixtral| / max |mixtral| (candle's ops: the layer before our kernel).
    pub moe_diff: f32,
    /// The same for the dense FFN on our kernel against candle's.
    pub dense_diff: f32,
}

/// max |a − b| / max |b|.
fn relative_diff(a: &Tensor, b: &Tensor) -> candle_core::Result<f32> {
    let scale = b.abs()?.max_all()?.to_scalar::<f32>()?;
    Ok((a - b)?.abs()?.max_all()?.to_scalar::<f32>()? / scale.max(1e-3))
}

impl LayerCase {
    /// Seeded weights and input; checks that our output equals the Mixtral block's.
    pub fn new(experts: usize, device: &Device) -> BoxResult<Self> {
        let mut config = moe_audit::config::preset("mixtral").ok_or("no mixtral preset")?.config()?;
        config.experts = experts;
        let tensors = seeded_weights(LayerDims { hidden: HIDDEN, ffn: FFN, experts }, 0, device)?;
        let mixtral = MixtralBlock::new(experts, &VarBuilder::from_tensors(tensors.clone(), DType::F32, device))?;
        let moe = MoeLayer::from_tensors(config, tensors, DType::F32, device)?;
        let dense_tensors = seeded_weights(LayerDims { hidden: HIDDEN, ffn: TOP_K * FFN, experts: 1 }, 1, device)?;
        let dense_vb = VarBuilder::from_tensors(dense_tensors, DType::F32, device);
        let dense = Expert::new(HIDDEN, TOP_K * FFN, dense_vb.pp("experts.0"))?;
        let dense_candle = swiglu_linears(&dense_vb, "experts.0", TOP_K * FFN)?;
        let x = Seeded::new(2).normal(&[BATCH, SEQ, HIDDEN], device)?;

        // Same weights, same rule: the outputs agree up to float summation order.
        let mut case = Self { moe, dense, dense_candle, mixtral, x, moe_diff: 0.0, dense_diff: 0.0 };
        case.moe_diff = relative_diff(&case.moe()?, &case.mixtral()?)?;
        case.dense_diff = relative_diff(&case.dense()?, &case.dense_candle()?)?;
        for (what, diff) in [("MoeLayer and the Mixtral block", case.moe_diff), ("the dense FFNs", case.dense_diff)] {
            if diff > 1e-4 {
                return Err(format!("E={experts}: {what} differ: max |diff| is {diff:e} of max |y|").into());
            }
        }
        Ok(case)
    }

    pub fn moe(&self) -> candle_core::Result<Tensor> {
        self.moe.forward(&self.x).map(|(y, _)| y).map_err(|e| candle_core::Error::Msg(e.to_string()))
    }

    /// The dense FFN on our kernel, on `[batch, seq, hidden]` (experts take `[tokens, hidden]`).
    pub fn dense(&self) -> candle_core::Result<Tensor> {
        let (b, s, h) = self.x.dims3()?;
        self.dense.forward(&self.x.reshape((b * s, h))?)?.reshape((b, s, h))
    }

    /// The same FFN through candle's ops.
    pub fn dense_candle(&self) -> candle_core::Result<Tensor> {
        swiglu_candle(&self.dense_candle, &self.x)
    }

    pub fn mixtral(&self) -> candle_core::Result<Tensor> {
        self.mixtral.forward(&self.x)
    }
}
