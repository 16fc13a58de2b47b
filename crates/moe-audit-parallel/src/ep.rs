//! The expert-parallel MoE layer: E experts sharded over R ranks, each rank routing its own
//! sequences (the routing scope is the rank's tokens, as in Megatron-LM and DeepSpeed).
//!
//! Per rank: route → count exchange → dispatch (rows permuted so each destination's rows are
//! contiguous, one variable-count all-to-all) → local experts → the reverse all-to-all →
//! combine. Rows travel expert-major and in token order, so an expert sees exactly the block the
//! single-device layer gives it (rank 0's tokens, then rank 1's, ...), and combine adds each
//! token's weighted routes in ascending expert order starting from zero, as the single-device
//! layer does: with the same routing scope, the output is the same, bit for bit.
//!
//! One caveat is candle's, not ours: its CPU gate matmul takes another kernel for 32 rows or
//! fewer, whose logits differ in the last bit, so a rank with ≤ 32 tokens may route from
//! logits that differ from the whole batch's (as a single-device call of ≤ 32 tokens does).

use super::comm::Communicator;
use super::reduce::Precision;
use candle_core::{DType, Tensor};
use moe_audit_core::error::{Error, Result};
use moe_audit_core::layer::{CallSizes, MoeLayer};
use moe_audit_core::router::{logits_to_host, Router};
use moe_audit_core::routing::{scores, Decisions, Routing};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

/// Bytes per value on the wire (rows travel as `f32`).
const VALUE_BYTES: usize = std::mem::size_of::<f32>();

/// One rank's traffic in one exchange; rows to or from itself do not cross the wire.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Traffic {
    /// Rows sent to other ranks.
    pub rows_sent: usize,
    /// Bytes sent to other ranks.
    pub bytes_sent: usize,
    /// Rows received from other ranks.
    pub rows_received: usize,
    /// Bytes received from other ranks.
    pub bytes_received: usize,
    /// Rows this rank kept for itself.
    pub rows_local: usize,
}

/// One rank's accounting of one forward, beside the all-to-all formula of docs/ROUTING.md.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RankTraffic {
    /// The rank.
    pub rank: usize,
    /// Ranks in the exchange, N.
    pub ranks: usize,
    /// Tokens to experts.
    pub dispatch: Traffic,
    /// Expert outputs back to their tokens.
    pub combine: Traffic,
    /// The rank's dispatch payload B: every routed row, its own included, in bytes.
    pub payload_bytes: usize,
    /// What uniform routing sends off-rank: `B · (N−1)/N`.
    pub uniform_bytes_sent: f64,
}

impl RankTraffic {
    /// Dispatch bytes actually sent off-rank over the uniform-routing formula's (1 = uniform).
    pub fn vs_uniform(&self) -> f64 {
        if self.uniform_bytes_sent > 0.0 {
            self.dispatch.bytes_sent as f64 / self.uniform_bytes_sent
        } else {
            1.0
        }
    }
}

/// What one rank computed for its own tokens.
#[derive(Debug, Clone)]
pub struct RankOutput {
    /// `[local batch, seq_len, hidden]`.
    pub y: Tensor,
    /// The rank's routing record (its sequences only).
    pub routing: Routing,
    /// Host logits of its tokens, `[local batch * seq_len * experts]` (for merged load stats).
    pub logits: Vec<f32>,
    /// Its traffic.
    pub traffic: RankTraffic,
}

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

/// FNV-1a 64 of a tensor's `f32` bits, in order: equal outputs, equal checksums.
pub fn checksum(y: &Tensor) -> Result<u64> {
    let bits = y.flatten_all()?.to_vec1::<f32>()?;
    Ok(bits
        .iter()
        .flat_map(|v| v.to_bits().to_le_bytes())
        .fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)))
}

/// The whole batch after an expert-parallel forward, gathered on every rank.
#[derive(Debug, Clone)]
pub struct Gathered {
    /// `[batch, seq_len, hidden]`.
    pub y: Tensor,
    /// The ranks' routing records, concatenated (groups numbered across ranks).
    pub routing: Routing,
    /// Every rank's traffic, in rank order.
    pub traffic: Vec<RankTraffic>,
}

/// A [`MoeLayer`] run expert-parallel: this rank owns experts `rank·E/R .. (rank+1)·E/R`. Every
/// rank holds the same layer (seeded or loaded alike) and runs only its own experts.
#[derive(Debug, Clone, Copy)]
pub struct ExpertParallel<'a> {
    layer: &'a MoeLayer,
    /// Precision of the expert outputs on their way back, and of the combine's sum.
    combine: (Precision, Precision),
}

impl<'a> ExpertParallel<'a> {
    /// Bytes a [`report`](Self::report) of one call of `sizes` needs: the expert-parallel
    /// forward, its gathered outputs and the single-device forward it is checked against.
    pub fn memory_estimate(sizes: &CallSizes) -> u64 {
        sizes.estimate().saturating_mul(3)
    }

    /// Wraps a layer (f32 combine: the single-device layer's bits).
    pub fn new(layer: &'a MoeLayer) -> Self {
        ExpertParallel { layer, combine: (Precision::F32, Precision::F32) }
    }

    /// The combine in low precision: expert outputs return rounded to `wire`, each weighted
    /// output is rounded to `accumulate` and added to its token's sum in `accumulate`, in the
    /// same order (ascending expert) as the f32 combine.
    pub fn with_combine(self, wire: Precision, accumulate: Precision) -> Self {
        ExpertParallel { combine: (wire, accumulate), ..self }
    }

    /// What `ep` reports of the gathered forward `g` of `x` over `ranks`: the output against the
    /// single-device layer on the same routing (bit for bit), tokens routed otherwise than on
    /// the whole batch, each rank's traffic and, with a low-precision combine, its error.
    pub fn report(&self, x: &Tensor, g: Gathered, ranks: usize) -> Result<EpReport> {
        let layer = self.layer;
        let (_, whole) = layer.forward(x)?;
        let single = layer.apply(x, &g.routing)?;
        let (wire, accumulate) = self.combine;
        let low_precision_combine = if self.combine != (Precision::F32, Precision::F32) {
            let reference: Vec<f64> = single.flatten_all()?.to_vec1::<f32>()?.into_iter().map(f64::from).collect();
            let f = super::swamping::error_figures(&g.y.flatten_all()?.to_vec1::<f32>()?, &reference, 0.01);
            Some(CombineFigures {
                wire,
                accumulate,
                relative_error: f.relative_error,
                swamped_share: f.swamped_share,
                bias: f.bias,
            })
        } else {
            None
        };
        let differ = (whole.tokens.iter().zip(&g.routing.tokens)).filter(|(a, b)| a.routes != b.routes).count();
        let (batch, seq_len, _) = x.dims3()?;
        Ok(EpReport {
            router: layer.router().name().to_string(),
            ranks,
            batch,
            seq_len,
            hidden: layer.dims().hidden,
            experts: layer.dims().experts,
            output_checksum: format!("{:016x}", checksum(&g.y)?),
            equals_single_device: checksum(&g.y)? == checksum(&single)?,
            tokens_routed_differently: differ,
            traffic: g.traffic,
            low_precision_combine,
        })
    }

    /// Experts per rank, or an error when E does not split over `ranks`.
    pub fn local_experts(&self, ranks: usize) -> Result<usize> {
        let e = self.layer.dims().experts;
        if ranks == 0 || !e.is_multiple_of(ranks) {
            return Err(Error::usage(format!("{e} experts do not split evenly over {ranks} ranks")));
        }
        Ok(e / ranks)
    }

    /// This rank's forward over its own tokens. Collective: every rank must call it.
    ///
    /// # Shapes
    /// `x`: `[local batch, seq_len, hidden]`, `f32` on the CPU → `y` of the same shape.
    pub fn forward(&self, comm: &dyn Communicator, x: &Tensor) -> Result<RankOutput> {
        let (ranks, rank) = (comm.size(), comm.rank());
        let m = self.local_experts(ranks)?;
        let (b, s, h) = x.dims3()?;
        if h != self.layer.dims().hidden || x.dtype() != DType::F32 || !x.device().is_cpu() {
            return Err(Error::shape(
                &format!("expert-parallel layer on rank {rank}"),
                format!(
                    "input [{b}, {s}, {h}] {:?}, expected hidden {} in f32 on the CPU",
                    x.dtype(),
                    self.layer.dims().hidden
                ),
            ));
        }
        let router = self.layer.router();
        let logits = logits_to_host(&router.scores(x)?)?;
        let routing = router.assign(logits.view())?;

        // Dispatch: kept rows expert-major, token order within (the single-device order).
        let rows = routing.expert_rows();
        let (index, weight): (Vec<u32>, Vec<f32>) = rows.iter().flatten().map(|&(t, w)| (t as u32, w)).unzip();
        let mut per_expert: Vec<usize> = rows.iter().map(Vec::len).collect();
        // Null experts (past the record's E) hold a layer slot and never get a row.
        per_expert.resize(self.layer.dims().experts, 0);
        let from_expert = comm.all_to_all_counts(&per_expert, m)?;
        let send_rows: Vec<usize> = per_expert.chunks(m).map(|c| c.iter().sum()).collect();
        let recv_rows: Vec<usize> = from_expert.chunks(m).map(|c| c.iter().sum()).collect();
        let x = x.reshape((b * s, h))?;
        let device = x.device();
        let token_of_row = index.clone();
        let index = Tensor::new(index.as_slice(), device)?;
        let send = if weight.is_empty() { Vec::new() } else { x.index_select(&index, 0)?.flatten_all()?.to_vec1()? };
        let arrived = comm.all_to_all_rows(send, h, &send_rows, &recv_rows)?;

        // Local experts, each on its rows from rank 0, then rank 1, ... (as one block).
        let segment = |src: usize, j: usize| {
            let start =
                recv_rows[..src].iter().sum::<usize>() + from_expert[src * m..src * m + j].iter().sum::<usize>();
            start * h..(start + from_expert[src * m + j]) * h
        };
        let run = |j: usize| -> Result<Vec<f32>> {
            let n: usize = (0..ranks).map(|src| from_expert[src * m + j]).sum();
            if n == 0 {
                return Ok(Vec::new());
            }
            let block: Vec<f32> = (0..ranks).flat_map(|src| arrived[segment(src, j)].iter().copied()).collect();
            let out =
                self.layer.experts()[rank * m + j].forward_on_this_thread(&Tensor::from_vec(block, (n, h), device)?)?;
            Ok(out.flatten_all()?.to_vec1()?)
        };
        let outputs = (0..m).into_par_iter().map(run).collect::<Result<Vec<_>>>()?;

        // Back to the tokens' ranks, in the layout they arrived in (source-major).
        let mut back = Vec::with_capacity(arrived.len());
        let mut taken = vec![0usize; m];
        for src in 0..ranks {
            for (j, out) in outputs.iter().enumerate() {
                let len = from_expert[src * m + j] * h;
                back.extend_from_slice(&out[taken[j]..taken[j] + len]);
                taken[j] += len;
            }
        }
        let (wire, accumulate) = self.combine;
        if wire != Precision::F32 {
            back.iter_mut().for_each(|v| *v = wire.round(*v));
        }
        let returned = comm.all_to_all_rows(back, h, &recv_rows, &send_rows)?;

        // Combine: the single-device layer's ops on the same rows in the same order.
        let y = if self.combine != (Precision::F32, Precision::F32) {
            let mut y = vec![0f32; b * s * h];
            for (row, (&t, &w)) in token_of_row.iter().zip(&weight).enumerate() {
                let sum = &mut y[t as usize * h..(t as usize + 1) * h];
                for (acc, &v) in sum.iter_mut().zip(&returned[row * h..(row + 1) * h]) {
                    *acc = accumulate.round(*acc + accumulate.round(v * w));
                }
            }
            Tensor::from_vec(y, (b * s, h), device)?
        } else if weight.is_empty() {
            x.zeros_like()?
        } else {
            let n = weight.len();
            let weight = Tensor::new(weight.as_slice(), device)?.unsqueeze(1)?;
            let weighted = Tensor::from_vec(returned, (n, h), device)?.broadcast_mul(&weight)?;
            x.zeros_like()?.index_add(&index, &weighted, 0)?
        };
        let traffic = account(rank, ranks, h, wire.bytes(), &send_rows, &recv_rows);
        let logits = logits.into_raw_vec_and_offset().0;
        Ok(RankOutput { y: y.reshape((b, s, h))?, routing, logits, traffic })
    }

    /// Splits `x` by sequences over the ranks (rank r gets the r-th block of `batch / R`
    /// sequences), runs [`ExpertParallel::forward`], and gathers the whole result on every rank.
    ///
    /// # Shapes
    /// `x`: `[batch, seq_len, hidden]` with `batch` divisible by the number of ranks.
    pub fn forward_gathered(&self, comm: &dyn Communicator, x: &Tensor) -> Result<Gathered> {
        let mine = self.forward_block(comm, x)?;
        let all = comm.all_gather_bytes(serde_json::to_vec(&mine).expect("a rank result always serialises"))?;
        let parts = (all.iter().enumerate())
            .map(|(r, bytes)| {
                serde_json::from_slice::<RankResult>(bytes)
                    .map_err(|e| Error::shape("gather", format!("rank {r} sent an unreadable result: {e}")))
            })
            .collect::<Result<Vec<_>>>()?;
        gather(parts, x)
    }

    /// This rank's block of `x` (the r-th of `batch / R` sequences) through
    /// [`ExpertParallel::forward`], as it travels to the other ranks.
    fn forward_block(&self, comm: &dyn Communicator, x: &Tensor) -> Result<RankResult> {
        let per_rank = split_batch(x.dims3()?.0, comm.size())?;
        let first = comm.rank() * per_rank;
        // Errors name the sequence in the whole batch, not in the rank's block.
        let out = self.forward(comm, &x.narrow(0, first, per_rank)?).map_err(|e| match e {
            Error::NonFiniteScore { batch, pos, expert, value } => {
                Error::NonFiniteScore { batch: batch + first, pos, expert, value }
            }
            e => e,
        })?;
        Ok(RankResult {
            y: out.y.flatten_all()?.to_vec1()?,
            routing: out.routing,
            logits: out.logits,
            traffic: out.traffic,
        })
    }

    /// [`ExpertParallel::forward_gathered`] on `ranks` in-process ranks: every rank's result
    /// comes back to the caller as a value (threads share memory, so nothing is serialised).
    ///
    /// # Shapes
    /// `x`: `[batch, seq_len, hidden]` with `batch` divisible by `ranks`.
    pub fn forward_in_process(&self, x: &Tensor, ranks: usize) -> Result<Gathered> {
        self.local_experts(ranks)?;
        split_batch(x.dims3()?.0, ranks)?;
        gather(super::run_ranks(ranks, |comm| self.forward_block(comm, x))?, x)
    }
}

/// The ranks' results, in rank order, as the whole batch's.
fn gather(parts: Vec<RankResult>, x: &Tensor) -> Result<Gathered> {
    let (b, s, h) = x.dims3()?;
    let y: Vec<f32> = parts.iter().flat_map(|p| p.y.iter().copied()).collect();
    let traffic = parts.iter().map(|p| p.traffic).collect();
    let routing = concat(parts.into_iter().map(|p| (p.routing, p.logits)).collect());
    Ok(Gathered { y: Tensor::from_vec(y, (b, s, h), x.device())?, routing, traffic })
}

/// Sequences per rank, or an error when the batch does not split evenly.
pub fn split_batch(batch: usize, ranks: usize) -> Result<usize> {
    if ranks == 0 || !batch.is_multiple_of(ranks) {
        return Err(Error::usage(moe_audit_core::text!(
            crate::settings::RANKS,
            format!(" {ranks}: the batch of {batch} sequences must split evenly over the ranks")
        )));
    }
    Ok(batch / ranks)
}

/// One rank's share of [`Gathered`], as it travels (JSON bytes between processes; a plain value
/// between threads).
#[derive(Serialize, Deserialize)]
struct RankResult {
    y: Vec<f32>,
    routing: Routing,
    logits: Vec<f32>,
    traffic: RankTraffic,
}

/// `combine_value_bytes`: bytes per value of the expert outputs on their way back.
fn account(
    rank: usize,
    ranks: usize,
    h: usize,
    combine_value_bytes: usize,
    send_rows: &[usize],
    recv_rows: &[usize],
) -> RankTraffic {
    let bytes = h * VALUE_BYTES;
    let off = |rows: &[usize]| rows.iter().enumerate().filter(|&(r, _)| r != rank).map(|(_, n)| n).sum::<usize>();
    let exchange = |out: &[usize], inn: &[usize], bytes: usize| Traffic {
        rows_sent: off(out),
        bytes_sent: off(out) * bytes,
        rows_received: off(inn),
        bytes_received: off(inn) * bytes,
        rows_local: out[rank],
    };
    let payload_bytes = send_rows.iter().sum::<usize>() * bytes;
    RankTraffic {
        rank,
        ranks,
        dispatch: exchange(send_rows, recv_rows, bytes),
        combine: exchange(recv_rows, send_rows, h * combine_value_bytes),
        payload_bytes,
        uniform_bytes_sent: payload_bytes as f64 * (ranks - 1) as f64 / ranks as f64,
    }
}

/// The ranks' records as one record of the whole batch: sequences and groups renumbered,
/// capacities summed, loads and load stats over all tokens.
fn concat(parts: Vec<(Routing, Vec<f32>)>) -> Routing {
    let mut parts = parts.into_iter();
    let (first, mut logits) = parts.next().expect("at least one rank");
    let mut all = Decisions {
        router: first.router,
        batch: first.batch,
        seq_len: first.seq_len,
        experts: first.experts,
        top_k: first.top_k,
        capacity: first.capacity,
        scope: first.scope,
        tokens: first.tokens,
    };
    for (r, l) in parts {
        let (batch, groups) = (all.batch, all.scope.groups.len());
        all.tokens.extend(r.tokens.into_iter().map(|mut t| {
            t.batch += batch;
            t.group += groups;
            t
        }));
        all.scope.groups.extend(r.scope.groups);
        if let (Some(a), Some(b)) = (&mut all.capacity, &r.capacity) {
            a.iter_mut().zip(b).for_each(|(a, b)| *a += b);
        }
        all.batch += r.batch;
        logits.extend(l);
    }
    let softmax = scores::softmax_rows(&logits, all.experts);
    Routing::assemble(all, Some(&softmax))
}
