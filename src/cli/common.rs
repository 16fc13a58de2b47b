//! Flags and choices that several commands declare alike (sizes, the memory limit, a router
//! command's timeout and mode, communicators, the verdicts that fail a check), so each command's
//! module depends on this one and never on another command's.

use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
use clap::{Args, ValueEnum};
use moe_audit::analyze::{Report, Verdict};
use moe_audit::error::{Error, Result};
use moe_audit::external::{InputKind, Mode};
use moe_audit::RunSizes;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Sequences per call `route` and `snapshot` take by default: a few tokens a reader can follow
/// (their other sizes are [`RunSizes`]').
pub(crate) const SHOWN_BATCH: usize = 2;
/// Tokens per sequence `route` and `snapshot` take by default.
pub(crate) const SHOWN_SEQ_LEN: usize = 8;

/// `--trials`, `--seed`, `--fail-on`: how an audit runs and which verdicts fail it, declared
/// once for `check` and `model`.
#[derive(Debug, Args)]
pub(crate) struct AuditArgs {
    /// Trials of the randomised probes.
    #[arg(long, default_value_t = RunSizes::default().trials)]
    pub(crate) trials: usize,
    /// Seed of the seeded layer or model, the inputs and every random choice.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// Verdicts that make the audit exit 1, comma separated: `leak` (a causality leak, a broken
    /// invariant, a random router's inconclusive verdict), `latent` (only the capacity in force
    /// changed, no decision did), `drift` (probe X: routing in bf16 or f16 differs from f32).
    #[arg(long, value_name = "VERDICTS", default_value = FailOn::DEFAULT, value_parser = FailOn::parse)]
    pub(crate) fail_on: FailOn,
}

/// `--output`, `--witness-dir`: where a report and its witnesses go, declared once for
/// `check`, `model` and `engine`.
#[derive(Debug, Args)]
pub(crate) struct ReportArgs {
    /// Write the report here instead of stdout.
    #[arg(long, value_name = "FILE")]
    pub(crate) output: Option<PathBuf>,
    /// Write one witness file per leak here (named after the router, model or axis and the
    /// probe); `moe-audit replay` replays one.
    #[arg(long, value_name = "DIR")]
    pub(crate) witness_dir: Option<PathBuf>,
}

/// `--batch`, `--seq-len`, `--hidden`, `--ffn`: a seeded layer's call, declared once for `check`,
/// `model` and `ep`, with [`RunSizes`]' defaults.
#[derive(Debug, Args)]
pub(crate) struct SizeArgs {
    /// Sequences per call (split evenly over expert-parallel ranks).
    #[arg(long, default_value_t = RunSizes::default().batch)]
    pub(crate) batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = RunSizes::default().seq_len)]
    pub(crate) seq_len: usize,
    /// Hidden size of the seeded layer.
    #[arg(long, default_value_t = RunSizes::default().hidden)]
    pub(crate) hidden: usize,
    /// Expert FFN size of the seeded layer.
    #[arg(long, default_value_t = RunSizes::default().ffn)]
    pub(crate) ffn: usize,
}

impl SizeArgs {
    /// These sizes with `trials` and `ranks`, checked.
    pub(crate) fn validated(&self, trials: usize, ranks: usize) -> Result<RunSizes> {
        let sizes =
            RunSizes { batch: self.batch, seq_len: self.seq_len, hidden: self.hidden, ffn: self.ffn, trials, ranks };
        sizes.validate()?;
        Ok(sizes)
    }
}

/// `--max-memory`, declared once for every command.
#[derive(Debug, Args)]
pub(crate) struct MemoryArgs {
    /// Refuse to start a run estimated to need more memory (e.g. `4GiB`; default: half of
    /// physical memory).
    #[arg(long, value_name = "SIZE", value_parser = moe_audit::memory::parse_size, allow_hyphen_values = true)]
    pub(crate) max_memory: Option<bytesize::ByteSize>,
}

impl MemoryArgs {
    /// The budget in force.
    pub(crate) fn budget(&self) -> moe_audit::MemoryBudget {
        moe_audit::MemoryBudget::from_request(self.max_memory)
    }
}

/// `--timeout`: how long a command (a router or a model) may take to answer.
#[derive(Debug, Args)]
pub(crate) struct TimeoutArgs {
    /// Seconds to wait for the command's handshake and for each answer.
    #[arg(long, default_value_t = 60.0, value_name = "SECS", allow_hyphen_values = true)]
    pub(crate) timeout: f64,
}

impl TimeoutArgs {
    /// The timeout as a duration, checked.
    pub(crate) fn validated(&self) -> Result<Duration> {
        moe_audit::external::process::timeout(self.timeout)
    }
}

/// `--mode`: the mode a router command is audited or replayed in, parsed straight into the
/// library's [`Mode`] (clap's own shadow type would be a second name for it).
pub(crate) fn mode_parser() -> impl TypedValueParser<Value = Mode> {
    PossibleValuesParser::new([
        PossibleValue::new("train").help("Training mode (the default)"),
        PossibleValue::new("inference").help("Serving mode"),
    ])
    .map(|s| if s == "inference" { Mode::Inference } else { Mode::Train })
}

/// `--input` of `plan` and `snapshot plan`: what a harness feeds its router.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum InputArg {
    /// E gate logits per token.
    Logits,
    /// H hidden values per token.
    Hidden,
}

impl InputArg {
    /// `--hidden` of a harness's router: the width of hidden rows, so not given with logits.
    pub(crate) fn check_hidden(self, hidden: Option<usize>) -> Result<()> {
        match (self, hidden) {
            (InputArg::Logits, Some(_)) => Err(Error::usage("--hidden is the size of --input hidden rows")),
            _ => Ok(()),
        }
    }
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
pub(crate) enum CommKind {
    /// In-process ranks (threads).
    #[value(name = "inproc")]
    InProcess,
    /// MPI ranks (one per process).
    Mpi,
}

/// The error of `--comm mpi` in a build without MPI.
#[cfg(not(feature = "mpi"))]
pub(crate) fn no_mpi() -> Error {
    Error::usage("--comm mpi: this moe-audit was built without MPI (cargo build --features mpi)")
}

/// Which verdicts fail a check (`--fail-on`): each word names one verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FailOn {
    /// A causality leak, a broken invariant, or a verdict a random router made inconclusive.
    pub(crate) leak: bool,
    /// A latent dependence: only the capacity in force changed, no decision did.
    pub(crate) latent: bool,
    /// Precision drift (probe X).
    pub(crate) drift: bool,
}

impl FailOn {
    /// The default: a latent dependence fails as a leak does, since it drops tokens as soon as
    /// the capacity binds (docs/PROPERTIES.md, "Latent").
    pub(crate) const DEFAULT: &'static str = "leak,latent";

    /// Parses `--fail-on`'s comma-separated list.
    pub(crate) fn parse(list: &str) -> std::result::Result<FailOn, String> {
        let mut on = FailOn { leak: false, latent: false, drift: false };
        for word in list.split(',').map(str::trim) {
            match word {
                "leak" => on.leak = true,
                "latent" => on.latent = true,
                "drift" => on.drift = true,
                _ => {
                    return Err(format!(
                        "unknown verdict `{word}`: expected a comma-separated list of leak, latent, drift"
                    ))
                }
            }
        }
        Ok(on)
    }

    /// Whether a finding of verdict `v` fails the check.
    pub(crate) fn counts(self, v: Verdict) -> bool {
        match v {
            // A random router must not pass a gate silently, even when D is not among the probes.
            Verdict::Leak | Verdict::Inconclusive => self.leak,
            Verdict::Latent => self.latent,
            Verdict::Drift => self.drift,
            Verdict::Pass | Verdict::NotApplicable => false,
        }
    }

    /// Whether `report` has a verdict that fails (a broken invariant is a leak).
    pub(crate) fn fails(self, report: &Report) -> bool {
        report
            .routers
            .iter()
            .any(|r| (self.leak && !r.invariants.is_empty()) || r.findings.iter().any(|f| self.counts(f.verdict)))
    }
}

/// `path` as UTF-8 (a snapshot header records it as text), or a usage error naming `flag`.
pub(crate) fn utf8(path: &Path, flag: &str) -> Result<String> {
    path.to_str().map(str::to_string).ok_or_else(|| Error::usage(format!("{flag}: the path is not UTF-8")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fail_on_takes_a_list_of_verdicts() {
        let on = |leak, latent, drift| Ok(FailOn { leak, latent, drift });
        assert_eq!(FailOn::parse("leak"), on(true, false, false));
        assert_eq!(FailOn::parse("leak, drift"), on(true, false, true));
        assert_eq!(FailOn::parse("drift"), on(false, false, true));
        assert_eq!(FailOn::parse("latent"), on(false, true, false));
        assert_eq!(FailOn::parse(FailOn::DEFAULT), on(true, true, false));
        assert!(FailOn::parse("leaks").unwrap_err().contains("unknown verdict `leaks`"));
        assert!(FailOn::parse("").is_err());
    }

    #[test]
    fn each_word_counts_its_own_verdicts() {
        let all = [
            Verdict::Pass,
            Verdict::Leak,
            Verdict::Latent,
            Verdict::NotApplicable,
            Verdict::Inconclusive,
            Verdict::Drift,
        ];
        let counted = |list: &str| -> Vec<Verdict> {
            let on = FailOn::parse(list).unwrap();
            all.into_iter().filter(|&v| on.counts(v)).collect()
        };
        assert_eq!(counted("leak"), [Verdict::Leak, Verdict::Inconclusive]);
        assert_eq!(counted("latent"), [Verdict::Latent]);
        assert_eq!(counted("drift"), [Verdict::Drift]);
        assert_eq!(counted(FailOn::DEFAULT), [Verdict::Leak, Verdict::Latent, Verdict::Inconclusive]);
    }
}
