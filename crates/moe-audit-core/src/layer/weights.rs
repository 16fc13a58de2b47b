//! Where layer weights come from: an explicit seed (our own generator: candle's CPU RNG cannot
//! be seeded) or a safetensors file with Mixtral-style names.

use crate::error::{excerpt, Error, Result};
use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::StandardNormal;
use std::collections::HashMap;
use std::path::Path;

/// Sizes of an MoE layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerDims {
    /// Hidden size H.
    pub hidden: usize,
    /// Expert FFN size.
    pub ffn: usize,
    /// Number of experts E.
    pub experts: usize,
}

/// Mixtral-style tensor names: `gate.weight`, `experts.{i}.w1.weight`, `w2`, `w3`.
pub(crate) fn tensor_names(experts: usize) -> Vec<String> {
    let mut names = vec!["gate.weight".to_string()];
    for i in 0..experts {
        for w in ["w1", "w2", "w3"] {
            names.push(format!("experts.{i}.{w}.weight"));
        }
    }
    names
}

/// A deterministic generator for weights and inputs.
pub struct Seeded(ChaCha8Rng);

impl Seeded {
    /// A generator from an explicit seed.
    pub fn new(seed: u64) -> Self {
        Seeded(ChaCha8Rng::seed_from_u64(seed))
    }

    /// Uniform in `[-bound, bound)`, as an `f32` tensor on `device`.
    pub fn uniform(&mut self, shape: &[usize], bound: f32, device: &Device) -> Result<Tensor> {
        let n = shape.iter().product();
        let data: Vec<f32> = (0..n).map(|_| self.0.random_range(-bound..bound)).collect();
        Ok(Tensor::from_vec(data, shape, device)?)
    }

    /// Standard normal, as an `f32` tensor on `device`.
    pub fn normal(&mut self, shape: &[usize], device: &Device) -> Result<Tensor> {
        let n = shape.iter().product();
        let data: Vec<f32> = (0..n).map(|_| self.0.sample(StandardNormal)).collect();
        Ok(Tensor::from_vec(data, shape, device)?)
    }
}

/// Seeded Mixtral-style layer weights (`f32`): every matrix uniform in `±1/sqrt(fan_in)`, like
/// a linear layer's default init.
pub fn seeded_weights(dims: LayerDims, seed: u64, device: &Device) -> Result<HashMap<String, Tensor>> {
    let mut rng = Seeded::new(seed);
    let LayerDims { hidden, ffn, experts } = dims;
    let mut map = HashMap::new();
    for name in tensor_names(experts) {
        let (shape, fan_in) = match name.rsplit('.').nth(1) {
            Some("gate") => ([experts, hidden], hidden),
            Some("w2") => ([hidden, ffn], ffn),
            _ => ([ffn, hidden], hidden),
        };
        let t = rng.uniform(&shape, 1.0 / (fan_in as f32).sqrt(), device)?;
        map.insert(name, t);
    }
    Ok(map)
}

/// Reads a safetensors file into named tensors.
/// The file is read whole first, so it may hold at most `max_bytes` (half the memory limit:
/// the tensors are a second copy).
pub fn load_safetensors(path: &Path, device: &Device, max_bytes: u64) -> Result<HashMap<String, Tensor>> {
    let bytes = crate::files::read_bounded(path, max_bytes, crate::text!("half of ", crate::settings::MAX_MEMORY))?;
    if let Some(name) = duplicate_tensor_name(&bytes) {
        return Err(Error::input(path, format!("the header names tensor `{}` twice", excerpt(&name))));
    }
    candle_core::safetensors::load_buffer(&bytes, device).map_err(|e| Error::parse(path, "cannot load safetensors", e))
}

/// A name the safetensors header (8 bytes of length, then a JSON object) holds twice: the loader
/// would keep one of them silently. `None` for a header it cannot read (the loader says why).
fn duplicate_tensor_name(bytes: &[u8]) -> Option<String> {
    use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};
    struct FirstDuplicate;
    impl<'de> Visitor<'de> for FirstDuplicate {
        type Value = Option<String>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<Self::Value, A::Error> {
            let mut seen = std::collections::HashSet::new();
            while let Some(key) = map.next_key::<String>()? {
                map.next_value::<IgnoredAny>()?;
                if !seen.insert(key.clone()) {
                    return Ok(Some(key));
                }
            }
            Ok(None)
        }
    }
    let len = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
    let header = bytes.get(8..8usize.checked_add(usize::try_from(len).ok()?)?)?;
    serde_json::Deserializer::from_slice(header).deserialize_map(FirstDuplicate).ok().flatten()
}

/// Infers [`LayerDims`] from Mixtral-style tensors.
pub(crate) fn infer_dims(tensors: &HashMap<String, Tensor>, source: &str) -> Result<LayerDims> {
    let get = |name: &str| {
        tensors.get(name).ok_or_else(|| Error::shape(source, format!("missing tensor `{name}`"))).and_then(|t| {
            t.dims2().map_err(|_| {
                let dims = excerpt(&format!("{:?}", t.dims()));
                Error::shape(source, format!("tensor `{name}` has shape {dims}, expected 2 dimensions"))
            })
        })
    };
    let (experts, hidden) = get("gate.weight")?;
    let (ffn, _) = get("experts.0.w1.weight")?;
    Ok(LayerDims { hidden, ffn, experts })
}
