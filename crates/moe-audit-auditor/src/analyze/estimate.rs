//! What an audit allocates, estimated from its sizes before it starts (see [`moe_audit_core::memory`]).

use super::AuditOptions;
use moe_audit_core::layer::CallSizes;

impl AuditOptions {
    /// Peak bytes of an audit of a router with `experts` experts and `routes` routes per token,
    /// in a seeded layer of hidden size `hidden` and expert FFN size `ffn`.
    ///
    /// The base call with its layer, plus the cases of the largest probe (F and N hold
    /// `trials` calls of the base size for a stateful router, which gets them made up front; R
    /// fewer calls of up to twice the size) and two routing records per worker thread. A pure
    /// router's F and N cases are made on demand, so its peak stays well below (BENCHMARKS.md,
    /// "Memory", and issue #15's scaling table).
    pub fn memory_estimate(&self, experts: usize, routes: usize, hidden: usize, ffn: usize) -> u64 {
        let call = CallSizes { batch: self.batch, seq_len: self.seq_len, experts, routes, hidden, ffn };
        let trials = self.trials as u64;
        let cases = call.logits_bytes().saturating_mul(trials.max(2 * (trials / 8 + 4)));
        let routings = call.routing_bytes().saturating_mul(2 * rayon::current_num_threads() as u64);
        // A quarter on top for the allocator and what the sizes do not show (vectors grown by
        // doubling, temporaries): measured peaks come to 80-100% of the sum alone.
        let sum = call.estimate().saturating_add(cases).saturating_add(routings);
        sum.saturating_add(sum / 4)
    }
}
