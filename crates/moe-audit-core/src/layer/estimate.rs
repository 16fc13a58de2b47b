//! What a call through a seeded layer takes in memory, estimated from its sizes before anything
//! is allocated (checked against a [`crate::MemoryBudget`]). Here, with the layer, because the
//! expert weights' share is the layer's packed format.

use super::Expert;

/// `a * b * ...`, saturating: estimates of absurd sizes must not overflow.
fn product(factors: &[usize]) -> u64 {
    factors.iter().fold(1u64, |acc, &f| acc.saturating_mul(f as u64))
}

/// The sizes of one routed call through a seeded layer, and what its parts take in memory.
#[derive(Debug, Clone, Copy)]
pub struct CallSizes {
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Experts E.
    pub experts: usize,
    /// Routes per token (k; 1 for expert choice).
    pub routes: usize,
    /// Hidden size of the layer.
    pub hidden: usize,
    /// Expert FFN size of the layer.
    pub ffn: usize,
}

impl CallSizes {
    /// The `f32` logits of the call.
    pub fn logits_bytes(&self) -> u64 {
        product(&[self.batch, self.seq_len, self.experts, 4])
    }

    /// Its routing record: per token an entry of about 64 bytes and 16 per route.
    pub fn routing_bytes(&self) -> u64 {
        product(&[self.batch, self.seq_len, 64 + 16 * self.routes.max(1)])
    }

    /// The call with the layer: the process itself (32 MiB), logits, one routing record, the
    /// hidden states and their output, and the expert (packed, as f32 layers keep them) and gate
    /// weights.
    pub fn estimate(&self) -> u64 {
        let hidden = product(&[self.batch, self.seq_len, self.hidden, 4, 2]);
        let experts = (self.experts as u64).saturating_mul(Expert::bytes_f32(self.hidden, self.ffn));
        let weights = experts.saturating_add(product(&[self.experts, self.hidden, 4]));
        [32 << 20, self.logits_bytes(), self.routing_bytes(), hidden, weights]
            .iter()
            .fold(0u64, |a, &b| a.saturating_add(b))
    }
}
