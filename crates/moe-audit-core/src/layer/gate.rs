//! A real gate from a checkpoint: `--weights FILE.safetensors --gate TENSOR [--bias TENSOR]`
//! puts a trained gate matrix (and DeepSeek-V3's selection bias) under a router configuration,
//! so the audit routes the scores a real model would produce.

use crate::config::RouterConfig;
use crate::error::{excerpt, excerpt_names, Error, Result};
use crate::router::{ConfigRouter, Hints, Router};
use crate::routing::Routing;
use crate::MemoryBudget;
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use ndarray::{ArrayView2, ArrayView3};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;
use std::path::Path;

/// Where the gate comes from.
#[derive(Debug, Clone)]
pub struct GateSource<'a> {
    /// The safetensors file.
    pub weights: &'a Path,
    /// The gate matrix `[experts, hidden]`, e.g. `model.layers.3.block_sparse_moe.gate.weight`.
    pub gate: &'a str,
    /// The selection-only bias `[experts]`, e.g. `model.layers.3.mlp.gate.e_score_correction_bias`.
    pub bias: Option<&'a str>,
    /// Hidden states `[..., hidden]` to sample the audit's tokens from (a safetensors file and
    /// the tensor, which may be left out when the file holds one); standard normal without.
    pub hidden_states: Option<(&'a Path, Option<&'a str>)>,
    /// The memory limit (`--max-memory`): the files are read whole, within half of it.
    pub budget: MemoryBudget,
}

impl GateSource<'_> {
    /// The router `config` with this gate (in f32); the bias replaces `expert_bias`.
    pub fn router(&self, config: RouterConfig) -> Result<GateRouter> {
        let router = self.config_router(config)?;
        let states = match self.hidden_states {
            None => None,
            Some((path, name)) => {
                let tensors = crate::layer::load_safetensors(path, &Device::Cpu, self.budget.tensors())?;
                let name = match name {
                    Some(name) => name.to_string(),
                    None if tensors.len() == 1 => tensors.keys().next().expect("one tensor").clone(),
                    None => {
                        return Err(Error::input(
                            path,
                            format!("holds {} tensors: name one as FILE:TENSOR", tensors.len()),
                        ))
                    }
                };
                let t = float_tensor(&tensors, path, &name)?;
                let hidden = router.hidden_size().expect("a gate has a hidden size");
                let rows = t.elem_count() / hidden.max(1);
                if t.dims().last() != Some(&hidden) || rows == 0 {
                    return Err(Error::input(
                        path,
                        format!(
                            "tensor `{}` has shape {}, expected [..., {hidden}] (the gate's hidden size)",
                            excerpt(&name),
                            excerpt(&format!("{:?}", t.dims()))
                        ),
                    ));
                }
                Some(t.reshape((rows, hidden))?)
            }
        };
        Ok(GateRouter { inner: router, states })
    }

    fn config_router(&self, mut config: RouterConfig) -> Result<ConfigRouter> {
        let path = self.weights;
        let tensors = crate::layer::load_safetensors(path, &Device::Cpu, self.budget.tensors())?;
        let gate = float_tensor(&tensors, path, self.gate)?;
        let (experts, hidden) = gate.dims2().map_err(|_| {
            Error::input(
                path,
                format!(
                    "tensor `{}` has shape {}, expected [experts, hidden]",
                    self.gate,
                    excerpt(&format!("{:?}", gate.dims()))
                ),
            )
        })?;
        if hidden == 0 {
            return Err(Error::input(
                path,
                format!("tensor `{}` has shape [{experts}, 0]: a gate needs a hidden size of at least 1", self.gate),
            ));
        }
        if experts != config.experts {
            return Err(Error::input(
                path,
                format!(
                    "tensor `{}` has {experts} rows (experts), router `{}` has {} experts",
                    self.gate, config.name, config.experts
                ),
            ));
        }
        if let Some(name) = self.bias {
            let bias = float_tensor(&tensors, path, name)?;
            if bias.dims() != [experts] {
                return Err(Error::input(
                    path,
                    format!(
                        "tensor `{name}` has shape {}, expected [{experts}]",
                        excerpt(&format!("{:?}", bias.dims()))
                    ),
                ));
            }
            config = config
                .with_expert_bias(bias.to_vec1()?)
                .map_err(|e| e.in_config(&format!("{}:{name}", path.display())))?;
        }
        let vb = VarBuilder::from_tensors(HashMap::from([("weight".to_string(), gate)]), DType::F32, &Device::Cpu);
        ConfigRouter::new(config, hidden, vb)
    }
}

/// A built-in router on a real gate, drawing the audit's hidden states from real activations when
/// given: each token is a row of the file picked by a seeded generator (with replacement).
pub struct GateRouter {
    inner: ConfigRouter,
    /// `[rows, hidden]`.
    states: Option<Tensor>,
}

impl Router for GateRouter {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn experts(&self) -> usize {
        self.inner.experts()
    }
    fn hidden_size(&self) -> Option<usize> {
        self.inner.hidden_size()
    }
    fn config(&self) -> Option<&RouterConfig> {
        self.inner.config()
    }
    fn hints(&self) -> Option<&dyn Hints> {
        Some(self)
    }
    fn scores(&self, hidden: &Tensor) -> Result<Tensor> {
        self.inner.scores(hidden)
    }
    fn assign(&self, logits: ArrayView3<f32>) -> Result<Routing> {
        self.inner.assign(logits)
    }
    fn accepts_padding_mask(&self) -> bool {
        self.inner.accepts_padding_mask()
    }
    fn assign_masked(&self, logits: ArrayView3<f32>, padding: ArrayView2<bool>) -> Result<Routing> {
        self.inner.assign_masked(logits, padding)
    }
    fn prefix_stable(&self, batch: usize) -> bool {
        self.inner.prefix_stable(batch)
    }
    fn inference(&self) -> Result<Option<Box<dyn Router>>> {
        self.inner.inference()
    }
}

impl Hints for GateRouter {
    fn draw_hidden(&self, (b, s): (usize, usize), seed: u64) -> Result<Option<Tensor>> {
        let Some(states) = &self.states else {
            return Ok(None);
        };
        let (rows, hidden) = states.dims2()?;
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let picks: Vec<u32> = (0..b * s).map(|_| rng.random_range(0..rows) as u32).collect();
        let picks = Tensor::from_vec(picks, b * s, &Device::Cpu)?;
        Ok(Some(states.index_select(&picks, 0)?.reshape((b, s, hidden))?))
    }
}

/// A floating-point tensor by name, as f32, with its values checked finite.
fn float_tensor(tensors: &HashMap<String, Tensor>, path: &Path, name: &str) -> Result<Tensor> {
    let t = tensors.get(name).ok_or_else(|| {
        let mut names: Vec<&str> = tensors.keys().map(String::as_str).collect();
        names.sort_unstable();
        Error::input(path, format!("no tensor `{}`; it has {}", excerpt(name), excerpt_names(names)))
    })?;
    if !matches!(t.dtype(), DType::F16 | DType::BF16 | DType::F32 | DType::F64) {
        return Err(Error::input(
            path,
            format!("tensor `{}` is {:?}, expected a float dtype (f16, bf16, f32, f64)", excerpt(name), t.dtype()),
        ));
    }
    let t = t.to_dtype(DType::F32)?;
    let values = t.flatten_all()?.to_vec1::<f32>()?;
    if let Some(i) = values.iter().position(|v| !v.is_finite()) {
        return Err(Error::input(
            path,
            format!("tensor `{}` has a non-finite value {} at flat index {i}", excerpt(name), values[i]),
        ));
    }
    Ok(t)
}
