//! The layer the analyzer runs, single-device and expert-parallel: defined here, where it runs
//! in parallel, so the analyzer depends on `parallel` and not the other way round.

use super::{forward_in_process, Communicator, ExpertParallel, Gathered};
use candle_core::Tensor;
use moe_audit_core::error::{Error, Result};
use moe_audit_core::layer::MoeLayer;
use moe_audit_core::routing::Routing;

/// A layer the analyzer can run: hidden states in, outputs and routing out.
pub trait Layer {
    /// # Shapes
    /// `x`: `[batch, seq_len, hidden]` → `[batch, seq_len, hidden]`.
    fn forward(&self, x: &Tensor) -> Result<(Tensor, Routing)>;

    /// The layer expert-parallel on `ranks` ranks, each routing its own block of sequences,
    /// gathered; `None` for a layer that cannot run expert-parallel.
    ///
    /// # Shapes
    /// `x`: `[batch, seq_len, hidden]`, `batch` divisible by `ranks`.
    fn forward_parallel(&self, x: &Tensor, ranks: usize) -> Result<Option<Gathered>> {
        let _ = (x, ranks);
        Ok(None)
    }
}

impl Layer for MoeLayer {
    fn forward(&self, x: &Tensor) -> Result<(Tensor, Routing)> {
        MoeLayer::forward(self, x)
    }

    fn forward_parallel(&self, x: &Tensor, ranks: usize) -> Result<Option<Gathered>> {
        forward_in_process(self, x, ranks).map(Some)
    }
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

impl Layer for OnComm<'_> {
    fn forward(&self, x: &Tensor) -> Result<(Tensor, Routing)> {
        self.layer.forward(x)
    }

    fn forward_parallel(&self, x: &Tensor, ranks: usize) -> Result<Option<Gathered>> {
        if ranks != self.comm.size() {
            return Err(Error::usage(format!("{ranks} ranks asked for, the communicator has {}", self.comm.size())));
        }
        ExpertParallel::new(self.layer).forward_gathered(self.comm, x).map(Some)
    }
}
