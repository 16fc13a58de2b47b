//! Flags and choices that several commands declare alike (sizes, the memory limit, a router
//! command's timeout and mode, communicators, the verdicts that fail a check), so each command's
//! module depends on this one and never on another command's.

use clap::{Args, ValueEnum};
use moe_audit::analyze::{Report, RouterReport};
use moe_audit::error::{Error, Result};
use moe_audit::external::{InputKind, Mode};
use moe_audit::RunSizes;
use std::path::Path;
use std::time::Duration;

/// `--batch`, `--seq-len`, `--hidden`, `--ffn`: a seeded layer's call, declared once for `check`,
/// `model` and `ep`, with [`RunSizes`]' defaults.
#[derive(Debug, Args)]
pub struct SizeArgs {
    /// Sequences per call (split evenly over expert-parallel ranks).
    #[arg(long, default_value_t = RunSizes::default().batch)]
    pub batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = RunSizes::default().seq_len)]
    pub seq_len: usize,
    /// Hidden size of the seeded layer.
    #[arg(long, default_value_t = RunSizes::default().hidden)]
    pub hidden: usize,
    /// Expert FFN size of the seeded layer.
    #[arg(long, default_value_t = RunSizes::default().ffn)]
    pub ffn: usize,
}

impl SizeArgs {
    /// These sizes with `trials` and `ranks`, checked.
    pub fn validated(&self, trials: usize, ranks: usize) -> Result<RunSizes> {
        let sizes =
            RunSizes { batch: self.batch, seq_len: self.seq_len, hidden: self.hidden, ffn: self.ffn, trials, ranks };
        sizes.validate()?;
        Ok(sizes)
    }
}

/// `--max-memory`, declared once for every command.
#[derive(Debug, Args)]
pub struct MemoryArgs {
    /// Refuse to start a run estimated to need more memory (e.g. `4GiB`; default: half of
    /// physical memory).
    #[arg(long, value_name = "SIZE", value_parser = moe_audit::memory::parse_size, allow_hyphen_values = true)]
    pub max_memory: Option<bytesize::ByteSize>,
}

impl MemoryArgs {
    /// The budget in force.
    pub fn budget(&self) -> moe_audit::MemoryBudget {
        moe_audit::MemoryBudget::from_request(self.max_memory)
    }
}

/// `--timeout`: how long a command (a router or a model) may take to answer.
#[derive(Debug, Args)]
pub struct TimeoutArgs {
    /// Seconds to wait for the command's handshake and for each answer.
    #[arg(long, default_value_t = 60.0, value_name = "SECS", allow_hyphen_values = true)]
    pub timeout: f64,
}

impl TimeoutArgs {
    /// The timeout as a duration, checked.
    pub fn validated(&self) -> Result<Duration> {
        moe_audit::external::process::timeout(self.timeout)
    }
}

/// `--mode`: the mode a router command is audited or replayed in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ModeArg {
    /// Training mode (the default).
    Train,
    /// Serving mode.
    Inference,
}

impl From<ModeArg> for Mode {
    fn from(m: ModeArg) -> Mode {
        match m {
            ModeArg::Train => Mode::Train,
            ModeArg::Inference => Mode::Inference,
        }
    }
}

/// `--input` of `plan` and `snapshot plan`: what a harness feeds its router.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum InputArg {
    /// E gate logits per token.
    Logits,
    /// H hidden values per token.
    Hidden,
}

impl From<InputArg> for InputKind {
    fn from(input: InputArg) -> InputKind {
        match input {
            InputArg::Logits => InputKind::Logits,
            InputArg::Hidden => InputKind::Hidden,
        }
    }
}

/// Communicators of `--comm` (`check`, `ep`, `collectives`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CommKind {
    /// In-process ranks (threads).
    #[value(name = "inproc")]
    InProcess,
    /// MPI ranks (one per process).
    Mpi,
}

/// The error of `--comm mpi` in a build without MPI.
#[cfg(not(feature = "mpi"))]
pub fn no_mpi() -> Error {
    Error::Usage("--comm mpi: this moe-audit was built without MPI (cargo build --features mpi)".into())
}

/// Which verdicts fail a check (`--fail-on`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FailOn {
    /// A causality leak, a broken invariant, or a verdict a random router made inconclusive.
    pub leak: bool,
    /// Precision drift (probe X).
    pub drift: bool,
}

impl FailOn {
    /// Parses `--fail-on`'s comma-separated list.
    pub fn parse(list: &str) -> std::result::Result<FailOn, String> {
        let mut on = FailOn { leak: false, drift: false };
        for word in list.split(',').map(str::trim) {
            match word {
                "leak" => on.leak = true,
                "drift" => on.drift = true,
                _ => return Err(format!("unknown verdict `{word}`: expected a comma-separated list of leak, drift")),
            }
        }
        Ok(on)
    }

    /// Whether `report` has a verdict that fails.
    pub fn fails(self, report: &Report) -> bool {
        (self.leak && report.fails()) || (self.drift && report.routers.iter().any(RouterReport::drifts))
    }
}

/// `path` as UTF-8 (a snapshot header records it as text), or a usage error naming `flag`.
pub fn utf8(path: &Path, flag: &str) -> Result<String> {
    path.to_str().map(str::to_string).ok_or_else(|| Error::Usage(format!("{flag}: the path is not UTF-8")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fail_on_takes_a_list_of_verdicts() {
        assert_eq!(FailOn::parse("leak"), Ok(FailOn { leak: true, drift: false }));
        assert_eq!(FailOn::parse("leak, drift"), Ok(FailOn { leak: true, drift: true }));
        assert_eq!(FailOn::parse("drift"), Ok(FailOn { leak: false, drift: true }));
        assert!(FailOn::parse("leaks").unwrap_err().contains("unknown verdict `leaks`"));
        assert!(FailOn::parse("").is_err());
    }
}
