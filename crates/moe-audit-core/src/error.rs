//! The library's one error type: every variant says what is wrong and where.

use std::fmt;
use std::path::PathBuf;

/// Result alias used across the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in moe-audit, with enough context to act on it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A router configuration failed to parse or validate.
    #[error("{source_name}: {field}: {message}")]
    Config {
        /// The file (or `preset:NAME`) the configuration came from.
        source_name: String,
        /// The dotted field path, e.g. `capacity.factor` (`-` when the whole document is wrong).
        field: String,
        /// What is wrong, including the offending value.
        message: String,
    },
    /// A router name that is neither a preset nor a file.
    #[error("unknown router `{name}`: not a preset ({known}) and not a file")]
    UnknownRouter {
        /// What the user asked for.
        name: String,
        /// The preset names, comma separated.
        known: String,
    },
    /// A score that routing cannot use (NaN or infinite).
    #[error("non-finite score {value} at batch {batch}, position {pos}, expert {expert}")]
    NonFiniteScore {
        /// Sequence index in the batch.
        batch: usize,
        /// Position in the sequence.
        pos: usize,
        /// Expert id.
        expert: usize,
        /// The offending value.
        value: f32,
    },
    /// Tensor or matrix shapes that do not fit together.
    #[error("shape mismatch in {context}: {message}")]
    Shape {
        /// Where the shapes met.
        context: String,
        /// Expected versus got.
        message: String,
    },
    /// An input file that could not be read or parsed.
    #[error("{}: {message}", path.display())]
    Input {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// A file or directory that could not be read, written or created: what failed, and the
    /// system's error as its source.
    #[error("{}: {doing}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What failed (`cannot read`, `cannot write`, `cannot create`), with advice if any.
        doing: String,
        /// The system's error.
        #[source]
        source: std::io::Error,
    },
    /// A file whose content is not the document it should be (a witness, a plan manifest, a
    /// safetensors file): what it should have been, and the parser's error as its source.
    #[error("{}: {expected}", path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// What it is not (`not a witness`), or what could not be done with it.
        expected: String,
        /// The parser's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// What the system refused: a thread pool that cannot start, a record that cannot be
    /// serialised; the system's error as its source.
    #[error("{what}")]
    System {
        /// What could not be done.
        what: String,
        /// Why.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Content that cannot be used as given, not a setting of the run: a witness of another
    /// model, a snapshot header's `[input]` that does not fit its router, a harness's answer
    /// that does not fit its plan.
    #[error("{0}")]
    Invalid(String),
    /// A setting (a size, a limit, a list) that cannot be used; settings are named as
    /// [`Setting`]s, so that the command line can write them as its flags.
    #[error("{0}")]
    Usage(String),
    /// A setting out of its range, named as a value: the command line writes it as its flag.
    #[error("{setting}: {message}")]
    Setting {
        /// The setting.
        setting: Setting,
        /// What is wrong, including the offending value.
        message: String,
    },
    /// An expert-parallel rank failed; every rank stops with this error.
    #[error("rank {rank} failed: {message}")]
    Rank {
        /// The rank that failed first.
        rank: usize,
        /// Its error.
        message: String,
    },
    /// A failure inside candle (device, dtype, kernel).
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
}

impl Error {
    /// An [`Error::Config`]: `field` of the configuration from `source_name` is wrong.
    pub fn config(source_name: &str, field: &str, message: impl Into<String>) -> Self {
        Error::Config { source_name: source_name.to_string(), field: field.to_string(), message: message.into() }
    }

    /// An [`Error::Shape`]: shapes that do not fit together in `context`.
    pub fn shape(context: &str, message: impl Into<String>) -> Self {
        Error::Shape { context: context.to_string(), message: message.into() }
    }

    /// An [`Error::Io`]: `doing` (`cannot read`) failed on `path` for `source`.
    pub fn io(path: impl Into<PathBuf>, doing: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), doing: doing.into(), source }
    }

    /// An [`Error::Parse`]: the file at `path` is not what `expected` says, for `source`.
    pub fn parse(
        path: impl Into<PathBuf>,
        expected: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Error::Parse { path: path.into(), expected: expected.into(), source: Box::new(source) }
    }

    /// An [`Error::System`]: `what` could not be done, for `source`.
    pub fn system(what: impl Into<String>, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        Error::System { what: what.into(), source: Box::new(source) }
    }

    /// An [`Error::Input`]: what is wrong with the file at `path`.
    pub fn input(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Error::Input { path: path.into(), message: message.into() }
    }
}

/// What is wrong with one field of a document (a router config, a sweep grid, a plan's options),
/// found before the caller adds which document it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// The dotted field path, e.g. `capacity.factor`.
    pub field: String,
    /// What is wrong, including the offending value.
    pub message: String,
}

impl std::fmt::Display for FieldError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

impl FieldError {
    /// `field` is wrong: `message`.
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        FieldError { field: field.into(), message: message.into() }
    }

    /// The same error on `prefix.field` (a nested table, e.g. `inference`).
    pub fn within(self, prefix: &str) -> Self {
        FieldError { field: format!("{prefix}.{}", self.field), ..self }
    }

    /// As an [`Error::Config`] of the document `source_name`.
    pub fn in_config(self, source_name: &str) -> Error {
        Error::Config { source_name: source_name.to_string(), field: self.field, message: self.message }
    }
}

/// A setting of a run that a message may name. The library writes it as `` setting `name` ``
/// (the field or parameter it sets); the command line writes its flag instead, so no library
/// message names a flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Setting {
    /// Sequences per call.
    Batch,
    /// Tokens per sequence.
    SeqLen,
    /// Hidden size.
    Hidden,
    /// Expert FFN size.
    Ffn,
    /// Random cases per probe.
    Trials,
    /// Expert-parallel ranks.
    Ranks,
    /// The probes an audit runs.
    Probes,
    /// How long an external router may take to answer.
    Timeout,
    /// The command of an external router.
    RouterCmd,
    /// The memory limit.
    MaxMemory,
    /// Rewriting a snapshot in place.
    Update,
    /// Trace files answered by a harness.
    Traces,
    /// Writing a harness's inputs instead of a snapshot.
    Plan,
    /// A file of logit rows.
    Logits,
    /// A file of hidden-state rows.
    HiddenStates,
    /// Vocabulary size of the exploit decoder.
    Vocab,
    /// Training steps.
    Steps,
    /// Independent training runs.
    Seeds,
    /// Peak learning rate.
    Lr,
    /// Held-out evaluation batches.
    EvalBatches,
    /// Points on the learning curve.
    CurvePoints,
    /// Batches of the untrained probe.
    ProbeBatches,
    /// The share of routing decisions two records may disagree on.
    MaxDisagreement,
    /// The largest bias a low-precision reduction may have.
    MaxBias,
    /// The mode the audited calls are made in (training or inference).
    Mode,
    /// A model's `config.json`.
    Config,
    /// Where witnesses are written.
    WitnessDir,
    /// The output file.
    Output,
}

impl Setting {
    /// Every setting.
    pub const ALL: [Setting; 28] = [
        Setting::Batch,
        Setting::SeqLen,
        Setting::Hidden,
        Setting::Ffn,
        Setting::Trials,
        Setting::Ranks,
        Setting::Probes,
        Setting::Timeout,
        Setting::RouterCmd,
        Setting::MaxMemory,
        Setting::Update,
        Setting::Traces,
        Setting::Plan,
        Setting::Logits,
        Setting::HiddenStates,
        Setting::Vocab,
        Setting::Steps,
        Setting::Seeds,
        Setting::Lr,
        Setting::EvalBatches,
        Setting::CurvePoints,
        Setting::ProbeBatches,
        Setting::MaxDisagreement,
        Setting::MaxBias,
        Setting::Mode,
        Setting::Config,
        Setting::WitnessDir,
        Setting::Output,
    ];

    /// The library's name for it.
    pub fn name(self) -> &'static str {
        match self {
            Setting::Batch => "batch",
            Setting::SeqLen => "seq_len",
            Setting::Hidden => "hidden",
            Setting::Ffn => "ffn",
            Setting::Trials => "trials",
            Setting::Ranks => "ranks",
            Setting::Probes => "probes",
            Setting::Timeout => "timeout",
            Setting::RouterCmd => "router_cmd",
            Setting::MaxMemory => "max_memory",
            Setting::Update => "update",
            Setting::Traces => "traces",
            Setting::Plan => "plan",
            Setting::Logits => "logits",
            Setting::HiddenStates => "hidden_states",
            Setting::Vocab => "vocab",
            Setting::Steps => "steps",
            Setting::Seeds => "seeds",
            Setting::Lr => "lr",
            Setting::EvalBatches => "eval_batches",
            Setting::CurvePoints => "curve_points",
            Setting::ProbeBatches => "probe_batches",
            Setting::MaxDisagreement => "max_disagreement",
            Setting::MaxBias => "max_bias",
            Setting::Mode => "mode",
            Setting::Config => "config",
            Setting::WitnessDir => "witness_dir",
            Setting::Output => "output",
        }
    }
}

/// How messages name settings, when a front end (the command line) names them its own way.
static NAMES: std::sync::OnceLock<fn(Setting) -> &'static str> = std::sync::OnceLock::new();

/// Makes every message name each setting as `names` says (the binary: its flag, `--max-memory`)
/// instead of `` setting `max_memory` ``. Call once, before any error is made; later calls are
/// ignored. Messages are built with the name, so no message is rewritten afterwards.
pub fn name_settings(names: fn(Setting) -> &'static str) {
    let _ = NAMES.set(names);
}

impl fmt::Display for Setting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match NAMES.get() {
            Some(names) => f.write_str(names(*self)),
            None => write!(f, "setting `{}`", self.name()),
        }
    }
}

/// An error and its causes on one line, `what: cause: its cause`, as the command line prints
/// it. A cause whose text the line already ends with (an error that prints its source, as
/// candle's and some parsers' do) is not repeated.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut line = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let text = c.to_string();
        if !line.ends_with(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        cause = c.source();
    }
    line
}

/// The sizes that must be at least 1, checked in one place: the first that is 0 is named.
pub fn ensure_positive(sizes: &[(Setting, usize)]) -> Result<()> {
    match sizes.iter().find(|(_, v)| *v == 0) {
        Some((setting, _)) => Err(Error::Usage(format!("{setting} must be at least 1"))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_prints_with_its_causes_on_one_line() {
        let e = Error::io("x.json", "cannot read", std::io::Error::other("gone"));
        assert_eq!(e.to_string(), "x.json: cannot read");
        assert_eq!(chain(&e), "x.json: cannot read: gone");
        let parse = serde_json::from_str::<Vec<f32>>("[1,").unwrap_err();
        let e = Error::parse("rows.json", "not rows", parse);
        assert_eq!(chain(&e), "rows.json: not rows: EOF while parsing a value at line 1 column 3");
        // A cause the message already ends with (candle prints its source) is not repeated.
        let e = Error::Candle(candle_core::Error::Msg("bad dtype".into()));
        assert_eq!(chain(&e), "candle: bad dtype");
    }

    #[test]
    fn a_field_error_names_its_document_and_table() {
        let e = FieldError::new("capacity.factor", "must be finite and > 0, got 0").within("inference");
        assert_eq!(
            e.in_config("r.toml").to_string(),
            "r.toml: inference.capacity.factor: must be finite and > 0, got 0"
        );
    }
}
