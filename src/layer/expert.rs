//! One SwiGLU expert: `w2(silu(w1 x) * w3 x)`, Mixtral's expert MLP.

use super::cpu::{self, with_cpu_f32};
use crate::error::Result;
use candle_core::{Device, Module, Tensor, D};
use candle_nn::VarBuilder;

/// A SwiGLU feed-forward expert. `w1` and `w3` are stored fused (`[2*ffn, hidden]`) so one
/// matmul computes both projections.
///
/// The weights stay `[out, in]` and enter the matmul transposed (`x · Wᵀ`, as
/// `candle_nn::Linear` does): for the few rows an expert sees, that is the layout the CPU
/// kernel reads fastest (BENCHMARKS.md).
#[derive(Debug, Clone)]
pub struct Expert {
    w13: Tensor,
    w2: Tensor,
    ffn: usize,
}

impl Expert {
    /// Loads `w1.weight` `[ffn, hidden]`, `w3.weight` `[ffn, hidden]` and `w2.weight`
    /// `[hidden, ffn]` from `vb`.
    pub fn new(hidden: usize, ffn: usize, vb: VarBuilder) -> Result<Self> {
        let w1 = vb.get((ffn, hidden), "w1.weight")?;
        let w3 = vb.get((ffn, hidden), "w3.weight")?;
        let w2 = vb.get((hidden, ffn), "w2.weight")?;
        Ok(Self { w13: Tensor::cat(&[&w1, &w3], 0)?, w2: w2.contiguous()?, ffn })
    }

    /// [`Module::forward`], bit for bit, for callers that already run experts as parallel
    /// tasks: in f32 on the CPU it runs on the calling thread (the host path of `cpu.rs`);
    /// anything else goes through candle's ops.
    ///
    /// # Shapes
    /// `x`: `[tokens, hidden]` → `[tokens, hidden]`.
    pub fn forward_on_this_thread(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (tokens, hidden) = x.dims2()?;
        if hidden == self.w2.dim(0)? {
            if let Some(y) = with_cpu_f32(x, |x| self.forward_host(x, tokens)).flatten() {
                return Tensor::from_vec(y, (tokens, hidden), &Device::Cpu);
            }
        }
        self.forward(x)
    }

    /// The expert on `tokens` host rows (`[tokens, hidden]`, row-major) on the calling thread;
    /// `None` unless the weights are f32 on the CPU.
    pub(super) fn forward_host(&self, x: &[f32], tokens: usize) -> Option<Vec<f32>> {
        with_cpu_f32(&self.w13, |w13| with_cpu_f32(&self.w2, |w2| cpu::swiglu(x, tokens, w13, w2, self.ffn))).flatten()
    }
}

impl Module for Expert {
    /// # Shapes
    /// `x`: `[tokens, hidden]` → `[tokens, hidden]`.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = x.matmul(&self.w13.t()?)?;
        let gate = h.narrow(D::Minus1, 0, self.ffn)?;
        let up = h.narrow(D::Minus1, self.ffn, self.ffn)?;
        (candle_nn::ops::silu(&gate)? * up)?.matmul(&self.w2.t()?)
    }
}
