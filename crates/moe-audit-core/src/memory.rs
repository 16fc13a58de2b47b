//! Memory limits: a run estimates what it will allocate and refuses, before allocating, to go
//! over the limit (a sequence length of 10^9 fails at once instead of swapping).

use crate::error::{Error, Result};
use bytesize::ByteSize;

/// Share of physical memory a run may use when no `--max-memory` is given.
const DEFAULT_SHARE: u64 = 2; // one half

/// Assumed physical memory where it cannot be read.
const FALLBACK_PHYSICAL: u64 = 8 << 30;

/// Total physical memory, from `/proc/meminfo` (Linux); `None` where it cannot be read.
pub fn physical_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The memory a run may take (`--max-memory`). Estimates are checked against the whole before
/// anything is allocated; what reads a file whole gets a share of it, because the parsed form
/// costs more than the bytes read. The shares are defined here and nowhere else.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryBudget {
    bytes: u64,
}

impl MemoryBudget {
    /// A budget of `bytes`.
    pub fn new(bytes: u64) -> Self {
        MemoryBudget { bytes }
    }

    /// The budget in force: `requested`, or half of physical memory.
    pub fn from_request(requested: Option<ByteSize>) -> Self {
        Self::new(
            requested.map_or_else(|| physical_memory().unwrap_or(FALLBACK_PHYSICAL) / DEFAULT_SHARE, |b| b.as_u64()),
        )
    }

    /// The whole budget, in bytes.
    pub fn bytes(self) -> u64 {
        self.bytes
    }

    /// Fails with the estimate when `estimate` bytes exceed the budget.
    pub fn ensure_fits(self, what: &str, estimate: u64) -> Result<()> {
        ensure_fits(what, estimate, self.bytes)
    }

    /// What a text file read whole and parsed (JSON, JSON lines) may hold: a quarter, since its
    /// parsed values take up to three times its bytes.
    pub fn text(self) -> u64 {
        self.bytes / 4
    }

    /// [`Self::text`] in the words an error gives for it.
    pub(crate) fn text_why(self) -> crate::error::Text {
        crate::text!("a quarter of ", crate::settings::MAX_MEMORY)
    }

    /// What the tensors of a safetensors file may hold: half, since they are read whole and
    /// then converted (dtype, device) into a copy.
    pub fn tensors(self) -> u64 {
        self.bytes / 2
    }

    /// The longest line or payload a peer process (a router, a model) may send: a quarter, and
    /// at least 64 KiB so a tiny budget still carries a handshake.
    pub fn message(self) -> usize {
        usize::try_from(self.text()).unwrap_or(usize::MAX).max(1 << 16)
    }
}

/// Parses a memory limit ([`MAX_MEMORY`](crate::settings::MAX_MEMORY): `512MiB`, `4GiB`, `2000000000`): a positive size, said clearly when not.
pub fn parse_size(text: &str) -> std::result::Result<ByteSize, String> {
    let size: ByteSize = text.trim().parse().ok().filter(|_| !text.trim_start().starts_with('-')).ok_or_else(|| {
        format!(
            "`{}` is not a size: use a positive number of bytes with a unit, e.g. 512MiB or 4GiB",
            crate::error::excerpt(text)
        )
    })?;
    if size.as_u64() == 0 {
        return Err("a limit of 0 bytes lets nothing run: use a positive size, e.g. 512MiB".into());
    }
    Ok(size)
}

/// Fails with the estimate when `estimate` bytes exceed `limit`.
pub fn ensure_fits(what: &str, estimate: u64, limit: u64) -> Result<()> {
    if estimate <= limit {
        return Ok(());
    }
    let (estimate, limit) = (ByteSize(estimate).display().iec(), ByteSize(limit).display().iec());
    Err(Error::usage(crate::text!(
        what,
        format!(" needs about {estimate} of memory, over the limit of {limit} ("),
        crate::settings::MAX_MEMORY,
        "; the default is half of physical memory): use smaller sizes or raise the limit"
    )))
}
