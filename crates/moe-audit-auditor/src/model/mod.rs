//! Whole models: token ids in, every MoE layer's routing (and the model's output rows) out.
//!
//! A single-layer audit feeds a router rows it crafts; a user's question is about their model:
//! "change future tokens: does an earlier token's routing, at any layer, or its output change?".
//! A [`Model`] answers a [`TokenCall`] (token ids `[batch, seq_len]`, a padding mask, a mode,
//! the forward or the generation path) with one [`Routing`] per MoE layer. Two implementations:
//! a model in another process over `moe-audit/3` ([`process`], docs/PROTOCOL.md) and the
//! built-in seeded decoder ([`builtin`]) that Rust CI audits without Python. [`audit`] runs the
//! token probes on either and compares every layer.

pub mod answer_diff;
pub mod audit;
pub mod builtin;
pub mod process;
pub mod protocol;

pub use crate::external::Mode;
pub use audit::{audit_model, ModelAuditOptions, ModelFinding, ModelReport};
pub use builtin::{Builtin, BuiltinSpec};
pub use process::ModelProcess;

use moe_audit_core::error::{Error, ProtocolError, Result};
use moe_audit_core::routing::Routing;
use serde::{Deserialize, Serialize};

/// The protocol tag of whole-model conversations.
pub const PROTOCOL_3: &str = "moe-audit/3";

/// What a decoder layer holds (one type with the routing records' layouts).
pub use moe_audit_core::layer::LayerKind;

/// One decoder layer of a model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerInfo {
    /// Global layer number, 0-based (MTP layers after the backbone's).
    pub layer: usize,
    /// Dense, MoE or MTP.
    pub kind: LayerKind,
    /// Experts E of a routed layer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub experts: Option<usize>,
    /// Experts per token of a routed layer; `None` for expert choice.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<usize>,
}

impl LayerInfo {
    /// Whether the layer has a router (MoE or MTP).
    pub fn routed(&self) -> bool {
        self.kind.routed()
    }
}

/// How a model introduced itself: the `moe-audit/3` handshake (the built-in model describes
/// itself alike).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelInfo {
    /// [`PROTOCOL_3`].
    pub protocol: String,
    /// Name used in reports.
    pub name: String,
    /// Token ids are `0..vocab`.
    pub vocab: usize,
    /// Every decoder layer, by increasing global number.
    pub layers: Vec<LayerInfo>,
    /// Width D of the output rows returned per token (0: none).
    #[serde(default)]
    pub outputs: usize,
    /// Responses carry every routed layer's router logits.
    #[serde(default)]
    pub logits: bool,
    /// Requests may carry a padding mask.
    #[serde(default)]
    pub padding_mask: bool,
    /// The model can run the generation path (prefill, then a KV cache one token at a time).
    #[serde(default)]
    pub generate: bool,
}

/// The most layers a model may declare.
pub(crate) const MAX_LAYERS: usize = 4096;
/// The largest vocabulary (token ids travel as u32).
pub(crate) const MAX_VOCAB: usize = 1 << 31;

impl ModelInfo {
    /// Checks the handshake; the error says which field is wrong.
    pub fn validate(&self) -> std::result::Result<(), ProtocolError> {
        use crate::external::protocol::MAX_SIZE;
        if self.protocol != PROTOCOL_3 {
            let protocol = moe_audit_core::error::excerpt(&self.protocol);
            return Err(format!("handshake: protocol `{protocol}`, expected `{PROTOCOL_3}`").into());
        }
        if let Err(e) = moe_audit_core::names::check(&self.name) {
            return Err(format!("handshake: name {e}").into());
        }
        if !(1..=MAX_VOCAB).contains(&self.vocab) {
            return Err(format!("handshake: vocab {} is not from 1 to {MAX_VOCAB}", self.vocab).into());
        }
        if self.outputs > MAX_SIZE {
            return Err(format!("handshake: outputs {} is over {MAX_SIZE}", self.outputs).into());
        }
        if self.layers.len() > MAX_LAYERS {
            return Err(format!("handshake: {} layers, more than {MAX_LAYERS}", self.layers.len()).into());
        }
        for (i, l) in self.layers.iter().enumerate() {
            let at = format!("handshake: layers[{i}] (layer {})", l.layer);
            if i > 0 && l.layer <= self.layers[i - 1].layer {
                return Err(format!("{at}: layer numbers must increase").into());
            }
            match (l.routed(), l.experts, l.top_k) {
                (false, None, None) => {}
                (false, ..) => return Err(format!("{at}: a dense layer has no experts or top_k").into()),
                (true, None, _) => return Err(format!("{at}: a routed layer needs experts").into()),
                (true, Some(e), _) if !(1..=MAX_SIZE).contains(&e) => {
                    return Err(format!("{at}: experts {e} is not from 1 to {MAX_SIZE}").into())
                }
                (true, Some(e), Some(k)) if k == 0 || k > e => {
                    return Err(format!("{at}: top_k {k} is not from 1 to {e}").into())
                }
                _ => {}
            }
        }
        if !self.layers.iter().any(LayerInfo::routed) {
            return Err(format!("model `{}` has no MoE layer: nothing to audit", self.name).into());
        }
        Ok(())
    }

    /// The routed (MoE and MTP) layers, in order: the layers of every response.
    pub fn routed(&self) -> impl Iterator<Item = &LayerInfo> {
        self.layers.iter().filter(|l| l.routed())
    }

    /// Checks a call before it is sent: shape, token ids below the vocabulary, a padding mask
    /// only to a model that takes one, the generation path only to one that runs it.
    pub(crate) fn check_call(&self, call: &TokenCall) -> Result<()> {
        let what = || format!("model `{}`", self.name);
        let n = call.batch.checked_mul(call.seq_len).filter(|&n| n > 0);
        if n != Some(call.tokens.len()) {
            return Err(Error::shape(
                &what(),
                format!("{} token ids for batch {} x seq_len {}", call.tokens.len(), call.batch, call.seq_len),
            ));
        }
        if let Some(i) = call.tokens.iter().position(|&t| t as usize >= self.vocab) {
            return Err(Error::shape(
                &what(),
                format!(
                    "token id {} at batch {}, position {} is not below vocab {}",
                    call.tokens[i],
                    i / call.seq_len,
                    i % call.seq_len,
                    self.vocab
                ),
            ));
        }
        if let Some(mask) = &call.padding {
            if !self.padding_mask || mask.len() != call.tokens.len() {
                return Err(Error::shape(&what(), "a padding mask for a model that takes none, or of the wrong size"));
            }
        }
        if let Path::Generate { prefill } = call.path {
            if !self.generate {
                return Err(Error::shape(&what(), "the generation path, which the model does not run"));
            }
            if prefill > call.seq_len {
                return Err(Error::shape(&what(), format!("prefill {prefill} is over seq_len {}", call.seq_len)));
            }
        }
        Ok(())
    }

    /// Checks that a response lists exactly the routed layers, in order (the layer list may
    /// not change between calls); the error names a missing layer.
    pub(crate) fn check_layers(&self, layers: impl Iterator<Item = usize>) -> std::result::Result<(), String> {
        let want: Vec<usize> = self.routed().map(|l| l.layer).collect();
        let got: Vec<usize> = layers.collect();
        if want == got {
            return Ok(());
        }
        let listed = moe_audit_core::error::excerpt(&format!("{got:?}"));
        Err(match want.iter().find(|l| !got.contains(l)) {
            Some(missing) => {
                format!("layer {missing} is missing (the response lists layers {listed}, the handshake {want:?})")
            }
            None => format!("the response lists layers {listed}, the handshake {want:?}"),
        })
    }

    /// Checks what a model answered against the call and the handshake: every routed layer, in
    /// order, each routing `[batch, seq_len]` over its experts, logits and outputs as declared.
    /// The error says what is missing or wrong (a built-in model is held to it too).
    pub fn check_output(&self, call: &TokenCall, out: &ModelOutput) -> std::result::Result<(), ProtocolError> {
        self.check_layers(out.layers.iter().map(|l| l.layer))?;
        let t = call.tokens.len();
        for (info, l) in self.routed().zip(&out.layers) {
            let r = &l.routing;
            let experts = info.experts.unwrap_or(0);
            // The record's own top_k may differ from the handshake's in the other mode (expert
            // choice trained, token choice served).
            if (r.batch, r.seq_len, r.experts) != (call.batch, call.seq_len, experts) {
                return Err(format!(
                    "layer {}: a routing of batch {} x seq_len {} over {} experts, expected {} x {} over {experts}",
                    l.layer, r.batch, r.seq_len, r.experts, call.batch, call.seq_len
                )
                .into());
            }
            match (&l.logits, self.logits) {
                (Some(v), true) if v.len() == t * experts => {}
                (None, false) => {}
                _ => {
                    return Err(
                        format!("layer {}: router logits are not {t} x {experts} values as declared", l.layer).into()
                    )
                }
            }
        }
        match (&out.outputs, self.outputs) {
            (None, 0) => Ok(()),
            (Some(v), d) if d > 0 && v.len() == t * d => Ok(()),
            _ => Err(format!("output rows are not {t} x {} values as declared", self.outputs).into()),
        }
    }
}

/// Which path a call takes through the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", tag = "path")]
pub enum Path {
    /// One full forward over the whole sequence (the training path).
    Forward,
    /// The first `prefill` positions in one forward, then the remaining given tokens one at a
    /// time through the KV cache (teacher-forced decoding), as a serving engine runs.
    Generate {
        /// Positions prefilled in one forward.
        prefill: usize,
    },
}

/// One call of a model: token ids `[batch, seq_len]`, sequence-major.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenCall {
    /// Which configuration the model routes with.
    pub mode: Mode,
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// The audit's seed (a model that draws random numbers seeds them from it).
    pub seed: u64,
    /// `batch * seq_len` token ids.
    pub tokens: Vec<u32>,
    /// `batch * seq_len` flags, `true` = padding.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub padding: Option<Vec<bool>>,
    /// Forward or generation path.
    #[serde(flatten)]
    pub path: Path,
}

impl TokenCall {
    /// A training-mode forward over `tokens`.
    pub fn forward(batch: usize, seq_len: usize, seed: u64, tokens: Vec<u32>) -> Self {
        TokenCall { mode: Mode::Train, batch, seq_len, seed, tokens, padding: None, path: Path::Forward }
    }

    /// Whether token `(b, p)` is padding.
    pub(crate) fn is_padding(&self, b: usize, p: usize) -> bool {
        self.padding.as_ref().is_some_and(|m| m[b * self.seq_len + p])
    }

    /// A short description for messages: `train, forward, batch 4 x seq_len 128`.
    pub fn describe(&self) -> String {
        let path = match self.path {
            Path::Forward => "forward".to_string(),
            Path::Generate { prefill } => format!("generate after a prefill of {prefill}"),
        };
        let padding = if self.padding.is_some() { ", padded" } else { "" };
        format!("{}, {path}, batch {} x seq_len {}{padding}", self.mode, self.batch, self.seq_len)
    }
}

/// One routed layer's answer.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerOutput {
    /// Global layer number.
    pub layer: usize,
    /// The routing record of the whole call.
    pub routing: Routing,
    /// `[batch * seq_len, experts]` router logits, when the model sends them.
    pub logits: Option<Vec<f32>>,
}

/// A model's answer to one call.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelOutput {
    /// Every routed layer, in handshake order.
    pub layers: Vec<LayerOutput>,
    /// `[batch * seq_len, outputs]` output rows, when the model sends them.
    pub outputs: Option<Vec<f32>>,
}

/// A whole model: token ids in, every MoE layer's routing out. The audit sees models only
/// through this trait.
pub trait Model: Send + Sync {
    /// The model's layers and what it answers with.
    fn info(&self) -> &ModelInfo;
    /// Runs one call; the answer has passed [`ModelInfo::check_output`].
    fn call(&self, call: &TokenCall) -> Result<ModelOutput>;
}
