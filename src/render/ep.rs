//! `moe-audit ep`: the expert-parallel forward's report and its per-rank traffic table.

use crate::parallel::reduce::Precision;
use crate::parallel::RankTraffic;
use serde::Serialize;

/// What `ep` reports (the JSON contract).
#[derive(Debug, Serialize)]
pub struct EpReport {
    /// The router.
    pub router: String,
    /// Expert-parallel ranks.
    pub ranks: usize,
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Experts E.
    pub experts: usize,
    /// FNV-1a 64 of the output's f32 bits, sequence-major: equal outputs, equal checksums.
    pub output_checksum: String,
    /// The output equals the single-device layer's on the ranks' routing, bit for bit.
    pub equals_single_device: bool,
    /// Tokens whose routing differs from the single-device layer's on the whole batch (per-rank
    /// routing scope: 0 unless capacity or expert choice depends on which tokens share a rank).
    pub tokens_routed_differently: usize,
    /// Every rank's traffic, in rank order.
    pub traffic: Vec<RankTraffic>,
    /// Present with a low-precision combine.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub low_precision_combine: Option<CombineFigures>,
}

/// A low-precision combine against the f32 combine, with `collectives`' figures.
#[derive(Debug, Serialize)]
pub struct CombineFigures {
    /// The dtype the combined rows travel in.
    pub wire: Precision,
    /// The dtype they are summed in.
    pub accumulate: Precision,
    /// ‖y − y_f32‖₂ / ‖y_f32‖₂.
    pub relative_error: f64,
    /// Share of output values off by more than 1% of the f32 combine's.
    pub swamped_share: f64,
    /// Mean signed error over mean |y_f32|.
    pub bias: f64,
}

/// The per-rank traffic table of `ep`, with the output checksum and the single-device check.
pub fn render_ep(r: &EpReport) -> String {
    let mut s = format!(
        "router {} | {} ranks | batch {} x seq {}, hidden {} | {} experts, {} per rank\n",
        r.router,
        r.ranks,
        r.batch,
        r.seq_len,
        r.hidden,
        r.experts,
        r.experts / r.ranks
    );
    s += "rank  dispatch: sent rows  bytes  recv rows  local | combine: sent rows  recv rows | payload B  uniform B(N-1)/N  sent/uniform\n";
    for t in &r.traffic {
        s += &format!(
            "{:>4}  {:>18}  {:>5}  {:>9}  {:>5} | {:>17}  {:>9} | {:>9}  {:>16.0}  {:>12.3}\n",
            t.rank,
            t.dispatch.rows_sent,
            t.dispatch.bytes_sent,
            t.dispatch.rows_received,
            t.dispatch.rows_local,
            t.combine.rows_sent,
            t.combine.rows_received,
            t.payload_bytes,
            t.uniform_bytes_sent,
            t.vs_uniform()
        );
    }
    s += &format!(
        "output checksum {} | equal to the single-device layer on the ranks' routing, bit for bit: {} | tokens routed differently than on one device: {}\n",
        r.output_checksum,
        if r.equals_single_device { "yes" } else { "NO" },
        r.tokens_routed_differently
    );
    if let Some(c) = &r.low_precision_combine {
        s += &format!(
            "combine in {} on the wire, {} accumulator, against the f32 combine: relative error {:.2e} | {:.2}% of values off by > 1% | bias {:.2e}\n",
            c.wire.name(),
            c.accumulate.name(),
            c.relative_error,
            c.swamped_share * 100.0,
            c.bias
        );
    }
    s
}
