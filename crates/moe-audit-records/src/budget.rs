//! The memory a run may take (`--max-memory`), shared out among the readers and steps.

use moe_audit_core::error::Result;

/// What is left of `--max-memory` for one run: every reader and step takes its share before it
/// allocates, so the whole comparison stays within the limit.
#[derive(Debug, Clone)]
pub struct Budget {
    left: u64,
    whole: moe_audit_core::MemoryBudget,
}

impl Budget {
    /// The whole of `budget`, less what the process itself takes (32 MiB), to be spent by
    /// the records read.
    pub fn new(whole: moe_audit_core::MemoryBudget) -> Self {
        Budget { left: whole.bytes().saturating_sub(32 << 20), whole }
    }

    /// Takes `bytes` for `what`, or fails naming the limit (nothing taken).
    pub fn take(&mut self, what: &str, bytes: u64) -> Result<()> {
        if bytes > self.left {
            // Said as the whole run's need against the limit.
            self.whole.ensure_fits(what, (self.whole.bytes() - self.left).saturating_add(bytes))?;
        }
        self.left = self.left.saturating_sub(bytes);
        Ok(())
    }

    /// Bytes not yet taken.
    pub fn left(&self) -> u64 {
        self.left
    }
}
