//! A real gate from a checkpoint: `--weights FILE.safetensors --gate TENSOR [--bias TENSOR]`
//! puts a trained gate matrix (and DeepSeek-V3's selection bias) under a router configuration,
//! so the audit routes the scores a real model would produce.

use crate::config::RouterConfig;
use crate::error::{Error, Result};
use crate::router::ConfigRouter;
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
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
}

impl GateSource<'_> {
    /// The router `config` with this gate (in f32); the bias replaces `expert_bias`.
    pub fn router(&self, mut config: RouterConfig) -> Result<ConfigRouter> {
        let path = self.weights;
        let tensors = crate::layer::load_safetensors(path, &Device::Cpu)?;
        let gate = float_tensor(&tensors, path, self.gate)?;
        let (experts, hidden) = gate.dims2().map_err(|_| {
            Error::input(
                path,
                format!(
                    "tensor `{}` has shape {:?}, expected [experts, hidden]",
                    self.gate,
                    gate.dims()
                ),
            )
        })?;
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
                        "tensor `{name}` has shape {:?}, expected [{experts}]",
                        bias.dims()
                    ),
                ));
            }
            config.expert_bias = Some(bias.to_vec1()?);
            config.validate().map_err(|(field, message)| {
                Error::config(&format!("{}:{name}", path.display()), field, message)
            })?;
        }
        let vb = VarBuilder::from_tensors(
            HashMap::from([("weight".to_string(), gate)]),
            DType::F32,
            &Device::Cpu,
        );
        ConfigRouter::new(config, hidden, vb)
    }
}

/// A floating-point tensor by name, as f32, with its values checked finite.
fn float_tensor(tensors: &HashMap<String, Tensor>, path: &Path, name: &str) -> Result<Tensor> {
    let t = tensors.get(name).ok_or_else(|| {
        let mut names: Vec<&str> = tensors.keys().map(String::as_str).collect();
        names.sort_unstable();
        let shown = names.iter().take(8).copied().collect::<Vec<_>>().join(", ");
        let more = if names.len() > 8 {
            format!(", ... ({} tensors)", names.len())
        } else {
            String::new()
        };
        Error::input(path, format!("no tensor `{name}`; it has {shown}{more}"))
    })?;
    if !matches!(
        t.dtype(),
        DType::F16 | DType::BF16 | DType::F32 | DType::F64
    ) {
        return Err(Error::input(
            path,
            format!(
                "tensor `{name}` is {:?}, expected a float dtype (f16, bf16, f32, f64)",
                t.dtype()
            ),
        ));
    }
    let t = t.to_dtype(DType::F32)?;
    let values = t.flatten_all()?.to_vec1::<f32>()?;
    if let Some(i) = values.iter().position(|v| !v.is_finite()) {
        return Err(Error::input(
            path,
            format!(
                "tensor `{name}` has a non-finite value {} at flat index {i}",
                values[i]
            ),
        ));
    }
    Ok(t)
}
