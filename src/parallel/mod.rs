//! Expert parallelism: E experts sharded over R ranks, tokens moved to their experts and back by
//! all-to-all (docs/ROUTING.md, expert parallelism).
//!
//! [`Communicator`] is what the layer needs from a distributed engine; [`run_ranks`] gives
//! in-process ranks (threads, always built, the oracle), and with the cargo feature `mpi`,
//! [`mpi::MpiComm`] gives one rank per MPI process. [`ExpertParallel`] is the layer, with its
//! per-rank traffic accounting ([`RankTraffic`]). [`reduce`] has the reductions (all-reduce,
//! reduce-scatter, all-gather in f32/bf16/f16) built on the communicator's send-receive.

mod comm;
mod ep;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod reduce;
pub mod swamping;

pub use comm::{run_ranks, Communicator, InProcess};
pub use ep::{split_batch, ExpertParallel, Gathered, RankOutput, RankTraffic, Traffic};

use crate::error::Result;
use crate::layer::MoeLayer;
use candle_core::Tensor;

/// Runs `layer` expert-parallel on `ranks` in-process ranks over `x` (split by sequences) and
/// returns the gathered result.
///
/// # Shapes
/// `x`: `[batch, seq_len, hidden]`, `batch` divisible by `ranks`.
pub fn forward_in_process(layer: &MoeLayer, x: &Tensor, ranks: usize) -> Result<Gathered> {
    let ep = ExpertParallel::new(layer);
    ep.local_experts(ranks)?;
    split_batch(x.dims3()?.0, ranks)?;
    let mut all = run_ranks(ranks, |comm| ep.forward_gathered(comm, x))?;
    Ok(all.swap_remove(0))
}

/// A layer whose expert-parallel forward runs over a given communicator (MPI, say): what the
/// audit's layout probe uses when the ranks are not this process's threads.
pub struct OnComm<'a> {
    layer: &'a MoeLayer,
    comm: &'a dyn Communicator,
}

impl<'a> OnComm<'a> {
    /// `layer` over `comm`.
    pub fn new(layer: &'a MoeLayer, comm: &'a dyn Communicator) -> Self {
        OnComm { layer, comm }
    }
}

impl crate::analyze::Layer for OnComm<'_> {
    fn forward(&self, x: &Tensor) -> Result<(Tensor, crate::routing::Routing)> {
        self.layer.forward(x)
    }

    fn forward_parallel(&self, x: &Tensor, ranks: usize) -> Result<Option<Gathered>> {
        if ranks != self.comm.size() {
            return Err(crate::Error::Usage(format!(
                "{ranks} ranks asked for, the communicator has {}",
                self.comm.size()
            )));
        }
        ExpertParallel::new(self.layer).forward_gathered(self.comm, x).map(Some)
    }
}
