//! The router trait: two stages, so probes can test each on its own.
//!
//! 1. **scores**: hidden states through the gate matrix to logits, on any device and dtype;
//! 2. **assignment**: logits of one call to a [`Routing`], exact, on the host in `f32`.

use crate::config::RouterConfig;
use crate::error::{Error, Result};
use crate::routing::{assign, Logits, Routing};
use candle_core::{DType, Module, Tensor};
use candle_nn::{Linear, VarBuilder};
use ndarray::ArrayView3;

/// Anything that routes tokens to experts. The analyzer sees routers only through this trait.
pub trait Router: Send + Sync {
    /// Name used in records and reports.
    fn name(&self) -> &str;
    /// Number of experts E.
    fn experts(&self) -> usize;
    /// Stage 1: gate logits.
    ///
    /// # Shapes
    /// `hidden`: `[batch, seq_len, hidden]` → `[batch, seq_len, experts]`, same dtype and device.
    fn scores(&self, hidden: &Tensor) -> Result<Tensor>;
    /// Stage 2: the routing decisions for a score matrix.
    ///
    /// # Shapes
    /// `logits`: `[batch, seq_len, experts]`.
    fn assign(&self, logits: ArrayView3<f32>) -> Result<Routing>;
    /// Both stages.
    fn route(&self, hidden: &Tensor) -> Result<Routing> {
        self.assign(logits_to_host(&self.scores(hidden)?)?.view())
    }
}

/// Copies device logits of any float dtype to the host as `f32`, where assignment runs.
pub fn logits_to_host(logits: &Tensor) -> Result<Logits> {
    let (b, s, e) = logits.dims3()?;
    let data = logits.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    Ok(Logits::from_shape_vec((b, s, e), data).expect("dims3 matches the element count"))
}

/// A built-in router: a validated [`RouterConfig`] and a bias-free gate matrix `[experts, hidden]`.
#[derive(Debug, Clone)]
pub struct ConfigRouter {
    config: RouterConfig,
    gate: Linear,
}

impl ConfigRouter {
    /// Builds the router with the gate weight `weight` (`[experts, hidden]`) from `vb`.
    pub fn new(config: RouterConfig, hidden: usize, vb: VarBuilder) -> Result<Self> {
        let weight = vb.get((config.experts, hidden), "weight").map_err(|e| shape_error(&config, e))?;
        Ok(Self { config, gate: Linear::new(weight, None) })
    }

    /// The configuration this router follows.
    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    /// The gate matrix `[experts, hidden]`.
    pub fn gate_weight(&self) -> &Tensor {
        self.gate.weight()
    }
}

fn shape_error(config: &RouterConfig, e: candle_core::Error) -> Error {
    Error::shape(&format!("gate of router `{}`", config.name), e.to_string())
}

impl Router for ConfigRouter {
    fn name(&self) -> &str {
        &self.config.name
    }

    fn experts(&self) -> usize {
        self.config.experts
    }

    fn scores(&self, hidden: &Tensor) -> Result<Tensor> {
        let (_, _, h) = hidden.dims3()?;
        let (e, gh) = self.gate.weight().dims2()?;
        if h != gh {
            return Err(Error::shape(
                &format!("gate of router `{}`", self.config.name),
                format!("hidden size {h} does not match the gate's [{e}, {gh}]"),
            ));
        }
        Ok(self.gate.forward(hidden)?)
    }

    fn assign(&self, logits: ArrayView3<f32>) -> Result<Routing> {
        assign(&self.config, logits)
    }
}
