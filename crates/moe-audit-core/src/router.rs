//! The router trait: two stages, so probes can test each on its own.
//!
//! 1. **scores**: hidden states through the gate matrix to logits, on any device and dtype;
//! 2. **assignment**: logits of one call to a [`Routing`], exact, on the host in `f32`.

use crate::config::RouterConfig;
use crate::error::{Error, Result};
use crate::routing::{assign, assign_masked, assign_routes, Logits, Routing};
use candle_core::{DType, Module, Tensor};
use candle_nn::{Linear, VarBuilder};
use ndarray::{ArrayView2, ArrayView3};

/// Anything that routes tokens to experts. The analyzer sees routers only through this trait.
pub trait Router: Send + Sync {
    /// Name used in records and reports.
    fn name(&self) -> &str;
    /// Number of experts E.
    fn experts(&self) -> usize;
    /// Hidden size the score stage takes; `None` for a router fed logits directly.
    fn hidden_size(&self) -> Option<usize> {
        None
    }
    /// The built-in configuration, when the router has one (witnesses then replay from it).
    fn config(&self) -> Option<&RouterConfig> {
        None
    }
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
    /// Whether [`Router::assign_masked`] takes a padding mask.
    fn accepts_padding_mask(&self) -> bool {
        false
    }
    /// Stage 2 with a padding mask (`true` = padding).
    ///
    /// # Shapes
    /// `logits`: `[batch, seq_len, experts]`; `padding`: `[batch, seq_len]`.
    fn assign_masked(&self, logits: ArrayView3<f32>, padding: ArrayView2<bool>) -> Result<Routing> {
        let _ = (logits, padding);
        Err(Error::shape(&format!("router `{}`", self.name()), "the router takes no padding mask"))
    }
    /// Stage 2 when only the routes matter (the analyzer's comparisons): the routes of
    /// [`Router::assign`] (with a mask, [`Router::assign_masked`]); `stats` may be left at zero.
    /// The default computes everything; built-in routers skip the load statistics.
    fn assign_routes(&self, logits: ArrayView3<f32>, padding: Option<ArrayView2<bool>>) -> Result<Routing> {
        match padding {
            Some(mask) => self.assign_masked(logits, mask),
            None => self.assign(logits),
        }
    }
    /// Whether routing the first `t + 1` positions of each of `batch` sequences (no padding
    /// mask) gives exactly this router's routing of the whole call restricted to them, for
    /// every t. The prefix probe routes a few prefixes of such a router and derives the others
    /// ([`crate::routing::prefix_stable`]); `false`, the default, has every prefix routed.
    fn prefix_stable(&self, batch: usize) -> bool {
        let _ = batch;
        false
    }
    /// The router used when serving, if it differs from this one (`[inference]`).
    fn inference(&self) -> Result<Option<Box<dyn Router>>> {
        Ok(None)
    }
    /// Both stages.
    fn route(&self, hidden: &Tensor) -> Result<Routing> {
        self.assign(logits_to_host(&self.scores(hidden)?)?.view())
    }
    /// How the analyzer feeds a router that is not a gate on rows it can craft; `None`, the
    /// default: as a built-in router (see [`Hints`]).
    fn hints(&self) -> Option<&dyn Hints> {
        None
    }
}

/// What the analyzer needs to know only about routers fed hidden states or living elsewhere (a
/// subprocess, trace files, a real gate with real activations). Every method defaults to what
/// a built-in router needs, so such a router implements the few that differ and returns itself
/// from [`Router::hints`]. Routing needs none of them: the auditor reads them (with these
/// defaults for a router that gives none).
pub trait Hints: Send + Sync {
    /// Width of a row the assignment stage takes, when it is not E logits: H hidden values for
    /// a router that applies its own gate inside assignment (an external router with `input:
    /// hidden`).
    fn row_width(&self) -> Option<usize> {
        None
    }
    /// A row that wants expert `e` above all others, for targeted probes; `None`: the analyzer's
    /// own logit row (a large logit at `e`), which only fits a router fed logits.
    fn targeted_row(&self, e: usize) -> Option<Vec<f32>> {
        let _ = e;
        None
    }
    /// Hidden states `[batch, seq_len, hidden]` drawn from `seed` for the audit (real activations,
    /// say); `None`: standard normal, the default.
    fn draw_hidden(&self, shape: (usize, usize), seed: u64) -> Result<Option<Tensor>> {
        let _ = (shape, seed);
        Ok(None)
    }
    /// Whether calls may run concurrently. A router behind one subprocess answers calls one at a
    /// time, and must see them in a fixed order for the audit to stay deterministic.
    fn concurrent(&self) -> bool {
        true
    }
    /// Whether the router is audited in its serving mode, its [`Router::inference`] being the
    /// training one (an external router under `check --mode inference`): reports name the modes
    /// of the calls they compare by it.
    fn serving(&self) -> bool {
        false
    }
    /// Whether the adapter serving the router can seed its random draws from each request's
    /// seed with its option `seed_calls=True` (`Some(on)`), or has no such option (`None`):
    /// the advice for a random router names only what the adapter offers.
    fn seed_calls(&self) -> Option<bool> {
        None
    }
    /// The expert-parallel ranks of a layer that places each call's sequences over them itself
    /// (a router behind the protocol with `ranks`): its calls hold a multiple of it, and
    /// [`Hints::assign_placed`] chooses the placement. `None`: not such a layer.
    fn ranks(&self) -> Option<usize> {
        None
    }
    /// The routes of a call with sequence `b` on rank `placement[b]` (a balanced placement over
    /// [`Hints::ranks`]), for a comparison.
    ///
    /// # Shapes
    /// `logits`: `[batch, seq_len, width]`; `padding`: `[batch, seq_len]`; `placement`: `[batch]`.
    fn assign_placed(
        &self,
        logits: ArrayView3<f32>,
        padding: Option<ArrayView2<bool>>,
        placement: &[usize],
    ) -> Result<Routing> {
        let _ = (logits, padding, placement);
        Err(Error::invalid("the router places no sequences on ranks"))
    }
    /// How a router outside moe-audit introduced itself (its protocol handshake), when it did:
    /// its witnesses then store the calls as sent and replay against the live router.
    fn handshake(&self) -> Option<serde_json::Value> {
        None
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

    /// The same gate under another configuration (the `[inference]` one, say).
    pub fn with_config(&self, config: RouterConfig) -> Result<Self> {
        if config.experts != self.config.experts {
            return Err(Error::shape(
                &format!("router `{}`", config.name),
                format!("{} experts, the gate has {}", config.experts, self.config.experts),
            ));
        }
        Ok(Self { config, gate: self.gate.clone() })
    }

    /// One step of the router's state between training batches ([`RouterConfig::step`]).
    pub fn step(&mut self, batch: &crate::routing::StepBatch) -> Result<()> {
        self.config.step(batch)
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

    fn hidden_size(&self) -> Option<usize> {
        self.gate.weight().dims2().ok().map(|(_, h)| h)
    }

    fn config(&self) -> Option<&RouterConfig> {
        Some(&self.config)
    }

    fn assign(&self, logits: ArrayView3<f32>) -> Result<Routing> {
        assign(&self.config, logits)
    }

    fn accepts_padding_mask(&self) -> bool {
        self.config.padding_mask.is_some()
    }

    fn assign_masked(&self, logits: ArrayView3<f32>, padding: ArrayView2<bool>) -> Result<Routing> {
        assign_masked(&self.config, logits, Some(padding))
    }

    fn assign_routes(&self, logits: ArrayView3<f32>, padding: Option<ArrayView2<bool>>) -> Result<Routing> {
        assign_routes(&self.config, logits, padding)
    }

    fn prefix_stable(&self, batch: usize) -> bool {
        crate::routing::prefix_stable(&self.config, batch)
    }

    fn inference(&self) -> Result<Option<Box<dyn Router>>> {
        Ok(match self.config.inference_config()? {
            Some(config) => Some(Box::new(self.with_config(config)?)),
            None => None,
        })
    }
}
