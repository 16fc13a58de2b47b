//! `routes show`: one record summarised, load per layer and expert.

use super::compare::Side;
use super::record::{Record, CHUNK_TOKENS};
use serde::Serialize;

/// One layer's load.
#[derive(Debug, Clone, Serialize)]
pub struct LayerLoad {
    /// Global layer number.
    pub layer: usize,
    /// Tokens with at least one route in this layer.
    pub tokens: usize,
    /// Routes (ids that are not -1).
    pub routes: usize,
    /// Routes per expert.
    pub load: Vec<usize>,
    /// Busiest expert's load over the mean load (1 = perfectly balanced).
    pub max_over_mean: f64,
    /// Coefficient of variation of the loads.
    pub cv: f64,
    /// The busiest expert (lowest id on ties).
    pub busiest: usize,
    /// Experts no token chose.
    pub unused: usize,
}

/// A record summarised.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// The record.
    pub record: Side,
    /// Experts per layer counted (the config's, the logits' width, or the largest id + 1).
    pub experts: usize,
    /// Sequences in the record.
    pub sequences: usize,
    /// Rows that route nowhere (padding).
    pub empty_tokens: usize,
    /// Per layer.
    pub layers: Vec<LayerLoad>,
}

/// Load per layer and expert of `r`, with `experts` experts when known.
pub fn show(r: &Record, experts: Option<usize>) -> Summary {
    let l = r.layers.len();
    // One pass in chunks: per layer, each expert's routes and the tokens routed; tokens with
    // no route at all.
    let (load, tokens, empty_tokens) = r
        .par_reduce(
            CHUNK_TOKENS,
            |_, rows| {
                let mut load: Vec<Vec<usize>> = vec![Vec::new(); l];
                let mut tokens = vec![0usize; l];
                let mut empty = 0;
                for token in rows.chunks_exact(l * r.top_k) {
                    empty += usize::from(token.iter().all(|&e| e < 0));
                    for (i, row) in token.chunks_exact(r.top_k).enumerate() {
                        let mut any = false;
                        for &id in row.iter().filter(|&&id| id >= 0) {
                            let id = id as usize;
                            if id >= load[i].len() {
                                load[i].resize(id + 1, 0);
                            }
                            load[i][id] += 1;
                            any = true;
                        }
                        tokens[i] += usize::from(any);
                    }
                }
                (load, tokens, empty)
            },
            |(mut load, mut tokens, empty), (l2, t2, e2)| {
                for (all, p) in load.iter_mut().zip(l2) {
                    if p.len() > all.len() {
                        all.resize(p.len(), 0);
                    }
                    all.iter_mut().zip(p).for_each(|(a, b)| *a += b);
                }
                tokens.iter_mut().zip(t2).for_each(|(a, b)| *a += b);
                (load, tokens, empty + e2)
            },
        )
        .unwrap_or_else(|| (vec![Vec::new(); l], vec![0; l], 0));
    let largest = load.iter().map(Vec::len).max().unwrap_or(0);
    let e = experts.or(r.num_experts).unwrap_or(0).max(largest.max(1));
    let layers = load
        .into_iter()
        .zip(tokens)
        .enumerate()
        .map(|(i, (mut load, tokens))| {
            load.resize(e, 0);
            let routes: usize = load.iter().sum();
            let mean = routes as f64 / e as f64;
            let var = load.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / e as f64;
            let busiest = (0..e).max_by_key(|&x| (load[x], std::cmp::Reverse(x))).unwrap_or(0);
            LayerLoad {
                layer: r.layers[i],
                tokens,
                routes,
                max_over_mean: if routes == 0 { 0.0 } else { load[busiest] as f64 / mean },
                cv: if routes == 0 { 0.0 } else { var.sqrt() / mean },
                busiest,
                unused: if routes == 0 { e } else { load.iter().filter(|&&x| x == 0).count() },
                load,
            }
        })
        .collect();
    Summary { record: Side::of(None, r), experts: e, sequences: r.sequences.len(), empty_tokens, layers }
}
