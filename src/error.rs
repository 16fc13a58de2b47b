//! The library's one error type: every variant says what is wrong and where.

use std::path::PathBuf;

/// Result alias used across the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in moe-audit, with enough context to act on it.
#[derive(Debug, thiserror::Error)]
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
    /// A command-line value that cannot be used.
    #[error("{0}")]
    Usage(String),
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
    pub(crate) fn config(source_name: &str, field: &str, message: impl Into<String>) -> Self {
        Error::Config { source_name: source_name.to_string(), field: field.to_string(), message: message.into() }
    }

    pub(crate) fn shape(context: &str, message: impl Into<String>) -> Self {
        Error::Shape { context: context.to_string(), message: message.into() }
    }

    pub(crate) fn input(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Error::Input { path: path.into(), message: message.into() }
    }
}
