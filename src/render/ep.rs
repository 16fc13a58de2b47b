//! `moe-audit ep`: the expert-parallel forward's report and its per-rank traffic table.

use crate::parallel::EpReport;

/// The per-rank traffic table of `ep`, with the output checksum and the single-device check.
pub(crate) fn render_ep(r: &EpReport) -> String {
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
