//! The built-in model: a seeded tiny decoder whose MoE layers route with a router config, so
//! the whole-model audit (every layer, the generation path) runs in Rust CI without Python.
//!
//! Token embeddings plus sinusoidal positions (counted over non-padding tokens, as a serving
//! engine numbers a left-padded prompt), then N decoder layers of pre-norm causal attention
//! (one head) and a feed-forward: layer 0 dense (as DeepSeek's first dense layers), layers 1..N
//! the project's [`MoeLayer`] with the config's router; a final RMS norm and the unembedding,
//! whose log-softmax rows are the output rows. One function runs positions `from..to` against a
//! KV cache of `0..from`: the forward path is one such step over everything, the generation
//! path a prefill step and then one step per token, so both paths share every line of code and
//! differ only where a serving engine differs (the shapes, and what the router sees at once).

use super::{LayerInfo, LayerKind, LayerOutput, Mode, Model, ModelInfo, ModelOutput, Path, TokenCall, PROTOCOL_3};
use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::VarBuilder;
use moe_audit_core::config::RouterConfig;
use moe_audit_core::error::{Error, Result};
use moe_audit_core::layer::{seeded_weights, Expert, LayerDims, MoeLayer, Seeded};
use moe_audit_core::router::{logits_to_host, Router};
use moe_audit_core::routing::{Decisions, GroupRecord, Routing, ScopeRecord, TokenRouting};

/// What the built-in model is made of.
#[derive(Debug, Clone)]
pub struct BuiltinSpec {
    /// The router of every MoE layer.
    pub router: RouterConfig,
    /// Decoder layers N (layer 0 dense, the rest MoE): at least 2.
    pub layers: usize,
    /// Token ids `0..vocab`.
    pub vocab: usize,
    /// Hidden size H.
    pub hidden: usize,
    /// FFN size of the dense layer and of every expert.
    pub ffn: usize,
    /// Seed of every weight.
    pub seed: u64,
    /// A layer whose attention is not causal (a deliberate bug the audit must catch).
    pub non_causal: Option<usize>,
}

/// Seed offsets of the model's parts, so no two draw the same numbers.
const ATTENTION_SALT: u64 = 0x6174_746e;
const LAYER_SALT: u64 = 0x6c61_7972;

/// A decoder layer: attention weights `[H, H]` (applied as `x @ w`) and its feed-forward.
struct Block {
    wq: Tensor,
    wk: Tensor,
    wv: Tensor,
    wo: Tensor,
    ffn: Ffn,
}

enum Ffn {
    Dense(Expert),
    /// The MoE layer, and the router it serves with when its config has an `[inference]` table.
    Moe(Box<MoeLayer>, Option<Box<dyn Router>>),
}

/// The built-in decoder.
pub struct Builtin {
    info: ModelInfo,
    hidden: usize,
    /// `[V, H]`.
    embed: Tensor,
    blocks: Vec<Block>,
    /// `[H, V]`.
    unembed: Tensor,
    non_causal: Option<usize>,
}

/// What one step (positions `from..to` of every sequence) produced.
struct Step {
    /// Per MoE layer: the routing of the step's tokens and their router logits `[B, n, E]`.
    layers: Vec<(Routing, Vec<f32>)>,
    /// `[B, n, V]` log-probabilities.
    out: Vec<f32>,
}

impl Builtin {
    /// The model, every weight drawn from `spec.seed`.
    pub fn new(spec: BuiltinSpec) -> Result<Self> {
        let BuiltinSpec { router, layers, vocab, hidden: h, ffn, seed, non_causal } = spec;
        let what = || format!("built-in model with router `{}`", router.name);
        if let Some(l) = non_causal.filter(|&l| l >= layers) {
            return Err(Error::shape(
                &what(),
                format!("non-causal layer {l}: the model has layers 0 to {}", layers - 1),
            ));
        }
        if vocab == 0 || vocab > super::MAX_VOCAB || h == 0 || ffn == 0 {
            return Err(Error::shape(&what(), format!("vocab {vocab}, hidden {h} and ffn {ffn} must be positive")));
        }
        let dev = &Device::Cpu;
        let mut rng = Seeded::new(seed ^ ATTENTION_SALT);
        let embed = rng.normal(&[vocab, h], dev)?;
        let bound = 1.0 / (h as f32).sqrt();
        let mut blocks = Vec::with_capacity(layers);
        let mut infos = Vec::with_capacity(layers);
        for l in 0..layers {
            let mut w = || rng.uniform(&[h, h], bound, dev);
            let (wq, wk, wv, wo) = (w()?, w()?, w()?, w()?);
            let layer_seed = seed.wrapping_add(LAYER_SALT).wrapping_add(l as u64);
            let ffn = if l == 0 {
                infos.push(LayerInfo { layer: l, kind: LayerKind::Dense, experts: None, top_k: None });
                let tensors = seeded_weights(LayerDims { hidden: h, ffn, experts: 1 }, layer_seed, dev)?;
                Ffn::Dense(Expert::new(h, ffn, VarBuilder::from_tensors(tensors, DType::F32, dev).pp("experts.0"))?)
            } else {
                let kind = LayerKind::Moe;
                infos.push(LayerInfo { layer: l, kind, experts: Some(router.real_experts()), top_k: router.top_k() });
                let layer = MoeLayer::seeded(router.clone(), h, ffn, layer_seed, DType::F32, dev)?;
                let serve = layer.router().inference()?;
                Ffn::Moe(Box::new(layer), serve)
            };
            blocks.push(Block { wq, wk, wv, wo, ffn });
        }
        let unembed = rng.uniform(&[h, vocab], bound, dev)?;
        let info = ModelInfo {
            protocol: PROTOCOL_3.into(),
            name: format!("builtin-{}", router.name),
            vocab,
            layers: infos,
            outputs: vocab,
            logits: true,
            padding_mask: true,
            generate: true,
        };
        info.validate().map_err(|e| Error::shape(&what(), e))?;
        Ok(Builtin { info, hidden: h, embed, blocks, unembed, non_causal })
    }

    /// Bytes one call of `batch x seq_len` tokens allocates at most, roughly: the attention
    /// scores `[B, S, S]` and a few activations `[B, S, H]` and `[B, S, V]` per layer.
    pub fn call_bytes(&self, batch: usize, seq_len: usize) -> u64 {
        let (b, s) = (batch as u64, seq_len as u64);
        let per_layer = b * s * (s + 8 * self.hidden as u64 + 2 * self.info.vocab as u64);
        4 * per_layer.saturating_mul(self.blocks.len() as u64 + 2)
    }

    /// Runs positions `from..to` of every sequence against the cache of `0..from` (extended).
    fn step(&self, call: &TokenCall, (from, to): (usize, usize), cache: &mut [(Tensor, Tensor)]) -> Result<Step> {
        let (b, s, h) = (call.batch, call.seq_len, self.hidden);
        let n = to - from;
        let dev = &Device::Cpu;
        let ids: Vec<u32> = (0..b).flat_map(|i| call.tokens[i * s + from..i * s + to].iter().copied()).collect();
        let positions = positions(call);
        let pe: Vec<f32> =
            (0..b).flat_map(|i| (from..to).map(move |p| i * s + p)).flat_map(|t| sinusoid(positions[t], h)).collect();
        let x = self.embed.index_select(&Tensor::new(ids.as_slice(), dev)?, 0)?.reshape((b, n, h))?;
        let mut x = (x + Tensor::from_vec(pe, (b, n, h), dev)?)?;
        let mask = |causal: bool| -> Result<Tensor> {
            let m: Vec<f32> = (0..b)
                .flat_map(|i| {
                    (from..to).flat_map(move |q| {
                        (0..to).map(move |k| {
                            let visible = (k <= q || !causal) && (k == q || !call.is_padding(i, k));
                            if visible {
                                0.0
                            } else {
                                f32::NEG_INFINITY
                            }
                        })
                    })
                })
                .collect();
            Ok(Tensor::from_vec(m, (b, n, to), dev)?)
        };
        let causal_mask = mask(true)?;
        let padding = call.padding.as_ref().map(|m| {
            let part: Vec<bool> = (0..b).flat_map(|i| m[i * s + from..i * s + to].iter().copied()).collect();
            ndarray::Array2::from_shape_vec((b, n), part).expect("b x n flags")
        });
        let mut layers = Vec::new();
        for (l, (block, (k_cache, v_cache))) in self.blocks.iter().zip(cache.iter_mut()).enumerate() {
            let a = rms(&x)?.reshape((b * n, h))?;
            let proj = |w: &Tensor| -> Result<Tensor> { Ok(a.matmul(w)?.reshape((b, n, h))?) };
            let (q, k, v) = (proj(&block.wq)?, proj(&block.wk)?, proj(&block.wv)?);
            *k_cache = if from == 0 { k } else { Tensor::cat(&[&*k_cache, &k], 1)? };
            *v_cache = if from == 0 { v } else { Tensor::cat(&[&*v_cache, &v], 1)? };
            let m = if self.non_causal == Some(l) { mask(false)? } else { causal_mask.clone() };
            let scores = (q.matmul(&k_cache.t()?)? / (h as f64).sqrt())?.broadcast_add(&m)?;
            let att = candle_nn::ops::softmax_last_dim(&scores)?;
            let mixed = att.matmul(&*v_cache)?.reshape((b * n, h))?.matmul(&block.wo)?;
            x = (x + mixed.reshape((b, n, h))?)?;
            let f = rms(&x)?;
            let y = match &block.ffn {
                Ffn::Dense(expert) => expert.forward(&f.reshape((b * n, h))?)?.reshape((b, n, h))?,
                Ffn::Moe(layer, serve) => {
                    let logits = logits_to_host(&layer.router().scores(&f)?)?;
                    let router: &dyn Router = match (call.mode, serve) {
                        (Mode::Inference, Some(serve)) => serve.as_ref(),
                        _ => layer.router(),
                    };
                    let routing = match &padding {
                        Some(m) if router.accepts_padding_mask() => router.assign_masked(logits.view(), m.view())?,
                        _ => router.assign(logits.view())?,
                    };
                    let y = layer.apply(&f, &routing)?;
                    // Null experts' columns (past the record's E) are not the record's experts.
                    let real = logits.slice(ndarray::s![.., .., ..routing.experts]).iter().copied().collect();
                    layers.push((routing, real));
                    y
                }
            };
            x = (x + y)?;
        }
        let out = rms(&x)?.reshape((b * n, h))?.matmul(&self.unembed)?;
        let out = candle_nn::ops::log_softmax(&out, D::Minus1)?.flatten_all()?.to_vec1::<f32>()?;
        Ok(Step { layers, out })
    }
}

impl Model for Builtin {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn call(&self, call: &TokenCall) -> Result<ModelOutput> {
        self.info.check_call(call)?;
        let s = call.seq_len;
        let spans: Vec<(usize, usize)> = match call.path {
            Path::Forward => vec![(0, s)],
            Path::Generate { prefill } => {
                let first = (prefill > 0).then_some((0, prefill));
                first.into_iter().chain((prefill..s).map(|t| (t, t + 1))).collect()
            }
        };
        let empty = || Tensor::zeros((call.batch, 0, self.hidden), DType::F32, &Device::Cpu);
        let mut cache = (0..self.blocks.len()).map(|_| Ok((empty()?, empty()?))).collect::<Result<Vec<_>>>()?;
        let steps = spans.iter().map(|&span| self.step(call, span, &mut cache)).collect::<Result<Vec<_>>>()?;
        let v = self.info.vocab;
        let outputs = join_positions(call.batch, spans.iter().zip(&steps).map(|(&(a, b), st)| (b - a, &st.out[..])), v);
        let mut layers = Vec::new();
        for (i, info) in self.info.routed().enumerate() {
            let e = info.experts.unwrap_or(0);
            let parts: Vec<&Routing> = steps.iter().map(|st| &st.layers[i].0).collect();
            let logits = join_positions(
                call.batch,
                spans.iter().zip(&steps).map(|(&(a, b), st)| (b - a, &st.layers[i].1[..])),
                e,
            );
            layers.push(LayerOutput {
                layer: info.layer,
                routing: join_routings(&parts, call.batch),
                logits: Some(logits),
            });
        }
        let out = ModelOutput { layers, outputs: Some(outputs) };
        self.info.check_output(call, &out).map_err(|e| Error::shape(&format!("model `{}`", self.info.name), e))?;
        Ok(out)
    }
}

/// Each token's position: the non-padding tokens before it in its sequence.
fn positions(call: &TokenCall) -> Vec<usize> {
    let s = call.seq_len;
    (0..call.batch)
        .flat_map(|b| {
            let mut next = 0;
            (0..s).map(move |p| {
                let at = next;
                next += usize::from(!call.is_padding(b, p));
                at
            })
        })
        .collect()
}

/// The sinusoidal position code of `pos` (Vaswani et al.), `h` values.
fn sinusoid(pos: usize, h: usize) -> impl Iterator<Item = f32> {
    (0..h).map(move |i| {
        let angle = pos as f64 / 10_000f64.powf((i - i % 2) as f64 / h as f64);
        (if i % 2 == 0 { angle.sin() } else { angle.cos() }) as f32
    })
}

/// RMS norm over the last axis (no weight).
fn rms(x: &Tensor) -> Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    Ok(x.broadcast_div(&(ms + 1e-6)?.sqrt()?)?)
}

/// Rows of `width` values per token, given per step as `[B, n, width]`, joined into
/// `[B, S, width]` (sequence-major).
fn join_positions<'a>(batch: usize, parts: impl Iterator<Item = (usize, &'a [f32])> + Clone, width: usize) -> Vec<f32> {
    let mut out = Vec::new();
    for b in 0..batch {
        for (n, rows) in parts.clone() {
            out.extend_from_slice(&rows[b * n * width..(b + 1) * n * width]);
        }
    }
    out
}

/// The routing of a whole call from the routings of its steps (each `[B, n]`, in position
/// order): tokens renumbered, each step's routing groups kept as groups of their own (their
/// capacities are what was in force), per-expert capacities summed. One step is returned as is.
fn join_routings(parts: &[&Routing], batch: usize) -> Routing {
    if let [one] = parts {
        return (*one).clone();
    }
    let first = parts[0];
    let seq_len = parts.iter().map(|r| r.seq_len).sum();
    let mut groups: Vec<GroupRecord> = Vec::new();
    let mut offsets = Vec::with_capacity(parts.len());
    for r in parts {
        offsets.push(groups.len());
        groups.extend(r.scope.groups.iter().cloned());
    }
    let mut tokens = Vec::with_capacity(batch * seq_len);
    for b in 0..batch {
        let mut pos = 0;
        for (r, &offset) in parts.iter().zip(&offsets) {
            for p in 0..r.seq_len {
                let t = r.token(b, p);
                tokens.push(TokenRouting { batch: b, pos: pos + p, group: t.group + offset, ..t.clone() });
            }
            pos += r.seq_len;
        }
    }
    let capacity = parts.iter().filter_map(|r| r.capacity.as_ref()).fold(None::<Vec<usize>>, |sum, c| {
        Some(match sum {
            None => c.clone(),
            Some(s) => s.iter().zip(c).map(|(a, b)| a + b).collect(),
        })
    });
    let decisions = Decisions {
        router: first.router.clone(),
        batch,
        seq_len,
        experts: first.experts,
        top_k: first.top_k,
        capacity,
        scope: ScopeRecord { group: first.scope.group, flatten: first.scope.flatten, groups },
        tokens,
    };
    Routing::assemble(decisions, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(preset: &str) -> Builtin {
        let router = RouterConfig::load(preset).unwrap();
        Builtin::new(BuiltinSpec { router, layers: 3, vocab: 50, hidden: 16, ffn: 32, seed: 1, non_causal: None })
            .unwrap()
    }

    #[test]
    fn generation_through_the_cache_equals_the_forward_for_a_dropless_router() {
        let m = model("mixtral");
        let tokens: Vec<u32> = (0..2 * 9).map(|i| (i * 7 % 50) as u32).collect();
        let forward = TokenCall::forward(2, 9, 0, tokens);
        let generate = TokenCall { path: Path::Generate { prefill: 3 }, ..forward.clone() };
        let (a, b) = (m.call(&forward).unwrap(), m.call(&generate).unwrap());
        let (ya, yb) = (a.outputs.unwrap(), b.outputs.unwrap());
        let worst = ya.iter().zip(&yb).fold(0f32, |w, (x, y)| w.max((x - y).abs()));
        assert!(worst < 1e-4, "outputs differ by {worst}");
        for (la, lb) in a.layers.iter().zip(&b.layers) {
            for (ta, tb) in la.routing.tokens.iter().zip(&lb.routing.tokens) {
                let ids = |t: &TokenRouting| t.routes.iter().map(|r| r.expert).collect::<Vec<_>>();
                assert_eq!(ids(ta), ids(tb), "layer {} token ({}, {})", la.layer, ta.batch, ta.pos);
            }
        }
    }

    #[test]
    fn a_model_without_moe_layers_is_refused() {
        let router = RouterConfig::load("mixtral").unwrap();
        let spec = BuiltinSpec { router, layers: 1, vocab: 50, hidden: 16, ffn: 32, seed: 1, non_causal: None };
        let e = Builtin::new(spec).err().unwrap().to_string();
        assert!(e.ends_with("model `builtin-mixtral` has no MoE layer: nothing to audit"), "{e}");
    }

    #[test]
    fn left_padding_keeps_the_real_tokens_outputs() {
        let m = model("mixtral");
        let plain = TokenCall::forward(1, 4, 0, vec![5, 6, 7, 8]);
        let mut padded = TokenCall::forward(1, 6, 0, vec![0, 0, 5, 6, 7, 8]);
        padded.padding = Some(vec![true, true, false, false, false, false]);
        let (a, b) = (m.call(&plain).unwrap().outputs.unwrap(), m.call(&padded).unwrap().outputs.unwrap());
        let worst = a.iter().zip(&b[2 * 50..]).fold(0f32, |w, (x, y)| w.max((x - y).abs()));
        assert!(worst < 1e-4, "outputs differ by {worst}");
    }
}
