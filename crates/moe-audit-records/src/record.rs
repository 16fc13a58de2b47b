//! The routing record every reader produces: expert ids `[tokens, layers, top_k]` as stored,
//! read a chunk of rows at a time through what cleaning decided (-1 = nothing to compare), the
//! global number of each layer, the sequences, and what reading found and
//! inferred (the writer, the dtype as stored, the layer numbering, padding, missing routes,
//! zero-filled layers, wrapped ids), so `routes show` and every diagnosis can say it.

use super::clean::{self, Fix, Found};
use super::config::Layout;
use super::formats::{Format, Raw, Sequence, ShapeHint};
use super::ids::Ids;
use moe_audit_core::error::Result;
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

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
    /// A writer's stored record made comparable against `layout` when given (see `clean`).
    pub(crate) fn of(path: &Path, mut raw: Raw, layout: Option<&Layout>) -> Result<Record> {
        let c = clean::clean(path, &mut raw, layout)?;
        Ok(Record {
            path: path.to_path_buf(),
            format: raw.format,
            tokens: raw.tokens,
            top_k: raw.top_k,
            layers: c.layers,
            layers_declared: c.layers_declared,
            ids: raw.experts,
            fix: c.fix,
            routed: c.routed,
            num_experts: c.num_experts,
            logits: raw.logits.map(|l| l.0),
            input_ids: raw.input_ids,
            sequences: c.sequences,
            meta: raw.meta,
            found: c.found,
        })
    }

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
    pub(crate) fn layer_routed(&self, layer: usize) -> bool {
        self.routed[layer]
    }

    /// Whether the record holds no route at all once its fill is recognised.
    pub fn is_empty(&self) -> bool {
        !self.routed.contains(&true)
    }

    /// Whether a token has no route in any layer (padding).
    pub(crate) fn token_empty(&self, token: usize) -> bool {
        let mut row = Vec::new();
        self.rows(token..token + 1, &mut row);
        row.iter().all(|&e| e < 0)
    }

    /// Padding rows found, all causes.
    pub(crate) fn padding_rows(&self) -> usize {
        self.found.padding.values().sum()
    }
}

impl ShapeHint {
    /// What `other` tells.
    pub fn of(other: &Record) -> Self {
        ShapeHint { layers: other.layers.iter().max().map_or(0, |&l| l + 1), top_k: other.top_k }
    }
}
