//! The routing record every reader produces: expert ids `[tokens, layers, top_k]` as stored,
//! read a chunk of rows at a time through what cleaning decided (-1 = nothing to compare), the
//! global number of each layer, the sequences, and what reading found and
//! inferred (the writer, the dtype as stored, the layer numbering, padding, missing routes,
//! zero-filled layers, wrapped ids), so `routes show` and every diagnosis can say it.

use super::clean::Fix;
use super::ids::Ids;
use serde::Serialize;
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::PathBuf;

/// The generic format's `format` metadata.
pub const GENERIC: &str = "moe-audit-routes/1";

/// Which writer's layout a record was read as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Format {
    /// `moe-audit-routes/1` (`.safetensors` or `.npz`), as `moe_audit.routes.record` writes it.
    Generic,
    /// A bare `.npy` `[tokens, layers, top_k]` (vLLM's `CompletionOutput.routed_experts`,
    /// a SkyRL trajectory, a Megatron inference array saved with `np.save`).
    Npy,
    /// An SGLang response: `meta_info.routed_experts` or `sglext.routed_experts`.
    Sglang,
    /// A vLLM HTTP response: `choices[i].routed_experts`, base64 of an `.npy`.
    VllmHttp,
    /// Megatron-Core `router_trace_rank{r}.jsonl` (one file or a folder of them).
    MegatronTrace,
    /// Megatron-Core inference routing: `moe_topk_indices` `[tokens, moe_layers, top_k]`.
    MegatronInference,
    /// verl's batch: `routed_experts` `[batch, prompt + response, layers, top_k]` + `attention_mask`.
    Verl,
    /// slime's replay targets: `rollout_routed_experts` (packed, with `cu_seqlens`) or per sample.
    Slime,
    /// SkyRL: `rollout_expert_indices` `[batch, tokens, layers, top_k]` + `router_padding_mask`,
    /// or the wire object `{data, shape, dtype}`.
    Skyrl,
    /// NeMo-RL: `routed_experts` `[batch, tokens, layers, top_k]` (-1 = missing), or `nrlre1:`.
    NemoRl,
    /// A batch `[batch, tokens, layers, top_k]` of no writer recognised by its names.
    Batch,
}

impl Format {
    /// How the report names it.
    pub fn name(self) -> &'static str {
        match self {
            Format::Generic => "moe-audit-routes/1",
            Format::Npy => "npy [tokens, layers, top_k]",
            Format::Sglang => "SGLang routed_experts",
            Format::VllmHttp => "vLLM HTTP routed_experts (base64 .npy)",
            Format::MegatronTrace => "Megatron-Core router_trace JSONL",
            Format::MegatronInference => "Megatron-Core inference moe_topk_indices",
            Format::Verl => "verl routed_experts [batch, tokens, layers, top_k]",
            Format::Slime => "slime rollout_routed_experts",
            Format::Skyrl => "SkyRL rollout_expert_indices",
            Format::NemoRl => "NeMo-RL routed_experts",
            Format::Batch => "batch [batch, tokens, layers, top_k]",
        }
    }
}

/// One sequence of a record: its rows, and the position in the sequence of its first row
/// (SGLang's `routed_experts_start_len`; 0 otherwise).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Sequence {
    /// Rows of the record.
    pub rows: Range<usize>,
    /// Sequence position of the first row.
    pub first_position: usize,
}

/// What reading a record found and inferred: said by `routes show`, used by the diagnoses.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Found {
    /// The element type as stored (`int32`, `uint8`, JSON ints, ...).
    pub dtype: String,
    /// How the layer numbers were taken (declared in the file, or inferred and why).
    pub numbering: String,
    /// Token rows left out as padding, by cause (`all-zero`, `mask`, a writer's fill, ...).
    pub padding: BTreeMap<String, usize>,
    /// Trailing packed segments made only of padding (slime's pad segment), dropped.
    pub pad_segments: usize,
    /// (token, layer) slots of routed layers with no route (-1: NeMo-RL's missing route, or a
    /// zero/fill row in one layer): counted apart, never compared.
    pub missing: usize,
    /// Layers the config says are dense whose slots held values (engines zero-fill them): ignored.
    pub dense_filled: Vec<usize>,
    /// Routed (or unknown) layers holding only zeros: dense without a config, else capture never ran.
    pub zero_layers: Vec<usize>,
    /// Values that are a -1 stored unsigned (255 in uint8, 65535 in uint16): read as -1.
    pub wrapped_minus_one: usize,
    /// Expert ids wrapped negative by a signed narrowing cast (int8, int16): unwrapped.
    pub wrapped_ids: usize,
    /// Expert ids stored in a type too narrow for the model's experts (ids modulo 256).
    pub narrow_for: Option<usize>,
    /// Ids not below the expert count (physical EPLB slots?): count and largest.
    pub beyond: Option<(usize, i32)>,
    /// Notes of the reader (steps or ranks merged, a shape taken from the other record, ...).
    pub notes: Vec<String>,
}

impl Found {
    /// Whether the layer numbers were given (in the file, or by the caller of `from_ids`),
    /// not inferred.
    pub fn numbering_declared(&self) -> bool {
        self.numbering.starts_with("declared")
    }
}

/// A routing record: expert ids `[tokens, layers, top_k]` (-1 = no route), the global number
/// of each layer of axis 1, and what else the file carried.
#[derive(Debug, Clone)]
pub struct Record {
    /// The file it was read from.
    pub path: PathBuf,
    /// Its format.
    pub format: Format,
    /// Rows (tokens).
    pub tokens: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Global layer number of each layer of axis 1.
    pub layers: Vec<usize>,
    /// Whether the file named the layers (else they were inferred: see [`Found::numbering`]).
    pub layers_declared: bool,
    /// Expert ids as stored, `[tokens, layers, top_k]`, read through `fix`.
    pub(crate) ids: Ids,
    /// What `clean` decided the stored values mean: applied to every row read.
    pub(crate) fix: Fix,
    /// Per layer index: whether any route is left once cleaned (a dense layer's placeholder,
    /// cleared, has none).
    pub(crate) routed: Vec<bool>,
    /// Router logits `[tokens, layers, width]`, when recorded.
    pub logits: Option<Vec<f32>>,
    /// Experts per layer (the logits' width, or the config's), when known.
    pub num_experts: Option<usize>,
    /// Token ids, when recorded.
    pub input_ids: Option<Vec<i64>>,
    /// The sequences (one when the file gives no boundaries).
    pub sequences: Vec<Sequence>,
    /// The file's metadata (generic format).
    pub meta: BTreeMap<String, String>,
    /// What reading found and inferred.
    pub found: Found,
}

/// Token rows per chunk of a pass over a whole record: what one thread holds at a time.
pub(crate) const CHUNK_TOKENS: usize = 512;

impl Record {
    /// The compared ids of `tokens` (`[n, layers, top_k]`, -1 = nothing to compare), into `out`.
    pub fn rows(&self, tokens: Range<usize>, out: &mut Vec<i32>) {
        let w = self.layers.len() * self.top_k;
        self.ids.decode(tokens.start * w..tokens.end * w, out);
        self.fix.apply(tokens, out);
    }

    /// The compared ids of `token` at layer index `layer`, into `out`.
    pub fn row(&self, token: usize, layer: usize, out: &mut Vec<i32>) {
        let at = (token * self.layers.len() + layer) * self.top_k;
        self.ids.decode(at..at + self.top_k, out);
        self.fix.apply_row(token, layer, out);
    }

    /// `each` on every chunk of `chunk` token rows (its first token, its ids as
    /// [`Record::rows`] reads them), in parallel, the results merged by `merge` (associative:
    /// the same result whatever the thread count); `None` for a record of no token.
    pub(crate) fn par_reduce<T: Send>(
        &self,
        chunk: usize,
        each: impl Fn(usize, &[i32]) -> T + Sync,
        merge: impl Fn(T, T) -> T + Sync + Send,
    ) -> Option<T> {
        use rayon::prelude::*;
        let each = &each;
        self.ids
            .par_chunks(self.tokens, self.layers.len() * self.top_k, chunk, |tokens, buf| {
                self.fix.apply(tokens.clone(), buf);
                each(tokens.start, buf)
            })
            .reduce_with(merge)
    }

    /// Whether any route of the layer index is left (a dense layer's placeholder has none).
    pub fn layer_routed(&self, layer: usize) -> bool {
        self.routed[layer]
    }

    /// Whether the record holds no route at all once its fill is recognised.
    pub fn is_empty(&self) -> bool {
        !self.routed.contains(&true)
    }

    /// Whether a token has no route in any layer (padding).
    pub fn token_empty(&self, token: usize) -> bool {
        let mut row = Vec::new();
        self.rows(token..token + 1, &mut row);
        row.iter().all(|&e| e < 0)
    }

    /// Padding rows found, all causes.
    pub fn padding_rows(&self) -> usize {
        self.found.padding.values().sum()
    }
}
