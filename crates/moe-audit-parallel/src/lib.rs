//! moe-audit-parallel: expert parallelism and the collectives it is built on.
//!
//! Expert parallelism: E experts sharded over R ranks, tokens moved to their experts and back by
//! all-to-all (docs/ROUTING.md, expert parallelism).
//!
//! [`Communicator`] is what the layer needs from a distributed engine; [`run_ranks`] gives
//! in-process ranks (threads, always built, the oracle), and with the cargo feature `mpi`,
//! `mpi::MpiComm` gives one rank per MPI process. [`ExpertParallel`] is the layer, with its
//! per-rank traffic accounting ([`RankTraffic`]). [`reduce`] has the reductions (all-reduce,
//! reduce-scatter, all-gather in f32/bf16/f16) built on the communicator's send-receive, and [`swamping`] measures
//! their error against the exact sum (low-precision accumulators swamp small terms).
#![warn(missing_docs)]

mod comm;
mod ep;
mod layer;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod reduce;
pub mod settings;
pub mod swamping;

pub use comm::{run_ranks, Communicator, InProcess};
pub use ep::{
    checksum, split_batch, CombineFigures, EpReport, ExpertParallel, Gathered, RankOutput, RankTraffic, Traffic,
};
pub use layer::{Layer, OnComm};

use candle_core::Tensor;
use moe_audit_core::error::Result;
use moe_audit_core::layer::MoeLayer;

/// Runs `layer` expert-parallel on `ranks` in-process ranks over `x` (split by sequences) and
/// returns the gathered result.
///
/// # Shapes
/// `x`: `[batch, seq_len, hidden]`, `batch` divisible by `ranks`.
pub fn forward_in_process(layer: &MoeLayer, x: &Tensor, ranks: usize) -> Result<Gathered> {
    ExpertParallel::new(layer).forward_in_process(x, ranks)
}
