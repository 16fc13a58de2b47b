//! The MoE layer on candle: gate → routing → dispatch → SwiGLU experts → combine.
//!
//! Dispatch gathers every expert's kept rows (padding slots included) in one `index_select`;
//! combine adds the weighted outputs back with one `index_add` in ascending expert order, so
//! each token's sum has a fixed order (deterministic, and reproducible by expert-parallel code).
//! f32 on the CPU takes the same steps on host memory (`cpu.rs`) with the experts' weights packed
//! once at load (`kernel.rs`): the same results up to the matmuls' summation order.

mod cpu;
mod estimate;
mod expert;
pub mod gate;
pub mod kernel;
mod weights;

pub use estimate::CallSizes;
pub use expert::Expert;
pub use kernel::Kernel;
use weights::infer_dims;
pub use weights::{load_safetensors, seeded_weights, LayerDims, Seeded};

use crate::config::RouterConfig;
use crate::error::{excerpt_long, Error, Result};
use crate::router::{ConfigRouter, Router};
use crate::routing::Routing;
use crate::MemoryBudget;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::VarBuilder;
use rayon::prelude::*;
use std::collections::HashMap;
use std::path::Path;

/// What a decoder layer of a model is: one concept for a model's layers over `moe-audit/3`
/// (`moe_audit::model`) and a routing record's layout (`moe_audit::records::config`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LayerKind {
    /// A routed (MoE) MLP.
    Moe,
    /// A dense MLP: no router.
    Dense,
    /// A multi-token-prediction layer after the backbone, with a router of its own.
    Mtp,
}

impl LayerKind {
    /// `moe`, `dense` or `mtp`.
    pub fn name(self) -> &'static str {
        match self {
            LayerKind::Moe => "moe",
            LayerKind::Dense => "dense",
            LayerKind::Mtp => "mtp",
        }
    }

    /// Whether the layer has a router (MoE or MTP).
    pub fn routed(self) -> bool {
        self != LayerKind::Dense
    }
}

/// A Mixture-of-Experts feed-forward layer: a router and E SwiGLU experts.
#[derive(Debug, Clone)]
pub struct MoeLayer {
    router: ConfigRouter,
    experts: Vec<Expert>,
    dims: LayerDims,
}

impl MoeLayer {
    /// Builds the layer from Mixtral-style names under `vb` (`gate.weight`, `experts.{i}.w1.weight`, ...).
    pub fn new(config: RouterConfig, hidden: usize, ffn: usize, vb: VarBuilder) -> Result<Self> {
        let dims = LayerDims { hidden, ffn, experts: config.experts };
        let experts = (0..config.experts)
            .map(|i| Expert::new(hidden, ffn, vb.pp(format!("experts.{i}"))))
            .collect::<Result<Vec<_>>>()?;
        let router = ConfigRouter::new(config, hidden, vb.pp("gate"))?;
        Ok(Self { router, experts, dims })
    }

    /// Builds the layer from named tensors, cast to `dtype`.
    pub fn from_tensors(
        config: RouterConfig,
        tensors: HashMap<String, Tensor>,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let dims = infer_dims(&tensors, &format!("weights of router `{}`", config.name))?;
        if dims.experts != config.experts {
            return Err(Error::shape(
                &format!("weights of router `{}`", config.name),
                format!("gate.weight has {} experts, the router config has {}", dims.experts, config.experts),
            ));
        }
        let vb = VarBuilder::from_tensors(tensors, dtype, device);
        Self::new(config, dims.hidden, dims.ffn, vb)
    }

    /// Seeded weights (see [`seeded_weights`]); the same seed gives the same layer on every run.
    pub fn seeded(
        config: RouterConfig,
        hidden: usize,
        ffn: usize,
        seed: u64,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let tensors = seeded_weights(LayerDims { hidden, ffn, experts: config.experts }, seed, device)?;
        Self::from_tensors(config, tensors, dtype, device)
    }

    /// Loads Mixtral-style weights from a safetensors file within the memory limit `budget`
    /// (see [`crate::MemoryBudget`]): the file may hold half of it (it is read whole, then its
    /// tensors are a second copy), and the tensors as stored plus their copies in `dtype` (and,
    /// in f32, the experts' packed copy) must fit before they are converted.
    pub fn from_safetensors(
        config: RouterConfig,
        path: &Path,
        dtype: DType,
        device: &Device,
        budget: MemoryBudget,
    ) -> Result<Self> {
        let tensors = load_safetensors(path, device, budget.tensors())?;
        let (stored, converted) = tensors.values().fold((0u64, 0u64), |(s, c), t| {
            let n = t.elem_count() as u64;
            (
                s.saturating_add(n.saturating_mul(t.dtype().size_in_bytes() as u64)),
                c.saturating_add(n.saturating_mul(dtype.size_in_bytes() as u64)),
            )
        });
        let packed = match (dtype, infer_dims(&tensors, &path.display().to_string())) {
            (DType::F32, Ok(d)) => (d.experts as u64).saturating_mul(Expert::bytes_f32(d.hidden, d.ffn)),
            _ => 0,
        };
        budget.ensure_fits(
            &format!("the weights in {}", path.display()),
            stored.saturating_add(converted).saturating_add(packed),
        )?;
        Self::from_tensors(config, tensors, dtype, device).map_err(|e| Error::input(path, excerpt_long(&e)))
    }

    /// The router (gate + assignment).
    pub fn router(&self) -> &ConfigRouter {
        &self.router
    }

    /// One step of the router's state (a balancing bias, thresholds) between training batches;
    /// the router's kind decides what moves ([`crate::RouterConfig::step`]).
    pub fn step(&mut self, batch: &crate::routing::StepBatch) -> Result<()> {
        self.router.step(batch)
    }

    /// The experts, by id.
    pub fn experts(&self) -> &[Expert] {
        &self.experts
    }

    /// Layer sizes.
    pub fn dims(&self) -> LayerDims {
        self.dims
    }

    /// Routes `x` and runs the experts.
    ///
    /// # Shapes
    /// `x`: `[batch, seq_len, hidden]` → `y`: `[batch, seq_len, hidden]`, same dtype and device.
    pub fn forward(&self, x: &Tensor) -> Result<(Tensor, Routing)> {
        let routing = self.router.route(x)?;
        let y = self.apply(x, &routing)?;
        Ok((y, routing))
    }

    /// Dispatch, experts and combine for a given routing: each token's output is the sum over
    /// its kept routes of weight × expert(x); dropped routes contribute nothing.
    ///
    /// # Shapes
    /// `x`: `[batch, seq_len, hidden]` → `[batch, seq_len, hidden]`.
    pub fn apply(&self, x: &Tensor, routing: &Routing) -> Result<Tensor> {
        let (b, s, h) = x.dims3()?;
        if (b, s) != (routing.batch, routing.seq_len) || h != self.dims.hidden {
            return Err(Error::shape(
                "MoE layer",
                format!(
                    "input [{b}, {s}, {h}] does not match routing [{}, {}] and hidden size {}",
                    routing.batch, routing.seq_len, self.dims.hidden
                ),
            ));
        }
        let x = x.reshape((b * s, h))?;
        let rows = routing.expert_rows();
        if rows.iter().all(Vec::is_empty) {
            return Ok(x.zeros_like()?.reshape((b, s, h))?);
        }
        if let Some(y) =
            cpu::with_cpu_f32(&x, |x| cpu::apply(kernel::Kernel::selected(), &self.experts, x, h, &rows)).flatten()
        {
            return Ok(Tensor::from_vec(y, (b, s, h), x.device())?);
        }
        let (index, weight): (Vec<u32>, Vec<f32>) = rows.iter().flatten().map(|&(t, w)| (t as u32, w)).unzip();
        let device = x.device();
        let index = Tensor::new(index.as_slice(), device)?;
        let weight = Tensor::new(weight.as_slice(), device)?.to_dtype(x.dtype())?.unsqueeze(1)?;
        let gathered = x.index_select(&index, 0)?;
        // (expert, first row, rows) of every busy expert, in ascending expert id.
        let mut slices = Vec::with_capacity(self.experts.len());
        let mut start = 0;
        for (e, rows) in rows.iter().enumerate().filter(|(_, r)| !r.is_empty()) {
            slices.push((e, start, rows.len()));
            start += rows.len();
        }
        let run = |&(e, start, len): &(usize, usize, usize)| self.experts[e].forward(&gathered.narrow(0, start, len)?);
        // Other dtypes on the CPU (f32 took the host path): experts side by side as parallel tasks.
        let outputs: Vec<Tensor> = if device.is_cpu() {
            slices.par_iter().map(run).collect::<candle_core::Result<_>>()?
        } else {
            slices.iter().map(run).collect::<candle_core::Result<_>>()?
        };
        let weighted = Tensor::cat(&outputs, 0)?.broadcast_mul(&weight)?;
        Ok(x.zeros_like()?.index_add(&index, &weighted, 0)?.reshape((b, s, h))?)
    }
}
