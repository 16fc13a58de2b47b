//! The sizes a run shares (a seeded layer's call, the audit's trials, the ranks): one type, one
//! default, one check. The command line's defaults are these.

use moe_audit_core::error::{ensure_positive, Result};
use serde::{Deserialize, Serialize};

/// The sizes of a run through a seeded layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunSizes {
    /// Sequences per call.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Hidden size of the seeded layer.
    pub hidden: usize,
    /// Expert FFN size of the seeded layer.
    pub ffn: usize,
    /// Trials of the randomised probes.
    pub trials: usize,
    /// Expert-parallel ranks.
    pub ranks: usize,
}

impl Default for RunSizes {
    fn default() -> Self {
        RunSizes { batch: 4, seq_len: 128, hidden: 64, ffn: 128, trials: 32, ranks: 2 }
    }
}

impl RunSizes {
    /// Every size must be at least 1; the first that is 0 is named (in this order).
    pub fn validate(&self) -> Result<()> {
        ensure_positive(&[
            (moe_audit_core::settings::BATCH, self.batch),
            (moe_audit_core::settings::SEQ_LEN, self.seq_len),
            (crate::settings::TRIALS, self.trials),
            (moe_audit_core::settings::HIDDEN, self.hidden),
            (moe_audit_core::settings::FFN, self.ffn),
            (moe_audit_parallel::settings::RANKS, self.ranks),
        ])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_is_valid_and_a_zero_size_is_named() {
        RunSizes::default().validate().unwrap();
        let e = RunSizes { seq_len: 0, ffn: 0, ..RunSizes::default() }.validate().unwrap_err();
        assert_eq!(e.to_string(), "setting `seq_len` must be at least 1");
        let e = RunSizes { ranks: 0, ..RunSizes::default() }.validate().unwrap_err();
        assert_eq!(e.to_string(), "setting `ranks` must be at least 1");
    }
}
