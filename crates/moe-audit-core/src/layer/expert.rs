//! One SwiGLU expert: `w2(silu(w1 x) * w3 x)`, Mixtral's expert MLP.

use super::cpu::{self, with_cpu_f32, Scratch};
use super::kernel::{self, Kernel, PackedMatrix, PackedRows};
use crate::error::Result;
use candle_core::{Device, Module, Tensor, D};
use candle_nn::VarBuilder;
use rayon::prelude::*;

/// A SwiGLU feed-forward expert. Packed, `w1` and `w3` are run tile by tile side by side (the
/// gate's activation applied as each tile comes out); as tensors they are stored fused
/// (`[2*ffn, hidden]`) so one matmul computes both projections.
///
/// In f32 on the CPU the weights are packed once, here, into the host kernel's panels
/// (`kernel.rs`), so that no forward packs them; they are kept in that form only. Any other
/// dtype or device keeps candle tensors `[out, in]` that enter the matmul transposed (`x · Wᵀ`,
/// as `candle_nn::Linear` does).
#[derive(Debug, Clone)]
pub struct Expert {
    weights: Weights,
    hidden: usize,
    ffn: usize,
}

#[derive(Debug, Clone)]
enum Weights {
    /// f32 on the CPU.
    Packed {
        w1: PackedMatrix,
        w3: PackedMatrix,
        w2: PackedMatrix,
    },
    Tensors {
        w13: Tensor,
        w2: Tensor,
    },
}

impl Expert {
    /// Loads `w1.weight` `[ffn, hidden]`, `w3.weight` `[ffn, hidden]` and `w2.weight`
    /// `[hidden, ffn]` from `vb`.
    pub fn new(hidden: usize, ffn: usize, vb: VarBuilder) -> Result<Self> {
        let w1 = vb.get((ffn, hidden), "w1.weight")?;
        let w3 = vb.get((ffn, hidden), "w3.weight")?;
        let w2 = vb.get((hidden, ffn), "w2.weight")?;
        let (w1, w3, w2) = (w1.contiguous()?, w3.contiguous()?, w2.contiguous()?);
        let pack = |w: &Tensor, n, k| with_cpu_f32(w, |w| PackedMatrix::pack(w, n, k));
        let weights = match (pack(&w1, ffn, hidden), pack(&w3, ffn, hidden), pack(&w2, hidden, ffn)) {
            (Some(w1), Some(w3), Some(w2)) => Weights::Packed { w1, w3, w2 },
            _ => Weights::Tensors { w13: Tensor::cat(&[&w1, &w3], 0)?, w2 },
        };
        Ok(Self { weights, hidden, ffn })
    }

    /// Bytes an expert of these sizes holds in f32 on the CPU (its packed weights).
    pub(crate) fn bytes_f32(hidden: usize, ffn: usize) -> u64 {
        PackedMatrix::bytes_for(ffn, hidden).saturating_mul(2).saturating_add(PackedMatrix::bytes_for(hidden, ffn))
    }

    /// [`Module::forward`] for callers that already run experts as parallel tasks: with packed
    /// weights it runs on the calling thread; anything else goes through candle's ops.
    ///
    /// # Shapes
    /// `x`: `[tokens, hidden]` → `[tokens, hidden]`.
    pub fn forward_on_this_thread(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match &self.weights {
            Weights::Packed { .. } => {
                self.forward_host(x, |tokens, x| self.swiglu_rows(&mut Scratch::default(), x, 0..tokens))
            }
            Weights::Tensors { .. } => self.forward(x),
        }
    }

    /// The expert on packed rows on the calling thread (`[rows, hidden]`, row-major out), its
    /// hidden activations in `act`; `None` unless the weights are packed (f32 on the CPU).
    pub(super) fn forward_packed(&self, kernel: Kernel, x: &PackedRows, act: &mut PackedRows) -> Option<Vec<f32>> {
        match &self.weights {
            Weights::Packed { w1, w3, w2 } => {
                kernel::swiglu_hidden(kernel, x, w1, w3, act);
                Some(kernel::matmul(kernel, act, w2))
            }
            Weights::Tensors { .. } => None,
        }
    }

    /// Rows `rows` of host `x` (`[_, hidden]`) through the packed expert.
    fn swiglu_rows(&self, scratch: &mut Scratch, x: &[f32], rows: std::ops::Range<usize>) -> Vec<f32> {
        scratch.run(Kernel::selected(), self, x, self.hidden, rows).expect("called with packed weights")
    }

    /// Runs `f(tokens, values)` on `x` as a contiguous f32 CPU tensor; an error for any other
    /// input (the weights are f32 on the CPU).
    fn forward_host(&self, x: &Tensor, f: impl FnOnce(usize, &[f32]) -> Vec<f32>) -> candle_core::Result<Tensor> {
        let (tokens, hidden) = x.dims2()?;
        if hidden != self.hidden {
            return Err(candle_core::Error::Msg(format!(
                "expert input has {hidden} features, the expert takes {}",
                self.hidden
            )));
        }
        let x = x.contiguous()?;
        let y = with_cpu_f32(&x, |x| f(tokens, x)).ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "the expert's weights are f32 on the CPU, its input is {:?} on {:?}",
                x.dtype(),
                x.device().location()
            ))
        })?;
        Tensor::from_vec(y, (tokens, hidden), &Device::Cpu)
    }
}

impl Module for Expert {
    /// With packed weights: the rows in blocks over the thread pool, each block on the host
    /// kernel; otherwise candle's ops.
    ///
    /// # Shapes
    /// `x`: `[tokens, hidden]` → `[tokens, hidden]`.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match &self.weights {
            Weights::Packed { .. } => self.forward_host(x, |tokens, x| {
                let block = cpu::task_rows(tokens).min(tokens.div_ceil(rayon::current_num_threads()).max(1));
                let starts: Vec<usize> = (0..tokens).step_by(block).collect();
                let blocks: Vec<Vec<f32>> = starts
                    .into_par_iter()
                    .map_init(Scratch::default, |scratch, s| self.swiglu_rows(scratch, x, s..(s + block).min(tokens)))
                    .collect();
                blocks.concat()
            }),
            Weights::Tensors { w13, w2 } => {
                let h = x.matmul(&w13.t()?)?;
                let gate = h.narrow(D::Minus1, 0, self.ffn)?;
                let up = h.narrow(D::Minus1, self.ffn, self.ffn)?;
                (candle_nn::ops::silu(&gate)? * up)?.matmul(&w2.t()?)
            }
        }
    }
}
