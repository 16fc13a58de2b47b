//! `routes show`: one record summarised, load per layer and expert.

use super::read::Record;
use super::Side;
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
    let largest = r.experts.iter().copied().max().unwrap_or(-1);
    let e = experts.or(r.num_experts).unwrap_or(0).max((largest + 1).max(1) as usize);
    let l = r.layers.len();
    let layers = (0..l)
        .map(|i| {
            let mut load = vec![0usize; e];
            let mut tokens = 0;
            for t in 0..r.tokens {
                let row = r.row(t, i);
                let mut any = false;
                for &id in row.iter().filter(|&&id| id >= 0) {
                    load[id as usize] += 1;
                    any = true;
                }
                tokens += usize::from(any);
            }
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
    Summary {
        record: Side::of("record", r),
        experts: e,
        sequences: r.sequences.len(),
        empty_tokens: (0..r.tokens).filter(|&t| r.token_empty(t)).count(),
        layers,
    }
}
